"""The storage interface: what every backend provides, and the helpers they share.

A :class:`Storage` is a small interface over one filesystem, with paths in the backend's own
form (no scheme). Backends live beside this module (``local``, ``generic``,
``objectstore``); :func:`asyncckpt.storage.resolve` picks one for a URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator

from ..errors import CheckpointNotFoundError, ConflictError, FormatError, StorageError
from ..workers import after_fork_in_child

TEMP_MARK = ".acktmp-"
#: The storage option that lets an object store without conditional writes be used anyway.
UNSAFE_UNCONDITIONAL_WRITES = "unsafe_unconditional_writes"
_MAX_TAGGED_BYTES = 1 << 20
_WRITE_ATTEMPTS = 3


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
    #: The files live in this process's memory (``memory://``, a caller's file object):
    #: another process cannot write them, so a writer process leaves them to threads.
    process_local: bool = False

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

    def abort_unfinished(self, path: str) -> None:
        """Abort unfinished writes below directory ``path`` that a listing does not show
        (multipart uploads on an object store, which a killed writer can leave behind).

        Local and generic filesystems show such writes as temp files, so this does nothing.
        """
        del path

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
            self._write_under_lock(path, data)
        return content_tag(data)

    def _write_under_lock(self, path: str, data: bytes) -> None:
        """``write_bytes`` for a compare-and-swap, whose temp file another writer's clean-up
        of leftovers (``remove_temp_files``) may delete mid-write: then write it again.
        The caller holds the lock, so no other compare-and-swap runs meanwhile."""
        for attempt in range(_WRITE_ATTEMPTS):
            try:
                self.write_bytes(path, data)
                return
            except CheckpointNotFoundError:
                if attempt == _WRITE_ATTEMPTS - 1:
                    raise

    def _check_tag(self, path: str, tag: str | None) -> None:
        found = self.read_tagged(path, _MAX_TAGGED_BYTES)
        current = None if found is None else found[1]
        if current != tag:
            raise ConflictError(
                f"{self.describe(path)} was replaced by another writer (expected "
                f"{tag or 'no file'}, found {current or 'no file'})"
            )


_create_lock = threading.Lock()


@after_fork_in_child
def _free_create_lock() -> None:
    """In a forked child: a thread of the parent may have held the lock at the fork. It is
    released in place, not replaced: ``storage.generic`` holds the same object."""
    if _create_lock.locked():
        _create_lock.release()


def content_tag(data: bytes) -> str:
    """The tag of a file's content where the store has no ETag of its own.

    Example:
        >>> content_tag(b"x")[:8]
        '2d711642'
    """
    return hashlib.sha256(data).hexdigest()[:32]


@contextlib.contextmanager
def errors_as(storage: Storage, path: str, action: str) -> Iterator[None]:
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
