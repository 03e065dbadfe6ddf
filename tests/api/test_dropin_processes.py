"""Read-after-save across processes for the drop-in ``save``/``load`` (real processes).

A ``load(path)`` that begins after a ``save(obj, path)`` returned, in any process, returns
that save's state or a later one; if the saving process dies, the load gives up with
``CheckpointTimeoutError`` instead of returning an older file or hanging:

* the PyTorch DDP tutorial recipe, literally (rank 0 saves, ``dist.barrier()``, every rank
  loads with ``map_location``), on 2 gloo ranks, for a new file and for an overwrite;
* a loader process that never saved and never joined a process group;
* the writer SIGKILLed mid-save: the load gives up at once (same machine: its pid is
  gone), or once its marker stops changing (a writer on "another host"), and a later save
  of the path works;
* two processes saving one path at once: the later-starting save wins, the earlier one
  fails with ``ConflictError``; no load ever sees a mixture;
* a writer and a loader process on S3 (moto and SeaweedFS).

Every write is held or slowed in the writer (a gate or a delay before the data file is
published), so that the load certainly starts while the write is in flight; nothing here
asserts a duration. Each child process has a hard timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import asyncckpt
from asyncckpt._storage import TEMP_MARK, resolve
from asyncckpt.errors import CheckpointTimeoutError, ConflictError
from tests import ranks

REPO = Path(__file__).resolve().parents[2]
MARKER = ".ackpending"
_CHILD_TIMEOUT = 120.0

pytestmark = pytest.mark.slow

# --------------------------------------------------------------------------- states


def make_state(tag: int, n: int = 1 << 20) -> dict[str, Any]:
    """A state every value of which follows from ``tag`` (and its size from ``n``)."""
    g = torch.Generator().manual_seed(tag)
    return {
        "tag": tag,
        "n": n,
        "w": torch.randn(n, generator=g),
        "ids": torch.arange(n // 8, dtype=torch.int64) + tag,
    }


def check_state(got: Any) -> int:
    """Assert that ``got`` is one whole ``make_state`` (no mixture); return its tag."""
    want = make_state(got["tag"], got["n"])
    assert set(got) == set(want)
    for key in ("w", "ids"):
        assert torch.equal(got[key], want[key]), f"{key} of state {got['tag']} differs"
    return int(got["tag"])


# --------------------------------------------------------------------------- child processes


#: How many data-file commits ``_hold_local_publish`` held in this process.
_held: list[str] = []


def _hold_local_publish(hold: str, gate: str | None, delay: float, name: str = ".ackpt") -> None:
    """Slow down or hold every local data-file commit of this process, before it publishes.

    ``delay``: sleep that long; ``gate``: wait for ``<gate>/release``; ``block``: wait for
    ever (the process is to be killed there). The hook patches this process's writer, so the
    writes stay on this process's threads (a writer process would not see it).
    """
    from asyncckpt._storage import local

    if hold != "none":
        os.environ["ASYNCCKPT_WRITER_PROCESSES"] = "0"

    real = local._LocalWriter.commit

    def commit(self: Any) -> None:
        if self.target.endswith(name):
            _held.append(self.target)
            if gate is not None:
                Path(gate, "held").touch()
            if hold == "delay":
                time.sleep(delay)
            elif hold == "gate":
                assert gate is not None
                _wait_for(Path(gate, "release"))
            elif hold == "block":
                threading.Event().wait()
        real(self)

    local._LocalWriter.commit = commit  # type: ignore[method-assign]


def _gated_s3_plan(gate: str) -> Any:
    """A FaultPlan that holds the start of each data file's upload until ``<gate>/release``."""
    from asyncckpt.testing import FaultPlan

    def on_call(op: str, path: str, call: int) -> None:
        if path.endswith(".ackpt") and op in ("create_multipart_upload", "put_object"):
            _wait_for(Path(gate, "release"))

    return FaultPlan(on_call=on_call)


def _wait_for(flag: Path) -> None:
    """Until ``flag`` exists; raises at the children's timeout (a hang fails loudly)."""
    deadline = time.monotonic() + _CHILD_TIMEOUT
    while not flag.exists():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{flag} never appeared in {_CHILD_TIMEOUT} s")
        time.sleep(0.01)


