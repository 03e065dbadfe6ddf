"""Tunables, in one place.

Each value is resolved as: explicit argument > ``ASYNCCKPT_<NAME>`` environment variable >
the default below. Resolution happens when a save or load starts, so changing the
environment between calls takes effect on the next call.

Example:
    >>> from asyncckpt._config import tunable
    >>> tunable("zstd_level", None)
    1
"""

from __future__ import annotations

import os
from typing import Final

#: name -> (default, help). Integers only: every tunable here is a count or a size.
DEFAULTS: Final[dict[str, tuple[int, str]]] = {
    "chunk_bytes": (16 << 20, "raw bytes per chunk; each chunk is compressed and checked alone"),
    "threads": (
        max(2, min(8, os.cpu_count() or 2)),
        "worker threads for compression, checksums and reads (zstd and I/O release the GIL)",
    ),
    "zstd_level": (
        1,
        "zstandard level; at 1, float byte planes use settings tuned for them (docs/FORMAT.md)",
    ),
    "inflight_chunks": (8, "chunks compressed ahead of the writer (bounds extra memory)"),
    # compression="auto": see asyncckpt._format.codec.choose_planes and asyncckpt._engine.encode.
    "auto_margin_pct": (
        25,
        'compression="auto": a byte plane switches between compressed and raw only when '
        "the other choice is estimated this many percent better (hysteresis against noise)",
    ),
    "auto_always_pct": (
        20,
        'compression="auto": a byte plane that its probe shrinks to at most this percent '
        "of its size is compressed whatever the rates",
    ),
    "auto_prior_write_mb_s": (
        100,
        'compression="auto": write bandwidth (MB/s) assumed for an object store, network '
        "filesystem or other storage target not measured yet in this process; low, so "
        "that a process starts by compressing there",
    ),
    "auto_prior_local_mb_s": (
        1000,
        'compression="auto": write bandwidth (MB/s) assumed for a local disk not measured '
        "yet in this process; high, so that a job's first saves to a fast disk do not "
        "compress for nothing",
    ),
    "auto_prior_encode_mb_s": (
        1000,
        'compression="auto": bytes (MB/s) one encoder thread is assumed to regroup, and to '
        "compress, before it is measured in this process",
    ),
    "auto_window_mib": (
        256,
        'compression="auto": measured rates average over about this many MiB of recent '
        "writes and encodes (a prior counts as one window)",
    ),
    "auto_explore_mib": (
        4096,
        'compression="auto": while the rates say raw, one chunk per this many MiB held '
        "back is compressed anyway, so that what compression costs stays measured",
    ),
    "max_inflight": (1, "saves whose snapshots may be held at once; each holds one host arena"),
    "pipeline_min_cpus": (
        8,
        "the background write starts encoding chunks while the snapshot is still being "
        "copied only on machines with at least this many CPUs; on fewer it waits for the "
        "whole copy, which then has the cores to itself",
    ),
    "writer_nice": (
        10,
        "Linux: how far below the main thread's priority the background save and encode "
        "threads run (niceness 0-19; 0: the same priority); the caller's threads then win "
        "the cores they share with a write, which fills the gaps",
    ),
    "writer_processes": (
        1,
        "1: background writes run in a child process that maps the snapshot's "
        "shared-memory arena (Linux; elsewhere, and for storages that live in this "
        "process's memory, on threads), so the write never takes this process's GIL; 0: on "
        "threads of this process (see the user guide, 'Writing in a separate process')",
    ),
    "writeback_mib": (
        32,
        "local files: after every this many MiB written, the kernel is asked to start "
        "writing them to disk (sync_file_range, Linux), so the final fsync does not write "
        "the whole file in series with the encoding; 0: leave it all to the fsync",
    ),
    "pin_budget_bytes": (
        1 << 30,
        "bytes of host memory one load may pin for copies to CUDA; storages past it are "
        "read into pageable memory",
    ),
    # The writer lease (docs/PROTOCOL.md, "Roles and the writer lease"), and the marker of a
    # drop-in save in flight ("Drop-in save and load across processes").
    "lease_renew_ms": (
        5_000,
        "how often a writer rewrites its lease record, and a drop-in save its marker "
        "(their heartbeat)",
    ),
    "lease_expiry_ms": (
        60_000,
        "a reader waiting for a step, or a load waiting for another process's drop-in "
        "save, gives up when the writer's lease or save marker has not changed for this "
        "long (the writer died or froze)",
    ),
    "lock_timeout_ms": (
        60_000,
        "local and POSIX filesystems: how long to wait for the version file's lock",
    ),
    # Object stores (S3 through s3fs; see docs/s3.md).
    "part_bytes": (
        8 << 20,
        "object stores: bytes per multipart part (S3 needs at least 5 MiB); smaller files "
        "are one PUT",
    ),
    "part_concurrency": (
        8,
        "object stores: parts of one file uploaded in parallel; a writer buffers at most "
        "(part_concurrency + 1) x part_bytes",
    ),
    "retry_attempts": (
        6,
        "object stores: attempts per request on throttling (503 SlowDown), 5xx, resets and "
        "timeouts",
    ),
    "retry_deadline_s": (120, "object stores: stop retrying a request after this many seconds"),
    "retry_backoff_ms": (
        100,
        "object stores: delay before the first retry; doubles per attempt (at most 10 s), "
        "with jitter",
    ),
}


#: Tunables for which 0 is meaningful (an offset, a switch, "never"); every other one must be >= 1.
ZERO_ALLOWED: Final[frozenset[str]] = frozenset(
    {"writer_nice", "writer_processes", "writeback_mib"}
)
#: Upper bounds, where there is one.
MAXIMA: Final[dict[str, int]] = {"writer_processes": 1}


def tunable(name: str, value: int | None) -> int:
    """Resolve one tunable.

    Args:
        name: a key of :data:`DEFAULTS`.
        value: the caller's explicit value, or None to fall back to the environment
            variable ``ASYNCCKPT_<NAME>`` and then the default.

    Returns:
        The resolved integer: positive, or non-negative for names in :data:`ZERO_ALLOWED`.

    Raises:
        ValueError: the name is unknown, or the value is not an integer in range.

    Example:
        >>> tunable("writer_nice", 0)
        0
    """
    if name not in DEFAULTS:
        raise ValueError(f"unknown tunable {name!r}; known: {sorted(DEFAULTS)}")
    source = "argument"
    if value is None:
        env = os.environ.get(f"ASYNCCKPT_{name.upper()}")
        if env is None:
            return DEFAULTS[name][0]
        source = f"environment variable ASYNCCKPT_{name.upper()}"
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{source}={env!r} is not an integer") from None
    if value < (0 if name in ZERO_ALLOWED else 1):
        kind = "a non-negative" if name in ZERO_ALLOWED else "a positive"
        raise ValueError(f"tunable {name} must be {kind} integer, got {value} from {source}")
    if value > MAXIMA.get(name, value):
        limit = MAXIMA[name]
        raise ValueError(f"tunable {name} must be at most {limit}, got {value} from {source}")
    return value
