"""The liveness kernel: small records rewritten as proof of life, judged stale on the
reader's clock, waited on with backoff (docs/PROTOCOL.md §0b): one :class:`Clock`
(injectable: :func:`use_clock`), one :class:`Heartbeat` thread per process renewing every
:class:`Beat`, one stale rule (:class:`Staleness`) and one wait (:func:`poll`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol, TypeVar

from asyncckpt import _threads as workers

log = logging.getLogger(__name__)
T = TypeVar("T")
#: Threads that run renewals: a store that hangs holds up the beats of its own records only.
_RENEW_THREADS = 4
_LOG_EVERY_S = 60.0


class Clock(Protocol):
    """Monotonic time in seconds and a sleep, as every liveness decision sees them: the
    :class:`RealClock`, or a fake one that tests inject (:func:`use_clock`)."""

    def now(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class RealClock:
    """:func:`time.monotonic` and :func:`time.sleep`.

    Example:
        >>> RealClock().now() > 0
        True
    """

    now = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)


class Beat:
    """One record this process keeps alive (:meth:`Heartbeat.add`): ``renew`` runs every
    ``period`` s until :meth:`stop`, or until it returns False (the record is lost); one
    that raises is logged and retried a period later (docs/PROTOCOL.md §0b)."""

    def __init__(self, owner: Heartbeat, name: str, period: float, renew: Callable[[], object]):
        self.name, self.period, self.renewals, self.due, self.busy = name, period, 0, 0.0, False
        self._owner, self._renew = owner, renew
        self._io = threading.RLock()  # held while renew runs: stop() waits for it
        self._ended, self._first = threading.Event(), threading.Event()

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
        """Renew no more; returns once a renewal in progress ended (so do not hold a lock
        that ``renew`` takes)."""
        with self._io:
            self._ended.set()
            self._first.set()
        self._owner.drop(self)

    def renew(self) -> bool:
        """Renew the record now, in the calling thread; whether it was renewed."""
        with self._io:
            if not self.is_alive():
                return False
            try:
                alive = self._renew()
            except Exception as exc:
                log.warning("could not renew %s: %s", self.name, exc)
                return False
            finally:
                self.renewals += 1
                self._first.set()
        if alive is False:
            self.stop()
        return alive is not False


class Heartbeat:
    """Every :class:`Beat` of a process, renewed when due by one thread (on a small pool:
    a store that hangs delays its own records only). The thread ends with the last beat;
    the next :meth:`add` starts another. Not ``threaded`` (a fake clock): the clock's
    ``sleep`` calls :meth:`renew_due`.

    Example:
        >>> beat = heartbeat().add("a record", 3600, lambda: None, at_once=True)
        >>> beat.wait_first(); beat.stop(); beat.renewals, beat.is_alive()
        (1, False)
    """

    def __init__(self, clock: Clock, threaded: bool = True) -> None:
        self.clock, self.threaded = clock, threaded
        self._lock, self._beats = threading.Lock(), list[Beat]()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def add(
        self, name: str, period: float, renew: Callable[[], object], at_once: bool = False
    ) -> Beat:
        """Keep a record alive: call ``renew`` every ``period`` s (first now if ``at_once``,
        else a period from now); ``name`` says what the record is, in messages."""
        beat = Beat(self, name, period, renew)
        beat.due = self.clock.now() + (0.0 if at_once else period)
        with self._lock:
            self._beats.append(beat)
            if self.threaded and self._thread is None:  # the thread resets it as it ends
                self._thread = threading.Thread(target=self._run, name="asyncckpt-heartbeat")
                self._thread.daemon = True
                # Thread.start waits until the thread runs (milliseconds on a busy machine);
                # the pool starts it, so that the caller (a save) does not pay that.
                workers.pool("beats", _RENEW_THREADS).submit(self._thread.start)
        if not self.threaded and at_once:
            self.renew_due()
        self._wake.set()
        return beat

    def drop(self, beat: Beat) -> None:
        """Forget ``beat`` (:meth:`Beat.stop` does)."""
        with self._lock, contextlib.suppress(ValueError):
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
        """Renew the beats that are due (threaded: on the pool); seconds to the next."""
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
            self._wake.wait(self.renew_due())  # threaded: on the real clock
            self._wake.clear()


_clock: Clock = RealClock()
_heartbeat = Heartbeat(_clock)


def clock() -> Clock:
    """The clock every liveness decision of this process uses now."""
    return _clock


def heartbeat() -> Heartbeat:
    """This process's heartbeat."""
    return _heartbeat


