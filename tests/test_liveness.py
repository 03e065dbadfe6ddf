"""The liveness kernel (``asyncckpt/_liveness.py``), in process, mostly on a fake clock:

* staleness is judged on the reader's own clock, from changes of content only;
* the poll's backoff doubles with jitter, up to its cap, and never sleeps past the deadline
  nor past the moment a watched record turns stale;
* one heartbeat thread per process whatever the number of beats, ending with the last;
* a beat whose renew raises is retried and does not stop the thread or the other beats;
* a forked child drops the parent's beats (in a script of its own, under a hard timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncckpt import _liveness as liveness
from asyncckpt.errors import CheckpointTimeoutError
from tests.fake_clock import fake_clock

REPO = Path(__file__).resolve().parents[1]


def _until(condition: Any) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.005)


# --------------------------------------------------------------------------- staleness


def test_a_record_is_stale_once_unchanged_for_the_expiry_on_the_readers_clock() -> None:
    with fake_clock() as clock:
        watch = liveness.Staleness(10.0)
        # The record names a time of its writer's clock: it plays no part.
        record = {"beat": 1, "written_at": 1e12}
        assert watch.stale_for("a", record) is None
        assert watch.next_stale() == clock.now() + 10
        clock.sleep(9.5)
        assert watch.stale_for("a", dict(record)) is None  # equal content: unchanged
        clock.sleep(0.5)
        assert watch.stale_for("a", record) == 10.0
        assert watch.stale_for("a", {"beat": 2, "written_at": 0.0}) is None  # rewritten
        clock.sleep(9.9)
        assert watch.stale_for("a", {"beat": 2, "written_at": 0.0}) is None
        assert watch.seen("a") == {"beat": 2, "written_at": 0.0}


def test_no_record_is_nothing_to_judge_and_records_are_judged_apart() -> None:
    with fake_clock() as clock:
        watch = liveness.Staleness(1.0)
        assert watch.stale_for("a", b"x") is None
        assert watch.stale_for("b", b"x") is None
        clock.sleep(0.6)
        assert watch.stale_for("b", b"y") is None  # b changed, a did not
        clock.sleep(0.6)
        assert watch.stale_for("a", b"x") == pytest.approx(1.2)
        assert watch.stale_for("b", b"y") is None
        assert watch.stale_for("a", None) is None  # gone: forgotten, never stale
        assert watch.seen("a") is None
        clock.sleep(5)
        assert watch.stale_for("a", None) is None


# --------------------------------------------------------------------------- the poll


def test_the_backoff_doubles_with_jitter_up_to_its_cap_and_stops_at_the_deadline() -> None:
    with fake_clock() as clock:
        start, calls = clock.now(), []

        def never() -> None:
            calls.append(clock.now())

        with pytest.raises(CheckpointTimeoutError, match=r"gave up after 5\.0 s"):
            liveness.poll(
                never,
                timeout=5.0,
                first=0.02,
                cap=1.0,
                expired=lambda waited: CheckpointTimeoutError(f"gave up after {waited} s"),
            )
        assert clock.now() == start + 5.0  # not a moment past the deadline
        assert calls[-1] == start + 5.0  # an attempt is made at the deadline
        *pauses, last = clock.slept
        delay = 0.02
        for pause in pauses:
            assert 0.5 * delay <= pause <= 1.5 * delay
            delay = min(delay * 2, 1.0)
        assert 0 < last <= 1.5 * delay  # cut short by the deadline
        assert len(calls) == len(clock.slept) + 1


def test_the_poll_wakes_when_a_watched_record_turns_stale() -> None:
    with fake_clock() as clock:
        watch = liveness.Staleness(3.0)
        start = clock.now()

        def attempt() -> None:
            stale = watch.stale_for("lease", "unchanged")
            if stale is not None:
                raise CheckpointTimeoutError(f"stale for {stale} s")

        with pytest.raises(CheckpointTimeoutError, match=r"stale for 3\.0 s"):
            liveness.poll(attempt, timeout=None, first=0.5, cap=2.0, watch=watch)
        assert clock.now() == start + 3.0


def test_the_poll_returns_the_first_result() -> None:
    with fake_clock() as clock:
        start = clock.now()
        assert liveness.poll(lambda: "done" if clock.now() >= start + 2 else None, timeout=60) == (
            "done"
        )
        assert start + 2 <= clock.now() < start + 4


# --------------------------------------------------------------------------- the heartbeat


def test_beats_are_renewed_every_period_on_the_fake_clock() -> None:
    with fake_clock() as clock:
        start, seen = clock.now(), []
        fast = liveness.heartbeat().add("fast", 1.0, lambda: seen.append(("fast", clock.now())))
        slow = liveness.heartbeat().add(
            "slow", 2.5, lambda: seen.append(("slow", clock.now())), at_once=True
        )
        assert seen == [("slow", start)]  # at once: before add returns
        clock.sleep(5.2)
        assert [(n, t - start) for n, t in seen] == [
            ("slow", 0.0),
            ("fast", 1.0),
            ("fast", 2.0),
            ("slow", 2.5),
            ("fast", 3.0),
            ("fast", 4.0),
            ("fast", 5.0),
            ("slow", 5.0),
        ]
        fast.stop()
        clock.sleep(10)
        assert fast.renewals == 5 and not fast.is_alive() and slow.renewals == 7  # 0 to 15


def test_a_renew_that_returns_false_ends_its_beat() -> None:
    with fake_clock() as clock:
        answers = iter([None, True, False, True])
        beat = liveness.heartbeat().add("lost", 1.0, lambda: next(answers))
        clock.sleep(10)
        assert beat.renewals == 3 and not beat.is_alive() and beat.join(0)
        assert liveness.heartbeat().beats() == []


@pytest.mark.timeout(120)
def test_one_heartbeat_thread_renews_every_beat_of_the_process_and_ends_with_the_last() -> None:
    def threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "asyncckpt-heartbeat"]

    renewed = [threading.Event() for _ in range(40)]
    beats = [
        liveness.heartbeat().add(f"record {i}", 0.01 + i / 1000, event.set)
        for i, event in enumerate(renewed)
    ]
    try:
        for event in renewed:
            assert event.wait(60)
        assert len(threads()) == 1
    finally:
        for beat in beats:
            beat.stop()
    if liveness.heartbeat().beats():
        pytest.skip("another test of this process left a beat running")
    for thread in threads():
        thread.join(timeout=60)
        assert not thread.is_alive()


@pytest.mark.timeout(120)
def test_a_renew_that_raises_is_retried_and_stops_neither_the_thread_nor_other_beats(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def fails() -> None:
        raise OSError("the store is down")

    bad = liveness.heartbeat().add("a failing record", 0.01, fails)
    good = liveness.heartbeat().add("a good record", 0.01, lambda: None)
    try:
        _until(lambda: bad.renewals >= 3 and good.renewals >= 3)
        assert bad.is_alive() and good.is_alive()
        late = liveness.heartbeat().add("a later record", 0.01, lambda: None)
        _until(lambda: late.renewals >= 2)  # the thread still runs
        late.stop()
    finally:
        bad.stop()
        good.stop()
    assert "could not renew a failing record: the store is down" in caplog.text


def test_stop_waits_for_a_renewal_in_progress_and_none_runs_after() -> None:
    entered, release, renewals = threading.Event(), threading.Event(), []

    def slow() -> None:
        renewals.append(1)
        entered.set()
        assert release.wait(60)

    beat = liveness.heartbeat().add("slow", 3600, slow, at_once=True)
    assert entered.wait(60)
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (beat.stop(), stopped.set()))
    stopper.start()
    assert not stopped.wait(0.05)  # still renewing
    release.set()
    stopper.join(60)
    assert stopped.is_set() and not beat.is_alive()
    beat.renew()
    assert renewals == [1]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_drops_the_parents_beats(tmp_path: Path) -> None:
    script = """
        import os, sys, threading, time
        from asyncckpt import _liveness as liveness

        renewed = threading.Event()
        parents = liveness.heartbeat().add("the parent's record", 0.01, renewed.set)
        assert renewed.wait(60)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                assert liveness.heartbeat().beats() == [], "the child kept the parent's beats"
                assert not parents.is_alive()
                parents.stop()  # the parent's handle, in the child: returns at once
                mine = threading.Event()
                beat = liveness.heartbeat().add("the child's record", 0.01, mine.set)
                assert mine.wait(60), "the child's own beat never ran"
                beat.stop()
            except BaseException as exc:
                print(repr(exc), flush=True)
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert parents.is_alive()
        sys.exit(os.waitstatus_to_exitcode(status))
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
