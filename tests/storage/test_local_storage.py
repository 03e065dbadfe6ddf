"""Local files: writeback started while a file is written (``writeback_mib``); links."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
import asyncckpt._storage.local as local
from asyncckpt._settings import Settings
from asyncckpt._storage import LocalStorage, is_temp_name
from asyncckpt.errors import StorageError
from tests.fake_clock import fake_clock

MIB = 1 << 20


@pytest.fixture
def handed_over(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every range the writers ask the kernel to write back, passed on to the real call
    (writes on threads: a writer process would not be seen)."""
    monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "0")
    ranges: list[tuple[int, int]] = []
    real = local.start_writeback

    def record(fd: int, start: int, length: int) -> bool:
        ranges.append((start, length))
        return real(fd, start, length)

    monkeypatch.setattr(local, "start_writeback", record)
    return ranges


def write_pieces(path: Path, pieces: list[bytes]) -> None:
    writer = LocalStorage().open_atomic(str(path))
    for piece in pieces:
        writer.write(piece)
    writer.commit()


def test_writeback_is_started_for_each_stretch_written(
    tmp_path: Path, handed_over: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_WRITEBACK_MIB", "1")
    pieces = [os.urandom(768 << 10) for _ in range(5)]  # 3.75 MiB in all
    write_pieces(tmp_path / "f", pieces)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)
    # Each call covers what was written since the previous one, from the start, in order:
    # after 1.5 MiB, 3 MiB; the last 0.75 MiB is left to the fsync.
    assert handed_over == [(0, 1536 << 10), (1536 << 10, 1536 << 10)]


def test_writeback_off_leaves_everything_to_the_fsync(
    tmp_path: Path, handed_over: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_WRITEBACK_MIB", "0")
    write_pieces(tmp_path / "f", [bytes(2 * MIB)] * 3)
    assert handed_over == []
    assert (tmp_path / "f").stat().st_size == 6 * MIB


def test_a_filesystem_without_writeback_is_asked_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def unsupported(fd: int, start: int, length: int) -> bool:
        calls.append(start)
        return False

    monkeypatch.setattr(local, "start_writeback", unsupported)
    monkeypatch.setenv("ASYNCCKPT_WRITEBACK_MIB", "1")
    pieces = [os.urandom(MIB) for _ in range(4)]
    write_pieces(tmp_path / "f", pieces)
    assert calls == [0]
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)


def failing_libc_call(err: int) -> Callable[[int, int, int, int], int]:
    def call(fd: int, start: int, length: int, flags: int) -> int:
        ctypes.set_errno(err)
        return -1

    return call


def test_unsupported_errno_means_not_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    for err in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP):
        monkeypatch.setattr(local, "_sync_file_range", lambda e=err: failing_libc_call(e))
        assert local.start_writeback(0, 0, MIB) is False


