"""Any other fsspec filesystem (``memory://``, ``gs://``, ``az://``, ...): two write strategies.

Every write is atomic; how depends on what the filesystem's files can do (docs/s3.md,
"Other fsspec backends"):

* ``"deferred"`` — opened at the final path with ``autocommit=False``, published by
  ``file.commit()``, dropped by ``file.discard()``: on GCS one resumable upload, not an
  upload and a server-side copy. Only where the filesystem is known to honour it
  (:data:`DEFERRED_COMMIT_PROTOCOLS`) or declares it (``asyncckpt_write_strategy``).
* ``"move"`` — a temp file beside the target, then ``fs.mv`` over it: every other
  filesystem, including those whose ``open(..., "wb")`` deletes the target before the write
  completes (adlfs, so Azure stays here).

Per-file ``autocommit=False`` is used rather than ``fs.transaction``: a transaction is a
flag on the filesystem *instance*, which fsspec caches and shares between threads, so it
would also defer the writes (and hide the files) of every other thread using it.

:meth:`FsspecStorage.create_exclusive` is ``fs.pipe_file(path, data, mode="create")`` where
the filesystem has that mode (gcsfs: ``ifGenerationMatch=0``), else check-then-write, exact
only between threads of one process (one warning per filesystem class).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import threading
from typing import Any, Literal, NoReturn

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.spec import AbstractBufferedFile

from asyncckpt._storage.base import (
    AtomicWriter,
    ReadHandle,
    Storage,
    content_tag,
    create_lock,
    errors_as,
    first_time,
    temp_name,
)
from asyncckpt.errors import CheckpointNotFoundError, ConflictError, FormatError, StorageError

log = logging.getLogger(__name__)

WriteStrategy = Literal["deferred", "move"]
WRITE_STRATEGIES: tuple[WriteStrategy, ...] = ("deferred", "move")

#: Protocols whose files honour ``autocommit=False`` (nothing visible until ``commit()``,
#: ``discard()`` leaves nothing): gcsfs finalizes its resumable upload only in ``commit``.
DEFERRED_COMMIT_PROTOCOLS = frozenset({"gs", "gcs"})
#: fsspec filesystems known to accept ``mode="create"`` in ``pipe_file`` and ignore it.
_IGNORES_CREATE_MODE = frozenset({"HTTPFileSystem"})
#: What a filesystem raises when it cannot do a conditional create (not a conflict).
_UNSUPPORTED = (NotImplementedError, TypeError, ValueError)

_warned: set[type[Any]] = set()


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def choose_write_strategy(fs: fsspec.AbstractFileSystem) -> WriteStrategy:
    """The write strategy for ``fs``: ``"deferred"`` where its files support it, else ``"move"``.

    A filesystem class may declare its own with a ``asyncckpt_write_strategy`` attribute.

    Raises:
        ValueError: the filesystem declares a strategy that does not exist.

    Example:
        >>> import fsspec
        >>> choose_write_strategy(fsspec.filesystem("memory"))
        'move'
    """
    declared = getattr(fs, "asyncckpt_write_strategy", None)
    if declared is not None:
        if declared not in WRITE_STRATEGIES:
            raise ValueError(
                f"{type(fs).__name__}.asyncckpt_write_strategy is {declared!r}; "
                f"expected one of {', '.join(WRITE_STRATEGIES)}"
            )
        return declared  # type: ignore[no-any-return]
    return "deferred" if set(_protocols(fs)) & DEFERRED_COMMIT_PROTOCOLS else "move"


def has_conditional_create(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs.pipe_file(..., mode="create")`` may be a real conditional write.

    False where it cannot be: fsspec's generic ``pipe_file`` (``exists`` then ``open``),
    an async filesystem without ``_pipe_file``, an implementation with no ``mode``
    parameter (it would swallow the argument and overwrite), or one known to ignore it.
    True is only a candidate: :meth:`FsspecStorage.create_exclusive` still falls back if
    the call raises ``NotImplementedError``, ``TypeError`` or ``ValueError``.

    Example:
        >>> import fsspec
        >>> has_conditional_create(fsspec.filesystem("memory"))
        True
    """
    if type(fs).__name__ in _IGNORES_CREATE_MODE:
        return False
    base = AsyncFileSystem if isinstance(fs, AsyncFileSystem) else fsspec.AbstractFileSystem
    name = "_pipe_file" if base is AsyncFileSystem else "pipe_file"
    method = getattr(type(fs), name)
    if method is getattr(base, name):
        return False
    try:
        return "mode" in inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin or C method: cannot tell, so do not trust it
        return False


