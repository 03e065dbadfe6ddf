"""Drop-in save markers (``asyncckpt._versions.pending``): the record, the storage methods behind
it, the publish check, the heartbeat, dead-writer detection and the wait in ``load``.

The behaviour across real processes is in ``tests/api/test_dropin_processes.py``; these tests
drive the pieces in one process, writing "other writers'" markers by hand.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import _liveness as liveness
from asyncckpt import cli
from asyncckpt._settings import Settings
from asyncckpt._storage import LocalStorage, Storage, resolve
from asyncckpt._storage.base import TEMP_MARK
from asyncckpt._versions import pending
from asyncckpt._versions.pending_record import (
    MAX_PENDING_BYTES,
    PendingRecord,
    decode_pending,
    encode_pending,
)
from asyncckpt._versions.protocol import encode_record
from asyncckpt.errors import CheckpointTimeoutError, ConflictError, StorageError
from tests.fake_clock import fake_clock

MARKER = ".ackpending"


def _record(**changes: Any) -> PendingRecord:
    """A marker record of another writer: this machine's identity, a pid of our choosing."""
    machine = pending.this_machine()
    fields: dict[str, Any] = {
        "token": "other-token",
        "host": machine.host,
        "pid": 1 << 22,
        "pid_ns": machine.pid_ns,
        "boot": machine.boot,
        "pid_start": 1,
        "beat": 0,
        "started": "2030-01-01T00:00:00+00:00",
    }
    fields.update(changes)
    return PendingRecord(**fields)


@pytest.fixture
def local_file(tmp_path: Path) -> tuple[Storage, str]:
    return LocalStorage(), str(tmp_path / "model.ackpt")


# --------------------------------------------------------------------------- the record


def test_record_round_trip() -> None:
    record = _record(pid_ns=None, boot=None, pid_start=None)
    raw = encode_pending(record)
    assert decode_pending(raw) == record
    doc = json.loads(raw)
    assert doc["kind"] == "drop-in-save" and doc["protocol"] == 1 and "time" in doc


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b'{"protocol": 1, "kind": "drop-in-sa',
        encode_pending(_record())[:-1] + b"}x",  # new bytes over a longer old record
        b"\xff\xfe",
        encode_record({"kind": "something-else", "token": "t"}),
        json.dumps({**json.loads(encode_pending(_record())), "protocol": 99}).encode(),
        json.dumps({**json.loads(encode_pending(_record())), "pid": "12"}).encode(),
        json.dumps({**json.loads(encode_pending(_record())), "pid_start": 1.5}).encode(),
        b'{"protocol": 1, "kind": "drop-in-save", "token": ' + b"[" * 10**5 + b"]" * 10**5 + b"}",
    ],
    ids=[
        "empty",
        "cut",
        "trailing",
        "binary",
        "other-kind",
        "newer",
        "pid-str",
        "start-float",
        "deeply-nested",
    ],
)
def test_partial_or_foreign_bytes_are_no_record(raw: bytes) -> None:
    assert decode_pending(raw) is None


# --------------------------------------------------------------------------- storage methods


def _marker_storages(tmp_path: Path) -> list[tuple[Storage, str]]:
    out = [resolve(str(tmp_path / "local" / "m"), None)]
    out.append(resolve(f"faulty::file://{tmp_path / 'generic' / 'm'}", None))
    out.append(resolve(f"s3mem://bucket/{tmp_path.name}/m", None))
    return out


def test_marker_methods_on_every_backend(tmp_path: Path) -> None:
    for storage, path in _marker_storages(tmp_path):
        kind = type(storage).__name__
        assert storage.read_marker(path, 100) is None, kind
        tag = storage.write_marker(path, b"first, longer")
        assert storage.read_marker(path, 100) == b"first, longer", kind
        with pytest.raises(ConflictError):
            storage.write_marker(path, b"x", replacing="not-the-tag")
        with storage.marker_lock(path):
            tag = storage.write_marker(path, b"second", replacing=tag)
        assert storage.read_marker(path, 100) == b"second", kind  # cut to its new length
        with pytest.raises(asyncckpt.errors.FormatError):
            storage.read_marker(path, 3)
        storage.delete(path)
        with pytest.raises(ConflictError):
            storage.write_marker(path, b"back", replacing=tag)  # never brought back
        assert storage.read_marker(path, 100) is None, kind