def test_io_error_from_writeback_fails_the_save_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "_sync_file_range", lambda: failing_libc_call(errno.EIO))
    monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "0")  # the failure is injected here
    monkeypatch.setenv("ASYNCCKPT_WRITEBACK_MIB", "1")
    target = tmp_path / "w.ackpt"
    with pytest.raises(StorageError, match=r"w\.ackpt.*write failed: Input/output error"):
        asyncckpt.save({"w": torch.randn(1 << 20)}, str(target), compression="none").result()
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux")
def test_real_writeback_on_this_filesystem(
    tmp_path: Path, handed_over: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert local._sync_file_range() is not None
    monkeypatch.setenv("ASYNCCKPT_WRITEBACK_MIB", "1")
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", str(MIB))
    state = {"w": torch.randn(3 << 20), "step": torch.tensor(7)}
    path = str(tmp_path / "w.ackpt")
    asyncckpt.save(state, path, compression="zstd").result()
    # contiguous stretches from the start of the file, each at least the 1 MiB asked for
    assert len(handed_over) >= 2
    assert all(length >= MIB for _, length in handed_over)
    assert [start for start, _ in handed_over] == [
        sum(length for _, length in handed_over[:i]) for i in range(len(handed_over))
    ]
    loaded = asyncckpt.load(path)
    assert torch.equal(loaded["w"], state["w"]) and int(loaded["step"]) == 7
    assert not any(is_temp_name(name) for name in os.listdir(tmp_path))


def test_writeback_is_resolved_when_the_save_starts(
    tmp_path: Path, handed_over: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changing the environment after ``save`` returned does not change that save."""
    opening = threading.Event()
    real_init = local._LocalWriter.__init__

    def slow_open(self: local._LocalWriter, storage: local.LocalStorage, target: str) -> None:
        opening.wait(30)  # the background write opens its file only after the change below
        real_init(self, storage, target)

    monkeypatch.setattr(local._LocalWriter, "__init__", slow_open)
    monkeypatch.setenv("ASYNCCKPT_WRITEBACK_MIB", "1")
    handle = asyncckpt.save(
        {"w": torch.randn(1 << 20)}, str(tmp_path / "w.ackpt"), compression="none"
    )
    monkeypatch.setenv("ASYNCCKPT_WRITEBACK_MIB", "0")
    opening.set()
    handle.result()
    assert handed_over, "the save started with writeback every 1 MiB"


def test_delete_tree_of_a_link_removes_the_link_only(tmp_path: Path) -> None:
    target = tmp_path / "other" / "5"
    target.mkdir(parents=True)
    (target / "COMMIT").write_text("{}")
    link = tmp_path / "run" / "5"
    link.parent.mkdir()
    link.symlink_to(target, target_is_directory=True)
    storage = LocalStorage()
    assert storage.is_link(str(link)) and not storage.is_link(str(target))
    storage.delete_tree(str(link))
    assert not os.path.lexists(link) and (target / "COMMIT").exists()
    storage.delete_tree(str(link))  # gone: not an error


def test_a_storage_uses_the_settings_it_was_built_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settings come with the storage (resolved by the entry point), not from the
    environment of the moment it writes."""
    from asyncckpt._settings import Settings
    from asyncckpt._storage import resolve

    storage, path = resolve(str(tmp_path / "a.ackpt"), None, Settings(writeback_mib=3))
    monkeypatch.setenv("ASYNCCKPT_WRITEBACK_MIB", "0")
    writer = storage.open_atomic(path)
    try:
        assert writer.writeback_bytes == 3 << 20
    finally:
        writer.abort()
    monkeypatch.setenv("ASYNCCKPT_LOCK_TIMEOUT_MS", "7")
    assert resolve(str(tmp_path), None)[0].settings.lock_timeout_ms == 7  # None: resolved now


def _held_across_a_fork(hold: Callable[[], Any], take: Callable[[], Any]) -> None:
    """Fork a child while ``hold()`` is held (as a DataLoader worker started while a save
    commits), release it in the parent, then ``take()`` it again while the child lives."""
    release_child_r, release_child_w = os.pipe()
    with hold():
        pid = os.fork()
        if pid == 0:  # the child: stays alive, doing nothing, until told to exit
            try:
                os.read(release_child_r, 1)
            finally:
                os._exit(0)
    try:
        with take():  # before the fix: "still locked by another process" (the child)
            pass
    finally:
        os.write(release_child_w, b"x")
        _, status = os.waitpid(pid, 0)
        os.close(release_child_r)
        os.close(release_child_w)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_keep_the_parents_file_locks(tmp_path: Path) -> None:
    storage = LocalStorage(Settings.resolve(lock_timeout_ms=200))
    marker = str(tmp_path / "model.ackpt.ackpending")
    _held_across_a_fork(lambda: storage.marker_lock(marker), lambda: storage.marker_lock(marker))
    version = str(tmp_path / "VERSION.lock")
    _held_across_a_fork(
        lambda: local._flocked(storage, version), lambda: local._flocked(storage, version)
    )


@pytest.mark.timeout(60)
def test_a_released_lock_is_free_while_a_just_forked_child_still_has_its_descriptor(
    tmp_path: Path,
) -> None:
    """A child forked a moment ago holds a copy of the lock's descriptor until its fork hook
    runs, which a loaded machine may delay past ``lock_timeout_ms``; the parent's release
    must unlock all the same. A duplicate descriptor stands for that child, deterministically."""
    from asyncckpt import _threads

    storage = LocalStorage(Settings.resolve(lock_timeout_ms=200))
    marker = str(tmp_path / "model.ackpt.ackpending")
    version = str(tmp_path / "VERSION.lock")
    for hold in (lambda: storage.marker_lock(marker), lambda: local._flocked(storage, version)):
        with hold():
            (held,) = _threads._lock_fds
            child_copy = os.dup(held)  # the child's, not yet dropped by its fork hook
        try:
            with hold():  # before the fix: "still locked by another process" (the copy)
                pass
        finally:
            os.close(child_copy)


@pytest.mark.timeout(120)
def test_a_lock_held_elsewhere_fails_after_lock_timeout_ms_on_the_liveness_clock(
    tmp_path: Path,
) -> None:
    import fcntl

    lock = str(tmp_path / "VERSION.lock")
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)  # another open file: flock excludes it
    fcntl.flock(holder, fcntl.LOCK_EX)
    storage = LocalStorage(Settings.resolve(lock_timeout_ms=60_000))
    try:
        with fake_clock() as clock:
            start = clock.now()
            with pytest.raises(StorageError, match="still locked"), local._flocked(storage, lock):
                pass
            assert clock.now() - start == pytest.approx(60.0)  # the timeout, not a try later
    finally:
        os.close(holder)
