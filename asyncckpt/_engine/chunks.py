"""The one chunk-read engine: every load reads its chunks here, verified, into place.

Every reader (``load``, ``Checkpointer.load``, the DCP ``Reader``, ``convert``, ``verify``)
goes through :func:`read_runs`: one bounded queue of chunk reads, each fetched and then
decoded on shared pools (:class:`_Stages`), per storage a :class:`Run` of its chunks (a
partial load reads only the chunks of its entries). Every chunk's checksum is verified
before it is decoded; a mismatch raises :class:`~asyncckpt.errors.ChecksumError` naming the
file, the chunk and the keys it holds.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from typing import NamedTuple

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
#: Compressed chunks whose stored bytes may be held at once, beyond one per thread: the
#: fetch of the next chunks runs while the chunks before them are decoded.
FETCH_AHEAD = 2


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
    of its run's bytes}``, ``into``'s included. Buffers are allocated as reading reaches
    them, after :func:`.opened.check_sizes`, so a crafted file cannot make the reader
    allocate more than its bytes can decode to.

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
    queue = _Queue(threads * QUEUED_PER_THREAD)
    stages = _Stages(pool("fetch", threads), pool("read", threads), threads + FETCH_AHEAD)
    buffers: dict[int, torch.Tensor] = {}
    try:
        for sid in sorted(runs):  # storage order is file order
            run = runs[sid]
            buf = into.get(sid)
            if buf is None:
                buf = _allocate_for(opened, run_bytes(opened, run), sid in pinned)
            buffers[sid] = buf
            _queue_run(queue, stages, opened, sid, run, byte_view(buf))
        queue.drain()
    finally:
        queue.cancel()
    return buffers


def _queue_run(
    queue: _Queue, stages: _Stages, opened: OpenedFile, sid: int, run: Run, view: memoryview
) -> None:
    start = 0
    for index in range(run.first, run.stop):
        raw_len = opened.manifest.chunks[index].raw_len
        queue.add(stages.read(queue, opened, index, sid, view[start : start + raw_len]))
        start += raw_len


class _ChunkRead:
    """One chunk in flight: its fetch (read and checksum) and then, for a compressed chunk,
    its decode; ``done`` completes once both have, with the first failure."""

    def __init__(self) -> None:
        self.done: Future[None] = Future()
        self._stages: list[Future[None]] = []
        self._stopped = False
        self._lock = threading.Lock()

    def then(self, pool: DaemonPool, fn: Callable[..., None], *args: object) -> Future[None] | None:
        """Run the next stage on ``pool``; None once :meth:`cancel` has stopped the read."""
        with self._lock:
            if self._stopped:
                return None
            stage = pool.submit(fn, *args)
            self._stages.append(stage)
            return stage

    def cancel(self) -> None:
        """Stop what has not started; wait for what has (it writes into the buffers)."""
        with self._lock:
            self._stopped = True
            stages = list(self._stages)
        for stage in stages:
            stage.cancel()
        for stage in stages:
            if not stage.cancelled():
                stage.exception()


class _Stages:
    """Chunk reads in two stages on two pools, chained by callbacks (no pool thread waits
    for another): the fetch (I/O, then checksum) on ``fetchers``, the decode on
    ``decoders``, so the network (or disk) and the CPUs work at once; a reader that fetched
    and decoded each chunk in turn left the network idle during every decode.

    Compressed chunks are fetched into scratch buffers reused across chunks (a fresh one per
    chunk would be zero-filled and page-faulted in every time), at most ``scratches`` held
    at once; raw chunks are fetched straight into their place.
    """

    def __init__(self, fetchers: DaemonPool, decoders: DaemonPool, scratches: int) -> None:
        self._fetchers, self._decoders = fetchers, decoders
        self._free: list[bytearray] = []
        self._held = 0
        self._limit = max(1, scratches)
        self._lock = threading.Lock()

    def read(
        self, queue: _Queue, opened: OpenedFile, index: int, sid: int, out: memoryview
    ) -> _ChunkRead:
        chunk = opened.manifest.chunks[index]
        raw = chunk.codec == "raw"
        scratch = None if raw else self._scratch(queue, chunk.stored_len)
        stored = out if scratch is None else memoryview(scratch)[: chunk.stored_len]
        read = _ChunkRead()

        def decode(fetched: Future[None]) -> None:
            if fetched.cancelled() or fetched.exception() is not None or raw:
                self._finish(read, fetched, scratch)
                return
            decoded = read.then(self._decoders, _decode_chunk, opened, index, sid, stored, out)
            if decoded is None:  # cancelled meanwhile
                self._finish(read, fetched, scratch)
            else:
                decoded.add_done_callback(lambda d: self._finish(read, d, scratch))

        fetched = read.then(self._fetchers, _fetch_chunk, opened, index, sid, stored)
        assert fetched is not None  # nothing can have cancelled it yet
        fetched.add_done_callback(decode)
        return read

    def _scratch(self, queue: _Queue, size: int) -> bytearray:
        """A scratch buffer of at least ``size`` bytes; with all of them held, the oldest
        chunks in flight are waited for until one is given back."""
        while True:
            with self._lock:
                if self._free:
                    buf = self._free.pop()
                    break
                if self._held < self._limit:
                    buf = bytearray()
                    break
            queue.wait_oldest()
        with self._lock:
            self._held += 1
        if len(buf) < size:
            buf = bytearray(size)
        return buf

    def _finish(self, read: _ChunkRead, last: Future[None], scratch: bytearray | None) -> None:
        """The scratch back first, then ``read.done``: whoever waits for it may take one."""
        if scratch is not None:
            with self._lock:
                self._held -= 1
                self._free.append(scratch)
        error = None if last.cancelled() else last.exception()
        if error is not None:
            read.done.set_exception(error)
        else:  # done, or cancelled after a failure elsewhere: nobody reads it then
            read.done.set_result(None)


class _Queue:
    """Chunk reads in flight, at most ``limit`` unfinished; the first failure stops all."""

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._pending: collections.deque[_ChunkRead] = collections.deque()

    def add(self, read: _ChunkRead) -> None:
        self._pending.append(read)
        while len(self._pending) > self._limit:
            self.wait_oldest()

    def wait_oldest(self) -> None:
        """Wait for the oldest chunk in flight; re-raises its error."""
        self._pending.popleft().done.result()

    def drain(self) -> None:
        while self._pending:
            self.wait_oldest()

    def cancel(self) -> None:
        # After a failure, chunks still queued must not write into buffers being dropped.
        for read in self._pending:
            read.cancel()
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


def _fetch_chunk(opened: OpenedFile, index: int, sid: int, stored: memoryview) -> None:
    """Read chunk ``index``'s stored bytes into ``stored`` and check them."""
    chunk = opened.manifest.chunks[index]
    got = opened.read_into(chunk.offset, stored)
    keys = opened.manifest.keys_of_storage
    if got != chunk.stored_len:
        detail = f"only {got} of {chunk.stored_len} bytes could be read"
        raise ChecksumError(opened.name, index, keys(sid), detail)
    if checksum(stored) != chunk.crc32:
        raise ChecksumError(opened.name, index, keys(sid), "checksum mismatch")


def _decode_chunk(
    opened: OpenedFile, index: int, sid: int, stored: memoryview, out: memoryview
) -> None:
    chunk = opened.manifest.chunks[index]
    try:
        decode_chunk(stored, chunk.codec, opened.manifest.storages[sid].itemsize, out)
    except FormatError as exc:
        raise ChecksumError(
            opened.name, index, opened.manifest.keys_of_storage(sid), str(exc)
        ) from exc
