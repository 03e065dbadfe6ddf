"""Storage: a small interface over an fsspec filesystem, with atomic writes.

URLs are resolved here and nowhere else (:func:`resolve`). Two strategies implement the
interface:

* :class:`LocalStorage` — local disk through the OS: write to a temp file beside the target,
  fsync it, rename it over the target, fsync the directory. A reader sees the old file or the
  new one; a crash leaves at most a temp file, which is removed on the next failure or by
  ``Checkpointer`` clean-up, never a partial target.
* :class:`FsspecStorage` — any other fsspec filesystem (``memory://`` and friends): the same
  temp-then-move sequence through fsspec calls.
* :class:`~asyncckpt.objectstore.ObjectStorage` — object stores (``s3://``): no renames; data
  at its final key through a single PUT or a multipart upload, conditional creates.

Every backend error surfaces as :class:`~asyncckpt.errors.StorageError` (or
:class:`~asyncckpt.errors.CheckpointNotFoundError`) chained with ``from``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from . import config
from .errors import CheckpointNotFoundError, ConflictError, FormatError, StorageError

TEMP_MARK = ".acktmp-"
#: The storage option that lets an object store without conditional writes be used anyway.
UNSAFE_UNCONDITIONAL_WRITES = "unsafe_unconditional_writes"
_MAX_TAGGED_BYTES = 1 << 20


def temp_name(path: str) -> str:
    """A unique sibling of ``path`` that readers and listings recognise as temporary."""
    head, tail = os.path.split(path)
    return os.path.join(head, f"{tail}{TEMP_MARK}{uuid.uuid4().hex[:12]}")


def is_temp_name(path: str) -> bool:
    """Whether ``path`` is a temp file left by an unfinished write."""
    return TEMP_MARK in os.path.basename(path)


class AtomicWriter(ABC):
    """A file being written; it appears at its target only when :meth:`commit` succeeds."""

    @abstractmethod
    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``."""

    @abstractmethod
    def commit(self) -> None:
        """Make the file durable and visible at its target, atomically."""

    @abstractmethod
    def abort(self) -> None:
        """Discard everything written; never raises."""


