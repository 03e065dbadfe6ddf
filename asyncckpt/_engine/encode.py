"""Encode a snapshot into one file: chunks compressed in parallel, written in order.

Runs on the background save thread, which writes finished chunks while a pool of threads
compresses and checksums the next ones (at most ``inflight_chunks`` wait in memory).

The writer may start before the snapshot is complete (see ``snapshot.snapshot``'s
``on_layout``): each chunk is handed to the encoders only once its bytes have landed in the
arena, and if the copy fails the file is aborted (the target is left untouched). With
``compression="auto"`` it also times its writes and encoders, for
:mod:`asyncckpt._engine.autocompress`.

Nothing here imports torch: the writer process runs this module without it (see
:mod:`asyncckpt._engine.writer_process`), reading staged bytes through :class:`StagedBytes`.
"""

from __future__ import annotations

import collections
import datetime
import functools
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncckpt import _cpu as cpu
from asyncckpt._engine import autocompress
from asyncckpt._engine.autocompress import AutoRun, AutoSettings
from asyncckpt._format.codec import EncodeReport, checksum, encode_chunk
from asyncckpt._format.container import (
    MAX_CHUNK_BYTES,
    ArrayEntry,
    Chunk,
    Manifest,
    StorageEntry,
    TensorEntry,
    encode_footer,
    encode_header,
    encode_manifest,
)
from asyncckpt._settings import Settings
from asyncckpt._storage import AtomicWriter, Storage
from asyncckpt._storage.base import PublishGuard
from asyncckpt._threads import pool
from asyncckpt._version import __version__
from asyncckpt.errors import AsyncCkptError

log = logging.getLogger(__name__)

#: Chunk lengths are multiples of this, so every element width divides them.
_CHUNK_ALIGN = 16

#: A chunk's bytes, the width of its elements, and whether they are floating point.
_Slice = tuple[memoryview, int, bool]

#: Consecutive small chunks are encoded and written together up to this many bytes; the
#: write joins their payloads while holding the GIL, so a batch stays well under a chunk.
_BATCH_BYTES = 4 << 20


