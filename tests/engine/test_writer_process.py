"""The writer process (``writer_processes=1``): writes run in a child that maps the arena.

Covers the round trip (single files, versioned roots, arena reuse), errors raised in the
child and re-raised once by the handle, the child's death (the save fails, the target and
the root stay as they were, the next save starts a new child), the caller's death (the child
follows it), a clean exit, and the storages that stay on threads.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt._engine import writer_child, writer_process
from asyncckpt._engine.arena import shared_memory_supported, shared_regions
from asyncckpt._format.container import FOOTER_SIZE, decode_footer, decode_manifest
from asyncckpt._settings import Settings
from asyncckpt._storage.base import TEMP_MARK, Storage
from asyncckpt._storage.local import LocalStorage
from asyncckpt.errors import StorageError, WriterProcessError

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not shared_memory_supported(), reason="the writer process needs memfd"),
]
REPO = Path(__file__).resolve().parents[2]


class GatedFileSystem(DirFileSystem):  # type: ignore[misc]
    """Local files (through fsspec, not ``LocalStorage``) whose data-file writes wait, once
    started, until a ``release`` file exists (markers and the commit are not held).

    Importable by the writer process (the class is pickled by reference), so a test can
    hold the child inside a write and kill it there.
    """

    protocol = "gated"
    asyncckpt_write_strategy = "move"  # a temp file beside the target, then a rename

    def __init__(self, gate: str = "", **kwargs: Any) -> None:
        super().__init__(path="/", fs=LocalFileSystem(), **kwargs)
        self.gate = gate

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        opened = super().open(path, mode, **kwargs)  # the temp file exists from here on
        held = "w" in mode and ".ackpt" in path and self.gate
        if held and not os.path.exists(f"{self.gate}/release"):
            Path(f"{self.gate}/started").write_text(str(os.getpid()))
            deadline = time.monotonic() + 120
            while not os.path.exists(f"{self.gate}/release") and time.monotonic() < deadline:
                if os.path.exists(f"{self.gate}/exit"):  # the writer process ends itself
                    os._exit(int(Path(f"{self.gate}/exit").read_text()))
                time.sleep(0.01)
        return opened


fsspec.register_implementation("gated", GatedFileSystem, clobber=True)


class EnvSpyFileSystem(DirFileSystem):  # type: ignore[misc]
    """Local files through fsspec that record, beside each data file they start writing,
    the writing process's pid and its ``ASYNCCKPT_*`` environment (as JSON)."""

    protocol = "envspy"
    asyncckpt_write_strategy = "move"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(path="/", fs=LocalFileSystem(), **kwargs)

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode and ".ackpt" in path:
            seen = {k: v for k, v in os.environ.items() if k.startswith("ASYNCCKPT_")}
            spy = path.split(".ackpt")[0] + ".env.json"
            Path(spy).write_text(json.dumps({"pid": os.getpid(), "environ": seen}))
        return super().open(path, mode, **kwargs)


