"""``compression="auto"``: what a process learns about its storage and its encoders.

Measured, and remembered for the process's later saves: per storage target (a local device,
a bucket, a URL's top directory), the save thread's seconds in ``out.write`` and the commit
per stored byte (not its waits for a busy core: those are the CPU's doing); the encoders'
CPU seconds per raw byte regrouped and compressed; and each save's idle cores
(:func:`asyncckpt._cpu.spare_cores`). :func:`choose_planes` turns those into a choice per
byte plane: compress where the store is the bottleneck and the CPU has room. An unmeasured
target is assumed fast if a local disk (``auto_prior_local_mb_s``: a job's first saves do
not compress for nothing), else slow (``auto_prior_write_mb_s``: bytes cost more than CPU
there; a process starts by compressing, and learns).

Example:
    >>> from asyncckpt._settings import Settings
    >>> settings = AutoSettings.of(Settings())
    >>> rate = Rate(window=100, prior=2.0)
    >>> rate.add(100.0, 100)  # 1 s per byte over one window: halfway to it
    >>> 1.0 < rate.value < 2.0
    True
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from asyncckpt import _threads as workers
from asyncckpt._format.codec import INCOMPRESSIBLE, EncodeReport, shrinks
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage

# -- the cost model: which planes pay for their compression ---------------------------


@dataclass(frozen=True)
class Rates:
    """The speeds that :func:`choose_planes` weighs, in seconds per byte.

    Attributes:
        write_s: storage: seconds to write and commit one stored byte.
        compress_s: one encoder thread: CPU seconds to compress one byte of a plane.
        group_s: one encoder thread: CPU seconds to regroup one byte of a chunk into planes.
        threads: encoder threads working in parallel.
        spare_cores: CPU cores the rest of the machine leaves idle (None: unknown); see
            :attr:`parallel`.

    Example:
        >>> link = Rates(write_s=5e-9, compress_s=1e-9, group_s=0.25e-9, threads=2)  # 200 MB/s
        >>> link.break_even(4)  # an fp32 plane must shrink by 20 % to pay
        0.2
        >>> Rates(5e-9, 1e-9, 0.25e-9, threads=2, spare_cores=0.0).break_even(4)  # busy CPU
        0.4
    """

    write_s: float
    compress_s: float
    group_s: float
    threads: int
    spare_cores: float | None = None

    @property
    def parallel(self) -> float:
        """Encoder threads that run on cores nothing else wants: ``threads`` when the spare
        cores are unknown, else the spare cores, between 1 and ``threads``. Below one spare
        core the encoding is paid in full, one CPU-second per second, by whatever it
        displaces."""
        threads = float(max(1, self.threads))
        if self.spare_cores is None:
            return threads
        return max(1.0, min(threads, self.spare_cores))

    def break_even(self, width: int) -> float:
        """The fraction of a plane that compressing it must save to pay for itself.

        Compressing a plane of ``n`` bytes that keeps ``r`` of them saves ``(1 - r) * n``
        bytes of writing and costs ``n * (compress_s + width * group_s) / parallel``
        seconds of encoding (the whole chunk is regrouped for it, unless ``width`` is 1).

        Example:
            >>> Rates(write_s=4e-9, compress_s=1e-9, group_s=0.25e-9, threads=2).break_even(4)
            0.25
        """
        group = width * self.group_s if width > 1 else 0.0
        cost = (self.compress_s + group) / self.parallel
        return cost / self.write_s if self.write_s > 0 else float("inf")


def choose_planes(
    ratios: Sequence[float | None],
    previous: Sequence[bool],
    rates: Rates,
    *,
    margin: float,
    always: float,
) -> tuple[bool, ...]:
    """Which planes of one chunk ``compression="auto"`` compresses (a pure function).

    ``ratios`` are each plane's estimated stored/raw fraction, ``previous`` whether it was
    compressed last time. A plane is compressed when it saves more than
    :meth:`Rates.break_even` of its bytes. To stay put on noisy rates, a plane's choice
    flips only when the other side wins by ``margin`` (a fraction: 0.25 is 25 %). A
    plane kept whole by the probe (over :data:`INCOMPRESSIBLE`) is never compressed; one
    that shrinks to ``always`` or less always is, whatever the rates (its bytes saved
    dominate). An unknown ratio (None) keeps the previous choice.

    Example:
        >>> ratios = [1.0, 0.95, 0.34, 0.1]  # noise, near-noise, exponents, mostly zeros
        >>> slow_disk = Rates(write_s=10e-9, compress_s=1e-9, group_s=0.25e-9, threads=2)
        >>> choose_planes(ratios, [True] * 4, slow_disk, margin=0.25, always=0.2)
        (False, False, True, True)
        >>> fast_disk = Rates(write_s=0.5e-9, compress_s=1e-9, group_s=0.25e-9, threads=2)
        >>> choose_planes(ratios, [True] * 4, fast_disk, margin=0.25, always=0.2)
        (False, False, False, True)
    """
    need = rates.break_even(len(ratios))
    chosen = []
    for ratio, before in zip(ratios, previous, strict=True):
        if ratio is None:
            chosen.append(before)
        elif ratio > INCOMPRESSIBLE or ratio <= always:
            chosen.append(ratio <= always)
        else:
            bar = need / (1 + margin) if before else need * (1 + margin)
            chosen.append(1 - ratio > bar)
    return tuple(chosen)


@dataclass(frozen=True)
class AutoSettings:
    """The ``compression="auto"`` tunables of one save (from its :class:`Settings`).

    Attributes:
        margin: hysteresis, as a fraction (``auto_margin_pct`` / 100).
        always: plane ratio compressed whatever the rates (``auto_always_pct`` / 100).
        prior_write_s: seconds per byte assumed for an unmeasured storage target.
        prior_local_write_s: the same for a local disk (not a network filesystem).
        prior_encode_s: seconds per byte assumed for an encoder thread to regroup, and to
            compress, before it is measured.
        window: bytes that measured rates average over (``auto_window_mib``).
        explore_bytes: compress one chunk per this many bytes the rates hold back.
    """

    margin: float
    always: float
    prior_write_s: float
    prior_local_write_s: float
    prior_encode_s: float
    window: int
    explore_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> AutoSettings:
        """The ``auto_*`` tunables of ``settings``, in the units used here.

        Example:
            >>> AutoSettings.of(Settings()).margin
            0.25
        """
        return cls(
            margin=settings.auto_margin_pct / 100,
            always=settings.auto_always_pct / 100,
            prior_write_s=1e-6 / settings.auto_prior_write_mb_s,
            prior_local_write_s=1e-6 / settings.auto_prior_local_mb_s,
            prior_encode_s=1e-6 / settings.auto_prior_encode_mb_s,
            window=settings.auto_window_mib << 20,
            explore_bytes=settings.auto_explore_mib << 20,
        )


class Rate:
    """Seconds per byte, averaged over roughly the last ``window`` bytes measured.

    Older measurements fade with the bytes measured since (weight ``exp(-bytes / window)``),
    so the rate follows a storage whose speed changes, while one slow call moves it by no
    more than its share of the window. A prior counts as one window of measurements.
    """

    def __init__(self, window: int, prior: float | None = None) -> None:
        self.window = window
        self.seconds = 0.0 if prior is None else prior * window
        self.nbytes = 0.0 if prior is None else float(window)

    def add(self, seconds: float, nbytes: int) -> None:
        keep = math.exp(-nbytes / self.window)
        self.seconds = self.seconds * keep + seconds
        self.nbytes = self.nbytes * keep + nbytes

    @property
    def value(self) -> float:
        """The average, or 0.0 (free) while nothing has been measured and there is no prior."""
        return self.seconds / self.nbytes if self.nbytes else 0.0


class _Target:
    """What ``"auto"`` learned about one storage target: its speed and its last choices."""

    def __init__(self, settings: AutoSettings, local: bool = False) -> None:
        prior = settings.prior_local_write_s if local else settings.prior_write_s
        self.write = Rate(settings.window, prior)  # in out.write
        self.commit = Rate(settings.window)  # in the commit (fsync, upload completion)
        self.choices: dict[tuple[int, int], bool] = {}  # (width, plane) -> compressed
        self.held_back = 0  # bytes the rates kept raw since the last exploration


class _Encoders:
    """Encoder speeds, shared by every target: the CPU is the process's, whatever the storage."""

    def __init__(self, settings: AutoSettings) -> None:
        self.compress = Rate(settings.window, settings.prior_encode_s)
        self.group = Rate(settings.window, settings.prior_encode_s)