_LIST_ATTEMPTS = 5


class FsspecStorage(Storage):
    """Any fsspec filesystem ``fs`` that is neither local disk nor an S3-API object store,
    written with ``write_strategy`` (``"deferred"`` or ``"move"``, see the module docstring;
    None chooses with :func:`choose_write_strategy`).

    Raises:
        ValueError: an unknown ``write_strategy``.

    Example:
        >>> import fsspec
        >>> storage = FsspecStorage(fsspec.filesystem("memory"))
        >>> storage.write_bytes("/doc/x", b"hello")
        >>> storage.read_bytes("/doc/x", 100), storage.write_strategy
        (b'hello', 'move')
        >>> storage.delete_tree("/doc")
    """

    def __init__(
        self, fs: fsspec.AbstractFileSystem, write_strategy: WriteStrategy | None = None
    ) -> None:
        self.fs = fs
        self.label = f"{_protocols(fs)[0]}://"
        strategy = write_strategy or choose_write_strategy(fs)
        if strategy not in WRITE_STRATEGIES:
            raise ValueError(f"unknown write strategy {strategy!r}")
        self.write_strategy: WriteStrategy = strategy
        self.conditional_create = has_conditional_create(fs)
        self.process_local = "memory" in _protocols(fs)

    def target(self, path: str) -> tuple[str, ...]:
        return (type(self).__name__, self.describe(path.lstrip("/").split("/", 1)[0]))

    def describe(self, path: str) -> str:
        return super().describe(path.removeprefix("/") if self.label == "memory://" else path)

    def open_atomic(self, path: str) -> AtomicWriter:
        if self.write_strategy == "deferred":
            return _DeferredWriter(self, path)
        return _MoveWriter(self, path)

    def size(self, path: str) -> int:
        with errors_as(self, path, "stat"):
            return int(self.fs.size(path))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        with errors_as(self, path, "read"):
            data: bytes = self.fs.cat_file(path, start=start, end=start + length)
            return data

    def open_read(self, path: str) -> ReadHandle:
        """The file opened once: on ``memory://`` a snapshot of its bytes (a file moved over
        ``path`` meanwhile is a new object; the old one is not changed), elsewhere the
        filesystem's file object, as pinned as the backend makes it (see docs/PROTOCOL.md).
        """
        return _FsspecHandle(self, path)

    def exists(self, path: str) -> bool:
        with errors_as(self, path, "stat"):
            return bool(self.fs.exists(path))

    def delete(self, path: str) -> None:
        with errors_as(self, path, "delete"), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def read_marker(self, path: str, limit: int) -> bytes | None:
        try:
            with errors_as(self, path, "read"):
                data: bytes = self.fs.cat_file(path, start=0, end=limit + 1)
        except CheckpointNotFoundError:
            return None
        if len(data) > limit:
            raise FormatError(f"{self.describe(path)}: larger than {limit} bytes")
        return data

    def write_marker(self, path: str, data: bytes, replacing: str | None = None) -> str:
        if replacing is not None:
            self._check_marker_tag(path, replacing)
        self._makedirs_for(path)
        with errors_as(self, path, "write"):
            self.fs.pipe_file(path, data)  # one request; no temp file, no move
        return content_tag(data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        # The process-wide lock and the existence check make this exact between threads
        # (memory://, whose "create" mode is itself a check-then-write); the conditional
        # write makes it exact between processes where the backend has one.
        with create_lock:
            if self.exists(path):
                raise ConflictError(f"{self.describe(path)} already exists")
            if self.conditional_create and self._pipe_create(path, data):
                return
            self.write_bytes(path, data)

    def _pipe_create(self, path: str, data: bytes) -> bool:
        """Try the conditional write; False (and never again) where it is unsupported."""
        self._makedirs_for(path)
        try:
            with errors_as(self, path, "create"):
                try:
                    self.fs.pipe_file(path, data, mode="create")
                except FileExistsError:  # gcsfs: HTTP 412, another writer created it first
                    raise ConflictError(f"{self.describe(path)} already exists") from None
        except _UNSUPPORTED as exc:
            self.conditional_create = False
            if first_time(_warned, type(self.fs)):
                log.warning(
                    "%s has no conditional create (pipe_file(mode='create') raised %s: %s): "
                    "exclusive creates there are exact only between threads of one process; "
                    "two processes committing one step at once could both succeed (see "
                    "docs/PROTOCOL.md)",
                    type(self.fs).__name__,
                    type(exc).__name__,
                    exc,
                )
            return False
        return True

    def _makedirs_for(self, path: str) -> None:
        parent = path.rpartition("/")[0]
        if parent:
            with errors_as(self, path, "create"):
                self.fs.makedirs(parent, exist_ok=True)

    def list_dir(self, path: str) -> list[str]:
        with errors_as(self, path, "list"):
            entries = self._ls(path)
        prefix = path.rstrip("/") + "/"
        names = {e.rstrip("/").split("/")[-1] for e in entries if e.rstrip("/") != path}
        return sorted(n for n in names if n and f"{prefix}{n}" != prefix)

    def _ls(self, path: str) -> list[str]:
        # fsspec's in-memory filesystem lists by walking a dict that other threads change
        # (a temp file renamed away mid-listing): a KeyError or RuntimeError there means
        # "list again", not a failure.
        for attempt in range(_LIST_ATTEMPTS):
            try:
                return list(self.fs.ls(path, detail=False))
            except FileNotFoundError:
                return []
            except (KeyError, RuntimeError):
                if attempt == _LIST_ATTEMPTS - 1:
                    raise
        return []

    def delete_tree(self, path: str) -> None:
        with errors_as(self, path, "delete"), contextlib.suppress(FileNotFoundError):
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)