def test_the_local_marker_lock_excludes_another_process(tmp_path: Path) -> None:
    path = str(tmp_path / "m.ackpt.ackpending")
    code = (
        "import sys; from asyncckpt._storage import LocalStorage\n"
        "with LocalStorage().marker_lock(sys.argv[1]):\n"
        "    print('locked', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "ASYNCCKPT_LOCK_TIMEOUT_MS": "200"},
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "locked"
        os.environ["ASYNCCKPT_LOCK_TIMEOUT_MS"] = "200"
        try:
            with (
                pytest.raises(StorageError, match="still locked"),
                LocalStorage().marker_lock(path),
            ):
                pass
        finally:
            del os.environ["ASYNCCKPT_LOCK_TIMEOUT_MS"]
    finally:
        child.communicate("", timeout=60)
    with LocalStorage().marker_lock(path):  # free again once the holder let go
        pass
    assert sorted(os.listdir(tmp_path)) == []  # the lock is the directory's: no lock file


# --------------------------------------------------------------------------- begin, check, finish


def test_begin_writes_a_record_of_this_process_and_finish_removes_it(
    local_file: tuple[Storage, str],
) -> None:
    storage, path = local_file
    check = pending.begin(storage, path, settings=Settings.resolve())
    assert check is not None
    raw = storage.read_marker(path + MARKER, MAX_PENDING_BYTES)
    assert raw is not None
    record = decode_pending(raw)
    assert record is not None and record.token == check.token
    assert (record.pid, record.host) == (os.getpid(), pending.this_machine().host)
    assert record.pid_start == pending.process_start(os.getpid())
    assert pending.writer_gone(record) is None  # this process, with the save in flight
    pending.finish(check)
    assert not os.path.exists(path + MARKER)
    assert pending.writer_gone(record) is not None  # ... and now without it


def test_saves_of_one_file_in_one_process_share_the_marker(
    local_file: tuple[Storage, str],
) -> None:
    storage, path = local_file
    first, second = (
        pending.begin(storage, path, settings=Settings.resolve()),
        pending.begin(storage, path, settings=Settings.resolve()),
    )
    assert first is not None and second is not None and first.token == second.token
    pending.finish(first)
    assert os.path.exists(path + MARKER)  # the second save is still in flight
    with second():
        pass  # still this process's marker: publishing is allowed
    pending.finish(second)
    assert not os.path.exists(path + MARKER)


def test_the_check_refuses_once_another_save_replaced_the_marker(
    local_file: tuple[Storage, str],
) -> None:
    storage, path = local_file
    check = pending.begin(storage, path, settings=Settings.resolve())
    assert check is not None
    other = _record(host="far.invalid", pid=4242)
    storage.write_marker(path + MARKER, encode_pending(other))
    superseded = r"a later save of .*model\.ackpt by pid 4242 on host far\.invalid .* superseded"
    with pytest.raises(ConflictError, match=superseded), check():
        pytest.fail("published over a later save")
    later = pending.begin(
        storage, path, settings=Settings.resolve()
    )  # a new save here starts later still: a new marker
    assert later is not None and later.token != check.token
    pending.finish(check)  # the superseded one leaves the marker alone
    current = decode_pending(storage.read_marker(path + MARKER, 1000) or b"")
    assert current is not None and current.token == later.token
    pending.finish(later)
    storage.delete(path + MARKER)
    check = pending.begin(storage, path, settings=Settings.resolve())
    assert check is not None
    storage.delete(path + MARKER)  # gone: a later save finished first (or a hand)
    with pytest.raises(ConflictError, match="superseded this one and has finished"), check():
        pass
    pending.finish(check)


def test_a_save_whose_marker_was_replaced_fails_and_leaves_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "0")  # the commit is patched here
    path = tmp_path / "model.ackpt"
    asyncckpt.save({"v": torch.zeros(4)}, path).result()
    from asyncckpt._storage import local

    real = local._LocalWriter.commit

    def commit(self: Any) -> None:  # another process's save starts just before the rename
        LocalStorage().write_marker(f"{path}{MARKER}", encode_pending(_record(pid=77)))
        real(self)

    monkeypatch.setattr(local._LocalWriter, "commit", commit)
    handle = asyncckpt.save({"v": torch.ones(4)}, path)
    with pytest.raises(ConflictError, match="pid 77"):
        handle.result()
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["model.ackpt", f"model.ackpt{MARKER}"]
    os.remove(f"{path}{MARKER}")
    assert asyncckpt.load(path)["v"].sum() == 0  # untouched, no temp file left


