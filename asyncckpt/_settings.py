"""Tunables, resolved once into a frozen :class:`Settings` at each entry point.

Each value is resolved as: explicit argument (an entry point's ``settings=``) >
``ASYNCCKPT_<NAME>`` environment variable > the default below. The entry points (the
drop-in API, ``Checkpointer``, ``asyncckpt.dcp``, the Lightning plugin, the command line)
resolve one when they start and hand it down; nothing below them reads the environment, and
a writer process receives the object, not the caller's environment.

Example:
    >>> from asyncckpt._settings import Settings
    >>> Settings.resolve(zstd_level=3).zstd_level
    3
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncckpt.errors import AsyncCkptWarning

#: Prefix of the environment variables that set tunables.
ENV_PREFIX = "ASYNCCKPT_"


def _tunable(default: int, help: str, *, minimum: int = 1, maximum: int | None = None) -> Any:
    """A field of :class:`Settings`: its default, its help text and its range."""
    return field(default=default, metadata={"help": help, "minimum": minimum, "maximum": maximum})


@dataclass(frozen=True)
class Settings:
    """Every tunable of one save, load or ``Checkpointer``, resolved once.

    Build one with :meth:`resolve` (argument > environment > default); the fields are the
    tunables, documented in the user guide ("Tunables") and by ``Settings.help()``.

    Raises:
        ValueError: a field is not an integer in its range (named in the message).

    Example:
        >>> s = Settings.resolve(environ={"ASYNCCKPT_CHUNK_BYTES": "1048576"})
        >>> s.chunk_bytes, s.replace(chunk_bytes=4096).chunk_bytes
        (1048576, 4096)
    """

    chunk_bytes: int = _tunable(
        16 << 20, "raw bytes per chunk; each chunk is compressed and checked alone"
    )
    threads: int = _tunable(
        max(2, min(8, os.cpu_count() or 2)),
        "worker threads for compression, checksums and reads (zstd and I/O release the GIL)",
    )
    zstd_level: int = _tunable(
        1, "zstandard level; at 1, float byte planes use settings tuned for them (docs/FORMAT.md)"
    )
    inflight_chunks: int = _tunable(
        8, "chunks compressed ahead of the writer (bounds extra memory)"
    )
    auto_margin_pct: int = _tunable(
        25,
        'compression="auto": a byte plane switches between compressed and raw only when '
        "the other choice is estimated this many percent better (hysteresis against noise)",
    )
    auto_always_pct: int = _tunable(
        20,
        'compression="auto": a byte plane that its probe shrinks to at most this percent '
        "of its size is compressed whatever the rates",
    )
    auto_prior_write_mb_s: int = _tunable(
        100,
        'compression="auto": write bandwidth (MB/s) assumed for an object store, network '
        "filesystem or other storage target not measured yet in this process; low, so "
        "that a process starts by compressing there",
    )
    auto_prior_local_mb_s: int = _tunable(
        1000,
        'compression="auto": write bandwidth (MB/s) assumed for a local disk not measured '
        "yet in this process; high, so that a job's first saves to a fast disk do not "
        "compress for nothing",
    )
    auto_prior_encode_mb_s: int = _tunable(
        1000,
        'compression="auto": bytes (MB/s) one encoder thread is assumed to regroup, and to '
        "compress, before it is measured in this process",
    )
    auto_window_mib: int = _tunable(
        256,
        'compression="auto": measured rates average over about this many MiB of recent '
        "writes and encodes (a prior counts as one window)",
    )
    auto_explore_mib: int = _tunable(
        4096,
        'compression="auto": while the rates say raw, one chunk per this many MiB held '
        "back is compressed anyway, so that what compression costs stays measured",
    )
    max_inflight: int = _tunable(
        1, "saves whose snapshots may be held at once; each holds one host arena"
    )
    pipeline_min_cpus: int = _tunable(
        8,
        "the background write starts encoding chunks while the snapshot is still being "
        "copied only on machines with at least this many CPUs; on fewer it waits for the "
        "whole copy, which then has the cores to itself",
    )
    writer_nice: int = _tunable(
        10,
        "Linux: how far below the main thread's priority the background save and encode "
        "threads run (niceness 0-19; 0: the same priority); the caller's threads then win "
        "the cores they share with a write, which fills the gaps",
        minimum=0,
        maximum=19,
    )
    writer_processes: int = _tunable(
        1,
        "1: background writes run in a child process that maps the snapshot's "
        "shared-memory arena (Linux; elsewhere, and for storages that live in this "
        "process's memory, on threads), so the write never takes this process's GIL; 0: on "
        "threads of this process (see the user guide, 'Writing in a separate process')",
        minimum=0,
        maximum=1,
    )
    writeback_mib: int = _tunable(
        32,
        "local files: after every this many MiB written, the kernel is asked to start "
        "writing them to disk (sync_file_range, Linux), so the final fsync does not write "
        "the whole file in series with the encoding; 0: leave it all to the fsync",
        minimum=0,
    )
    pin_budget_bytes: int = _tunable(
        1 << 30,
        "bytes of host memory one load may pin for copies to CUDA: the window a load "
        "streams its storages through (two halves, one read while the other is copied); "
        "larger storages and loads with into= are pinned within it, then pageable",
    )
    lease_renew_ms: int = _tunable(
        5_000,
        "how often a writer rewrites its lease record, and a drop-in save its marker "
        "(their heartbeat)",
    )
    lease_expiry_ms: int = _tunable(
        60_000,
        "a reader waiting for a step, or a load waiting for another process's drop-in "
        "save, gives up when the writer's lease or save marker has not changed for this "
        "long (the writer died or froze)",
    )
    lock_timeout_ms: int = _tunable(
        60_000, "local and POSIX filesystems: how long to wait for the version file's lock"
    )
    part_bytes: int = _tunable(
        8 << 20,
        "object stores: bytes per multipart part (S3 needs at least 5 MiB); smaller files "
        "are one PUT",
    )
    part_concurrency: int = _tunable(
        8,
        "object stores: parts of one file uploaded in parallel; a writer buffers at most "
        "(part_concurrency + 1) x part_bytes",
    )
    retry_attempts: int = _tunable(
        6,
        "object stores: attempts per request on throttling (503 SlowDown), 5xx, resets and "
        "timeouts",
    )
    retry_deadline_s: int = _tunable(
        120, "object stores: stop retrying a request after this many seconds"
    )
    retry_backoff_ms: int = _tunable(
        100,
        "object stores: delay before the first retry; doubles per attempt (at most 10 s), "
        "with jitter",
    )

    #: The tunables set by an argument or an environment variable rather than defaulted
    #: (a fallback the caller asked to avoid is then a warning, not a debug message).
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in _fields():
            _check(f, getattr(self, f.name), "argument")

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, **explicit: int | None) -> Settings:
        """Resolve every tunable: explicit argument > ``ASYNCCKPT_<NAME>`` > default.

        ``environ`` is the environment read (default: ``os.environ``); an explicit None
        falls through to it.

        Raises:
            TypeError: a keyword names no tunable.
            ValueError: a value (argument or environment variable) is not an integer in
                range; the message names its source.

        Example:
            >>> Settings.resolve(threads=2).threads
            2
        """
        env = os.environ if environ is None else environ
        _warn_unknown(env)
        _check_names(explicit)
        values: dict[str, int] = {}
        for f in _fields():
            var = ENV_PREFIX + f.name.upper()
            if (value := explicit.get(f.name)) is not None:
                values[f.name] = _check(f, value, "argument")
            elif (raw := env.get(var)) is not None:
                values[f.name] = _check(f, _parse(var, raw), f"environment variable {var}")
        return cls(**values, given=frozenset(values))

    @classmethod
    def of(cls, settings: SettingsArg = None) -> Settings:
        """What an entry point's ``settings=`` argument stands for.

        A :class:`Settings` is used as it is (resolved once, shared by many calls); a dict
        of tunables is the explicit arguments, over the environment; None: the environment
        and the defaults.

        Raises:
            TypeError: a dict key names no tunable, or ``settings`` is of another type.
            ValueError: a value is out of range (named in the message).

        Example:
            >>> Settings.of({"threads": 3}).threads, Settings.of(Settings(threads=5)).threads
            (3, 5)
        """
        if isinstance(settings, Settings):
            return settings
        if settings is None:
            return cls.resolve()
        if isinstance(settings, Mapping):
            return cls.resolve(None, **dict(settings))  # checked by name and range there
        raise TypeError(
            "settings must be an asyncckpt.Settings, a dict of tunables (e.g. "
            f'{{"threads": 4}}) or None, not {type(settings).__name__}'
        )

    def replace(self, **changes: int | None) -> Settings:
        """A copy with the given tunables changed (None keeps the current value).

        Raises:
            TypeError: a keyword names no tunable.
            ValueError: a value is out of range.
        """
        _check_names(changes)
        kept = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **kept, given=self.given | set(kept))

    @staticmethod
    def help() -> dict[str, tuple[int, str]]:
        """name -> (default, what it does), for the command line and the docs."""
        return {f.name: (f.default, f.metadata["help"]) for f in _fields()}  # type: ignore[misc]


#: What an entry point's ``settings=`` takes (see :meth:`Settings.of`).
SettingsArg = Settings | Mapping[str, int] | None


def _fields() -> tuple[dataclasses.Field[Any], ...]:
    """The tunables among the fields of :class:`Settings` (not ``given``)."""
    return tuple(f for f in dataclasses.fields(Settings) if "help" in f.metadata)


#: The tunables' names, in declaration order.
NAMES: tuple[str, ...] = tuple(f.name for f in _fields())


def _check_names(given: Mapping[str, object]) -> None:
    unknown = set(given) - set(NAMES)
    if unknown:
        raise TypeError(f"unknown tunables {sorted(unknown)}; known: {sorted(NAMES)}")


def _parse(var: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {var}={raw!r} is not an integer") from None


def _check(f: dataclasses.Field[Any], value: object, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"tunable {f.name} must be an integer, got {value!r} from {source}")
    low, high = f.metadata["minimum"], f.metadata["maximum"]
    if value < low:
        kind = "a non-negative" if low == 0 else "a positive"
        raise ValueError(f"tunable {f.name} must be {kind} integer, got {value} from {source}")
    if high is not None and value > high:
        raise ValueError(f"tunable {f.name} must be at most {high}, got {value} from {source}")
    return value


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_unknown(env: Mapping[str, str]) -> None:
    """Report each ``ASYNCCKPT_*`` variable that names no tunable, once per process."""
    known = {ENV_PREFIX + n.upper() for n in NAMES}
    for var in env:
        if not var.startswith(ENV_PREFIX) or var in known:
            continue
        with _warned_lock:
            if var in _warned:
                continue
            _warned.add(var)
        close = difflib.get_close_matches(var, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f"; tunables: {sorted(known)}"
        warnings.warn(
            f"{var} names no asyncckpt tunable and is ignored{hint}", AsyncCkptWarning, stacklevel=3
        )
