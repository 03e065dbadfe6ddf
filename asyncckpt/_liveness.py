"""The liveness kernel: small records rewritten as proof of life, judged stale on the
reader's clock, waited on with backoff (docs/PROTOCOL.md, "The liveness kernel").

The writer lease, the ranks' progress markers and the drop-in save markers are three
records of this kind; their modules say what the record holds and build on four parts here:

* one :class:`Clock`: the real one, or a :class:`FakeClock` that :func:`fake_clock`
  injects so that tests run hours of waiting in milliseconds;
* one :class:`Heartbeat` per process: every record kept alive is a :class:`Beat` with its
  own period and renew callback, and one thread calls each when due (on a small pool, so a
  store that hangs holds up its own beats only);
* one stale rule (:class:`Staleness`): a record is stale once its content has not changed
  for ``expiry`` seconds on the reader's own clock;
* one wait (:func:`poll`): jittered exponential backoff, bounded by the deadline and by the
  moment a watched record would turn stale.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol, TypeVar

from asyncckpt import _threads as workers

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Threads that run renewals: a store that hangs (retrying for up to retry_deadline_s) holds
#: up the beats of its own records only.
_RENEW_THREADS = 4
_LOG_EVERY_S = 60.0


# -- the clock ------------------------------------------------------------------------------


class Clock(Protocol):
    """Monotonic time and waiting, as every liveness decision sees them."""

    def now(self) -> float:
        """Seconds on a monotonic clock."""

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass."""

    def wait(self, event: threading.Event, seconds: float | None) -> bool:
        """Wait until ``event`` is set or ``seconds`` passed (None: no limit); whether set."""


class RealClock:
    """:func:`time.monotonic` and real waits.

    Example:
        >>> RealClock().now() > 0
        True
    """

    def now(self) -> float:
        """Seconds on :func:`time.monotonic`."""
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        """Sleep for real."""
        time.sleep(seconds)

    def wait(self, event: threading.Event, seconds: float | None) -> bool:
        """:meth:`threading.Event.wait`."""
        return event.wait(seconds)


