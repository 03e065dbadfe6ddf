"""Crash consistency: a writer process saving in a loop is killed with SIGKILL at random.

A subprocess saves a deterministic state of a few MB per step with
``Checkpointer(root, keep_last=2)``, logging each step before ``save`` and again once its
handle has returned. The test kills it at a random moment (many trials), then checks what a
fresh Checkpointer finds under the root:

* ``latest()`` (for a reader, and for a writer after its recovery) is a step the writer had
  started, no older than the last step whose save had returned and never older than after the
  previous trial, and ``load()`` returns that step's state bit for bit (every committed
  version too);
* leftovers are gone after the writer's recovery: no temp files at the root, no step
  directory without a valid commit record, and the version file names the newest version;
* the next run (the next trial's writer) continues from there with newer steps, and a last
  run that is not killed finishes with exactly the two newest versions and nothing else.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncckpt import Checkpointer
from asyncckpt._storage import TEMP_MARK, resolve
from asyncckpt._versions import writing as root_writer
from asyncckpt._versions.protocol import read_commit, read_version_file
from tests.state_checks import tree

pytestmark = pytest.mark.slow

TRIALS = 12
REPO = Path(__file__).resolve().parents[2]
_WRITER = (
    "import sys; from tests.api.test_checkpointer_crash import writer_main; "
    "writer_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))"
)


def crash_state(step: int) -> dict[str, Any]:
    """About 5 MiB, every byte a function of ``step``."""
    g = torch.Generator().manual_seed(7919 * step + 1)
    return {
        "step": step,
        "weights": torch.randn(1 << 20, generator=g),
        "half": torch.randn(1 << 18, generator=g).to(torch.bfloat16),
        "ids": torch.arange(1 << 16, dtype=torch.int64) * (step + 1),
        "meta": {"tag": f"step-{step}", "lr": 0.5**step},
    }


def assert_bits(got: Any, step: int) -> None:
    want = crash_state(step)
    assert got["step"] == step, f"loaded step {got['step']}, expected {step}"
    assert got["meta"] == want["meta"]
    for key in ("weights", "half", "ids"):
        a, b = got[key], want[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"step {step}: {key} differs"


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_crash_point(ckpt: Checkpointer, point: str, at: int) -> None:
    """Make this process SIGKILL itself at ``point`` of the save of step ``at``."""
    real_commit, real_version = root_writer.create_commit, root_writer.publish_version
    real_delete_tree = ckpt._storage.delete_tree
    committed = []

    def create_commit(storage: Any, root: str, record: Any) -> None:
        if point == "before-commit" and record.step == at:
            _kill_self()
        real_commit(storage, root, record)

    def publish_version(storage: Any, root: str, record: Any, tag: str | None) -> str:
        if point == "before-version-file" and record.step == at:
            _kill_self()
        new_tag = real_version(storage, root, record, tag)
        if record.step == at:
            committed.append(at)
            if point == "after-version-file":
                _kill_self()
        return new_tag

    def delete_tree(path: str) -> None:
        # retention removes a version's commit record first, then its directory
        if point == "mid-retention" and committed:
            _kill_self()
        real_delete_tree(path)

    root_writer.create_commit = create_commit  # type: ignore[assignment]
    root_writer.publish_version = publish_version  # type: ignore[assignment]
    ckpt._storage.delete_tree = delete_tree  # type: ignore[method-assign]


def writer_main(root: str, log_path: str, start: int, expected_latest: int, count: int) -> None:
    """Save steps ``start, start+1, ...`` (``count`` of them, or for ever if negative)."""
    ckpt = Checkpointer(root, keep_last=2)
    crash = os.environ.get("CRASH_TEST_POINT")
    if crash:
        point, at = crash.split(":")
        install_crash_point(ckpt, point, int(at))
    latest = ckpt.latest()
    assert (latest if latest is not None else -1) == expected_latest, (latest, expected_latest)
    with open(log_path, "a", buffering=1) as log:  # line-buffered: one write per line
        pending: tuple[int, Any] | None = None
        step = start
        while count < 0 or step < start + count:
            log.write(f"S {step}\n")
            handle = ckpt.save(step, crash_state(step))
            if pending is not None:
                pending[1].result()
                log.write(f"C {pending[0]}\n")
            pending = (step, handle)
            step += 1
        ckpt.close()
        if pending is not None:
            log.write(f"C {pending[0]}\n")


def parse_log(path: Path) -> tuple[set[int], set[int]]:
    """Steps started and steps whose save returned, per the writer's log."""
    started: set[int] = set()
    confirmed: set[int] = set()
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            (started if parts[0] == "S" else confirmed).add(int(parts[1]))
    assert confirmed <= started
    return started, confirmed


