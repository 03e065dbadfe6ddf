"""Local disk through the OS: temp file, fsync, rename, fsync the directory.

A reader sees the old file or the new one; a crash leaves at most a temp file, which the
next writer's recovery removes, never a partial target. The version file's compare-and-swap
holds an ``flock`` (see docs/PROTOCOL.md for what that guarantees on NFS and Lustre).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Iterator
from typing import BinaryIO

from .. import config
from ..errors import ConflictError, StorageError
from .base import AtomicWriter, Storage, content_tag, errors_as, temp_name


class LocalStorage(Storage):
    """Local disk through the OS, with fsync discipline."""

    label = ""

    def open_atomic(self, path: str) -> AtomicWriter:
        return _LocalWriter(path)

    def size(self, path: str) -> int:
        with errors_as(self, path, "stat"):
            return os.stat(path).st_size

    def read_range(self, path: str, start: int, length: int) -> bytes:
        with errors_as(self, path, "read"):
            fd = os.open(path, os.O_RDONLY)
            try:
                return os.pread(fd, length, start)
            finally:
                os.close(fd)

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        with errors_as(self, path, "read"):
            fd = os.open(path, os.O_RDONLY)
            try:
                done = 0
                while done < len(out):
                    n = os.preadv(fd, [out[done:]], start + done)
                    if n == 0:
                        break
                    done += n
                return done
            finally:
                os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def delete(self, path: str) -> None:
        with errors_as(self, path, "delete"), contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def create_exclusive(self, path: str, data: bytes) -> None:
        # Write a complete temp file, then hard-link it to the target: link() fails if the
        # target exists, so the target appears whole, once, or not at all.
        writer = _LocalWriter(path)
        try:
            writer.write(data)
            with errors_as(self, path, "create"):
                os.fsync(writer.file.fileno())
                writer.file.close()
                try:
                    os.link(writer.temp, path)
                except FileExistsError:
                    raise ConflictError(f"{path} already exists") from None
                fsync_dir(os.path.dirname(path) or ".")
        finally:
            writer.abort()

    def list_dir(self, path: str) -> list[str]:
        with errors_as(self, path, "list"):
            try:
                return sorted(os.listdir(path))
            except (FileNotFoundError, NotADirectoryError):
                return []

    def delete_tree(self, path: str) -> None:
        with errors_as(self, path, "delete"), contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path)
            fsync_dir(os.path.dirname(path) or ".")

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def replace_if(self, path: str, data: bytes, tag: str | None) -> str:
        # The lock file excludes every process that uses this protocol on this machine (and
        # on NFS/Lustre only where flock is coherent across clients; see docs/PROTOCOL.md).
        with errors_as(self, path, "lock"):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with _flocked(self, f"{path}.lock"):
            self._check_tag(path, tag)
            self._write_under_lock(path, data)
        return content_tag(data)


@contextlib.contextmanager
def _flocked(storage: Storage, lock_path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path``, waiting at most ``lock_timeout_ms``.

    Bounded so that a writer frozen while holding the lock (SIGSTOP, a swapped-out VM)
    turns into a clear error instead of a hang; the lock is only held for a read and an
    atomic rename, so a healthy holder never comes near the limit.
    """
    import fcntl

    deadline = time.monotonic() + config.tunable("lock_timeout_ms", None) / 1000
    with errors_as(storage, lock_path, "lock"):
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                    raise StorageError(f"{lock_path}: flock failed: {exc}") from exc
                if time.monotonic() >= deadline:
                    raise StorageError(
                        f"{lock_path}: still locked by another process after "
                        f"{config.tunable('lock_timeout_ms', None)} ms (a writer frozen while "
                        "committing?)"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class _LocalWriter(AtomicWriter):
    def __init__(self, target: str) -> None:
        self.target = target
        self.temp = temp_name(target)
        with errors_as(LocalStorage(), target, "create"):
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            self.file: BinaryIO = open(self.temp, "xb", buffering=0)  # noqa: SIM115

    def write(self, data: bytes | memoryview) -> None:
        with errors_as(LocalStorage(), self.temp, "write"):
            view = memoryview(data)
            while view:
                n = self.file.write(view)
                view = view[n or 0 :]

    def commit(self) -> None:
        try:
            with errors_as(LocalStorage(), self.target, "commit"):
                os.fsync(self.file.fileno())
                self.file.close()
                os.replace(self.temp, self.target)
                fsync_dir(os.path.dirname(self.target) or ".")
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            os.remove(self.temp)


def fsync_dir(path: str) -> None:
    """Make a rename or unlink in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
