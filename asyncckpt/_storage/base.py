"""The storage interface: what every backend provides, and the helpers they share."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from asyncckpt._threads import after_fork_in_child
from asyncckpt.errors import CheckpointNotFoundError, ConflictError, FormatError, StorageError

TEMP_MARK = ".acktmp-"
#: The storage option that lets an object store without conditional writes be used anyway.
UNSAFE_UNCONDITIONAL_WRITES = "unsafe_unconditional_writes"
#: What a compare-and-swap reads back at most; its records (VERSION, markers) are far smaller.
MAX_TAGGED_BYTES = 1 << 20
_WRITE_ATTEMPTS = 3

#: Entered around the step that makes a written file visible at its target (the rename, the
#: final PUT or CompleteMultipartUpload); raising there aborts the write and leaves the
#: target alone. Drop-in saves set one (``asyncckpt._versions.pending``) to check their save marker.
PublishGuard = Callable[[], AbstractContextManager[None]]


def temp_name(path: str) -> str:
    """A unique sibling of ``path`` that readers and listings recognise as temporary."""
    head, tail = os.path.split(path)
    return os.path.join(head, f"{tail}{TEMP_MARK}{uuid.uuid4().hex[:12]}")


def is_temp_name(path: str) -> bool:
    """Whether ``path`` is a temp file left by an unfinished write."""
    return TEMP_MARK in os.path.basename(path)


class AtomicWriter(ABC):
    """A file being written; it appears at its target only when :meth:`commit` succeeds."""

    #: Local files: after every this many bytes written the kernel is asked to start
    #: writing them to disk (``writeback_mib``); 0: only the commit's fsync does. A save
    #: sets it from the tunables it resolved when it started; other backends ignore it.
    writeback_bytes: int = 0
    #: Checked around the publishing step by :meth:`commit` (see :data:`PublishGuard`).
    publish_guard: PublishGuard | None = None

    def publishing(self) -> AbstractContextManager[None]:
        """The context :meth:`commit` makes the file visible in: the guard's, if one is set."""
        return contextlib.nullcontext() if self.publish_guard is None else self.publish_guard()

    @abstractmethod
    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``."""

    @abstractmethod
    def commit(self) -> None:
        """Make the file durable and visible at its target, atomically."""

    @abstractmethod
    def abort(self) -> None:
        """Discard everything written; never raises."""


class ReadHandle(ABC):
    """One file opened for reading: every read sees the same version of the file.

    A load reads a file's header, footer, manifest and chunks through one handle, so a file
    replaced meanwhile (an atomic ``save`` by another process) cannot give it the manifest
    of one version and the chunks of another. How the version is pinned is the backend's:
    an open descriptor (local disk), a snapshot (``memory://``), the ETag of the object
    (object stores, where a read of a replaced object raises
    :class:`~asyncckpt.errors.FileReplacedError`). Reads may run in parallel threads.
    Close it (or use it as a context manager) when done; closing twice is harmless.

    Attributes:
        name: the file as a user would write it (for messages).
        size: its size in bytes, of the pinned version.
    """

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size

    @abstractmethod
    def read_range(self, start: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``start`` (fewer only past the end of the file).

        Raises:
            FileReplacedError: the file is no longer the version this handle pinned and the
                backend cannot read that one any more.
            StorageError: the backend failed.
        """

    def read_into(self, start: int, out: memoryview) -> int:
        """Fill ``out`` from ``start``; returns the number of bytes read."""
        data = self.read_range(start, len(out))
        out[: len(data)] = data
        return len(data)

    def read_ranges(self, spans: list[tuple[int, int]]) -> list[bytes]:
        """:meth:`read_range` of each ``(start, length)``, in order. Backends where a read is
        a round trip send them at once (an object store: one round trip, not one each)."""
        return [self.read_range(start, length) for start, length in spans]

    def close(self) -> None:  # noqa: B027 (a handle that holds nothing has nothing to do)
        """Release what the handle holds (a descriptor, a snapshot); idempotent."""

    def __enter__(self) -> ReadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _PathHandle(ReadHandle):
    """A handle that reads by path each time: for storages without a way to pin a file."""

    def __init__(self, storage: Storage, path: str) -> None:
        super().__init__(storage.describe(path), storage.size(path))
        self.storage, self.path = storage, path

    def read_range(self, start: int, length: int) -> bytes:
        return self.storage.read_range(self.path, start, length)

    def read_into(self, start: int, out: memoryview) -> int:
        return self.storage.read_into(self.path, start, out)


class Storage(ABC):
    """Where checkpoint files live. Paths are the backend's own (no scheme)."""

    #: Human-readable location prefix for messages (e.g. ``memory://``); never credentials.
    label: str = ""
    #: The files live in this process's memory (``memory://``, a caller's file object):
    #: another process cannot write them, so a writer process leaves them to threads.
    process_local: bool = False
    #: Paths are this machine's file names: ``os`` calls (and libraries that open files by
    #: name, such as safetensors) work on them directly.
    local_paths: bool = False
    #: A path that holds bytes is a file, never a folder (an object store's key): then
    #: ``asyncckpt.load`` names a file by its size, one request, before listing anything.
    sized_paths_are_files: bool = False

    def describe(self, path: str) -> str:
        """``path`` as a user would write it, for error messages."""
        return f"{self.label}{path}"

    def file_key(self, path: str) -> tuple[str, str]:
        """Names the file ``path`` across every storage object of this process: in-process
        bookkeeping (saves in flight, markers) keys on it."""
        return (type(self).__name__, self.describe(path))

    def target(self, path: str) -> tuple[str, ...]:
        """Which device or store ``path`` is on (a local disk, a bucket, a filesystem's top
        directory): what is learned about writing to one (``compression="auto"``'s
        measurements) holds for every file on it."""
        return (type(self).__name__,)

    def on_local_disk(self, path: str) -> bool:
        """Whether ``path`` is a file on a disk of this machine, not on a network filesystem
        or a remote store (compressing pays less there)."""
        return False

    def check_writable(self, path: str) -> None:
        """Raise :class:`StorageError` if ``path`` can never be written: a read-only store
        (``http(s)://``), whose writes, commits and deletes all raise it, or a local
        directory. A save asks before it starts, so it fails at once, not at ``result()``."""
        del path

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

    def size_or_none(self, path: str) -> int | None:
        """:meth:`size`, or None when ``path`` is missing (a backend may then skip what
        :meth:`size` does to say why, such as asking whether the bucket exists)."""
        try:
            return self.size(path)
        except CheckpointNotFoundError:
            return None

    @abstractmethod
    def read_range(self, path: str, start: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``start`` (fewer only if the file is shorter)."""

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        """Fill ``out`` from ``start``; returns the number of bytes read."""
        data = self.read_range(path, start, len(out))
        out[: len(data)] = data
        return len(data)

    def open_read(self, path: str) -> ReadHandle:
        """Open ``path`` for reading, pinned to its current version (see :class:`ReadHandle`).

        This default reads by path every time, pinning nothing: backends override it.

        Raises:
            CheckpointNotFoundError: the file is missing.
        """
        return _PathHandle(self, path)

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove a file; a missing file is not an error."""

    def abort_unfinished(self, path: str, *, exact: bool = False) -> None:
        """Abort unfinished writes below directory ``path`` (with ``exact``, of the file
        ``path`` itself) that a killed writer left and a listing does not show (multipart
        uploads); elsewhere they show as temp files, so this does nothing."""
        del path, exact

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
        """Remove ``path`` and everything below it; a missing path is not an error.

        A ``path`` that is a symbolic link is removed as a link: deleting never follows one.
        """

    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link (only local disk has them): whoever deletes
        inside a directory asks first, as deleting through one would delete another run's files.
        """
        del path
        return False

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
        return "/".join(p.rstrip("/") for p in parts if p)

    # -- save markers (asyncckpt._versions.pending): small files rewritten in place -------

    def read_marker(self, path: str, limit: int) -> bytes | None:
        """A small file's bytes, in one request where the backend allows; None if missing.

        Raises:
            FormatError: the file is larger than ``limit`` bytes.
        """
        try:
            return self.read_bytes(path, limit)
        except CheckpointNotFoundError:
            return None

    def write_marker(self, path: str, data: bytes, replacing: str | None = None) -> str:
        """Write a small file directly at ``path`` (no temp file, no rename, no fsync);
        return its new tag.

        Cheap enough for the caller's stall, and not atomic: a reader may see the file
        empty or cut short meanwhile (markers are read as "being rewritten" then).

        Args:
            replacing: the tag this call returned when it last wrote ``path``: write only if
                the file still has it. Object stores make the PUT conditional on it
                (``If-Match``); elsewhere the file is read and compared first, which is
                exact only while the caller holds :meth:`marker_lock`.

        Raises:
            ConflictError: ``replacing`` was given and the file no longer has it.
        """
        if replacing is not None:
            self._check_marker_tag(path, replacing)
        self.write_bytes(path, data)
        return content_tag(data)

    def _check_marker_tag(self, path: str, tag: str) -> None:
        current = self.read_marker(path, MAX_TAGGED_BYTES)
        if current is None or content_tag(current) != tag:
            raise ConflictError(f"{self.describe(path)} was replaced or removed by another writer")

    def marker_lock(self, path: str) -> AbstractContextManager[None]:
        """Exclude every other marker update (write, check, delete) of ``path``.

        Local disk: an ``flock`` on the parent directory, which excludes the processes of
        this machine (and of an NFS or Lustre client only where flock is coherent there).
        Elsewhere there is no cross-process lock: a lock within this process only.
        """
        return process_lock(self, path)

    # -- compare-and-swap of small files (the version file) ----------------------------------

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str] | None:
        """A small file's bytes and a tag that changes whenever the file is replaced; None
        when the file does not exist."""
        try:
            data = self.read_bytes(path, limit)
        except CheckpointNotFoundError:
            return None
        return data, content_tag(data)

    def replace_if(self, path: str, data: bytes, tag: str | None) -> str:
        """Atomically replace ``path`` with ``data`` only if its tag is still ``tag``; return
        the new tag.

        ``tag=None`` means "only if ``path`` does not exist". This default serialises callers
        with a process-wide lock: exact for in-process filesystems (``memory://``) and best
        effort for others; local disk and object stores override it with real fences.

        Raises:
            ConflictError: the file's tag is not ``tag`` (someone else replaced it).
        """
        with create_lock:
            self._check_tag(path, tag)
            self._write_under_lock(path, data)
        return content_tag(data)

    def _write_under_lock(self, path: str, data: bytes) -> None:
        """``write_bytes``, again if another writer's clean-up of leftover temp files
        deleted its temp file mid-write (no other compare-and-swap runs: the caller holds
        the lock)."""
        for attempt in range(_WRITE_ATTEMPTS):
            try:
                self.write_bytes(path, data)
                return
            except CheckpointNotFoundError:
                if attempt == _WRITE_ATTEMPTS - 1:
                    raise

    def _check_tag(self, path: str, tag: str | None) -> None:
        found = self.read_tagged(path, MAX_TAGGED_BYTES)
        current = None if found is None else found[1]
        if current != tag:
            raise ConflictError(
                f"{self.describe(path)} was replaced by another writer (expected "
                f"{tag or 'no file'}, found {current or 'no file'})"
            )


create_lock = threading.Lock()
_warned_lock = threading.Lock()
_marker_locks_lock = threading.Lock()
_marker_locks: dict[tuple[str, str], threading.Lock] = {}


@contextlib.contextmanager
def process_lock(storage: Storage, path: str) -> Iterator[None]:
    """A lock of this process for one file (its entry stays: markers are few)."""
    with _marker_locks_lock:
        lock = _marker_locks.setdefault(storage.file_key(path), threading.Lock())
    with lock:
        yield


def first_time(seen: set[Any], key: Any) -> bool:
    """Add ``key`` to ``seen``; whether it was new (one warning per key, whichever thread
    warns first)."""
    with _warned_lock:
        if key in seen:
            return False
        seen.add(key)
        return True


@after_fork_in_child
def _free_create_lock() -> None:
    """In a forked child: a thread of the parent may have held a lock at the fork. It is
    released in place, not replaced: ``storage.fsspec_storage`` holds the same object."""
    for lock in (create_lock, _warned_lock):
        if lock.locked():
            lock.release()


def content_tag(data: bytes) -> str:
    """The tag of a file's content where the store has no ETag of its own.

    Example:
        >>> content_tag(b"x")[:8]
        '2d711642'
    """
    return hashlib.sha256(data).hexdigest()[:32]


#: Packages of the HTTP clients under fsspec filesystems. Some filesystems let their errors
#: through unconverted (``hf://`` raises httpx's on a refused connection, ``http://``
#: aiohttp's on a dropped one): they are the backend failing, as an ``OSError`` is.
_TRANSPORT_PACKAGES = frozenset(
    {
        "aiohttp",
        "httpcore",
        "httpcore2",
        "httpx",
        "httpx2",
        "huggingface_hub",
        "requests",
        "urllib3",
    }
)


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from an HTTP client library (by the package of its class).

    Matched by name, not by ``isinstance``: importing every client to get its classes would
    cost each process that never uses them.

    Example:
        >>> is_transport_error(ValueError("bad")), is_transport_error(OSError())
        (False, False)
    """
    return any(cls.__module__.partition(".")[0] in _TRANSPORT_PACKAGES for cls in type(exc).__mro__)


@contextlib.contextmanager
def errors_as(storage: Storage, path: str, action: str) -> Iterator[None]:
    """Translate backend exceptions (``OSError``, an HTTP client's) into asyncckpt errors
    naming the file."""
    try:
        yield
    except (CheckpointNotFoundError, StorageError):
        raise
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{storage.describe(path)}: no such file") from exc
    except OSError as exc:
        err = StorageError(f"{storage.describe(path)}: {action} failed: {exc.strerror or exc}")
        err.errno = exc.errno
        raise err from exc
    except Exception as exc:
        if not is_transport_error(exc):
            raise
        raise StorageError(
            f"{storage.describe(path)}: {action} failed: {type(exc).__name__}: {exc}"
        ) from exc