class StagedBytes(Protocol):
    """One staged storage as the writer reads it: :class:`.snapshot.StagedStorage` (its
    fields are documented there), or the writer process's view of a shared arena."""

    @property
    def itemsize(self) -> int: ...

    @property
    def is_float(self) -> bool: ...

    @property
    def device(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    def view(self) -> memoryview: ...


class StagedState(Protocol):
    """A staged state as the writer reads it: :class:`.snapshot.Snapshot` (documented
    there), or the writer process's."""

    @property
    def root(self) -> Any: ...

    @property
    def tensors(self) -> Sequence[TensorEntry]: ...

    @property
    def arrays(self) -> Sequence[ArrayEntry]: ...

    @property
    def storages(self) -> Sequence[StagedBytes]: ...

    def wait_staged(self, index: int, end: int) -> None: ...

    def copied(self) -> bool: ...


def _torch_version() -> str:
    """The version of the torch that this process saves from (recorded in the manifest)."""
    torch = sys.modules.get("torch")
    return str(getattr(torch, "__version__", "")) if torch is not None else ""


@dataclass(frozen=True)
class WriteOptions:
    """One write's compression and the tunables of the save it belongs to.

    The tunables come from ``settings``, resolved once at the entry point that started the
    save (``asyncckpt.save``, a ``Checkpointer``, the DCP writer, the command line); the
    engine reads nothing from the environment. A writer process receives this object.

    Example:
        >>> WriteOptions("zstd", Settings.resolve(zstd_level=3)).settings.zstd_level
        3
    """

    compression: str
    settings: Settings
    #: CPU cores the rest of the machine left idle when the save started (None: unknown),
    #: for ``compression="auto"``.
    spare_cores: float | None = field(default_factory=lambda: cpu.spare_cores())
    #: The saving process's torch, for the manifest (a writer process has none of its own).
    torch_version: str = field(default_factory=_torch_version)

    @property
    def threads(self) -> int:
        """Encoder threads (``threads``)."""
        return self.settings.threads

    @property
    def auto(self) -> AutoSettings:
        """The ``compression="auto"`` tunables."""
        return AutoSettings.of(self.settings)


@dataclass(frozen=True)
class _Encoded:
    codec: str
    payload: bytes | memoryview
    crc32: int
    raw_len: int


def write_snapshot(
    snap: StagedState,
    storage: Storage,
    path: str,
    options: WriteOptions,
    progress: Callable[[int], None] | None = None,
    guard: PublishGuard | None = None,
) -> int:
    """Write ``snap`` to ``path`` of ``storage``, replacing it atomically (or leaving it
    untouched on any failure); return the file's size in bytes.

    ``progress`` is called with the raw bytes of each chunk once it is written; ``guard`` is
    entered around the step that publishes the file (see
    :data:`asyncckpt._storage.base.PublishGuard`): what it raises aborts the write.

    Raises:
        StorageError: the backend failed (the target is untouched).
        ConflictError: ``guard`` refused to publish (the target is untouched).
    """
    auto = None
    if options.compression == "auto":
        auto = autocompress.for_write(
            storage, path, options.auto, options.threads, options.spare_cores
        )
    with storage.atomic_write(path) as out:
        out.writeback_bytes = options.settings.writeback_mib << 20
        out.publish_guard = guard
        size = _write_body(out, snap, options, auto, progress)
        committing = cpu.ThreadClock.now()
    if auto is not None:
        auto.committed((cpu.ThreadClock.now() - committing).busy, size)
    abort_strays(storage, path)
    return size


def abort_strays(storage: Storage, path: str) -> None:
    """After ``path`` was written: abort the unfinished writes of exactly that file that
    other writers left (the multipart upload of a ``save`` killed mid-upload, which nothing
    else would ever remove on an object store). Never raises: the file is written.

    Only uploads of this key: not those of other files under its prefix. A second process
    saving the same key at this moment loses its upload too (its save fails, instead of
    replacing this one later).
    """
    try:
        storage.abort_unfinished(path, exact=True)
    except AsyncCkptError as exc:
        log.warning("could not look for unfinished uploads of %s: %s", storage.describe(path), exc)


def _write_body(
    out: AtomicWriter,
    snap: StagedState,
    options: WriteOptions,
    auto: AutoRun | None,
    progress: Callable[[int], None] | None,
) -> int:
    """Write the header, the chunks as they are encoded, and the manifest; return the size."""
    header = encode_header()
    out.write(header)
    offset = len(header)
    chunks: list[Chunk] = []
    offset = write_chunks(
        out, offset, snap.storages, options, chunks, progress, snap.wait_staged, auto, snap.copied
    )
    entries, first = [], 0
    for staged, count in zip(snap.storages, _chunk_counts(snap.storages, chunks)):
        entries.append(StorageEntry(staged.nbytes, staged.itemsize, staged.device, first, count))
        first += count
    tables = (chunks, entries, snap.tensors, snap.arrays)
    return offset + write_manifest(out, offset, *tables, snap.root, options.torch_version)


def _no_wait(index: int, end: int) -> None:
    """``ready`` for a snapshot that is complete."""


def _all_copied() -> bool:
    """``copied`` for a snapshot that is complete."""
    return True


def write_chunks(
    out: AtomicWriter,
    offset: int,
    storages: Sequence[StagedBytes],
    options: WriteOptions,
    chunks: list[Chunk],
    progress: Callable[[int], None] | None = None,
    ready: Callable[[int, int], None] = _no_wait,
    auto: AutoRun | None = None,
    copied: Callable[[], bool] = _all_copied,
) -> int:
    """Encode ``storages`` and write their chunks at ``offset``; return the offset after.

    Each written chunk is appended to ``chunks``; ``progress`` gets its raw length.
    ``ready`` and ``copied`` follow a copy still going on (see :func:`_encode_all`).
    """
    for batch in _encode_all(storages, options, ready, auto, copied):
        started = cpu.ThreadClock.now() if auto is not None else None
        payload = batch[0].payload if len(batch) == 1 else b"".join(e.payload for e in batch)
        out.write(payload)
        if auto is not None and started is not None:
            # Not the time spent waiting for a busy core: that is the CPU's, not the store's.
            auto.wrote((cpu.ThreadClock.now() - started).busy, len(payload))
        for enc in batch:
            chunks.append(Chunk(offset, len(enc.payload), enc.raw_len, enc.codec, enc.crc32))
            offset += len(enc.payload)
            if progress is not None:
                progress(enc.raw_len)
    return offset


def write_manifest(
    out: AtomicWriter,
    offset: int,
    chunks: Sequence[Chunk],
    storages: Sequence[StorageEntry],
    tensors: Sequence[TensorEntry],
    arrays: Sequence[ArrayEntry],
    root: Any,
    torch_version: str,
) -> int:
    """Write a file's manifest (its tables, and what wrote it when) and its footer after
    the chunks, which end at ``offset``; return the bytes written."""
    manifest = Manifest(
        chunks=tuple(chunks),
        storages=tuple(storages),
        tensors=tuple(tensors),
        arrays=tuple(arrays),
        root=root,
        byteorder=sys.byteorder,
        meta={
            "library": f"asyncckpt {__version__}",
            "torch": torch_version,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        },
    )
    body = encode_manifest(manifest)
    footer = encode_footer(offset, body)
    out.write(body)
    out.write(footer)
    return len(body) + len(footer)


def _chunk_counts(storages: Sequence[StagedBytes], chunks: list[Chunk]) -> Iterator[int]:
    it = iter(chunks)
    for staged in storages:
        remaining, count = staged.nbytes, 0
        while remaining:
            remaining -= next(it).raw_len
            count += 1
        yield count


def _slices(
    storages: Sequence[StagedBytes],
    chunk_bytes: int,
    ready: Callable[[int, int], None] = _no_wait,
) -> Iterator[_Slice]:
    """The chunks of every storage, each yielded once ``ready(storage, end)`` returned."""
    chunk_bytes = min(chunk_bytes, MAX_CHUNK_BYTES)  # readers refuse longer chunks
    step = max(_CHUNK_ALIGN, chunk_bytes - chunk_bytes % _CHUNK_ALIGN)
    for index, staged in enumerate(storages):
        view = staged.view()
        if not len(view):
            ready(index, 0)  # device copies of an empty storage still have to be waited on
        for start in range(0, len(view), step):
            chunk = view[start : start + step]
            ready(index, start + len(chunk))
            yield chunk, staged.itemsize, staged.is_float


def _encode_all(
    storages: Sequence[StagedBytes],
    options: WriteOptions,
    ready: Callable[[int, int], None] = _no_wait,
    auto: AutoRun | None = None,
    copied: Callable[[], bool] = _all_copied,
) -> Iterator[list[_Encoded]]:
    """Yield encoded chunks in order, in batches, while up to ``inflight_chunks`` encode.

    A batch is one chunk, or consecutive small ones (small tensors) adding up to at most
    ``_BATCH_BYTES``: one hand-off to an encoder and one write for all of them. Each
    hand-off makes a thread take the GIL back, which costs up to the switch interval (5 ms)
    while the training thread runs Python; a model's hundreds of biases and norms paid that
    per tensor.

    ``ready``, ``copied``: see :func:`_slices` and :func:`_batches`.
    """
    workers = pool("encode", options.threads, options.settings.writer_nice)
    window: collections.deque[Future[list[_Encoded]]] = collections.deque()
    try:
        for batch in _batches(
            _slices(storages, options.settings.chunk_bytes, ready), _BATCH_BYTES, copied
        ):
            if len(window) >= options.settings.inflight_chunks:
                yield window.popleft().result()
            window.append(workers.submit(_encode_batch, batch, options, auto))
        while window:
            yield window.popleft().result()
    finally:
        for future in window:  # on failure, let queued work finish before buffers are reused
            future.cancel() or future.exception()


def _batches(
    slices: Iterator[_Slice], limit: int, copied: Callable[[], bool] = _all_copied
) -> Iterator[list[_Slice]]:
    """Consecutive slices grouped while their bytes add up to at most ``limit``; while
    ``copied()`` is false, each slice alone (the next one may not have landed yet)."""
    batch: list[_Slice] = []
    size = 0
    for item in slices:
        if batch and size + len(item[0]) > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += len(item[0])
        if not copied():
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode_batch(
    batch: list[_Slice], options: WriteOptions, auto: AutoRun | None = None
) -> list[_Encoded]:
    encoded = []
    for raw, itemsize, is_float in batch:
        report = EncodeReport()
        codec, payload = encode_chunk(
            raw,
            itemsize=itemsize,
            is_float=is_float,
            compression=options.compression,
            level=options.settings.zstd_level,
            choose=None if auto is None else functools.partial(auto.choose, nbytes=len(raw)),
            report=report,
        )
        if auto is not None:
            auto.encoded(report)
        encoded.append(_Encoded(codec, payload, checksum(payload), len(raw)))
    return encoded