@contextlib.contextmanager
def use_clock(fake: Clock) -> Iterator[Heartbeat]:
    """Run the block on ``fake`` time (tests): waits and staleness use it, and beats added
    inside go to a heartbeat of their own, with no thread: the fake clock's sleeps renew
    them (:meth:`Heartbeat.renew_due`)."""
    global _clock, _heartbeat
    before = _clock, _heartbeat
    _clock, _heartbeat = fake, Heartbeat(fake, threaded=False)
    try:
        yield _heartbeat
    finally:
        _clock, _heartbeat = before


@workers.after_fork_in_child
def _forget_after_fork() -> None:
    """The parent's beats and thread are not the child's: it must never renew them."""
    global _heartbeat
    beats, _heartbeat = _heartbeat.beats(), Heartbeat(_heartbeat.clock, _heartbeat.threaded)
    for beat in beats:  # their locks may be held by a thread the child does not have
        beat._io, beat._owner = threading.RLock(), _heartbeat
        beat._ended, beat._first = threading.Event(), threading.Event()
        beat.stop()  # on the fresh locks: ended, and not in the child's heartbeat


class Staleness:
    """The one stale rule: a record is stale once its content has not changed for
    ``expiry_s`` seconds on the reader's own clock (never a time the writer wrote: two
    machines' clocks disagree; a change of content is what crosses between them).

    Example:
        >>> watch = Staleness(expiry_s=60.0)  # tests/fake_clock.py lets a minute pass
        >>> watch.stale_for("lease", b"beat 1"), watch.stale_for("lease", b"beat 1")
        (None, None)
    """

    def __init__(self, expiry_s: float) -> None:
        self.expiry_s, self.clock = expiry_s, clock()
        self._seen: dict[Hashable, tuple[object, float]] = {}

    def stale_for(self, key: Hashable, content: object, since: float | None = None) -> float | None:
        """Take in what record ``key`` holds now (None: there is none, nothing to judge;
        ``since``: when a record first seen held it, default now); return how long it has
        not changed if that reached the expiry, else None."""
        now = self.clock.now()
        if content is None:
            self._seen.pop(key, None)
            return None
        seen = self._seen.get(key)
        if seen is None or seen[0] != content:  # new, or rewritten: its writer is alive
            seen = self._seen[key] = (content, now if seen is not None or since is None else since)
        # The same sum as next_stale(): a poll woken at that moment finds the record stale.
        return now - seen[1] if now >= seen[1] + self.expiry_s else None

    def seen(self, key: Hashable) -> object:
        """What record ``key`` held when last seen (None: not seen)."""
        return self._seen.get(key, (None, 0.0))[0]

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
    """Call ``attempt`` until it returns something other than None, and return that;
    ``attempt`` raises to end the wait with an error.

    The backoff (``first`` seconds doubling up to ``cap``, jittered) never sleeps past
    ``timeout`` nor past the moment a record ``watch`` follows turns stale (docs/PROTOCOL.md
    §0b, "One wait"). ``what`` is logged every minute the wait lasts.

    Raises:
        BaseException: ``expired(seconds waited)``, once ``timeout`` seconds passed with no
            result (an attempt is always made at the deadline).

    Example:
        >>> poll(lambda: 42, timeout=1.0)
        42
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