class Storage(ABC):
    """Where checkpoint files live. Paths are the backend's own (no scheme)."""

    #: Human-readable location prefix for messages (e.g. ``memory://``); never credentials.
    label: str = ""

    def describe(self, path: str) -> str:
        """``path`` as a user would write it, for error messages."""
        return f"{self.label}{path}"

    @contextlib.contextmanager
    def atomic_write(self, path: str) -> Iterator[AtomicWriter]:
        """Context manager: commit on normal exit, abort (and re-raise) on any exception."""
        writer = self.open_atomic(path)
        try:
            yield writer
        except BaseException:
            writer.abort()
            raise
        writer.commit()

    def write_bytes(self, path: str, data: bytes) -> None:
        """Atomically replace ``path`` with ``data``."""
        with self.atomic_write(path) as w:
            w.write(data)

    @abstractmethod
    def open_atomic(self, path: str) -> AtomicWriter: ...

    @abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes; raises CheckpointNotFoundError when missing."""

    @abstractmethod
    def read_range(self, path: str, start: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``start`` (fewer only if the file is shorter)."""

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        """Fill ``out`` from ``start``; returns the number of bytes read."""
        data = self.read_range(path, start, len(out))
        out[: len(data)] = data
        return len(data)

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove a file; a missing file is not an error."""

    @abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create ``path`` holding ``data`` durably, only if it does not exist yet.

        Raises:
            ConflictError: ``path`` already exists (someone else created it first).
        """

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) of the entries directly under ``path``; [] if it is missing."""

    @abstractmethod
    def delete_tree(self, path: str) -> None:
        """Remove ``path`` and everything below it; a missing path is not an error."""

    def read_bytes(self, path: str, limit: int) -> bytes:
        """The whole of a small file.

        Raises:
            CheckpointNotFoundError: the file is missing.
            FormatError: the file is larger than ``limit`` bytes.
        """
        size = self.size(path)
        if size > limit:
            raise FormatError(f"{self.describe(path)}: {size} bytes, expected at most {limit}")
        return self.read_range(path, 0, size)

    def join(self, *parts: str) -> str:
        """Join path parts with ``/``."""
        return "/".join(p.rstrip("/") for p in parts if p)

    # -- compare-and-swap of small files (the version file) ----------------------------------

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str] | None:
        """A small file's bytes and a tag that changes whenever the file is replaced.

        Returns:
            None when the file does not exist.
        """
        try:
            data = self.read_bytes(path, limit)
        except CheckpointNotFoundError:
            return None
        return data, content_tag(data)

    def replace_if(self, path: str, data: bytes, tag: str | None) -> str:
        """Atomically replace ``path`` with ``data`` only if its tag is still ``tag``.

        ``tag=None`` means "only if ``path`` does not exist". This default serialises callers
        with a process-wide lock: exact for in-process filesystems (``memory://``) and best
        effort for others; local disk and object stores override it with real fences.

        Returns:
            The new tag.

        Raises:
            ConflictError: the file's tag is not ``tag`` (someone else replaced it).
        """
        with _create_lock:
            self._check_tag(path, tag)
            self.write_bytes(path, data)
        return content_tag(data)

    def _check_tag(self, path: str, tag: str | None) -> None:
        found = self.read_tagged(path, _MAX_TAGGED_BYTES)
        current = None if found is None else found[1]
        if current != tag:
            raise ConflictError(
                f"{self.describe(path)} was replaced by another writer (expected "
                f"{tag or 'no file'}, found {current or 'no file'})"
            )


def content_tag(data: bytes) -> str:
    """The tag of a file's content where the store has no ETag of its own.

    Example:
        >>> content_tag(b"x")[:8]
        '2d711642'
    """
    return hashlib.sha256(data).hexdigest()[:32]


class LocalStorage(Storage):
    """Local disk through the OS, with fsync discipline."""

    label = ""

    def open_atomic(self, path: str) -> AtomicWriter:
        return _LocalWriter(path)

    def size(self, path: str) -> int:
        with _errors(self, path, "stat"):
            return os.stat(path).st_size

    def read_range(self, path: str, start: int, length: int) -> bytes:
        with _errors(self, path, "read"):
            fd = os.open(path, os.O_RDONLY)
            try:
                return os.pread(fd, length, start)
            finally:
                os.close(fd)

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        with _errors(self, path, "read"):
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
        with _errors(self, path, "delete"), contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def create_exclusive(self, path: str, data: bytes) -> None:
        # Write a complete temp file, then hard-link it to the target: link() fails if the
        # target exists, so the target appears whole, once, or not at all.
        writer = _LocalWriter(path)
        try:
            writer.write(data)
            with _errors(self, path, "create"):
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
        with _errors(self, path, "list"):
            try:
                return sorted(os.listdir(path))
            except (FileNotFoundError, NotADirectoryError):
                return []

    def delete_tree(self, path: str) -> None:
        with _errors(self, path, "delete"), contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path)
            fsync_dir(os.path.dirname(path) or ".")

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def replace_if(self, path: str, data: bytes, tag: str | None) -> str:
        # The lock file excludes every process that uses this protocol on this machine (and
        # on NFS/Lustre only where flock is coherent across clients; see docs/PROTOCOL.md).
        with _errors(self, path, "lock"):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with _flocked(self, f"{path}.lock"):
            self._check_tag(path, tag)
            self.write_bytes(path, data)
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
    with _errors(storage, lock_path, "lock"):
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
        with _errors(LocalStorage(), target, "create"):
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            self.file: BinaryIO = open(self.temp, "xb", buffering=0)  # noqa: SIM115

    def write(self, data: bytes | memoryview) -> None:
        with _errors(LocalStorage(), self.temp, "write"):
            view = memoryview(data)
            while view:
                n = self.file.write(view)
                view = view[n or 0 :]

    def commit(self) -> None:
        try:
            with _errors(LocalStorage(), self.target, "commit"):
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
        with _errors(self, path, "stat"):
            return int(self.fs.size(path))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        with _errors(self, path, "read"):
            data: bytes = self.fs.cat_file(path, start=start, end=start + length)
            return data

    def exists(self, path: str) -> bool:
        with _errors(self, path, "stat"):
            return bool(self.fs.exists(path))

    def delete(self, path: str) -> None:
        with _errors(self, path, "delete"), contextlib.suppress(FileNotFoundError):
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
        with _errors(self, path, "list"):
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
        prefix = path.rstrip("/") + "/"
        names = {e.rstrip("/").split("/")[-1] for e in entries if e.rstrip("/") != path}
        return sorted(n for n in names if n and f"{prefix}{n}" != prefix)

    def delete_tree(self, path: str) -> None:
        with _errors(self, path, "delete"), contextlib.suppress(FileNotFoundError):
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)


_create_lock = threading.Lock()


class _FsspecWriter(AtomicWriter):
    def __init__(self, storage: FsspecStorage, target: str) -> None:
        self.storage = storage
        self.target = target
        self.temp = temp_name(target)
        with _errors(storage, target, "create"):
            parent = target.rsplit("/", 1)[0] if "/" in target else ""
            if parent:
                storage.fs.makedirs(parent, exist_ok=True)
            self.file = storage.fs.open(self.temp, "wb")

    def write(self, data: bytes | memoryview) -> None:
        with _errors(self.storage, self.temp, "write"):
            self.file.write(data)

    def commit(self) -> None:
        try:
            with _errors(self.storage, self.target, "commit"):
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


@contextlib.contextmanager
def _errors(storage: Storage, path: str, action: str) -> Iterator[None]:
    """Translate backend exceptions into asyncckpt errors naming the file."""
    try:
        yield
    except (CheckpointNotFoundError, StorageError):
        raise
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{storage.describe(path)}: no such file") from exc
    except OSError as exc:
        raise StorageError(
            f"{storage.describe(path)}: {action} failed: {exc.strerror or exc}"
        ) from exc


def resolve(
    f: str | os.PathLike[str], storage_options: dict[str, Any] | None
) -> tuple[Storage, str]:
    """Turn a user's path, PathLike or fsspec URL into ``(storage, path)``.

    Args:
        f: a local path, ``os.PathLike``, or URL such as ``memory://ckpt/x`` or ``file:///x``.
        storage_options: keyword arguments for the fsspec filesystem (e.g. an endpoint).

    Returns:
        The storage backend and the path within it.

    Raises:
        TypeError: ``f`` is not a path or URL (file objects are not supported).
        StorageError: the URL's filesystem cannot be created (e.g. a missing extra).
    """
    if isinstance(f, os.PathLike):
        f = os.fspath(f)
    if not isinstance(f, str):
        raise TypeError(
            f"expected a path, os.PathLike or fsspec URL, got {type(f).__qualname__}; "
            "file objects are not supported because writes must be atomic"
        )
    if "://" not in f:
        return LocalStorage(), os.path.abspath(f)
    from .objectstore import ObjectStorage, is_object_store, prepare_options

    options = dict(storage_options or {})
    unsafe = bool(options.pop(UNSAFE_UNCONDITIONAL_WRITES, False))
    try:
        fs, path = fsspec.core.url_to_fs(f, **prepare_options(f, options))
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot open {f.split('://')[0]}:// storage: {exc}") from exc
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(), os.path.abspath(path)
    if is_object_store(fs):  # s3:// (and wrappers of it): no renames, see objectstore.py
        label = f[: f.rindex("://") + 3]
        return ObjectStorage(fs, label=label, allow_unconditional=unsafe), path
    return FsspecStorage(fs), path


# Test and simulation filesystems from asyncckpt.testing (imported only when used):
# ``faulty::<url>`` injects faults, latency and bandwidth limits into any filesystem, and
# ``s3mem://`` serves the S3 API from memory.
for _name, _cls in (("faulty", "FaultyFileSystem"), ("s3mem", "MemoryS3FileSystem")):
    with contextlib.suppress(ValueError):
        fsspec.register_implementation(_name, f"asyncckpt.testing.{_cls}")
