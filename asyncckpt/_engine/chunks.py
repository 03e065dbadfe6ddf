"""The one chunk-read engine: every load reads its chunks here, verified, into place.

``asyncckpt.load``, ``Checkpointer.load`` (single-file and sharded versions), the DCP
``Reader``, ``convert`` and ``verify`` all read through :func:`read_runs`: one bounded
queue of chunk reads on the shared ``read`` pool, one :func:`_read_chunk` (read, check the
CRC-32, decode), one per-thread scratch buffer for compressed bytes. What to read is a
parameter: per storage, a :class:`Run` of its chunks (all of them, or only those under the
bytes a caller asked for), so a load of a subset of the entries reads only their chunks.

Every chunk's checksum is verified before it is decoded; a mismatch raises
:class:`~asyncckpt.errors.ChecksumError` naming the file, the chunk and the keys it holds.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch

from asyncckpt._device import cuda
from asyncckpt._engine.arena import pinned_host
from asyncckpt._engine.opened import Budget, OpenedFile, check_sizes
from asyncckpt._engine.snapshot import byte_view
from asyncckpt._format.codec import checksum, decode_chunk
from asyncckpt._threads import DaemonPool, pool
from asyncckpt.errors import ChecksumError, FormatError

#: Chunks queued per reader thread ahead of the oldest unfinished one; buffers are
#: allocated as their first chunk is queued, so a damaged file fails before most of them.
QUEUED_PER_THREAD = 4


class Run(NamedTuple):
    """The chunks of one storage to read: ``[first, stop)`` of the file's chunk table;
    ``base`` is the byte of the storage where chunk ``first`` starts."""

    first: int
    stop: int
    base: int


def whole_run(opened: OpenedFile, sid: int) -> Run:
    """Every chunk of storage ``sid``.

    Raises:
        FormatError: the file has no storage ``sid``.
    """
    storages = opened.manifest.storages
    if not 0 <= sid < len(storages):
        raise FormatError(f"{opened.name}: no storage {sid} among {len(storages)}")
    entry = storages[sid]
    return Run(entry.first_chunk, entry.first_chunk + entry.num_chunks, 0)


def run_bytes(opened: OpenedFile, run: Run) -> int:
    """The decoded size of ``run``'s chunks."""
    return sum(opened.manifest.chunks[i].raw_len for i in range(run.first, run.stop))


def read_runs(
    opened: OpenedFile,
    runs: Mapping[int, Run],
    threads: int,
    *,
    into: Mapping[int, torch.Tensor] | None = None,
    pinned: Collection[int] = (),
    budget: Budget | None = None,
    what: str = "its storages",
) -> dict[int, torch.Tensor]:
    """Read, verify and decode the chunks of ``runs`` (``{storage index: the run of its
    chunks}``) on ``threads`` threads, in file order: ``{storage index: 1-D uint8 CPU tensor
    of its run's bytes}``, ``into``'s included.

    Buffers are allocated as reading reaches them, after the declared sizes were checked
    against the file's size, so a crafted file cannot make the reader allocate more than
    its bytes can decode to.

    Args:
        into: per storage, a 1-D uint8 CPU tensor of exactly its run's size to decode into
            (a caller's own tensor: no copy after); the others get fresh buffers.
        pinned: storages whose fresh buffer is pinned (for a copy to an accelerator).
        budget: charged with the fresh buffers, before the first one is allocated.
        what: what the budget's error says the buffers are for.

    Raises:
        ChecksumError: a chunk is damaged (the first one found).
        FormatError: the declared sizes cannot be justified by the file, or allocated.
        MemoryBudgetError: the fresh buffers would exceed ``budget``.

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt._engine.opened import open_file
        >>> from asyncckpt._storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"a": torch.arange(3), "b": torch.ones(2)}, path).result()
        >>> with open_file(*resolve(path, None)) as opened:
        ...     {s: b.numel() for s, b in read_runs(opened, {1: whole_run(opened, 1)}, 2).items()}
        {1: 8}
    """
    check_sizes(opened)  # bounds every allocation below by the file's size
    into = into or {}
    if budget is not None:
        fresh = sum(run_bytes(opened, run) for sid, run in runs.items() if sid not in into)
        budget.charge(opened.name, fresh, what)
    queue = _Queue(pool("read", threads), threads * QUEUED_PER_THREAD)
    buffers: dict[int, torch.Tensor] = {}
    try:
        for sid in sorted(runs):  # storage order is file order
            run = runs[sid]
            buf = into.get(sid)
            if buf is None:
                buf = _allocate_for(opened, run_bytes(opened, run), sid in pinned)
            buffers[sid] = buf
            _queue_run(queue, opened, sid, run, byte_view(buf))
        queue.drain()
    finally:
        queue.cancel()
    return buffers


def _queue_run(queue: _Queue, opened: OpenedFile, sid: int, run: Run, view: memoryview) -> None:
    start = 0
    for index in range(run.first, run.stop):
        raw_len = opened.manifest.chunks[index].raw_len
        queue.submit(_read_chunk, opened, index, sid, view[start : start + raw_len])
        start += raw_len


class _Queue:
    """Futures on a shared pool, at most ``limit`` unfinished; the first failure stops all."""

    def __init__(self, workers: DaemonPool, limit: int) -> None:
        self._workers = workers
        self._limit = max(1, limit)
        self._pending: collections.deque[Future[None]] = collections.deque()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        while len(self._pending) >= self._limit:
            self._pending.popleft().result()  # re-raises the oldest chunk's error first
        self._pending.append(self._workers.submit(fn, *args))

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def cancel(self) -> None:
        # After a failure, chunks still queued must not write into buffers being dropped.
        for future in self._pending:
            future.cancel()
        for future in self._pending:
            if not future.cancelled():
                future.exception()
        self._pending.clear()


def _allocate_for(opened: OpenedFile, nbytes: int, pin: bool) -> torch.Tensor:
    try:
        return _allocate(nbytes, pin)
    except RuntimeError as exc:  # out of memory
        raise FormatError(
            f"{opened.name}: cannot allocate the {nbytes} bytes of a storage"
        ) from exc


def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
    if pin:
        return pinned_host(nbytes, cuda().own_device())
    return torch.empty(nbytes, dtype=torch.uint8)


def _stored_scratch(size: int) -> memoryview:
    """A per-thread buffer for a chunk's compressed bytes, reused: a fresh one per chunk
    would be zero-filled and page-faulted in every time."""
    buf: bytearray | None = getattr(_local, "stored", None)
    if buf is None or len(buf) < size:
        buf = _local.stored = bytearray(size)
    return memoryview(buf)[:size]


_local = threading.local()


def _read_chunk(opened: OpenedFile, index: int, sid: int, out: memoryview) -> None:
    chunk = opened.manifest.chunks[index]
    # A raw chunk is read straight into its place; it is checked there before use.
    stored = out if chunk.codec == "raw" else _stored_scratch(chunk.stored_len)
    got = opened.read_into(chunk.offset, stored)
    keys = opened.manifest.keys_of_storage
    if got != chunk.stored_len:
        detail = f"only {got} of {chunk.stored_len} bytes could be read"
        raise ChecksumError(opened.name, index, keys(sid), detail)
    if checksum(stored) != chunk.crc32:
        raise ChecksumError(opened.name, index, keys(sid), "checksum mismatch")
    if chunk.codec == "raw":
        return
    try:
        decode_chunk(stored, chunk.codec, opened.manifest.storages[sid].itemsize, out)
    except FormatError as exc:
        raise ChecksumError(opened.name, index, keys(sid), str(exc)) from exc