def test_a_marker_that_cannot_be_written_fails_the_handle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.ackpt"
    asyncckpt.save({"v": torch.zeros(4)}, path).result()

    def refuse(self: Any, marker: str, data: bytes, replacing: str | None = None) -> str:
        raise StorageError(f"{marker}: write failed: injected")

    monkeypatch.setattr(LocalStorage, "write_marker", refuse)
    handle = asyncckpt.save({"v": torch.ones(4)}, path)  # returns a handle, as before
    with pytest.raises(StorageError, match="injected"):
        handle.result()
    assert sorted(os.listdir(tmp_path)) == ["model.ackpt"]
    assert asyncckpt.load(path)["v"].sum() == 0


@pytest.mark.parametrize("plant", ["symlink", "dangling-symlink", "fifo"])
def test_a_marker_planted_as_a_link_or_special_file_is_never_written_through(
    tmp_path: Path, plant: str
) -> None:
    path = tmp_path / "model.ackpt"
    asyncckpt.save({"v": torch.zeros(4)}, path).result()
    victim = tmp_path / "elsewhere" / "precious.txt"
    victim.parent.mkdir()
    marker = Path(f"{path}{MARKER}")
    if plant == "symlink":
        victim.write_bytes(b"someone else's file")
        marker.symlink_to(victim)
    elif plant == "dangling-symlink":
        marker.symlink_to(victim)  # would create the file it points to
    else:
        os.mkfifo(marker)  # opening it to write would block until a reader came
    handle = asyncckpt.save({"v": torch.ones(4)}, path)
    with pytest.raises(StorageError, match=re.escape(str(marker))):
        handle.result()
    if plant == "symlink":
        assert victim.read_bytes() == b"someone else's file"
    else:
        assert not victim.exists()
    marker.unlink()
    assert asyncckpt.load(path)["v"].sum() == 0  # the file was left alone


_KILLED_WRITING_MARKER = """
import os, signal, sys, torch, asyncckpt

def killing(write):
    def wrapped(fd, data, *rest):
        if b"drop-in-save" in bytes(data):  # the marker's record: die before writing it
            os.kill(os.getpid(), signal.SIGKILL)
        return write(fd, data, *rest)
    return wrapped

os.write, os.pwrite = killing(os.write), killing(os.pwrite)
asyncckpt.save({"v": torch.ones(4)}, sys.argv[1]).result()
"""


@pytest.mark.timeout(120)
def test_a_save_killed_as_it_writes_its_marker_leaves_no_unreadable_marker(
    tmp_path: Path,
) -> None:
    """A marker is created with its record in it, never empty first: a writer killed in
    between left an empty marker that no load could judge (no pid to check), so loads
    waited ``lease_expiry_ms`` and then blamed "an unknown process"."""
    path = tmp_path / "model.ackpt"
    asyncckpt.save({"v": torch.zeros(4)}, path).result()
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITING_MARKER, str(path)], timeout=100, check=False
    )
    assert child.returncode == -9
    marker = Path(f"{path}{MARKER}")
    assert not marker.exists() or decode_pending(marker.read_bytes()) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) in (
        ["model.ackpt"],
        ["model.ackpt", marker.name],
    )
    with contextlib.suppress(CheckpointTimeoutError):  # a readable marker: the dead pid, at once
        assert asyncckpt.load(path)["v"].sum() == 0


