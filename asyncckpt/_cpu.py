"""How much CPU a background write may take: the writer's CPU budget.

On a machine whose cores training keeps busy, every CPU-second a background write spends
(compression, checksums, copies into the page cache) is a second taken from training;
on one with idle cores it costs nothing. ``compression="auto"`` weighs its choices with
what is measured here (:mod:`asyncckpt._engine.autocompress`): :func:`spare_cores`, the
cores the rest of the machine left idle (the writer's own CPU time not counted), and
:class:`ThreadClock`, which tells a write slowed by a busy CPU from slow storage.

Example:
    >>> clock = ThreadClock.now()
    >>> spent = ThreadClock.now() - clock
    >>> spent.wall >= spent.busy >= 0.0 and spent.cpu >= 0.0
    True
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Windows shorter than this say too little about the machine; the last estimate stands.
_MIN_WINDOW_S = 0.05
_SCHEDSTAT = "/proc/thread-self/schedstat"


@dataclass(frozen=True)
class ThreadClock:
    """A reading of the calling thread's clocks, in seconds; differences are durations.

    Attributes:
        wall: ``time.perf_counter()``.
        cpu: CPU time of the thread (booked at scheduler ticks: over a short interval it
            may exceed ``wall``).
        waited: time the thread was runnable but waiting for a core (0.0 where the kernel
            does not say: then waiting for a core counts as wall time).
    """

    wall: float
    cpu: float
    waited: float

    @classmethod
    def now(cls) -> ThreadClock:
        """The calling thread's clocks now."""
        cpu, waited = _schedstat() or (time.thread_time(), 0.0)
        return cls(time.perf_counter(), cpu, waited)

    def __sub__(self, other: ThreadClock) -> ThreadClock:
        return ThreadClock(self.wall - other.wall, self.cpu - other.cpu, self.waited - other.waited)

    @property
    def busy(self) -> float:
        """The time the work took, less what the CPU's contention added to it.

        A thread that mostly ran (a write to memory) is timed without its wait for a core.
        One that mostly slept in I/O (a write to a store) keeps its whole wall time: each
        wake-up from the store queues for a core on a busy machine while the store goes on,
        so that queueing overlaps the store's own time (a 0.482 s write to a 10 MB/s link on
        a loaded 2-core machine queued 0.475 s in all, and looked 7 ms long without this).
        """
        blocked = self.wall - self.cpu - self.waited
        if blocked > self.cpu:
            return self.wall
        return max(0.0, self.wall - self.waited)


def _schedstat() -> tuple[float, float] | None:
    """(CPU seconds, run-queue wait seconds) of the calling thread, Linux only."""
    global _schedstat_ok
    if not _schedstat_ok:
        return None
    try:
        with open(_SCHEDSTAT, "rb") as f:
            fields = f.read().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        _schedstat_ok = False
        return None


_schedstat_ok = sys.platform.startswith("linux")


def usable_cpus() -> list[int] | None:
    """The CPUs this process may run on (None where the OS does not say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _busy_seconds(cpus: list[int] | None) -> float | None:
    """CPU seconds the machine has spent busy on ``cpus`` since boot (``/proc/stat``)."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = None if cpus is None else {f"cpu{i}".encode() for i in cpus}
    ticks = 0
    for line in lines[1:]:
        fields = line.split()
        if not fields or not fields[0].startswith(b"cpu"):
            break
        if wanted is None or fields[0] in wanted:
            values = [int(v) for v in fields[1:9]]
            ticks += sum(values) - values[3] - values[4]  # all but idle and iowait
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """Spare cores over the window since the previous reading (see :func:`spare_cores`).

    Args:
        writer_seconds: CPU seconds the background writer has used so far (threads of this
            process and a writer process); they are not counted as the machine being busy.
        machine: CPU seconds the machine has been busy so far, or None if it cannot say;
            defaults to ``/proc/stat`` over the usable CPUs, falling back to this process's
            own CPU time.
        cores: the CPUs counted (defaults to the usable ones).
        clock: wall clock.
    """

    def __init__(
        self,
        writer_seconds: Callable[[], float],
        machine: Callable[[], float | None] | None = None,
        cores: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        cpus = usable_cpus()
        counted = len(cpus) if cpus else os.cpu_count() or 1
        self.cores = float(counted) if cores is None else cores
        self._machine = machine or (lambda: _busy_seconds(cpus))
        self._writer = writer_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._last = self._sample()
        self.spare: float | None = None

    def _sample(self) -> tuple[float, float, float]:
        busy = self._machine()
        return self._clock(), _own_seconds() if busy is None else busy, self._writer()

    def read(self) -> float | None:
        """Cores left idle since the last reading, between 0 and :attr:`cores`; None until
        a window of at least 50 ms has passed (the previous estimate within shorter ones)."""
        with self._lock:
            now = self._sample()
            wall = now[0] - self._last[0]
            if wall < _MIN_WINDOW_S:
                return self.spare
            others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2]))
            self.spare = min(self.cores, max(0.0, self.cores - others / wall))
            self._last = now
            return self.spare


_meter_lock = threading.Lock()
_meter: CpuMeter | None = None
#: CPU seconds of the background writer, from sources registered by the writer modules.
_writer_sources: list[Callable[[], float]] = []


def add_writer_source(source: Callable[[], float]) -> None:
    """Count ``source()`` (cumulative CPU seconds) as the background writer's own work."""
    with _meter_lock:
        _writer_sources.append(source)


def _writer_seconds() -> float:
    return sum(source() for source in list(_writer_sources))


def spare_cores() -> float | None:
    """CPU cores that the rest of the machine left idle since the previous call.

    The first call measures from the first use of this module (the import of
    ``asyncckpt``), so a process's first save already sees how busy training kept the CPU.
    The background writer's own CPU time is not counted: a write in flight does not make
    the CPU look busy to the next one. Between 0 and the number of usable CPUs; None until a
    window of 50 ms has passed.

    Example:
        >>> value = spare_cores()
        >>> value is None or value >= 0.0
        True
    """
    return _the_meter().read()


def _the_meter() -> CpuMeter:
    global _meter
    with _meter_lock:
        if _meter is None:
            _meter = CpuMeter(_writer_seconds)
        return _meter


_the_meter()  # the first window starts at import
