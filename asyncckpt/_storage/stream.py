"""A caller's file object (``io.BytesIO``, a file opened ``"wb"``/``"rb"``) as a storage."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from typing import Any

from asyncckpt._storage.base import AtomicWriter, Storage, errors_as


def is_file_object(f: object, method: str) -> bool:
    """Whether ``f`` is a file object (not a path or URL) with the method ``method``.

    Example:
        >>> import io
        >>> is_file_object(io.BytesIO(), "write"), is_file_object("x.ackpt", "write")
        (True, False)
    """
    return not isinstance(f, (str, bytes, os.PathLike)) and callable(getattr(f, method, None))


def stream_label(f: Any) -> str:
    name = getattr(f, "name", None)
    return name if isinstance(name, str) else f"<{type(f).__name__}>"


class _StreamWriter(AtomicWriter):
    """Writes into a caller's file object; on abort, truncates back where it started."""

    def __init__(self, storage: StreamStorage) -> None:
        self.storage = storage
        self.f = storage.f
        self.start: int | None = None
        with contextlib.suppress(Exception):
            if self.f.seekable():
                self.start = self.f.tell()

    def write(self, data: bytes | memoryview) -> None:
        with errors_as(self.storage, "", "write"):
            view = memoryview(data).cast("B")
            while view:
                n = self.f.write(view)
                # Buffered files write everything or raise; raw files may write less.
                view = view[len(view) if n is None else n :]

    def commit(self) -> None:
        with errors_as(self.storage, "", "flush"):
            self.f.flush()

    def abort(self) -> None:
        if self.start is not None:
            with contextlib.suppress(Exception):
                self.f.seek(self.start)
                self.f.truncate()


class StreamStorage(Storage):
    """A caller's file object seen as one file (path ``""``), for ``save`` and ``load``.

    Reads cover the object from its position when opened to its end (the one version there
    is, so a read handle reads it by path); they seek and read under a lock, because a load
    reads chunks from several threads. A stream that cannot seek is read into memory first.
    ``f``: a binary file object, writable to save into it, readable to load from it.

    Example:
        >>> import io
        >>> storage = StreamStorage(io.BytesIO(b"..abc"))
        >>> storage.size(""), storage.read_range("", 2, 5)
        (5, b'abc')
    """

    process_local = True

    def __init__(self, f: Any) -> None:
        self.f = f
        self.label = stream_label(f)
        self._lock = threading.Lock()
        self._base: int | None = None
        self._size: int | None = None

    def describe(self, path: str) -> str:
        return self.label

    def open_atomic(self, path: str) -> AtomicWriter:
        return _StreamWriter(self)

    def _measure(self) -> tuple[int, int]:
        if self._base is None or self._size is None:
            with errors_as(self, "", "read"):
                seekable = bool(getattr(self.f, "seekable", lambda: False)())
                if not seekable:  # a pipe or socket: read it all once
                    self.f = io.BytesIO(self.f.read())
                self._base = self.f.tell()
                self._size = self.f.seek(0, io.SEEK_END) - self._base
        return self._base, self._size

    def size(self, path: str) -> int:
        return self._measure()[1]

    def read_range(self, path: str, start: int, length: int) -> bytes:
        base, size = self._measure()
        length = max(0, min(length, size - start))
        parts: list[bytes] = []
        with self._lock, errors_as(self, "", "read"):
            self.f.seek(base + start)
            while length > 0:
                part = self.f.read(length)
                if not part:
                    break
                parts.append(part)
                length -= len(part)
        return b"".join(parts)

    def exists(self, path: str) -> bool:
        return True

    def delete(self, path: str) -> None:
        raise TypeError("a file object cannot be deleted")

    delete_tree = delete

    def create_exclusive(self, path: str, data: bytes) -> None:
        raise TypeError("a file object cannot be created exclusively")

    def list_dir(self, path: str) -> list[str]:
        return []