@pytest.mark.timeout(60)
def test_a_marker_planted_as_a_fifo_fails_a_load_instead_of_hanging_it(tmp_path: Path) -> None:
    path = tmp_path / "model.ackpt"
    asyncckpt.save({"v": torch.zeros(4)}, path).result()
    marker = Path(f"{path}{MARKER}")
    os.mkfifo(marker)  # opening it to read would block until a writer came
    with pytest.raises(StorageError, match=re.escape(str(marker))):
        asyncckpt.load(path)
    marker.unlink()
    assert asyncckpt.load(path)["v"].sum() == 0


@pytest.mark.timeout(120)
def test_the_check_runs_in_the_writer_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncckpt._engine.arena import shared_memory_supported

    if not shared_memory_supported():
        pytest.skip("the writer process needs memfd")
    from tests.engine.test_writer_process import GatedFileSystem

    assert GatedFileSystem.protocol == "gated"
    monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "1")
    gate = tmp_path / "gate"
    gate.mkdir()
    url = f"gated://{tmp_path / 'model.ackpt'}"
    handle = asyncckpt.save({"v": torch.ones(4)}, url, storage_options={"gate": str(gate)})
    deadline = time.monotonic() + 100
    while not (gate / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert int((gate / "started").read_text()) != os.getpid()  # the child is writing
    storage, path = resolve(url, {"gate": str(gate)})
    storage.write_marker(path + MARKER, encode_pending(_record(pid=99, host="far.invalid")))
    (gate / "release").touch()
    with pytest.raises(ConflictError, match=r"pid 99 on host far\.invalid"):
        handle.result(timeout=100)
    names = sorted(os.listdir(tmp_path))
    assert names == ["gate", f"model.ackpt{MARKER}"], names  # no file, no temp file


# --------------------------------------------------------------------------- the heartbeat


def _beat_all() -> int:
    """Renew every save marker of this process now, here; how many were rewritten."""
    return sum(b.renew() for b in liveness.heartbeat().beats() if MARKER in b.name)


def test_a_beat_rewrites_the_marker_and_stops_once_it_is_replaced(
    local_file: tuple[Storage, str],
) -> None:
    storage, path = local_file
    check = pending.begin(storage, path, settings=Settings.resolve())
    assert check is not None
    marker = path + MARKER
    before = decode_pending(storage.read_marker(marker, 1000) or b"")
    assert before is not None and before.beat == 0
    assert _beat_all() >= 1
    after = decode_pending(storage.read_marker(marker, 1000) or b"")
    assert after is not None and after.beat == 1 and after.token == before.token
    foreign = encode_pending(_record(pid=5))
    storage.write_marker(marker, foreign)
    _beat_all()
    assert storage.read_marker(marker, 1000) == foreign  # not overwritten
    pending.finish(check)
    assert storage.read_marker(marker, 1000) == foreign  # nor deleted
    storage.delete(marker)


@pytest.mark.timeout(120)
def test_the_heartbeat_thread_beats_while_a_save_is_in_flight(
    local_file: tuple[Storage, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_LEASE_RENEW_MS", "20")
    storage, path = local_file
    check = pending.begin(storage, path, settings=Settings.resolve())
    assert check is not None
    assert _wait_for_beats(storage, path, 3) >= 3
    pending.finish(check)
    # A full beat pass, now: it takes each marker's lock, so a beat of the heartbeat thread
    # in flight at finish() has ended by then; it must find nothing left to beat.
    assert _beat_all() == 0
    assert not os.path.exists(path + MARKER)  # no beat brings it back


def test_nothing_of_a_files_marker_outlives_its_saves(tmp_path: Path) -> None:
    """The bookkeeping of a file's marker (its slot) goes with its last save, and its beat
    with it (the heartbeat thread ends with the last beat: tests/test_liveness.py): a
    process saving many distinct files (a new name per epoch) holds nothing for the files
    it saved before."""
    beating = []
    for i in range(20):
        handle = asyncckpt.save({"v": torch.full((4,), float(i))}, tmp_path / f"e{i}.ackpt")
        beating += [b for b in liveness.heartbeat().beats() if MARKER in b.name]
        handle.result()
    assert beating  # markers were beaten while the saves ran
    for beat in beating:
        beat.join(timeout=60)
        assert not beat.is_alive()
    assert not any(MARKER in b.name for b in liveness.heartbeat().beats())
    assert pending._slots == {}
    assert asyncckpt.load(tmp_path / "e19.ackpt")["v"].tolist() == [19.0] * 4


def _beat_of(storage: Storage, path: str) -> int:
    record = decode_pending(storage.read_marker(path + MARKER, 1000) or b"")
    return -1 if record is None else record.beat


def _wait_for_beats(storage: Storage, path: str, wanted: int) -> int:
    deadline, beat = time.monotonic() + 100, -1
    while beat < wanted and time.monotonic() < deadline:
        beat = max(beat, _beat_of(storage, path))
        time.sleep(0.01)
    return beat


@pytest.mark.timeout(150)
def test_a_slow_interval_or_a_hanging_store_holds_up_no_other_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = LocalStorage()
    # In three directories: the marker lock is the directory's.
    slow, hung, quick = (str(tmp_path / n / "m.ackpt") for n in ("slow", "hung", "quick"))
    monkeypatch.setenv("ASYNCCKPT_LEASE_RENEW_MS", str(3_600_000))
    checks = [
        pending.begin(storage, slow, settings=Settings.resolve())
    ]  # the heartbeat now waits an hour for this one
    monkeypatch.setenv("ASYNCCKPT_LEASE_RENEW_MS", "20")
    release = threading.Event()
    real = LocalStorage.write_marker

    def write_marker(self: Any, path: str, data: bytes, replacing: str | None = None) -> str:
        if path == hung + MARKER and replacing is not None:
            release.wait(120)  # a store that hangs on the beats of this file
        return real(self, path, data, replacing)

    monkeypatch.setattr(LocalStorage, "write_marker", write_marker)
    checks += [
        pending.begin(storage, hung, settings=Settings.resolve()),
        pending.begin(storage, quick, settings=Settings.resolve()),
    ]
    try:
        assert _wait_for_beats(storage, quick, 5) >= 5
        assert _beat_of(storage, slow) == 0 and _beat_of(storage, hung) == 0
    finally:
        release.set()
        for check in checks:
            assert check is not None
            pending.finish(check)
    assert not any(n.endswith(MARKER) for _, _, names in os.walk(tmp_path) for n in names)


# --------------------------------------------------------------------------- dead writers


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(60)
    return child.pid


def test_dead_writer_detection() -> None:
    if pending.this_machine().boot is None or pending.process_start(os.getpid()) is None:
        pytest.skip("needs /proc")
    assert "no longer exists" in (pending.writer_gone(_record(pid=_exited_pid())) or "")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = pending.process_start(child.pid)
        assert start is not None
        assert pending.writer_gone(_record(pid=child.pid, pid_start=start)) is None  # alive
        reused = pending.writer_gone(_record(pid=child.pid, pid_start=start + 1))
        assert reused is not None and "another process" in reused
    finally:
        child.kill()
        child.wait(60)
    gone = _exited_pid()
    for elsewhere in (
        _record(pid=gone, host="far.invalid"),
        _record(pid=gone, boot="another-boot"),
        _record(pid=gone, pid_ns="pid:[1]"),
        _record(pid=gone, pid_ns=None),
    ):
        assert pending.writer_gone(elsewhere) is None  # cannot be judged from here


def test_process_start_reads_a_command_name_with_parentheses() -> None:
    if pending.process_start(os.getpid()) is None:
        pytest.skip("needs /proc")
    code = (
        "import ctypes, sys, time\n"
        "ctypes.CDLL(None).prctl(15, b'x) (y 1 2', 0, 0, 0)\n"  # PR_SET_NAME
        "print('named', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "named"
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            assert b"(x) (y 1 2)" in f.read()
        start = pending.process_start(child.pid)
        assert start is not None and start >= (pending.process_start(os.getpid()) or 0)
    finally:
        child.kill()
        child.wait(60)


# --------------------------------------------------------------------------- the wait in load


def test_load_gives_up_at_once_on_a_dead_writer_of_this_machine(tmp_path: Path) -> None:
    if pending.this_machine().boot is None:
        pytest.skip("needs /proc")
    path = tmp_path / "model.ackpt"
    asyncckpt.save({"v": torch.zeros(2)}, path).result()
    pid = _exited_pid()
    LocalStorage().write_marker(f"{path}{MARKER}", encode_pending(_record(pid=pid)))
    with pytest.raises(CheckpointTimeoutError) as caught:
        asyncckpt.load(path)
    message = str(caught.value)
    assert f"pid {pid}" in message and "no longer exists" in message and str(path) in message
    assert f"delete {path}{MARKER}" in message and "previous save's state" in message
    asyncckpt.save({"v": torch.ones(2)}, path).result()  # a new save clears it
    assert asyncckpt.load(path)["v"].sum() == 2


def test_a_load_resuming_after_the_writer_died_can_load_the_file_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if pending.this_machine().boot is None:
        pytest.skip("needs /proc")
    path = tmp_path / "model.ackpt"
    asyncckpt.save({"v": torch.zeros(2)}, path).result()
    pid = _exited_pid()
    LocalStorage().write_marker(f"{path}{MARKER}", encode_pending(_record(pid=pid)))
    loaded = asyncckpt.load(path, dead_writer="load")
    assert loaded["v"].tolist() == [0.0, 0.0]  # the previous save's state
    assert f"pid {pid}" in caplog.text and "loading" in caplog.text
    with pytest.raises(CheckpointTimeoutError):
        asyncckpt.load(path)  # the default still raises
    with pytest.raises(ValueError, match="dead_writer"):
        asyncckpt.load(path, dead_writer="ignore")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("marker", ["record", "partial"])
def test_load_gives_up_once_a_marker_stops_changing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marker: str
) -> None:
    monkeypatch.setenv("ASYNCCKPT_LEASE_EXPIRY_MS", "300")
    path = tmp_path / "model.ackpt"  # never written: the save in flight was its first
    raw = encode_pending(_record(host="far.invalid"))
    LocalStorage().write_marker(f"{path}{MARKER}", raw if marker == "record" else raw[:20])
    with fake_clock() as clock:
        start = clock.now()
        with pytest.raises(CheckpointTimeoutError, match="has not changed") as caught:
            asyncckpt.load(path)
        assert clock.now() - start == pytest.approx(0.3)  # on the expiry
    assert "nothing yet" in str(caught.value)
    if marker == "record":
        assert "far.invalid" in str(caught.value)


@pytest.mark.timeout(120)
def test_load_waits_while_the_marker_changes_and_returns_once_it_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_LEASE_EXPIRY_MS", "500")
    path = tmp_path / "model.ackpt"
    asyncckpt.save({"v": torch.zeros(2)}, path).result()
    asyncckpt.save({"v": torch.full((2,), 7.0)}, str(path) + ".new").result()
    marker = f"{path}{MARKER}"
    storage = LocalStorage()
    storage.write_marker(marker, encode_pending(_record(host="far.invalid")))
    done = []

    def beat(n: int) -> None:
        storage.write_marker(marker, encode_pending(_record(host="far.invalid", beat=n)))

    def publish() -> None:
        os.replace(str(path) + ".new", path)
        storage.delete(marker)
        done.append(clock.now() - start)

    with fake_clock() as clock:
        start = clock.now()
        # Another writer beats every 50 ms for 1.5 s (3 x the expiry), then publishes.
        for n in range(30):
            clock.at(start + 0.05 * n, functools.partial(beat, n))
        clock.at(start + 1.5, publish)
        loaded = asyncckpt.load(path)
    assert done == [pytest.approx(1.5)] and loaded["v"].tolist() == [7.0, 7.0]


def test_a_marker_an_object_store_denies_reading_is_taken_as_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, moto: Any
) -> None:
    """S3 answers a GET of a missing key with 403 to a reader without s3:ListBucket.

    On moto: s3mem:// lives in this process's memory, where a save leaves no marker."""
    from asyncckpt.testing import Fault, FaultPlan
    from tests.conftest import S3_BUCKET

    url = f"s3://{S3_BUCKET}/denied-{tmp_path.name}/m.ackpt"
    asyncckpt.save({"v": torch.ones(2)}, url, storage_options=moto.storage_options).result()
    plan = FaultPlan([Fault("cat_file", nth=1, kind="denied")])  # the marker's GET only
    options = {"faulty": {"plan": plan}, "s3": moto.storage_options}
    loaded = asyncckpt.load(f"faulty::{url}", storage_options=options)
    assert loaded["v"].tolist() == [1.0, 1.0]
    assert plan.fired(kind="denied") and plan.fired()[0].path.endswith(MARKER)
    assert "save markers cannot be read" in caplog.text


def test_memory_files_have_no_marker(memory_root: str) -> None:
    handle = asyncckpt.save({"v": torch.ones(2)}, f"{memory_root}/m.ackpt")
    storage, root = resolve(memory_root, None)
    assert all(MARKER not in n for n in storage.list_dir(root))
    handle.result()
    assert storage.list_dir(root) == ["m.ackpt"]


# --------------------------------------------------------------------------- the CLI


def test_inspect_and_verify_mention_a_save_in_flight(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.ackpt"
    asyncckpt.save({"v": torch.ones(2)}, path).result()
    LocalStorage().write_marker(f"{path}{MARKER}", encode_pending(_record(host="far.invalid")))
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pid 4194304 on host far.invalid" in out and "in flight" in out
    assert cli.main(["verify", str(path)]) == 0
    assert "in flight" in capsys.readouterr().out
    assert cli.main(["inspect", "--json", str(path)]) == 0
    assert "far.invalid" in json.loads(capsys.readouterr().out)["pending"]
    if pending.this_machine().boot is not None:
        dead = encode_pending(_record(pid=_exited_pid()))
        LocalStorage().write_marker(f"{path}{MARKER}", dead)
        assert cli.main(["inspect", str(path)]) == 0
        assert "never finished: its writer is dead" in capsys.readouterr().out
    new = tmp_path / "new.ackpt"
    LocalStorage().write_marker(f"{new}{MARKER}", encode_pending(_record(host="far.invalid")))
    assert cli.main(["inspect", str(new)]) != 0
    assert "no such file or checkpoint root yet (a save of this file" in capsys.readouterr().err
    assert all(TEMP_MARK not in n for n in os.listdir(tmp_path))


# --------------------------------------------------------------------------- the benchmark


def test_bench_dropin_runs_and_reports_every_figure(tmp_path: Path) -> None:
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_dropin.py"
    spec = importlib.util.spec_from_file_location("bench_dropin", script)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.run(saves=4, seaweed=False, out=str(tmp_path))
    assert json.loads((tmp_path / "bench_dropin.json").read_text()) == result
    local = result["targets"]["local"]
    for key in ("stall_with_ms", "stall_without_ms", "durable_with_ms", "load_check_ms"):
        assert local[key] > 0, key
    assert "seaweedfs" in result["skipped"]