def check_root(
    root: Path, started: set[int], confirmed: set[int], previous: int | None, context: str
) -> int | None:
    """Everything a fresh Checkpointer must find after a kill; returns the latest step."""
    floor = max([*confirmed, *([] if previous is None else [previous])], default=None)
    # Taken before any reader looks: readers and a writer that did not save change nothing
    # (the next run's first save rolls the version file forward and drops leftovers:
    # checked by the callers).
    before = tree(root)
    # A reader sees a committed step before anyone repairs the root.
    seen = Checkpointer(root, writer_rank=1).latest()
    if seen is not None:
        assert seen in started, f"{context}: reader's latest {seen} was never started"
        assert_bits(Checkpointer(root, writer_rank=1).load(), seen)
    if floor is not None:
        assert seen is not None and seen >= floor, f"{context}: reader's latest {seen} < {floor}"
    with Checkpointer(root, keep_last=2) as ckpt:
        latest = ckpt.latest()
        versions = ckpt.versions()
        if floor is not None:
            assert latest is not None and latest >= floor, f"{context}: latest {latest} < {floor}"
        if latest is None:
            assert versions == []
            return None
        assert seen is not None and latest >= seen
        assert latest in started, f"{context}: latest {latest} was never started"
        assert versions[-1] == latest and set(versions) <= started, f"{context}: {versions}"
        storage, base = resolve(root, None)
        record = read_version_file(storage, base)
        assert record is not None and record.step is not None, f"{context}: {record}"
        assert record.step <= latest, f"{context}: version file {record} is ahead of {latest}"
        for step in versions:
            assert read_commit(storage, base, step) is not None
            assert_bits(ckpt.load(step=step), step)
        assert_bits(ckpt.load(), latest)
    assert tree(root) == before, f"{context}: a reader or a writer that did not save changed it"
    return latest


#: How long a writer may take to reach one point of its progress (a fresh interpreter that
#: imports torch, then a save) before it counts as hung: each wait fails on its own, so a
#: test of many trials has no budget for the whole that a busy machine could overrun.
STEP_DEADLINE_S = 120


