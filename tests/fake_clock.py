"""A fake clock for the liveness kernel (``asyncckpt._liveness``), for tests that wait.

:func:`fake_clock` runs a block on virtual time: every wait, staleness judgment and beat of
the process started inside uses a :class:`FakeClock`, whose :meth:`~FakeClock.sleep` returns
at once, having moved time forward and, on the way and in time order, renewed the beats that
fell due and fired the actions set with :meth:`~FakeClock.at`. Hours of waiting take
milliseconds, and the order of events is the same on every run.

Example:
    >>> with fake_clock() as clock:
    ...     clock.at(clock.now() + 5, lambda: print("fired"))
    ...     clock.sleep(10)
    ...     clock.now(), clock.slept
    fired
    (1010.0, [10])
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
from collections.abc import Callable, Iterator

from asyncckpt import _liveness as liveness


class FakeClock:
    """Virtual time (see the module); ``slept`` lists every sleep asked for, in order."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self.slept: list[float] = []
        self.heartbeat: liveness.Heartbeat | None = None
        self._timers: list[tuple[float, int, Callable[[], object]]] = []
        self._order = itertools.count()
        self._lock = threading.RLock()

    def now(self) -> float:
        return self.t

    def at(self, when: float, action: Callable[[], object]) -> None:
        """Run ``action`` (in the sleeping thread) once time reaches ``when``."""
        with self._lock:
            heapq.heappush(self._timers, (when, next(self._order), action))

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.slept.append(seconds)
            end = self.t + max(0.0, seconds)
            while (step := self._next(end)) is not None:
                self.t = max(self.t, step[0])
                step[1]()
            self.t = end

    def _next(self, end: float) -> tuple[float, Callable[[], object]] | None:
        timer = self._timers[0][0] if self._timers else None
        beat = None if self.heartbeat is None else self.heartbeat.next_due()
        if beat is not None and beat <= end and (timer is None or beat <= timer):
            assert self.heartbeat is not None
            return beat, self.heartbeat.renew_due
        if timer is not None and timer <= end:
            return timer, heapq.heappop(self._timers)[2]
        return None


@contextlib.contextmanager
def fake_clock(start: float = 1000.0) -> Iterator[FakeClock]:
    """Run the block on a :class:`FakeClock` (see the module)."""
    clock = FakeClock(start)
    with liveness.use_clock(clock) as heartbeat:
        clock.heartbeat = heartbeat
        yield clock