fsspec.register_implementation("envspy", EnvSpyFileSystem, clobber=True)


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves in this test write in the writer process."""
    monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "1")


@pytest.fixture
def blocker(tmp_path: Path) -> Path:
    """A file where a save expects a directory: writing under it fails with an OSError."""
    path = tmp_path / "file"
    path.write_text("not a directory")
    return path


def state(value: float = 1.0) -> dict[str, Any]:
    return {
        "w": torch.full((300, 300), value),
        "ids": torch.arange(1000),
        "empty": torch.empty(0),
        "meta": {"name": "model", "value": value},
    }


def child() -> writer_process.WriterProcess:
    process = writer_process.current()
    assert process is not None, "no writer process is running"
    return process


def jobs_so_far() -> int:
    """Files the current writer process has written (0 when none is running)."""
    process = writer_process.current()
    return 0 if process is None else process.jobs


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def test_save_round_trip_runs_in_the_child(in_process: None, tmp_path: Path) -> None:
    path = tmp_path / "a.ackpt"
    handle = asyncckpt.save(state(2.0), path)
    info = handle.result(timeout=120)
    assert info.stats.stored_bytes == path.stat().st_size
    before = child().jobs
    assert child().pid != os.getpid() and before >= 1
    loaded = asyncckpt.load(path)
    assert torch.equal(loaded["w"], state(2.0)["w"]) and loaded["meta"] == state(2.0)["meta"]
    assert loaded["empty"].numel() == 0
    asyncckpt.save(state(3.0), path).result(timeout=120)
    assert child().jobs == before + 1
    assert asyncckpt.load(path)["meta"]["value"] == 3.0


def test_the_child_writes_with_the_jobs_settings_not_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settings object says 64 KiB chunks, the environment 1 MiB: the child writes 64 KiB
    chunks and sees no ASYNCCKPT_* variable at all (it takes nothing from its environment)."""
    from asyncckpt._api.dropin import stage
    from asyncckpt._engine.encode import WriteOptions
    from asyncckpt._storage import resolve

    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", str(1 << 20))
    monkeypatch.setenv("ASYNCCKPT_LOCK_TIMEOUT_MS", "1234")
    options = WriteOptions("none", Settings.resolve(chunk_bytes=64 << 10, writer_processes=1))
    storage, path = resolve(f"envspy://{tmp_path}/a.ackpt", None)
    data = {"w": torch.arange(1 << 18, dtype=torch.float32)}  # 1 MiB
    snap = stage(data, options)
    try:
        writer_process.write(snap, storage, path, options)
    finally:
        snap.lease.release()
    spy = json.loads((tmp_path / "a.env.json").read_text())
    assert spy["pid"] != os.getpid()  # written in the child
    assert spy["environ"] == {}
    raw = (tmp_path / "a.ackpt").read_bytes()
    footer = decode_footer(raw[-FOOTER_SIZE:], len(raw), "a.ackpt")
    body = raw[footer.manifest_offset : footer.manifest_offset + footer.manifest_length]
    chunks = decode_manifest(body, footer, "a.ackpt").chunks
    assert {c.raw_len for c in chunks} == {64 << 10} and len(chunks) == 16
    assert torch.equal(asyncckpt.load(tmp_path / "a.ackpt")["w"], data["w"])


def test_the_child_maps_the_arena_once_and_reuses_it(in_process: None, tmp_path: Path) -> None:
    for i in range(3):
        asyncckpt.save(state(float(i)), tmp_path / f"{i}.ackpt").result(timeout=120)
    assert len(child()._mapped) == 1  # one shared arena, sent once, reused by every save


def test_reserve_starts_the_child_and_shares_the_arena_the_first_save_gets(
    in_process: None, tmp_path: Path, arena_allocations: list[int]
) -> None:
    thread = asyncckpt.reserve(state())
    assert thread is not None
    thread.join(60)
    assert writer_process.start(Settings.resolve()).result(timeout=120).pid != os.getpid()
    assert len(shared_regions()) >= 1
    asyncckpt.save(state(6.0), tmp_path / "a.ackpt").result(timeout=120)
    assert len(arena_allocations) == 1  # the reserved (shared) arena, not a second one
    assert asyncckpt.load(tmp_path / "a.ackpt")["meta"]["value"] == 6.0


def test_checkpointer_writes_commits_and_retires_with_the_child(
    in_process: None, tmp_path: Path
) -> None:
    with Checkpointer(tmp_path / "root", keep_last=2) as ckpt:
        before = jobs_so_far()
        for step in (1, 2, 3):
            ckpt.save(step, state(float(step)))
        ckpt.wait()
        assert ckpt.latest() == 3 and ckpt.versions() == [2, 3]
        assert child().jobs == before + 3
        assert ckpt.load(2)["meta"]["value"] == 2.0