def writer_main(spec_json: str) -> None:
    """A process that saves (``spec``: path, storage options, states, how to hold the write).

    Prints ``returned`` once ``save`` returned, then ``durable`` or ``conflict <message>``.
    """
    spec = json.loads(spec_json)
    path, options = spec["path"], spec.get("options")
    if spec.get("host"):  # pretend to run elsewhere: loaders cannot check this pid
        from asyncckpt._versions import pending

        real = pending.this_machine()
        fake = pending.Machine(spec["host"], real.pid_ns, real.boot)
        pending.this_machine = lambda: fake  # type: ignore[assignment]
    for tag in spec.get("before", []):
        asyncckpt.save(make_state(tag), path, storage_options=options).result()
    if spec.get("hold") == "s3-gate":
        options = {"faulty": {"plan": _gated_s3_plan(spec["gate"])}, "s3": options}
        path = f"faulty::{path}"
    _hold_local_publish(spec.get("hold", "none"), spec.get("gate"), spec.get("delay", 0.0))
    for tag in spec["tags"]:
        handle = asyncckpt.save(
            make_state(tag, spec.get("n", 1 << 20)), path, storage_options=options
        )
        print(f"returned {tag}", flush=True)
        _report(handle)
    print("done", flush=True)


def _report(handle: asyncckpt.SaveHandle) -> None:
    try:
        handle.result()
        print("durable", flush=True)
    except ConflictError as exc:
        print("conflict", json.dumps(str(exc)), flush=True)


def loader_main(
    path: str, options_json: str, loops: str = "1", stop: str = "", go: str = ""
) -> None:
    """A process that never saved and joined no process group: load ``path`` ``loops``
    times, or until the file ``stop`` exists, and print ``loaded <tag>`` for each load
    (checked whole), or ``error <type> <message>``. With ``go``, print ``ready`` and wait
    for that file first, then print ``loading``."""
    options = json.loads(options_json)
    if go:
        storage, target = resolve(path, options)
        storage.exists(target)  # the client is set up (its first request is slow on S3)
        _say_when_waiting(path)
        print("ready", flush=True)
        _wait_for(Path(go))
        print("loading", flush=True)
    done = 0
    while done < int(loops) or (stop and not Path(stop).exists()):
        try:
            tag = check_state(asyncckpt.load(path, map_location="cpu", storage_options=options))
            print(f"loaded {tag}", flush=True)
        except Exception as exc:
            print("error", type(exc).__name__, json.dumps(str(exc)), flush=True)
            return
        done += 1


def _say_when_waiting(path: str) -> None:
    """Print ``waiting`` once this process's load reads the save marker of ``path`` a
    second time: the first read found a save in flight, so the load is waiting for it."""
    from asyncckpt._versions import paths  # where a load resolves its path
    from tests.crashpoints import CrashPlan, CrashStorage, StorageOp

    reads: list[StorageOp] = []

    def on_call(op: StorageOp) -> None:
        if op.op == "read_marker" and op.path.endswith(MARKER):
            reads.append(op)
            if len(reads) == 2:
                print("waiting", flush=True)

    plan = CrashPlan("count", on_call=on_call)
    real = paths.resolve

    def resolve_counted(f: Any, options: Any, settings: Any = None) -> tuple[Any, str]:
        storage, where = real(f, options, settings)
        return CrashStorage(storage, plan), where

    paths.resolve = resolve_counted  # type: ignore[assignment]