#: Guards everything below; each use is a few arithmetic operations.
_auto_lock = threading.Lock()
#: Storage target (see :meth:`Storage.target`) -> what was learned about it.
_targets: dict[tuple[str, ...], _Target] = {}
#: Created by the process's first ``"auto"`` write.
_encoders: _Encoders | None = None
#: (width, plane) -> the last stored/raw ratio seen; stands in for planes too short to probe.
_plane_ratios: dict[tuple[int, int], float] = {}
#: Targets remembered at most; the oldest is forgotten first.
_MAX_TARGETS = 64


@workers.after_fork_in_child
def _renew_lock() -> None:
    """In a forked child: a save thread of the parent may have held the lock at the fork."""
    global _auto_lock
    _auto_lock = threading.Lock()


def reset() -> None:
    """Forget everything ``"auto"`` learned in this process (for tests)."""
    global _encoders
    with _auto_lock:
        _targets.clear()
        _plane_ratios.clear()
        _encoders = None


def for_write(
    storage: Storage,
    path: str,
    settings: AutoSettings,
    threads: int,
    spare_cores: float | None = None,
) -> AutoRun:
    """The chooser and meter for one ``compression="auto"`` write to ``path`` of
    ``storage``, sharing what the process learned about that storage target so far.
    ``spare_cores``: :func:`asyncckpt._cpu.spare_cores` when the save started (None: unknown).
    """
    global _encoders
    key = storage.target(path)
    with _auto_lock:
        target = _targets.pop(key, None)
    if target is None:
        target = _Target(settings, storage.on_local_disk(path))  # reads the mount table
    with _auto_lock:
        target = _targets.pop(key, None) or target
        _targets[key] = target  # most recently used last
        while len(_targets) > _MAX_TARGETS:
            del _targets[next(iter(_targets))]
        encoders = _encoders = _encoders or _Encoders(settings)
        for rate in (target.write, target.commit, encoders.compress, encoders.group):
            rate.window = settings.window
    return AutoRun(target, encoders, settings, threads, spare_cores)