def test_a_write_error_in_the_child_is_raised_once_by_the_handle(
    in_process: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A directory where the file should go: the save marker beside it is written (by this
    # process), the child writes the temp file, and only the child's rename fails. (save
    # refuses a directory at the call, as torch.save does: that check is skipped here, as
    # if the directory appeared after the call.)
    monkeypatch.setattr(LocalStorage, "check_writable", Storage.check_writable)
    blocker = tmp_path / "x.ackpt"
    blocker.mkdir()
    handle = asyncckpt.save(state(), blocker)
    with pytest.raises(StorageError) as caught:
        handle.result(timeout=120)
    assert str(blocker) in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError)  # the backend's error, as on threads
    assert any("writer process" in note for note in getattr(caught.value, "__notes__", []))
    asyncckpt.wait(timeout=120)  # observed through result(): not raised again
    asyncckpt.save(state(), tmp_path / "ok.ackpt").result(timeout=120)


def test_an_unobserved_error_in_the_child_is_raised_by_the_next_save(
    in_process: None, tmp_path: Path, blocker: Path
) -> None:
    handle = asyncckpt.save(state(), blocker / "x.ackpt")
    with contextlib.suppress(Exception):
        handle._failure(timeout=120)  # wait without observing
    with pytest.raises(StorageError):
        asyncckpt.save(state(), tmp_path / "next.ackpt")
    asyncckpt.save(state(), tmp_path / "next.ackpt").result(timeout=120)


def test_a_killed_child_fails_that_save_only(in_process: None, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "release").touch()
    root = f"gated://{tmp_path / 'root'}"
    with Checkpointer(root, storage_options={"gate": str(gate)}) as ckpt:
        ckpt.save(1, state(1.0)).result(timeout=120)
        (gate / "release").unlink()
        handle = ckpt.save(2, state(2.0))
        wait_for(gate / "started")
        pid = int((gate / "started").read_text())
        assert pid == child().pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WriterProcessError, match=rf"pid {pid}\) was killed by SIGKILL"):
            handle.result(timeout=120)
        assert ckpt.latest() == 1
        assert torch.equal(ckpt.load()["w"], state(1.0)["w"])
        left = [p.name for p in (tmp_path / "root" / "2").iterdir()]
        assert not [name for name in left if TEMP_MARK in name], left  # the child's temp file
        (gate / "release").touch()
        ckpt.save(3, state(3.0)).result(timeout=120)  # a new child
        assert child().pid != pid
        assert ckpt.latest() == 3 and ckpt.load()["meta"]["value"] == 3.0


#: Ways for the writer process to die in the middle of a write, and what the error says.
DEATHS = [
    pytest.param(signal.SIGKILL, r"was killed by SIGKILL", id="SIGKILL"),
    pytest.param(signal.SIGTERM, r"was killed by SIGTERM", id="SIGTERM"),
    pytest.param(
        signal.SIGRTMIN + 6,
        rf"was killed by signal {signal.SIGRTMIN + 6} \(SIGRTMIN\+6\)",
        id="SIGRTMIN+6",
    ),
    pytest.param("exit 3", r"exited with status 3", id="exit-3"),
]


def _end_writer(gate: Path, death: int | str) -> int:
    """End the writer process held in a write by ``death`` (a signal, or ``"exit N"``)."""
    wait_for(gate / "started")
    pid = int((gate / "started").read_text())
    assert pid == child().pid
    if isinstance(death, str):
        (gate / "exit").write_text(death.split()[1])
    else:
        os.kill(pid, death)
    return pid