class FakeClock:
    """Virtual time for tests: :meth:`sleep` moves it forward at once, renewing on the way,
    in time order, the beats that fall due and firing the actions set with :meth:`at`.

    Example:
        >>> with fake_clock() as clock:
        ...     clock.at(clock.now() + 5, lambda: print("fired"))
        ...     clock.sleep(10)
        ...     clock.slept
        fired
        [10]
    """

    def __init__(self, heartbeat: Heartbeat | None = None, start: float = 1000.0) -> None:
        self.t = start
        self.heartbeat = heartbeat
        #: Every sleep asked for, in order (what a test checks a backoff against).
        self.slept: list[float] = []
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._lock = threading.RLock()

    def now(self) -> float:
        """The virtual time."""
        return self.t

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` (in the sleeping thread) once virtual time reaches ``when``."""
        with self._lock:
            heapq.heappush(self._timers, (when, next(self._order), action))

    def sleep(self, seconds: float) -> None:
        """Move time ``seconds`` forward, renewing due beats and firing due actions."""
        with self._lock:
            self.slept.append(seconds)
            end = self.t + max(0.0, seconds)
            while (step := self._next(end)) is not None:
                when, fire = step
                self.t = max(self.t, when)
                fire()
            self.t = end

    def wait(self, event: threading.Event, seconds: float | None) -> bool:
        """Sleep ``seconds`` unless ``event`` is set (None: do not wait at all)."""
        if not event.is_set() and seconds is not None:
            self.sleep(seconds)
        return event.is_set()

    def _next(self, end: float) -> tuple[float, Callable[[], object]] | None:
        timer = self._timers[0][0] if self._timers else None
        beat = None if self.heartbeat is None else self.heartbeat.next_due()
        if beat is not None and beat <= end and (timer is None or beat <= timer):
            heartbeat = self.heartbeat
            assert heartbeat is not None
            return beat, heartbeat.renew_due
        if timer is not None and timer <= end:
            return timer, heapq.heappop(self._timers)[2]
        return None


# -- the heartbeat --------------------------------------------------------------------------


class Beat:
    """One record this process keeps alive: :class:`Heartbeat` calls ``renew`` every
    ``period`` seconds until :meth:`stop`, or until ``renew`` returns False (the record is
    lost to another process, or its owner is gone). A renew that raises is logged and
    retried at the next period: a missed beat only lets readers give up sooner.

    Example:
        >>> with fake_clock() as clock:
        ...     beat = heartbeat().add("a record", 1.0, lambda: None)
        ...     clock.sleep(3.5)
        ...     beat.stop()
        ...     beat.renewals, beat.is_alive()
        (3, False)
    """

    def __init__(
        self, owner: Heartbeat, name: str, period: float, renew: Callable[[], bool | None]
    ) -> None:
        self.name, self.period = name, period
        self.renewals = 0
        self.due = 0.0
        self.busy = False  # a renewal is queued or running
        self._owner, self._renew_fn = owner, renew
        self._io = threading.RLock()  # held while renew runs: stop() waits for it
        self._ended = threading.Event()
        self._first = threading.Event()

    def is_alive(self) -> bool:
        """Whether the record is still renewed."""
        return not self._ended.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the beat ended (stopped, or its renew returned False)."""
        return self._ended.wait(timeout)

    def wait_first(self) -> None:
        """Block until the first renewal ran (or failed), or the beat ended."""
        self._first.wait()

    def stop(self) -> None:
        """Renew no more; returns once a renewal in progress ended. Call it without
        holding a lock that ``renew`` takes."""
        with self._io:
            self._end()
        self._owner.drop(self)

    def renew(self) -> None:
        """Renew the record now, in the calling thread (unless the beat ended)."""
        with self._io:
            if not self.is_alive():
                return
            try:
                alive = self._renew_fn()
            except Exception as exc:
                log.warning("could not renew %s: %s", self.name, exc)
                alive = True
            finally:
                self._first.set()
            self.renewals += 1
            if alive is False:
                self._end()
        if alive is False:
            self._owner.drop(self)

    def _end(self) -> None:
        self._ended.set()
        self._first.set()

    def _forget(self) -> None:
        """In a forked child: the parent's beat, never renewed here (fresh locks)."""
        self._io, self._ended, self._first = threading.RLock(), threading.Event(), threading.Event()
        self._end()


class Heartbeat:
    """Every :class:`Beat` of this process, renewed when due by one thread (which ends
    with the last beat; the next :meth:`add` starts another). Not threaded (a fake clock):
    the clock's sleep renews due beats.
    """

    def __init__(self, clock: Clock, threaded: bool = True) -> None:
        self.clock, self.threaded = clock, threaded
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._beats: list[Beat] = []
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def add(
        self, name: str, period: float, renew: Callable[[], bool | None], at_once: bool = False
    ) -> Beat:
        """Keep a record alive: call ``renew`` every ``period`` seconds (first now if
        ``at_once``, else after one period). ``name`` says what it is, in messages."""
        beat = Beat(self, name, period, renew)
        beat.due = self.clock.now() + (0.0 if at_once else period)
        with self._lock:
            self._beats.append(beat)
        if not self.threaded:
            if at_once:
                self.renew_due()
            return beat
        with self._lock:
            if self._thread is None:  # it is set to None by the thread, as it ends
                self._thread = threading.Thread(
                    target=self._run, name="asyncckpt-heartbeat", daemon=True
                )
                # Thread.start waits until the thread runs (milliseconds on a busy machine):
                # the pool starts it, so that the caller (a save) does not pay that.
                workers.pool("beats", _RENEW_THREADS).submit(self._thread.start)
        self._wake.set()
        return beat

    def drop(self, beat: Beat) -> None:
        """Forget ``beat`` (:meth:`Beat.stop` calls this)."""
        with self._lock:
            if beat in self._beats:
                self._beats.remove(beat)
        self._wake.set()

    def beats(self) -> list[Beat]:
        """The beats registered now."""
        with self._lock:
            return list(self._beats)

    def next_due(self) -> float | None:
        """When the next beat not being renewed is due (None: none)."""
        with self._lock:
            return min((b.due for b in self._beats if not b.busy), default=None)

    def renew_due(self) -> float | None:
        """Renew every beat that is due (threaded: on the pool, else here); return the
        seconds until the next one is due (None: none is waiting)."""
        now = self.clock.now()
        with self._lock:
            due = [b for b in self._beats if b.due <= now and not b.busy]
            for beat in due:
                beat.busy = True
        for beat in due:
            if self.threaded:
                workers.pool("beats", _RENEW_THREADS).submit(self._renew, beat)
            else:
                self._renew(beat)
        after = self.next_due()
        return None if after is None else max(0.001, after - self.clock.now())

    def _renew(self, beat: Beat) -> None:
        try:
            beat.renew()
            beat.due = self.clock.now() + beat.period
        finally:
            beat.busy = False
            self._wake.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._beats:  # decided under the lock that add() starts one under
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
            wait = self.renew_due()
            self.clock.wait(self._wake, wait)
            self._wake.clear()

    def forget_after_fork(self) -> None:
        """In a forked child: the beats and the thread are the parent's (a child must
        never renew the parent's records): end them all, keep nothing."""
        beats = self._beats
        self._reset()
        for beat in beats:
            beat._forget()


# -- the process's clock and heartbeat ------------------------------------------------------

_clock: Clock = RealClock()
_heartbeat = Heartbeat(_clock)


def clock() -> Clock:
    """The clock every liveness decision of this process uses now."""
    return _clock


def heartbeat() -> Heartbeat:
    """This process's heartbeat."""
    return _heartbeat


@contextlib.contextmanager
def fake_clock(start: float = 1000.0) -> Iterator[FakeClock]:
    """Run the block on virtual time (for tests): waits, staleness and the beats added
    inside use a :class:`FakeClock`, whose sleeps return at once and renew due beats.

    Example:
        >>> with fake_clock() as clock:
        ...     clock.sleep(3600)
        ...     clock.now()
        4600.0
    """
    global _clock, _heartbeat
    before = _clock, _heartbeat
    fake = FakeClock(start=start)
    fake.heartbeat = Heartbeat(fake, threaded=False)
    _clock, _heartbeat = fake, fake.heartbeat
    try:
        yield fake
    finally:
        _clock, _heartbeat = before


@workers.after_fork_in_child
def _forget_after_fork() -> None:
    _heartbeat.forget_after_fork()


# -- staleness and waiting ------------------------------------------------------------------


class Staleness:
    """The one stale rule: a record is stale once its content has not changed for
    ``expiry_s`` seconds on the reader's own clock (never a time the writer wrote: two
    machines' clocks disagree; a change of content is what crosses between them).

    Example:
        >>> with fake_clock() as clock:
        ...     watch = Staleness(10.0)
        ...     watch.stale_for("lease", b"beat 1")
        ...     clock.sleep(10)
        ...     watch.stale_for("lease", b"beat 1")
        10.0
    """

    def __init__(self, expiry_s: float) -> None:
        self.expiry_s = expiry_s
        self.clock = clock()
        self._seen: dict[Hashable, tuple[object, float]] = {}

    def stale_for(self, key: Hashable, content: object) -> float | None:
        """Take in what record ``key`` holds now (None: there is none, nothing to judge);
        return how long it has not changed if that reached the expiry, else None."""
        now = self.clock.now()
        if content is None:
            self._seen.pop(key, None)
            return None
        seen = self._seen.get(key)
        if seen is None or seen[0] != content:  # new, or rewritten: its writer is alive
            self._seen[key] = (content, now)
            return None
        # The same sum as next_stale(): a poll woken at that moment finds the record stale.
        return now - seen[1] if now >= seen[1] + self.expiry_s else None

    def seen(self, key: Hashable) -> object:
        """What record ``key`` held when last seen (None: not seen)."""
        seen = self._seen.get(key)
        return None if seen is None else seen[0]

    def next_stale(self) -> float | None:
        """When the first record seen would turn stale, if none changes (None: none seen)."""
        return min((since + self.expiry_s for _, since in self._seen.values()), default=None)


def poll(
    attempt: Callable[[], T | None],
    *,
    timeout: float | None,
    expired: Callable[[float], BaseException] | None = None,
    first: float = 0.02,
    cap: float = 1.0,
    watch: Staleness | None = None,
    what: str | None = None,
) -> T:
    """Call ``attempt`` until it returns something other than None, and return that.

    Between calls, a delay of ``first`` seconds doubling up to ``cap``, each drawn from 50
    to 150 % of itself (so that waiters do not poll in step), never past the deadline
    ``timeout`` seconds from now, nor past the moment a record ``watch`` follows would turn
    stale (so that a dead writer is noticed on time). ``attempt`` raises to end the wait
    with an error. ``what`` is logged every minute the wait lasts ("still waiting for").

    Raises:
        BaseException: ``expired(seconds waited)``, once ``timeout`` seconds passed with
            no result (an attempt is always made at the deadline).

    Example:
        >>> with fake_clock() as clock:
        ...     poll(lambda: clock.now() >= 1003 or None, timeout=None)
        True
    """
    now = started = clock().now()
    deadline = None if timeout is None else started + timeout
    delay, next_log = first, started + _LOG_EVERY_S
    while (result := attempt()) is None:
        now = clock().now()
        if deadline is not None and now >= deadline:
            assert expired is not None, "a wait with a timeout says what its expiry raises"
            raise expired(now - started)
        if what is not None and now >= next_log:
            log.info("still waiting for %s", what)
            next_log = now + _LOG_EVERY_S
        bounds = (deadline, None if watch is None else watch.next_stale())
        ahead = [b - now for b in bounds if b is not None and b > now]
        clock().sleep(min([delay * (0.5 + random.random()), *ahead]))
        delay = min(delay * 2, cap)
    return result