@dataclass(eq=False)
class AutoRun:
    """``compression="auto"`` during one write: chooses planes, and feeds measurements back.

    :meth:`choose` and :meth:`encoded` run on encoder threads, :meth:`wrote` and
    :meth:`committed` on the save thread; all hold ``_auto_lock`` briefly.
    """

    target: _Target
    encoders: _Encoders
    settings: AutoSettings
    threads: int
    spare_cores: float | None = None

    def choose(
        self, width: int, ratios: tuple[float | None, ...], nbytes: int = 0
    ) -> tuple[bool, ...]:
        """Which planes of a chunk of ``nbytes`` to compress (bound to ``nbytes``, an
        :data:`asyncckpt._format.codec.PlaneChooser`)."""
        keys = [(width, j) for j in range(width)]
        with _auto_lock:
            known = [_plane_ratios.get(k) if r is None else r for r, k in zip(ratios, keys)]
            previous = [self.target.choices.get(k, True) for k in keys]
            write = self.target.write.value + self.target.commit.value
            encoders = self.encoders
            rates = Rates(
                write, encoders.compress.value, encoders.group.value, self.threads, self.spare_cores
            )
            chosen = choose_planes(
                known, previous, rates, margin=self.settings.margin, always=self.settings.always
            )
            self.target.choices.update(zip(keys, chosen))
            return self._explore(known, chosen, nbytes)

    def _explore(
        self, ratios: list[float | None], chosen: tuple[bool, ...], nbytes: int
    ) -> tuple[bool, ...]:
        """Now and then compress what the rates held back: otherwise, once a target goes
        raw, the encode rates would never be measured again, however wrong they were."""
        shrinking = shrinks(len(ratios), ratios)
        if shrinking == chosen or not any(shrinking):
            return chosen
        self.target.held_back += nbytes
        if self.target.held_back < self.settings.explore_bytes:
            return chosen
        self.target.held_back = 0
        return shrinking

    def encoded(self, report: EncodeReport) -> None:
        """Feed back what one chunk's encoding cost and found."""
        width = len(report.ratios)
        with _auto_lock:
            if report.compressed_bytes:
                self.encoders.compress.add(report.compress_s, report.compressed_bytes)
            if report.grouped_bytes:
                self.encoders.group.add(report.group_s, report.grouped_bytes)
            for j, ratio in enumerate(report.ratios):
                if ratio is not None:
                    _plane_ratios[(width, j)] = ratio

    def wrote(self, seconds: float, nbytes: int) -> None:
        """Feed back one ``out.write`` call."""
        with _auto_lock:
            self.target.write.add(seconds, nbytes)

    def committed(self, seconds: float, nbytes: int) -> None:
        """Feed back the commit of a file of ``nbytes``."""
        with _auto_lock:
            self.target.commit.add(seconds, nbytes)