class Child:
    """A Python child process running ``tests.api.test_dropin_processes.<main>(*args)``; its
    output lines are read by a thread, so that every wait has a timeout."""

    def __init__(self, main: str, *args: str, env: dict[str, str] | None = None) -> None:
        here = "tests.api.test_dropin_processes"
        code = f"import sys; from {here} import {main}; {main}(*sys.argv[1:])"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, prefix: str, timeout: float = _CHILD_TIMEOUT) -> str:
        """The next line starting with ``prefix`` (others are kept in ``seen``)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.fail(f"no {prefix!r} line within {timeout} s")
            if line is None:
                self.fail(f"exited before printing {prefix!r}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def wait(self, timeout: float = _CHILD_TIMEOUT) -> int:
        """Wait for the exit; every line printed is in ``seen`` after this."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"still running after {timeout} s")
        while (line := self.lines.get(timeout=30)) is not None:
            self.seen.append(line)
        self.lines.put(None)
        return code

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.wait() == -signal.SIGKILL

    def fail(self, why: str) -> Any:
        self.stop()
        err = self.proc.stderr.read() if self.proc.stderr else ""
        pytest.fail(f"child {self.pid}: {why}; output {self.seen}\n{err}", pytrace=False)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def children() -> Any:
    """Start children with ``children(main, *args)``; all are killed at the end."""
    started: list[Child] = []

    def start(main: str, *args: str, env: dict[str, str] | None = None) -> Child:
        child = Child(main, *args, env=env)
        started.append(child)
        return child

    yield start
    for child in started:
        child.stop()


def _load_in_child(children: Any, path: str, options: Any = None) -> str:
    """Load ``path`` in a new process; return what it printed."""
    loader = children("loader_main", path, json.dumps(options))
    line = loader.expect("")
    assert loader.wait() == 0
    return line


def _load_while_held(children: Any, path: str, options: Any, gate: Path) -> str:
    """Load ``path`` in a new process while a writer is held at ``gate``, then release the
    writer; return what the loader printed."""
    go = gate / "go"
    loader = children("loader_main", path, json.dumps(options), "1", "", str(go))
    loader.expect("ready")  # imported: its load starts as soon as it is told to
    go.touch()
    loader.expect("loading")
    loader.expect("waiting")  # the load found the held save in flight and waits for it
    (gate / "release").touch()
    line = loader.expect("")
    assert loader.wait() == 0
    return line


# --------------------------------------------------------------------------- the DDP tutorial


class _Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _tutorial(rank: int, world: int, workdir: Path, overwrite: bool, slow_disk: bool) -> None:
    """The recipe of PyTorch's DDP tutorial ("Save and Load Checkpoints"), with only
    ``torch.save``/``torch.load`` swapped for ``asyncckpt.save``/``asyncckpt.load``.

    ``slow_disk``: rank 0's writes are held for a second (on its threads), so the load
    surely begins before the file is there; else the defaults (the writer process)."""
    path = str(workdir / "model.checkpoint")
    if overwrite:  # an older, smaller, different state is there already
        if rank == 0:
            asyncckpt.save(_Net(8).state_dict(), path).result()
        dist.barrier()
    if rank == 0 and slow_disk:
        # A slow disk: the write outlasts the barrier. The hold matches the file the recipe
        # saves (not only .ackpt names), and is checked below to have fired.
        _hold_local_publish("delay", None, 1.0, name=os.path.basename(path))
    torch.manual_seed(rank)
    model = DistributedDataParallel(_Net(512))  # rank 0's initial weights, broadcast
    if rank == 0:
        # All processes should see same parameters as they all start from same random
        # parameters and gradients are synchronized in backward passes. Therefore, saving
        # it in one process is sufficient.
        asyncckpt.save(model.state_dict(), path)
    # Use a barrier() to make sure that process 1 loads the model after process 0 saves it.
    dist.barrier()
    # configure map_location properly
    map_location = {"cpu": "cpu"}  # on GPUs: {"cuda:%d" % 0: "cuda:%d" % rank}
    loaded = asyncckpt.load(path, map_location=map_location)
    model.load_state_dict(loaded)
    mine = model.state_dict()
    assert set(loaded) == set(mine), f"rank {rank} loaded keys {sorted(loaded)}"
    for key, value in loaded.items():
        assert torch.equal(value, mine[key]), f"rank {rank}: {key} differs from rank 0's"
    if rank == 0 and slow_disk:
        assert _held == [path], f"the slow disk never held the save: {_held}"
    dist.barrier()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slow_disk", [True, False], ids=["slow-disk", "defaults"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new-file", "overwrite"])
