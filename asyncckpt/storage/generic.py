"""Any other fsspec filesystem (``memory://`` and friends): temp file, then move.

Generic filesystems have no atomic create-if-absent or compare-and-swap, so those are exact
only within one process (a process-wide lock); see docs/PROTOCOL.md.
"""

from __future__ import annotations

import contextlib

import fsspec

from ..errors import ConflictError
from .base import AtomicWriter, Storage, _create_lock, errors_as, temp_name


class FsspecStorage(Storage):
    """Any fsspec filesystem that supports move (``memory://``, and others)."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.label = f"{protocol}://"

    def describe(self, path: str) -> str:
        return (
            f"{self.label}{path.removeprefix('/')}"
            if self.label == "memory://"
            else f"{self.label}{path}"
        )

    def open_atomic(self, path: str) -> AtomicWriter:
        return _FsspecWriter(self, path)

    def size(self, path: str) -> int:
        with errors_as(self, path, "stat"):
            return int(self.fs.size(path))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        with errors_as(self, path, "read"):
            data: bytes = self.fs.cat_file(path, start=start, end=start + length)
            return data

    def exists(self, path: str) -> bool:
        with errors_as(self, path, "stat"):
            return bool(self.fs.exists(path))

    def delete(self, path: str) -> None:
        with errors_as(self, path, "delete"), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def create_exclusive(self, path: str, data: bytes) -> None:
        # Generic filesystems have no atomic create-if-absent; check-then-move under a
        # process-wide lock is exact for in-process filesystems (memory://) and best effort
        # elsewhere. Object stores use conditional writes instead (see docs/PROTOCOL.md).
        with _create_lock:
            if self.exists(path):
                raise ConflictError(f"{self.describe(path)} already exists")
            self.write_bytes(path, data)

    def list_dir(self, path: str) -> list[str]:
        with errors_as(self, path, "list"):
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
        prefix = path.rstrip("/") + "/"
        names = {e.rstrip("/").split("/")[-1] for e in entries if e.rstrip("/") != path}
        return sorted(n for n in names if n and f"{prefix}{n}" != prefix)

    def delete_tree(self, path: str) -> None:
        with errors_as(self, path, "delete"), contextlib.suppress(FileNotFoundError):
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)


class _FsspecWriter(AtomicWriter):
    def __init__(self, storage: FsspecStorage, target: str) -> None:
        self.storage = storage
        self.target = target
        self.temp = temp_name(target)
        with errors_as(storage, target, "create"):
            parent = target.rsplit("/", 1)[0] if "/" in target else ""
            if parent:
                storage.fs.makedirs(parent, exist_ok=True)
            self.file = storage.fs.open(self.temp, "wb")

    def write(self, data: bytes | memoryview) -> None:
        with errors_as(self.storage, self.temp, "write"):
            self.file.write(data)

    def commit(self) -> None:
        try:
            with errors_as(self.storage, self.target, "commit"):
                self.file.close()
                self.storage.fs.mv(self.temp, self.target)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.file.close()
        with contextlib.suppress(Exception):
            self.storage.fs.rm_file(self.temp)
