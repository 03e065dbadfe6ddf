"""Roles across processes: a polling evaluator, a frozen (SIGSTOPped) writer, racing writers.

Each child is a fresh interpreter running a snippet below; every wait has a deadline and
children are killed at the end, so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from asyncckpt import Checkpointer
from asyncckpt.protocol import read_version_file
from asyncckpt.storage import resolve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[1]

COMMON = """
import json, os, signal, sys, time, torch, asyncckpt
from asyncckpt import Checkpointer
from asyncckpt.errors import ConflictError
def state(step, who=0):
    return {"step": step, "who": who, "w": torch.full((50_000,), float(step))}
def consistent(got):
    return bool((got["w"] == float(got["step"])).all()) and got["w"].numel() == 50_000
"""

EVALUATOR = (
    COMMON
    + """
root, out = sys.argv[1], sys.argv[2]
loads, seen = 0, []
open(out + ".ready", "w").close()
while not os.path.exists(out + ".stop"):
    try:
        got = Checkpointer(root).load()  # a fresh Checkpointer each time, as a poller would
    except asyncckpt.errors.CheckpointNotFoundError:
        continue
    assert consistent(got), got["step"]
    loads += 1
    seen.append(got["step"])
    if loads == 1:
        open(out + ".loaded", "w").close()
json.dump({"loads": loads, "seen": seen}, open(out, "w"))
"""
)


def _run(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"child hung:\n{err[-3000:]}")
    return proc.returncode, out, err


def _wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped (state T in /proc), at most 60 s."""
    deadline = time.monotonic() + 60
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} never stopped: {states}"
        time.sleep(0.005)


def _wait_for_file(path: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_an_evaluator_polling_the_root_never_disturbs_the_trainer(tmp_path: Path) -> None:
    import json

    import torch

    root, out = str(tmp_path / "run"), str(tmp_path / "eval.json")
    evaluator = _run(EVALUATOR, root, out)
    try:
        _wait_for_file(out + ".ready", evaluator)
        with Checkpointer(root, keep_last=2) as trainer:
            for step in range(40):
                w = torch.full((50_000,), float(step))
                trainer.save(step, {"step": step, "who": 0, "w": w}).result(timeout=120)
                time.sleep(0.01)
            assert trainer.latest() == 39
        _wait_for_file(out + ".loaded", evaluator)  # at least one load beside the saves
    finally:
        Path(out + ".stop").touch()
    code, _, err = _finish(evaluator)
    assert code == 0, err[-3000:]
    report = json.loads(Path(out).read_text())
    assert report["loads"] > 0
    assert report["seen"] == sorted(report["seen"])  # the latest never moved backwards
    assert Checkpointer(root).versions() == [38, 39]


ZOMBIE = (
    COMMON
    + """
root, where, signal_file = sys.argv[1], sys.argv[2], sys.argv[3]
from asyncckpt import root_writer
ckpt = Checkpointer(root)
for step in (1, 2):
    ckpt.save(step, state(step)).result()
real_create, real_publish = root_writer.create_commit, root_writer.publish_version
def freeze():
    # Park this thread here, then tell the test, which SIGSTOPs the whole process: a
    # self-sent SIGSTOP lets this thread run on for a moment (into the commit) first.
    open(signal_file, "w").close()
    while not os.path.exists(signal_file + ".go"):
        time.sleep(0.005)
def create_commit(storage, r, record):
    if where == "before-commit" and record.step == 3:
        freeze()
    return real_create(storage, r, record)
def publish_version(storage, r, record, tag):
    if where == "before-version" and record.step == 3:
        freeze()
    return real_publish(storage, r, record, tag)
root_writer.create_commit, root_writer.publish_version = create_commit, publish_version
try:
    ckpt.save(3, state(3)).result()
    print("zombie: success")
except ConflictError as exc:
    print("zombie: conflict:", exc)
ckpt.close()
"""
)


@pytest.mark.parametrize("where", ["before-commit", "before-version"])
def test_a_frozen_writer_that_wakes_up_cannot_move_the_version_backwards(
    tmp_path: Path, where: str
) -> None:
    import torch

    root, signal_file = str(tmp_path / "run"), str(tmp_path / "frozen")
    zombie = _run(ZOMBIE, root, where, signal_file)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(signal_file):
            assert zombie.poll() is None, zombie.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the zombie never reached its freeze point"
            time.sleep(0.02)
        os.kill(zombie.pid, signal.SIGSTOP)  # frozen at the chosen point of its commit
        _wait_stopped(zombie.pid)  # SIGSTOP lands asynchronously: only then may it go on
        Path(signal_file + ".go").touch()  # it goes on from there once continued
        with Checkpointer(root) as restarted:  # takes the root over while A is frozen
            for step in (10, 20):
                restarted.save(step, {"step": step, "who": 1, "w": torch.full((50_000,), 1.0)})
        storage, base = resolve(root, None)
        assert read_version_file(storage, base).step == 20  # type: ignore[union-attr]
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    code, out, err = _finish(zombie)
    assert code == 0, err[-3000:]
    assert "zombie: conflict" in out, out + err[-3000:]
    record = read_version_file(storage, base)
    assert record is not None and record.step == 20 and record.epoch == 2
    reader = Checkpointer(root)
    assert reader.latest() == 20
    assert reader.load()["who"] == 1
    if where == "before-commit":
        assert 3 not in reader.versions()  # fenced before its COMMIT: nothing visible


RACER = (
    COMMON
    + """
root, who, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
options = json.loads(sys.argv[4])
ckpt = Checkpointer(root, storage_options=options or None)
while not os.path.exists(go):
    time.sleep(0.001)
try:
    ckpt.save(7, state(7, who)).result()
    print("won")
except ConflictError as exc:
    print("lost:", exc)
"""
)


def _race(root: str, options: dict[str, Any], tmp_path: Path, racers: int = 6) -> None:
    import json

    go = str(tmp_path / "go")
    procs = [_run(RACER, root, str(i), go, json.dumps(options)) for i in range(racers)]
    time.sleep(3)  # let every racer import torch and reach the start line
    Path(go).touch()
    results = [_finish(p) for p in procs]
    for code, _, err in results:
        assert code == 0, err[-3000:]
    winners = [i for i, (_, out, _) in enumerate(results) if out.startswith("won")]
    assert len(winners) == 1, [out for _, out, _ in results]
    got = Checkpointer(root, storage_options=options or None).load(step=7)
    assert got["who"] == winners[0] and got["step"] == 7


def test_racing_writer_processes_on_local_disk(tmp_path: Path) -> None:
    _race(str(tmp_path / "run"), {}, tmp_path)


def test_racing_writer_processes_on_s3(s3_root: str, s3_server: Any, tmp_path: Path) -> None:
    _race(s3_root, s3_server.storage_options, tmp_path)