def test_ddp_tutorial_recipe_on_two_gloo_ranks(
    tmp_path: Path, overwrite: bool, slow_disk: bool
) -> None:
    ranks.run(__name__, "_tutorial", 2, tmp_path, overwrite, slow_disk, timeout=240)
    assert sorted(os.listdir(tmp_path)) == ["model.checkpoint"]


# --------------------------------------------------------------------------- another process


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overwrite", [False, True], ids=["new-file", "overwrite"])
def test_a_process_that_never_saved_loads_what_was_saved(
    tmp_path: Path, children: Any, overwrite: bool
) -> None:
    path = str(tmp_path / "model.ackpt")
    gate = tmp_path / "gate"
    gate.mkdir()
    spec = {"path": path, "before": [1] if overwrite else [], "tags": [2], "n": 3 << 20}
    writer = children("writer_main", json.dumps({**spec, "hold": "gate", "gate": str(gate)}))
    writer.expect("returned")
    assert _load_while_held(children, path, None, gate) == "loaded 2"  # waited for the write
    writer.expect("durable")
    assert writer.wait() == 0
    assert sorted(os.listdir(tmp_path)) == ["gate", "model.ackpt"]


# --------------------------------------------------------------------------- a dead writer


@pytest.mark.timeout(240)
def test_a_killed_writer_on_this_machine_makes_the_load_give_up_at_once(
    tmp_path: Path, children: Any
) -> None:
    path = tmp_path / "model.ackpt"
    spec = {"path": str(path), "before": [1], "tags": [2], "hold": "block"}
    writer = children("writer_main", json.dumps(spec))
    writer.expect("returned")
    writer.kill()
    with pytest.raises(CheckpointTimeoutError) as caught:
        asyncckpt.load(path)
    message = str(caught.value)
    for part in (str(path), f"pid {writer.pid}", socket.gethostname(), "no longer exists"):
        assert part in message
    assert "previous save's state" in message and f"delete {path}{MARKER}" in message
    asyncckpt.save(make_state(3), path).result()  # a later save replaces the dead one's marker
    assert check_state(asyncckpt.load(path)) == 3
    assert _load_in_child(children, str(path)) == "loaded 3"
    assert _names(tmp_path) == ["model.ackpt"]


def _names(folder: Path) -> list[str]:
    """What is in ``folder`` besides temp files (a killed writer leaves its own)."""
    return sorted(n for n in os.listdir(folder) if TEMP_MARK not in n)


@pytest.mark.timeout(240)
def test_a_killed_writer_elsewhere_is_given_up_on_once_its_marker_stops_changing(
    tmp_path: Path, children: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_LEASE_EXPIRY_MS", "3000")
    path = tmp_path / "model.ackpt"
    spec = {"path": str(path), "before": [1], "tags": [2], "hold": "block", "host": "far.invalid"}
    writer = children("writer_main", json.dumps(spec), env={"ASYNCCKPT_LEASE_RENEW_MS": "100"})
    writer.expect("returned")
    outcome: list[Any] = []

    def load() -> None:
        try:
            outcome.append(asyncckpt.load(path))
        except Exception as exc:
            outcome.append(exc)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    beats = _beats_seen(Path(f"{path}{MARKER}"), 5)
    assert beats >= 5 and loader.is_alive() and not outcome  # the heartbeat keeps it waiting
    writer.kill()
    loader.join(60)
    assert not loader.is_alive()
    (error,) = outcome
    assert isinstance(error, CheckpointTimeoutError), error
    message = str(error)
    for part in (str(path), f"pid {writer.pid}", "far.invalid", "has not changed"):
        assert part in message
    asyncckpt.save(make_state(3), path).result()
    assert check_state(asyncckpt.load(path)) == 3
    assert _names(tmp_path) == ["model.ackpt"]


def _beats_seen(marker: Path, wanted: int) -> int:
    """Poll a marker until its beat reaches ``wanted`` (or 60 s pass); return the last."""
    deadline, beat = time.monotonic() + 60, -1
    while beat < wanted and time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):  # missing yet, or being rewritten
            beat = json.loads(marker.read_bytes()).get("beat", beat)
        time.sleep(0.05)
    return beat