def is_http(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is fsspec's HTTP filesystem (``http://``, ``https://``).

    Example:
        >>> import fsspec
        >>> is_http(fsspec.filesystem("memory"))
        False
    """
    return bool({"http", "https"} & set(_protocols(fs)))


class HttpStorage(FsspecStorage):
    """A web server through fsspec's ``http(s)://`` filesystem: a read-only store.

    Files load by ranged GETs (a presigned S3 URL, a model hub, any server that answers
    ``Range``). Nothing is ever written, moved or deleted: HTTP has no atomic write, and
    fsspec would turn one into a PUT or POST that a server may take as anything. Paths are
    whole URLs (fsspec keeps the scheme and host in them), so there is no label.

    Example:
        >>> import fsspec
        >>> storage = HttpStorage(fsspec.filesystem("http"))
        >>> storage.describe("http://127.0.0.1:8000/x.ackpt")
        'http://127.0.0.1:8000/x.ackpt'
        >>> storage.check_writable("http://127.0.0.1:8000/x.ackpt")
        Traceback (most recent call last):
        asyncckpt.errors.StorageError: http://127.0.0.1:8000/x.ackpt: http(s):// URLs are ...
    """

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        super().__init__(fs, "move")
        self.label = ""

    def describe(self, path: str) -> str:
        return path

    def check_writable(self, path: str) -> NoReturn:
        """Raise the error every write, commit or delete gets here."""
        raise StorageError(
            f"{self.describe(path)}: http(s):// URLs are read-only: asyncckpt loads from "
            "them but cannot save, commit or delete there. Save to a local path or s3:// "
            "and serve that."
        )

    def no_ranges(self, path: str) -> StorageError:
        """The error for a server that answers a ranged GET with the whole file."""
        return StorageError(
            f"{self.describe(path)}: the server does not answer HTTP range requests (it "
            "sent the whole file); a load reads a file in parts. Serve it from one that "
            "does (web servers, S3 presigned URLs and the Hugging Face Hub do)."
        )

    def read_range(self, path: str, start: int, length: int) -> bytes:
        data = super().read_range(path, start, length)
        if len(data) > length:  # fsspec returns whatever body came back
            raise self.no_ranges(path)
        return data

    def open_read(self, path: str) -> ReadHandle:
        return _HttpHandle(self, path)

    def _read_only(self, path: str, *args: Any, **kwargs: Any) -> NoReturn:
        self.check_writable(path)

    open_atomic = delete = create_exclusive = delete_tree = write_marker = replace_if = _read_only


#: Serializes seek-then-read on file objects that cannot read a range by themselves: the
#: object may be shared (``memory://`` hands every opener the same one).
_seek_lock = threading.Lock()


class _FsspecHandle(ReadHandle):
    """One fsspec file object for the handle's life, read the cheapest way it offers: a
    snapshot (``memory://``), its own ranged fetch (fsspec's buffered files: no shared
    position, so reads run in parallel), else seek and read under a lock."""

    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self.storage, self.path = storage, path
        self._snapshot: memoryview | None = None
        with errors_as(storage, path, "open"):
            self.file = storage.fs.open(path, "rb")
        try:
            with errors_as(storage, path, "read"):
                size = self._measure()
        except BaseException:
            self.close()
            raise
        super().__init__(storage.describe(path), size)

    def _measure(self) -> int:
        if isinstance(self.file, io.BytesIO):
            # memory://: its bytes, never copied. A file moved over the path is a new
            # object, so this one keeps the version opened (getvalue() would share the
            # buffer too, but make the next getbuffer(), used by its size, copy it).
            self._snapshot = self.file.getbuffer()
            return len(self._snapshot)
        size = getattr(self.file, "size", None)
        if type(size) is int:
            return size
        with _seek_lock:
            return int(self.file.seek(0, io.SEEK_END))

    def read_range(self, start: int, length: int) -> bytes:
        if self._snapshot is not None:
            return bytes(self._snapshot[start : start + max(0, length)])
        length = max(0, min(length, self.size - start))
        if not length:
            return b""
        with errors_as(self.storage, self.path, "read"):
            if isinstance(self.file, AbstractBufferedFile):
                data: bytes = self.file._fetch_range(start, start + length)
                return data
            with _seek_lock:
                self.file.seek(start)
                return bytes(self.file.read(length))

    def read_into(self, start: int, out: memoryview) -> int:
        if self._snapshot is None:
            return super().read_into(start, out)
        part = self._snapshot[start : start + len(out)]
        out[: len(part)] = part
        return len(part)

    def close(self) -> None:
        if self._snapshot is not None:
            with contextlib.suppress(BufferError):  # let the file object be resized again
                self._snapshot.release()
            self._snapshot = None
        with contextlib.suppress(Exception):
            self.file.close()


class _HttpHandle(_FsspecHandle):
    """A URL opened once, whose server must answer ranged GETs."""

    storage: HttpStorage

    def read_range(self, start: int, length: int) -> bytes:
        try:
            return super().read_range(start, length)
        except ValueError as exc:  # fsspec's HTTPFile: a 200 with the whole file, past 0
            raise self.storage.no_ranges(self.path) from exc


def _discard(file: Any) -> None:
    """Throw away a file opened for writing without publishing it; never raises."""
    with contextlib.suppress(Exception):
        discard = getattr(file, "discard", None)
        if discard is not None:
            discard()
    # A buffered file that is garbage-collected unclosed is closed by its finalizer, which
    # flushes (and with autocommit, publishes) what it holds; mark it closed so it cannot.
    with contextlib.suppress(Exception):
        if isinstance(file, AbstractBufferedFile):
            file.closed = True


class _FsspecWriter(AtomicWriter):
    """A file of the filesystem opened for writing at ``at`` on behalf of ``target``."""

    def __init__(self, storage: FsspecStorage, target: str, at: str, **how: Any) -> None:
        self.storage, self.target, self.at = storage, target, at
        storage._makedirs_for(target)
        with errors_as(storage, target, "create"):
            self.file = storage.fs.open(at, "wb", **how)

    def write(self, data: bytes | memoryview) -> None:
        with errors_as(self.storage, self.at, "write"):
            self.file.write(data)


class _DeferredWriter(_FsspecWriter):
    """Write at the final path with ``autocommit=False``; ``commit()`` publishes."""

    def __init__(self, storage: FsspecStorage, target: str) -> None:
        self.done = False
        super().__init__(storage, target, target, autocommit=False)

    def commit(self) -> None:
        try:
            with errors_as(self.storage, self.target, "commit"):
                self.file.close()  # uploads what is buffered; publishes nothing yet
                with self.publishing():
                    self.file.commit()
            self.done = True
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if not self.done:
            self.done = True
            _discard(self.file)


class _MoveWriter(_FsspecWriter):
    """Write a temp file beside the target, then move it over the target."""

    def __init__(self, storage: FsspecStorage, target: str) -> None:
        self.temp = temp_name(target)
        super().__init__(storage, target, self.temp)

    def commit(self) -> None:
        try:
            with errors_as(self.storage, self.target, "commit"):
                self.file.close()
                with self.publishing():
                    self.storage.fs.mv(self.temp, self.target)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.file.close()
        with contextlib.suppress(Exception):
            self.storage.fs.rm_file(self.temp)
