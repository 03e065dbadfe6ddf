"""An opened asyncckpt file: its footer and manifest read and validated, its handle pinned.

Every load opens its file once (:func:`open_file`), reads every chunk through that one
handle, and starts over if the file is replaced meanwhile
(:func:`~asyncckpt._engine.decode.read_file`); the memory it may allocate for decoded data
is a :class:`Budget` shared by every file of the load.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

from asyncckpt._format.container import (
    FOOTER_SIZE,
    HEADER_SIZE,
    MAX_EXPANSION,
    Manifest,
    decode_footer,
    decode_header,
    decode_manifest,
)
from asyncckpt._storage import ReadHandle, Storage
from asyncckpt.errors import FormatError, MemoryBudgetError, TruncatedFileError


@dataclass(frozen=True)
class OpenedFile:
    """A file whose footer and manifest have been read and validated, and the handle that
    pins it: every chunk of one load is read through ``handle``, from the same version.

    Close it when done (it is a context manager); a load closes it on every path.
    """

    storage: Storage
    path: str
    size: int
    manifest: Manifest
    handle: ReadHandle

    @property
    def name(self) -> str:
        return self.storage.describe(self.path)

    def read_into(self, start: int, out: memoryview) -> int:
        """Fill ``out`` from byte ``start`` of the pinned file; returns the bytes read."""
        return self.handle.read_into(start, out)

    def close(self) -> None:
        """Close the handle (idempotent)."""
        self.handle.close()

    def __enter__(self) -> OpenedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Bytes read from the end of a file to open it: the footer, and the manifest with it if it
#: fits (a manifest is about 200 bytes per tensor); a longer one is a read of its own.
TAIL_BYTES = 256 << 10


def open_file(storage: Storage, path: str) -> OpenedFile:
    """Open ``path`` (one handle, see :meth:`Storage.open_read`) and read and validate its
    header, footer and manifest; the caller closes it (``with open_file(...) as opened:``).

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        TruncatedFileError, FormatError: the file is not a complete asyncckpt file.
        FileReplacedError: the file was replaced between two of the reads (object stores).
    """
    handle = storage.open_read(path)
    name, size = storage.describe(path), handle.size
    try:
        if size < HEADER_SIZE + FOOTER_SIZE:
            raise TruncatedFileError(f"{name}: {size} bytes is too short for an asyncckpt file")
        # The header, and the footer with, in the same read, the manifest before it when it
        # fits in TAIL_BYTES; both sent at once (on an object store every read is a round
        # trip a restart waits for).
        at = max(HEADER_SIZE, size - TAIL_BYTES)
        header, tail = handle.read_ranges([(0, HEADER_SIZE), (at, size - at)])
        decode_header(header, name)
        footer = decode_footer(tail[-FOOTER_SIZE:], size, name)
        if footer.manifest_offset >= at:
            start = footer.manifest_offset - at
            body = tail[start : start + footer.manifest_length]
        else:
            body = handle.read_range(footer.manifest_offset, footer.manifest_length)
        manifest = decode_manifest(body, footer, name)
        if manifest.byteorder != sys.byteorder:
            raise FormatError(
                f"{name}: written on a {manifest.byteorder}-endian machine; this one is "
                f"{sys.byteorder}-endian and asyncckpt does not swap bytes"
            )
    except BaseException:
        handle.close()
        raise
    return OpenedFile(storage, path, size, manifest, handle)


def check_sizes(opened: OpenedFile) -> None:
    """Refuse a file whose chunks claim to decode to more than its size can justify: the
    consequence of the manifest's validation (docs/FORMAT.md §12), stated against the
    file's actual size, so that nothing is allocated from a manifest that contradicts it.

    Raises:
        FormatError: the storages' total exceeds ``MAX_EXPANSION`` times the file's size.

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt._storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"w": torch.zeros(1000)}, path).result()
        >>> with open_file(*resolve(path, None)) as opened:
        ...     check_sizes(opened)
    """
    total = sum(entry.nbytes for entry in opened.manifest.storages)
    if total > opened.size * MAX_EXPANSION:
        raise FormatError(
            f"{opened.name}: its storages claim {total} bytes, more than a file of "
            f"{opened.size} bytes can decode to"
        )


class Budget:
    """The memory one load may allocate for decoded data, over all the files it reads:
    ``max_bytes`` (that of ``load``), or None: no limit besides what the files' sizes bound.

    Raises:
        ValueError: ``max_bytes`` is not a non-negative integer.

    Example:
        >>> budget = Budget(100)
        >>> budget.charge("x.ackpt", 60, "its storages")
        >>> budget.charge("y.ackpt", 60, "its storages")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        asyncckpt.errors.MemoryBudgetError: y.ackpt: loading it needs 120 bytes for its ...
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative integer or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.used = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """For a reader pickled into another process: its lock is made again there."""
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def charge(self, name: str, nbytes: int, what: str) -> None:
        """Count ``nbytes`` about to be allocated for ``name``; refuse them past the limit.

        Raises:
            MemoryBudgetError: the load would then hold more than ``max_bytes``.
        """
        with self._lock:
            total = self.used + nbytes
            if self.max_bytes is not None and total > self.max_bytes:
                raise MemoryBudgetError(name, total, self.max_bytes, what)
            self.used = total
