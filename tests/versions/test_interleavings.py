"""Interleavings of the actors on one root, against a model of which versions must exist.

A hypothesis state machine drives, in any order: the writer (``save`` with ``keep_last``),
a restarted writer (the old one closed), a writer frozen while a new one takes the root
and that later wakes and saves, a polling reader, ``asyncckpt gc``, ``rewind``, and a
forked child that loads. After every step the root must match the model exactly: the
committed versions, the newest one loading bit for bit (a content hash), ``VERSION``
never behind the newest version and moving backwards only by a rewind, no temp file
left after a successful save or gc, and a woken frozen writer changing nothing.

Deterministic: derandomized, no example database, no heartbeat during a run (the lease
renewal period is an hour: a frozen writer stays frozen until a rule wakes it).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncckpt import Checkpointer
from asyncckpt.cli.main import main as cli_main
from asyncckpt.errors import AsyncCkptError
from tests.fuzzing import DEEP_EXAMPLES
from tests.testing.crash_scenarios import (
    DETERMINISTIC_ENV,
    EXPECTED,
    content_hash,
    state,
    temp_files,
    version_step,
)

KEEP_LAST = 3
#: A forked child that has not exited by then fails the test loudly.
CHILD_TIMEOUT_S = 60
#: Steps go up to this (the content hashes are precomputed for them).
MAX_STEP = max(EXPECTED)


class RootMachine(RuleBasedStateMachine):
    """The model: ``committed``, the versions that must exist, in order."""

    #: How often each actor acted, over every example.
    acted: ClassVar[collections.Counter[str]] = collections.Counter()

    def __init__(self) -> None:
        super().__init__()
        self.base = Path(os.environ["INTERLEAVINGS_TMP"]) / uuid.uuid4().hex[:8]
        self.root = self.base / "root"
        self.base.mkdir(parents=True)
        self.writer = self._new_writer()
        self.frozen: list[Checkpointer] = []
        self.committed: list[int] = []
        self.next_step = 1
        self.version_floor = -1  # VERSION's step may not drop below it (rewind lowers it)

    def _new_writer(self) -> Checkpointer:
        return Checkpointer(self.root, keep_last=KEEP_LAST, compression="none")

    def _take_step(self) -> int:
        step, self.next_step = self.next_step, self.next_step + 1
        return step

    # -- the actors ----------------------------------------------------------------------

    @precondition(lambda self: self.next_step <= MAX_STEP)
    @rule()
    def save(self) -> None:
        self.acted["save"] += 1
        step = self._take_step()
        self.writer.save(step, state(step)).result()
        self.committed = [*self.committed, step][-KEEP_LAST:]
        assert temp_files(self.root) == [], "temp files after a successful save"

    # Saves are what the other actors act on: two more rules that save make hypothesis
    # pick a save as often as the other actors together (it has no rule weights).
    @precondition(lambda self: self.next_step <= MAX_STEP)
    @rule()
    def save_again(self) -> None:
        self.save()

    @precondition(lambda self: self.next_step <= MAX_STEP)
    @rule()
    def save_once_more(self) -> None:
        self.save()

    @rule()
    def restart_writer(self) -> None:
        self.acted["restart_writer"] += 1
        self.writer.close()
        self.writer = self._new_writer()

    @precondition(lambda self: self.committed and self.next_step <= MAX_STEP)
    @rule()
    def freeze_writer_and_take_over(self) -> None:
        """The writer stops (a SIGSTOP, a swapped-out VM) without closing; a new job saves."""
        self.acted["freeze_writer_and_take_over"] += 1
        if self.writer._writer.epoch is None:  # never took the lease: nothing to fence
            return
        self.frozen.append(self.writer)
        self.writer = self._new_writer()
        self.save()

    @precondition(lambda self: self.frozen and self.next_step <= MAX_STEP)
    @rule(pick=st.integers(0, 7))
    def frozen_writer_wakes(self, pick: int) -> None:
        self.acted["frozen_writer_wakes"] += 1
        zombie = self.frozen.pop(pick % len(self.frozen))
        before = self._files()
        step = self._take_step()
        with pytest.raises(AsyncCkptError):
            zombie.save(step, state(step)).result()
        with contextlib.suppress(AsyncCkptError):
            zombie.close()
        assert self._files() == before, "a fenced writer changed the root"

    def _files(self) -> dict[str, bytes]:
        """Every file under the root and its bytes. Directories are left out: a fenced
        save leaves its step's directory, empty, for the lease holder's retention (it
        deletes only the files of its own attempt, PROTOCOL.md §0)."""
        return {
            p.relative_to(self.root).as_posix(): p.read_bytes()
            for p in sorted(self.root.rglob("*"))
            if p.is_file() and not p.is_symlink()
        }

    @precondition(lambda self: self.frozen and self.next_step <= MAX_STEP)
    @rule(pick=st.integers(0, 7))
    def another_frozen_writer_wakes(self, pick: int) -> None:
        self.frozen_writer_wakes(pick)  # a second rule: hypothesis rarely picks the first

    @rule()
    def polling_reader(self) -> None:
        self.acted["polling_reader"] += 1
        reader = Checkpointer(self.root, read_only=True)
        latest = reader.latest()
        assert latest == (self.committed[-1] if self.committed else None)
        if latest is not None:
            assert content_hash(reader.load()) == EXPECTED[latest]

    @precondition(lambda self: self.committed)
    @rule()
    def gc(self) -> None:
        self.acted["gc"] += 1
        assert cli_main(["gc", str(self.root), "--keep-last", "2"]) == 0
        self.committed = self.committed[-2:]
        assert temp_files(self.root) == [], "temp files after gc"

    @precondition(lambda self: len(self.committed) >= 2)
    @rule(pick=st.integers(0, 7))
    def rewind(self, pick: int) -> None:
        self.acted["rewind"] += 1
        target = self.committed[:-1][pick % (len(self.committed) - 1)]
        self.writer.rewind(target)
        self.committed = [s for s in self.committed if s <= target]
        self.version_floor = target

    @precondition(lambda self: self.committed)
    @rule()
    def forked_child_loads(self) -> None:
        self.acted["forked_child_loads"] += 1
        want = EXPECTED[self.committed[-1]]
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                got = content_hash(Checkpointer(self.root, read_only=True).load())
                code = 0 if got == want else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"the forked child hung past {CHILD_TIMEOUT_S} s")
            time.sleep(0.005)  # polling a child's exit: waitpid has no timeout
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"

    # -- after every step ----------------------------------------------------------------

    @invariant()
    def the_root_matches_the_model(self) -> None:
        reader = Checkpointer(self.root, read_only=True)
        assert reader.versions() == self.committed
        if not self.committed:
            return
        newest = self.committed[-1]
        assert reader.latest() == newest
        assert content_hash(reader.load()) == EXPECTED[newest]
        vstep = version_step(self.root)
        assert vstep == newest, f"VERSION names {vstep}, the newest version is {newest}"
        assert vstep >= self.version_floor, "VERSION moved backwards"
        self.version_floor = vstep

    def teardown(self) -> None:
        for ckpt in [self.writer, *self.frozen]:
            with contextlib.suppress(AsyncCkptError):
                ckpt.close()


RootMachine.TestCase.settings = settings(
    max_examples=DEEP_EXAMPLES or 15,
    stateful_step_count=12,
    deadline=None,
    derandomize=not DEEP_EXAMPLES,
    database=None,
)


@pytest.fixture
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in DETERMINISTIC_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("INTERLEAVINGS_TMP", str(tmp_path))


@pytest.mark.timeout(0 if DEEP_EXAMPLES else 300)  # a hunt runs as long as it takes
@pytest.mark.usefixtures("_env")
def test_interleavings() -> None:
    RootMachine.acted.clear()
    RootMachine.TestCase().runTest()
    print(dict(RootMachine.acted))  # which actors the examples reached (-rP shows it)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("_env")
def test_every_actor_in_one_scripted_run() -> None:
    """Every actor at least once, in a fixed order, whatever examples hypothesis picks."""
    machine = RootMachine()
    script = [
        machine.save,
        machine.save,
        machine.polling_reader,
        machine.freeze_writer_and_take_over,
        machine.save,
        machine.forked_child_loads,
        lambda: machine.frozen_writer_wakes(0),
        machine.restart_writer,
        machine.save,
        lambda: machine.rewind(1),
        machine.save,
        machine.gc,
        machine.freeze_writer_and_take_over,
        lambda: machine.frozen_writer_wakes(0),
        machine.polling_reader,
    ]
    try:
        for action in script:
            action()
            machine.the_root_matches_the_model()
    finally:
        machine.teardown()
    assert set(RootMachine.acted) >= {
        "save",
        "restart_writer",
        "freeze_writer_and_take_over",
        "frozen_writer_wakes",
        "polling_reader",
        "gc",
        "rewind",
        "forked_child_loads",
    }
