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
from asyncckpt._storage import resolve
from asyncckpt._versions.protocol import read_version_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]

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
from asyncckpt._versions import writing as root_writer
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
        # Its COMMIT named data the new writer's retention had removed: it withdrew it, and
        # its error says so instead of "step 3 is committed".
        assert "withdrew its COMMIT" in out, out


RACER = (
    COMMON
    + """
root, who, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
options = json.loads(sys.argv[4])
ckpt = Checkpointer(root, storage_options=options or None)
open(f"{go}.ready{who}", "w").close()  # at the start line
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
    for i, proc in enumerate(procs):  # every racer has imported torch and is at the line
        _wait_for_file(f"{go}.ready{i}", proc)
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


# -- issue 19: a fenced writer deletes nothing; FAILED per attempt; a frozen sharded writer -----

FENCED_CLOSE = (
    COMMON
    + """
root, signal_file = sys.argv[1], sys.argv[2]
try:
    with Checkpointer(root, keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state(step)).result()
        open(signal_file, "w").close()  # the test freezes us here, then another job takes over
        while not os.path.exists(signal_file + ".go"):
            time.sleep(0.005)
        ckpt.save(4, state(4)).result()  # fenced: raises, and the with block runs close()
    print("zombie: saved step 4")
except ConflictError as exc:
    print("zombie: fenced:", exc)
"""
)


def _freeze_at(proc: subprocess.Popen[str], signal_file: str) -> None:
    """Wait until ``proc`` parks at its freeze point, SIGSTOP it, and let it go on from
    there once it is continued."""
    _wait_for_file(signal_file, proc)
    os.kill(proc.pid, signal.SIGSTOP)
    _wait_stopped(proc.pid)  # SIGSTOP lands asynchronously: only then may it go on
    Path(signal_file + ".go").touch()


def test_a_zombie_that_wakes_fenced_deletes_none_of_the_new_writers_versions(
    tmp_path: Path,
) -> None:
    root, signal_file = str(tmp_path / "run"), str(tmp_path / "frozen")
    zombie = _run(FENCED_CLOSE, root, signal_file)
    try:
        _freeze_at(zombie, signal_file)
        with Checkpointer(root, keep_last=3) as restarted:  # keeps 2, 3 and its own 10
            restarted.save(10, _state(10)).result(timeout=120)
        assert Checkpointer(root).versions() == [2, 3, 10]
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    code, out, err = _finish(zombie)
    assert code == 0, err[-3000:]
    assert "zombie: fenced" in out, out + err[-3000:]
    # Its close() applied keep_last=2 before: it deleted step 2, which the new writer keeps.
    assert Checkpointer(root).versions() == [2, 3, 10]
    assert Checkpointer(root).load(step=2)["step"] == 2


def _state(step: int) -> dict[str, Any]:
    """The children's ``state(step, who=1)``."""
    import torch

    return {"step": step, "who": 1, "w": torch.full((50_000,), float(step))}


EVALUATOR_OF_STEP = (
    COMMON
    + """
root, out, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
from asyncckpt._versions import lease
real = lease.read_version_file
def read_version_file(*args):
    open(out + ".polled", "w").close()  # it went past the FAILED check of a poll
    return real(*args)
lease.read_version_file = read_version_file  # what the wait polls
try:
    got = Checkpointer(root).load(step=step, timeout=120)
    print("loaded", got["step"], got["who"], consistent(got))
except asyncckpt.errors.AsyncCkptError as exc:
    print("failed:", type(exc).__name__, exc)
"""
)


def test_an_evaluator_waits_through_an_earlier_jobs_failed_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FAILED left by an earlier job's save of step 2 must not end an evaluator's
    ``load(step=2, timeout=...)`` while a restarted job saves step 2 again."""
    import threading

    import torch

    from asyncckpt._storage import AtomicWriter

    root, out = str(tmp_path / "run"), str(tmp_path / "eval")
    old = Checkpointer(root)  # the earlier job: step 1, then a failed save of step 2
    old.save(1, _state(1)).result(timeout=120)
    real_open = old._storage.open_atomic

    def failing_open(path: str) -> AtomicWriter:
        if path.endswith(".ackpt"):
            raise OSError(28, "injected: the old job's disk is full")
        return real_open(path)

    monkeypatch.setattr(old._storage, "open_atomic", failing_open)
    with pytest.raises(OSError, match="injected"):
        old.save(2, _state(2)).result(timeout=120)
    old.close()
    monkeypatch.undo()
    assert (tmp_path / "run" / "2" / "FAILED").exists()

    restarted = Checkpointer(root)
    release = threading.Event()
    real_recover = restarted._writer._recover

    def recover() -> None:  # held after the lease is taken, before its recovery
        assert release.wait(120), "never released"
        real_recover()

    restarted._writer._recover = recover  # type: ignore[method-assign]
    handle = restarted.save(2, {"step": 2, "who": 1, "w": torch.full((50_000,), 2.0)})
    evaluator = None
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "_lease" / f"{2:012d}").exists():
            assert time.monotonic() < deadline, "the restarted job never took the lease"
            time.sleep(0.01)
        evaluator = _run(EVALUATOR_OF_STEP, root, out, "2")
        while not os.path.exists(out + ".polled") and evaluator.poll() is None:
            assert time.monotonic() < deadline + 120, "the evaluator never polled"
            time.sleep(0.01)
    finally:
        release.set()
    handle.result(timeout=120)
    restarted.close()
    code, stdout, err = _finish(evaluator)
    assert code == 0, err[-3000:]
    assert stdout.strip() == "loaded 2 1 True", stdout + err[-3000:]


SHARDED_WRITER = (
    COMMON
    + """
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from asyncckpt._versions import ranks as sharded
root, who, signal_file, group_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
options = json.loads(sys.argv[5]) or None
dist.init_process_group("gloo", init_method="file://" + group_file, rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
def dstate(step):
    w = torch.full((64,), float(10 * step + who))
    return {"w": distribute_tensor(w, mesh, [Shard(0)]), "step": step, "who": who}
ckpt = Checkpointer(root, storage_options=options)
if who == 0:  # the zombie: commits step 1, then freezes before writing step 2's metadata
    ckpt.save(1, dstate(1)).result()
    real = sharded.metadata_bytes
    def metadata_bytes(*args):
        body = real(*args)
        open(signal_file, "w").close()
        while not os.path.exists(signal_file + ".go"):
            time.sleep(0.005)
        return body
    sharded.metadata_bytes = metadata_bytes
try:
    ckpt.save(2, dstate(2)).result()
    print("saved step 2")
except ConflictError as exc:
    print("fenced:", exc)
ckpt.close()
dist.destroy_process_group()
"""
)


def _sharded_zombie(root: str, options: dict[str, Any], tmp_path: Path) -> None:
    import json

    import torch

    signal_file, args = str(tmp_path / "frozen"), json.dumps(options)
    zombie = _run(SHARDED_WRITER, root, "0", signal_file, str(tmp_path / "group0"), args)
    try:
        _freeze_at(zombie, signal_file)
        restarted = _run(SHARDED_WRITER, root, "1", "-", str(tmp_path / "group1"), args)
        code, out, err = _finish(restarted)
        assert code == 0 and out.strip() == "saved step 2", out + err[-3000:]
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    code, out, err = _finish(zombie)
    assert code == 0, err[-3000:]
    assert out.startswith("fenced:") and "step 2 was not committed" in out, out + err[-3000:]
    reader = Checkpointer(root, storage_options=options or None, read_only=True)
    assert reader.latest() == 2 and reader.versions() == [1, 2]
    got = reader.load()  # the newest version, whole: the restarted job's
    assert got["who"] == 1 and got["step"] == 2
    assert torch.equal(got["w"], torch.full((64,), 21.0))
    # The zombie wrote nothing into the step and says so: only the new writer's files are
    # there (its data, completion record and metadata, named by its attempt; COMMIT).
    assert "changed nothing else" in out, out
    commit = reader._reader.commit_of(2)
    assert commit is not None and commit.metadata_file is not None
    storage, base = resolve(root, options or None)
    names = set(storage.list_dir(storage.join(base, "2")))
    assert names == {"COMMIT", *commit.files, *(f.replace(".ackpt", ".done") for f in commit.files)}


@pytest.mark.timeout(400)
def test_a_frozen_sharded_writer_cannot_destroy_the_new_writers_version(tmp_path: Path) -> None:
    _sharded_zombie(str(tmp_path / "run"), {}, tmp_path)


@pytest.mark.timeout(400)
def test_a_frozen_sharded_writer_on_s3(s3_root: str, s3_server: Any, tmp_path: Path) -> None:
    _sharded_zombie(s3_root, s3_server.storage_options, tmp_path)