def wait_for_line(log: Path, proc: subprocess.Popen[bytes], line: str, err: Path) -> None:
    """Until the writer has logged ``line`` (``S n``: it calls save; ``C n``: n is durable)."""
    deadline = time.monotonic() + STEP_DEADLINE_S
    while f"{line}\n" not in (log.read_text() if log.exists() else ""):
        if proc.poll() is not None:
            pytest.fail(f"writer exited with {proc.returncode}:\n{err.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"writer never logged {line!r}:\n{err.read_text()}")
        time.sleep(0.01)


def wait_through(log: Path, proc: subprocess.Popen[bytes], steps: range, err: Path) -> int:
    """Follow the writer's saves of ``steps`` (each point with its own deadline: a busy
    machine slows the run but fails no wait), then wait for it to end; its exit status."""
    for step in steps:
        wait_for_line(log, proc, f"S {step}", err)
    try:
        return proc.wait(STEP_DEADLINE_S)
    finally:
        proc.kill()


def start_writer(
    root: Path,
    log: Path,
    start: int,
    latest: int | None,
    count: int,
    err: Path,
    crash: str | None = None,
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ASYNCCKPT_CHUNK_BYTES": str(512 << 10)}
    if crash is not None:
        env["CRASH_TEST_POINT"] = crash
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    args = [str(root), str(log), str(start), str(-1 if latest is None else latest), str(count)]
    with open(err, "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-c", _WRITER, *args], cwd=REPO, env=env, stderr=stderr
        )


# The backstop for a hang outside the waits: every trial's own bound (its wait, its pause,
# its kill), never a budget for the loop.
@pytest.mark.timeout((TRIALS + 3) * (2 * STEP_DEADLINE_S))
def test_sigkill_at_random_moments(tmp_path: Path) -> None:
    # A new seed each run explores new moments; every failure names it, and setting
    # CRASH_TEST_SEED to it replays the same kills.
    seed = int(os.environ.get("CRASH_TEST_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    root, log = tmp_path / "ckpt", tmp_path / "progress.log"
    latest: int | None = None
    next_step = 0
    committed_runs = 0
    for trial in range(TRIALS):
        context = f"trial {trial} (CRASH_TEST_SEED={seed})"
        err = tmp_path / f"writer{trial}.err"
        proc = start_writer(root, log, next_step, latest, -1, err)
        # A random moment: after a random point of the writer's progress (so a loaded
        # machine shifts no kill before it), then a random pause. The first trial's point
        # is a durable step, so some run always commits whatever the machine's speed.
        n = next_step
        points = [f"C {n}"] if trial == 0 else [f"S {n}", f"S {n + 1}", f"C {n}", f"C {n + 1}"]
        try:
            wait_for_line(log, proc, rng.choice(points), err)
            time.sleep(rng.uniform(0.0, 0.5))  # a random moment, not a threshold
            assert proc.poll() is None, f"{context}: writer died:\n{err.read_text()}"
        finally:
            proc.kill()  # SIGKILL
            proc.wait(60)
        started, confirmed = parse_log(log)
        before = latest
        latest = check_root(root, started, confirmed, before, context)
        if latest is not None and (before is None or latest > before):
            committed_runs += 1
        next_step = max(started) + 1  # every step number is started once, ever
    # at least one killed run committed something newer than the run before it
    assert committed_runs > 0, f"no run committed anything (CRASH_TEST_SEED={seed})"
    # A last run that is not killed continues and finishes cleanly.
    err = tmp_path / "final.err"
    proc = start_writer(root, log, next_step, latest, 3, err)
    assert wait_through(log, proc, range(next_step, next_step + 3), err) == 0, err.read_text()
    final = [next_step, next_step + 1, next_step + 2]
    with Checkpointer(root, keep_last=2) as ckpt:
        assert ckpt.versions() == final[-2:]
        assert ckpt.latest() == final[-1]
        assert_bits(ckpt.load(), final[-1])
        assert_bits(ckpt.load(step=final[-2]), final[-2])
    writer = Checkpointer(root, writer_rank=1)
    assert writer.versions() == final[-2:]
    files = tree(root)
    assert not [n for n in files if TEMP_MARK in n], files
    top = sorted(n for n in files if "/" not in n)
    assert top == sorted([*map(str, final[-2:]), "VERSION", "VERSION.lock", "_lease"])
    assert len([n for n in files if n.startswith("_lease/")]) == 1  # older epochs pruned
    for step in final[-2:]:
        inside = [n for n in files if n.startswith(f"{step}/")]
        assert len(inside) == 2 and f"{step}/COMMIT" in inside, inside


# (crash point, latest a reader sees before recovery, latest after the writer's recovery)
CRASH_POINTS = [
    ("before-commit", 3, 3),
    ("before-version-file", 4, 4),  # readers take the newer verified COMMIT at once
    ("after-version-file", 4, 4),
    ("mid-retention", 4, 4),
]


# The backstop for a hang outside the waits: the sum of every wait's own deadline.
@pytest.mark.timeout(10 * STEP_DEADLINE_S)
@pytest.mark.parametrize(("point", "reader_sees", "recovered"), CRASH_POINTS)
def test_sigkill_at_each_protocol_step(
    tmp_path: Path, point: str, reader_sees: int, recovered: int
) -> None:
    """Deterministic kills inside the save of step 4 (keep_last=2: it retires step 2)."""
    root, log = tmp_path / "ckpt", tmp_path / "progress.log"
    err = tmp_path / "writer.err"
    proc = start_writer(root, log, 0, None, -1, err, crash=f"{point}:4")
    code = wait_through(log, proc, range(5), err)
    assert code == -signal.SIGKILL, f"the crash point was not reached ({code}):\n{err.read_text()}"
    started, confirmed = parse_log(log)
    assert max(confirmed) == 3 and 4 in started
    assert Checkpointer(root, writer_rank=1).latest() == reader_sees
    # what the kill left behind, before anyone repairs it
    if point == "before-commit":
        assert list((root / "4").glob("*.ackpt")) and not (root / "4" / "COMMIT").exists()
    elif point == "before-version-file":
        assert (root / "4" / "COMMIT").exists()
    elif point == "mid-retention":
        assert list((root / "2").glob("*.ackpt")) and not (root / "2" / "COMMIT").exists()
    assert check_root(root, started, confirmed, None, point) == recovered
    with Checkpointer(root, writer_rank=1) as reader:
        # retention runs after a save, so a kill before it leaves one version too many
        assert reader.versions()[-2:] == [recovered - 1, recovered]
    # the next run continues with newer steps
    err = tmp_path / "next.err"
    nxt = max(started) + 1
    proc = start_writer(root, log, nxt, recovered, 2, err)
    assert wait_through(log, proc, range(nxt, nxt + 2), err) == 0, err.read_text()
    with Checkpointer(root, writer_rank=1) as reader:
        assert reader.versions() == [nxt, nxt + 1]
        assert_bits(reader.load(), nxt + 1)


def _kill_on_lease_link() -> None:
    """Make this process SIGKILL itself in the lease claim, after the record's temp file is
    written and before it is linked into place (where a killed claim leaves its debris)."""
    from asyncckpt._storage import local

    real_link = os.link

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if "_lease" in str(dst):
            _kill_self()
        real_link(src, dst, *args, **kwargs)

    local.os.link = link  # type: ignore[attr-defined]  # os is shared: this process only


_LEASE_KILLER = (
    "import sys; from tests.api.test_checkpointer_crash import _kill_on_lease_link, writer_main;"
    " _kill_on_lease_link();"
    " writer_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))"
)


@pytest.mark.timeout(6 * STEP_DEADLINE_S)
def test_a_lease_claim_killed_mid_write_leaves_nothing_behind(tmp_path: Path) -> None:
    """The claim's temp file of a writer killed in it is removed by the next writer's first
    save (it once took the same epoch number and kept the file as its own)."""
    root, log = tmp_path / "ckpt", tmp_path / "progress.log"
    err = tmp_path / "killed.err"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO)]))}
    args = [str(root), str(log), "0", "-1", "1"]
    with open(err, "wb") as stderr:
        killed = subprocess.Popen(
            [sys.executable, "-c", _LEASE_KILLER, *args], cwd=REPO, env=env, stderr=stderr
        )
    assert wait_through(log, killed, range(1), err) == -signal.SIGKILL, err.read_text()
    debris = [n for n in tree(root) if TEMP_MARK in n]
    assert debris and all(n.startswith("_lease/") for n in debris), tree(root)
    err = tmp_path / "next.err"
    proc = start_writer(root, log, 0, None, 2, err)
    assert wait_through(log, proc, range(2), err) == 0, err.read_text()
    assert not [n for n in tree(root) if TEMP_MARK in n], tree(root)
    assert Checkpointer(root, writer_rank=1).versions() == [0, 1]