@pytest.mark.parametrize(("death", "said"), DEATHS)
def test_any_death_of_the_child_fails_the_save_and_the_next_save_starts_a_new_one(
    in_process: None, tmp_path: Path, death: int | str, said: str
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "release").touch()
    url, options = f"gated://{tmp_path / 'a.ackpt'}", {"gate": str(gate)}
    asyncckpt.save(state(1.0), url, storage_options=options).result(timeout=120)
    (gate / "release").unlink()
    handle = asyncckpt.save(state(2.0), url, storage_options=options)
    pid = _end_writer(gate, death)
    with pytest.raises(WriterProcessError, match=rf"pid {pid}\) {said} while writing"):
        handle.result(timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ackpt", "gate"]  # no temp file
    assert asyncckpt.load(tmp_path / "a.ackpt")["meta"]["value"] == 1.0
    (gate / "exit").unlink(missing_ok=True)
    (gate / "release").touch()
    for value in (3.0, 4.0):  # every later save works, in one new child
        asyncckpt.save(state(value), url, storage_options=options).result(timeout=120)
        assert asyncckpt.load(tmp_path / "a.ackpt")["meta"]["value"] == value
    assert child().pid != pid


def test_a_child_that_died_between_saves_is_replaced_before_the_next_one(
    in_process: None, tmp_path: Path
) -> None:
    asyncckpt.save(state(1.0), tmp_path / "a.ackpt").result(timeout=120)
    first = child()
    os.kill(first.pid, signal.SIGRTMIN + 6)
    first.process.wait(60)
    asyncckpt.save(state(2.0), tmp_path / "a.ackpt").result(timeout=120)  # no failure
    assert child().pid != first.pid
    assert asyncckpt.load(tmp_path / "a.ackpt")["meta"]["value"] == 2.0


def test_a_memory_filesystem_stays_on_threads(
    in_process: None, memory_root: str, caplog: pytest.LogCaptureFixture
) -> None:
    before = jobs_so_far()
    with caplog.at_level(logging.WARNING, logger="asyncckpt._engine.writer_process"):
        writer_process._warned.clear()
        asyncckpt.save(state(4.0), f"{memory_root}/x.ackpt").result(timeout=120)
    assert asyncckpt.load(f"{memory_root}/x.ackpt")["meta"]["value"] == 4.0
    assert "lives in this process's memory" in caplog.text
    assert jobs_so_far() == before


def test_a_storage_that_cannot_be_pickled_stays_on_threads(
    in_process: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from asyncckpt.testing import FaultPlan

    url = f"faulty::file://{tmp_path / 'x.ackpt'}"
    options = {"faulty": {"plan": FaultPlan([])}}  # holds a lock: it cannot be pickled
    with caplog.at_level(logging.WARNING, logger="asyncckpt._engine.writer_process"):
        writer_process._warned.clear()
        asyncckpt.save(state(5.0), url, storage_options=options).result(timeout=120)
    assert asyncckpt.load(tmp_path / "x.ackpt")["meta"]["value"] == 5.0
    assert "cannot be sent to a process" in caplog.text


def test_a_filesystem_class_of_the_callers_script_is_written_on_threads(
    in_process: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A filesystem class defined in the training script (its ``__main__``) pickles here
    but cannot be unpickled by the child, whose ``__main__`` is not that script: the write
    runs on threads, said once, and the child stays up for the writes it can do."""
    script_fs = type("ScriptFileSystem", (DirFileSystem,), {"protocol": "scriptfs"})
    script_fs.__module__ = "__main__"
    monkeypatch.setattr(sys.modules["__main__"], "ScriptFileSystem", script_fs, raising=False)
    fsspec.register_implementation("scriptfs", script_fs, clobber=True)
    asyncckpt.save(state(1.0), tmp_path / "first.ackpt").result(timeout=120)
    pid = child().pid
    options = {"path": str(tmp_path), "fs": LocalFileSystem()}
    with caplog.at_level(logging.WARNING, logger="asyncckpt._engine.writer_process"):
        writer_process._warned.clear()
        for value in (6.0, 7.0):
            handle = asyncckpt.save(state(value), "scriptfs://x.ackpt", storage_options=options)
            handle.result(timeout=120)
            assert asyncckpt.load(tmp_path / "x.ackpt")["meta"]["value"] == value
    assert caplog.text.count("ScriptFileSystem") == 1, caplog.text
    before = child().jobs
    asyncckpt.save(state(8.0), tmp_path / "last.ackpt").result(timeout=120)
    assert (child().pid, child().jobs) == (pid, before + 1)


def test_the_tunable_takes_0_or_1() -> None:
    assert Settings.resolve(writer_processes=0).writer_processes == 0
    with pytest.raises(ValueError, match="at most 1"):
        Settings.resolve(writer_processes=2)


def _script(code: str, tmp_path: Path, **environ: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "ASYNCCKPT_WRITER_PROCESSES": "1", **environ}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_child_in_the_middle_of_a_write_dies_with_its_caller(tmp_path: Path) -> None:
    (tmp_path / "gate").mkdir()
    done = _script(
        """
        import os, signal, sys, time, torch, asyncckpt
        import tests.engine.test_writer_process  # registers gated://
        gate = sys.argv[1] + "/gate"
        asyncckpt.save(
            {"w": torch.ones(10)}, "gated://" + sys.argv[1] + "/a.ackpt",
            storage_options={"gate": gate},
        )
        while not os.path.exists(gate + "/started"):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
        tmp_path,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    pid = int((tmp_path / "gate" / "started").read_text())  # held in the write for 120 s
    deadline = time.monotonic() + 60
    while not _gone(pid):
        assert time.monotonic() < deadline, f"the writer process {pid} outlived its caller"
        time.sleep(0.05)
    assert not (tmp_path / "a.ackpt").exists()


def test_a_forked_worker_neither_uses_nor_breaks_the_writer_process(tmp_path: Path) -> None:
    done = _script(
        """
        import os, sys, torch, asyncckpt
        from asyncckpt._engine import writer_process
        asyncckpt.save({"w": torch.ones(10)}, sys.argv[1] + "/a.ackpt").result()
        pid = writer_process.current().pid
        worker = os.fork()  # as a DataLoader worker is forked, lives, and exits
        if worker == 0:
            os._exit(0 if writer_process.current() is None else 3)
        _, status = os.waitpid(worker, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the fork saw the parent's writer"
        asyncckpt.save({"w": torch.full((10,), 2.0)}, sys.argv[1] + "/b.ackpt").result()
        assert writer_process.current().pid == pid and writer_process.current().jobs == 2
        print("ok")
        """,
        tmp_path,
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr
    assert asyncckpt.load(tmp_path / "b.ackpt")["w"][0] == 2.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_script_that_saves_and_exits_leaves_a_whole_file_and_no_child(tmp_path: Path) -> None:
    done = _script(
        """
        import sys, torch, asyncckpt
        from asyncckpt._engine import writer_process
        asyncckpt.save({"w": torch.arange(1 << 20)}, sys.argv[1] + "/a.ackpt")
        from asyncckpt._settings import Settings
        print(writer_process.start(Settings()).result().pid, flush=True)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert torch.equal(asyncckpt.load(tmp_path / "a.ackpt")["w"], torch.arange(1 << 20))
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 60
    while not _gone(pid):
        assert time.monotonic() < deadline, f"the writer process {pid} outlived its caller"
        time.sleep(0.05)


def test_a_script_that_saves_and_exits_leaves_no_resource_unclosed(tmp_path: Path) -> None:
    """At exit, once no save is pending, the writer process is shut down cleanly: its
    socket closed and the child reaped, so development mode reports nothing left open."""
    done = _script(
        """
        import sys, torch, asyncckpt
        asyncckpt.save({"w": torch.arange(1 << 16)}, sys.argv[1] + "/a.ackpt")
        """,
        tmp_path,
        PYTHONDEVMODE="1",
    )
    assert done.returncode == 0, done.stderr
    assert "ResourceWarning" not in done.stderr, done.stderr
    assert torch.equal(asyncckpt.load(tmp_path / "a.ackpt")["w"], torch.arange(1 << 16))


class TwoArgumentError(Exception):
    """Pickles, but does not unpickle: ``__reduce__`` passes one argument back."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as caught:
        return caught


def test_an_error_that_does_not_unpickle_comes_back_as_its_summary() -> None:
    exc = raised(TwoArgumentError("disk", "on fire"))
    back = writer_process._rebuilt(("failed", *writer_child._portable(exc)), 42, "x.ackpt")
    assert isinstance(back, WriterProcessError)
    assert "x.ackpt" in str(back) and "TwoArgumentError: disk: on fire" in str(back)
    assert "raised in the writer process (pid 42)" in back.__notes__[0]


def test_a_cause_that_does_not_unpickle_ends_the_chain_there() -> None:
    root = raised(OSError(5, "Input/output error"))
    middle = raised(TwoArgumentError("disk", "on fire"), root)
    exc = raised(StorageError("x.ackpt: write failed"), middle)
    back = writer_process._rebuilt(("failed", *writer_child._portable(exc)), 42, "x.ackpt")
    assert isinstance(back, StorageError) and str(back) == "x.ackpt: write failed"
    assert back.__cause__ is None


def test_a_storage_error_keeps_its_errno_on_the_way_back() -> None:
    err = StorageError("x.ackpt: write failed: No space left on device")
    err.errno = errno.ENOSPC
    back = writer_process._rebuilt(("failed", *writer_child._portable(raised(err))), 42, "x")
    assert isinstance(back, StorageError) and str(back) == str(err)
    assert back.errno == errno.ENOSPC


def test_the_child_writes_without_importing_torch(tmp_path: Path) -> None:
    """The child starts in a fraction of a second with a small footprint: it writes from
    the shared arena without torch, and the file records the caller's torch."""
    done = _script(
        """
        import sys, torch, asyncckpt
        from pathlib import Path
        from asyncckpt._engine import writer_process
        state = {"w": torch.randn(1 << 18), "ids": torch.arange(100), "step": 3}
        asyncckpt.save(state, sys.argv[1] + "/a.ackpt").result()
        child = writer_process.current()
        maps = Path(f"/proc/{child.pid}/maps").read_text()
        print("torch" if "libtorch" in maps else "no torch", child.jobs)
        loaded = asyncckpt.load(sys.argv[1] + "/a.ackpt")
        assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["no", "torch", "1"]
    data = (tmp_path / "a.ackpt").read_bytes()
    footer = decode_footer(data[-FOOTER_SIZE:], len(data), "a.ackpt")
    body = data[footer.manifest_offset : footer.manifest_offset + footer.manifest_length]
    assert decode_manifest(body, footer, "a.ackpt").meta["torch"] == torch.__version__


_TRAINER = """
import os, sys, time, torch, asyncckpt
import tests.engine.test_writer_process  # registers gated://
base, preempted = sys.argv[1], sys.argv[2] == "handled"
gate = base + "/gate"
ckpt = asyncckpt.Checkpointer("gated://" + base + "/root", storage_options={"gate": gate})
stop = ckpt.on_preemption() if preempted else None
ckpt.save(1, {"w": torch.ones(10)})
print("saving", flush=True)
assert stop is not None and stop.wait(120), "no preemption signal came"
open(gate + "/release", "w").close()  # the loop goes on: the held write may finish now
ckpt.close()  # waits for the write the child was doing when the signal came, and commits
print("committed", ckpt.latest(), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("preempted", ["handled", "unhandled"])
def test_a_sigterm_to_the_process_group_lets_the_child_finish_the_write(
    tmp_path: Path, preempted: str
) -> None:
    """torchrun and SLURM signal the trainer's whole process group: with on_preemption()
    the write in flight in the writer process must still commit; without, the trainer dies
    of the signal and its child with it."""
    (tmp_path / "gate").mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "ASYNCCKPT_WRITER_PROCESSES": "1"}
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(tmp_path), preempted],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as under torchrun or srun
    )
    try:
        wait_for(tmp_path / "gate" / "started", timeout=120)  # the child is in the write
        writer = int((tmp_path / "gate" / "started").read_text())
        os.killpg(trainer.pid, signal.SIGTERM)
        out, err = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(timeout=30)
    if preempted == "handled":
        assert trainer.returncode == 0, err
        assert "committed 1" in out
    else:
        assert trainer.returncode == -signal.SIGTERM, err
    deadline = time.monotonic() + 60  # either way the child does not outlive the trainer
    while not _gone(writer):
        assert time.monotonic() < deadline, f"the writer process {writer} outlived its caller"
        time.sleep(0.05)