# --------------------------------------------------------------------------- two writers


@pytest.mark.timeout(240)
@pytest.mark.parametrize("first_to_finish", ["later", "earlier"])
def test_of_two_concurrent_saves_the_later_starting_one_wins(
    tmp_path: Path, children: Any, first_to_finish: str
) -> None:
    path = tmp_path / "model.ackpt"
    asyncckpt.save(make_state(1), path).result()
    gates = [tmp_path / "gate-a", tmp_path / "gate-b"]
    writers = []
    for gate, tag in zip(gates, (2, 3)):
        gate.mkdir()
        hold = "gate" if tag == 2 or first_to_finish == "earlier" else "none"
        spec = {"path": str(path), "tags": [tag], "hold": hold, "gate": str(gate), "n": tag << 20}
        writers.append(children("writer_main", json.dumps(spec)))
        writers[-1].expect("returned")  # its marker is there; a held write waits at its gate
    earlier, later = writers
    if first_to_finish == "later":
        later.expect("durable")
        assert _load_in_child(children, str(path)) == "loaded 3"
        (gates[0] / "release").touch()
        assert "superseded" in earlier.expect("conflict")
    else:
        (gates[0] / "release").touch()
        conflict = earlier.expect("conflict")
        assert f"a later save of {path} by pid {later.pid}" in conflict
        assert "superseded" in conflict
        loader = children("loader_main", str(path), "null")  # waits for the later save
        (gates[1] / "release").touch()
        assert loader.expect("") == "loaded 3"
        later.expect("durable")
    for writer in writers:
        assert writer.wait() == 0  # the failure was observed through result()
    assert check_state(asyncckpt.load(path)) == 3  # the earlier save left the file alone
    assert sorted(os.listdir(tmp_path)) == ["gate-a", "gate-b", "model.ackpt"]


@pytest.mark.timeout(300)
def test_loads_beside_two_writers_of_one_path_are_always_whole(
    tmp_path: Path, children: Any
) -> None:
    path = tmp_path / "model.ackpt"
    asyncckpt.save(make_state(1), path).result()
    stop = tmp_path / "stop"
    loader = children("loader_main", str(path), "null", "0", str(stop))
    writers = [
        children(
            "writer_main",
            json.dumps({"path": str(path), "tags": [100 * w + i for i in range(6)], "n": n}),
        )
        for w, n in ((1, 1 << 20), (2, 3 << 19))
    ]
    for writer in writers:
        writer.expect("done")
        assert writer.wait() == 0
    stop.touch()
    assert loader.wait() == 0
    loads = [line for line in loader.seen if line.startswith("loaded")]
    assert loads and len(loads) == len(loader.seen), loader.seen  # no error, ever
    outcomes = [line.split()[0] for w in writers for line in w.seen]
    assert set(outcomes) <= {"returned", "durable", "conflict", "done"}
    final = check_state(asyncckpt.load(path))
    assert final in [100 * w + i for w in (1, 2) for i in range(6)]
    assert sorted(os.listdir(tmp_path)) == ["model.ackpt", "stop"]


# --------------------------------------------------------------------------- S3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overwrite", [False, True], ids=["new-file", "overwrite"])
def test_a_loader_process_waits_for_a_save_in_flight_on_s3(
    s3_root: str, s3_server: Any, children: Any, overwrite: bool, tmp_path: Path
) -> None:
    url = f"{s3_root}/model.ackpt"
    options = s3_server.storage_options
    gate = tmp_path / "gate"
    gate.mkdir()
    spec = {
        "path": url,
        "options": options,
        "before": [1] if overwrite else [],
        "tags": [2],
        "n": 3 << 20,  # 12 MiB: several parts on either store
        "hold": "s3-gate",
        "gate": str(gate),
    }
    writer = children("writer_main", json.dumps(spec))
    writer.expect("returned")
    assert _load_while_held(children, url, options, gate) == "loaded 2"
    writer.expect("durable")
    assert writer.wait() == 0
    storage, root = resolve(s3_root, options)
    assert storage.list_dir(root) == ["model.ackpt"]  # the marker is gone
