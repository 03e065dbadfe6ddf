"""Snapshot: copy every tensor and array into reused host memory before ``save`` returns.

The copy is the only part of a save the caller waits for, so it goes into an *arena*, one
large host buffer reused across saves: fresh memory would cost page faults on every save
and grow the process (the leak users report with other async checkpointers). At most
``max_inflight`` arenas exist; a save that finds none free waits for the oldest pending
write to finish, which bounds host memory to ``max_inflight`` x the state size.

Storages shared by several tensors (tied weights, views) are copied once. Device-specific
code is confined to :class:`DeviceCopies` and :func:`_allocate`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .format import ArrayEntry, TensorEntry
from .tree import Flattened, dtype_name

_ALIGN = 64  # bytes; keeps every staged storage cache-line aligned inside the arena


@dataclass
class StagedStorage:
    """One storage's bytes, copied into the arena."""

    data: torch.Tensor  # 1-D uint8 CPU view into the arena
    itemsize: int  # byte-group width for the codec
    is_float: bool
    device: str  # where the bytes came from


@dataclass
class Snapshot:
    """Everything the background writer needs; independent of the caller's tensors."""

    root: Any
    tensors: list[TensorEntry]
    arrays: list[ArrayEntry]
    storages: list[StagedStorage]
    lease: ArenaLease
    copies: DeviceCopies

    def wait_copied(self) -> None:
        """Block until the device-to-host copies have landed (a no-op once they have)."""
        self.copies.wait()

    @property
    def raw_bytes(self) -> int:
        return sum(s.data.numel() for s in self.storages)


class ArenaPool:
    """At most ``max_inflight`` reusable host buffers, handed out one per save.

    Example:
        >>> pool = ArenaPool(max_inflight=1)
        >>> lease = pool.acquire(1024)
        >>> lease.buffer.numel() >= 1024
        True
        >>> lease.release()
    """

    def __init__(self, max_inflight: int) -> None:
        self.max_inflight = max_inflight
        self._free: list[torch.Tensor] = []
        self._leased = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> ArenaLease:
        """Take a buffer of at least ``nbytes``, waiting while all are leased."""
        with self._cond:
            while self._leased >= self.max_inflight:
                self._cond.wait()
            self._leased += 1
            buffer = self._free.pop() if self._free else None
        if buffer is None or buffer.numel() < nbytes:
            del buffer  # drop the small one before allocating, to cap peak memory
            buffer = _allocate(nbytes)
        return ArenaLease(self, buffer)

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._leased -= 1
            self._free.append(buffer)
            self._cond.notify()


class ArenaLease:
    """A buffer on loan from an :class:`ArenaPool`; ``release`` returns it exactly once."""

    def __init__(self, pool: ArenaPool, buffer: torch.Tensor) -> None:
        self._pool = pool
        self.buffer = buffer
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._pool._give_back(self.buffer)


def _allocate(nbytes: int) -> torch.Tensor:
    # Round up so small growth between saves does not force a new arena every time.
    size = max(_ALIGN, -(-nbytes // (1 << 20)) * (1 << 20))
    pin = torch.cuda.is_available()
    return torch.empty(size, dtype=torch.uint8, pin_memory=pin)


def byte_view(data: torch.Tensor) -> memoryview:
    """A writable memoryview of a 1-D uint8 CPU tensor's bytes (empty tensors included)."""
    if data.numel() == 0:
        return memoryview(bytearray())
    return memoryview(data.numpy())  # type: ignore[arg-type]


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of all of ``t``'s storage, on ``t``'s device."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)


class DeviceCopies:
    """Device-to-host copies: one side stream per CUDA device, ordered after the producer.

    Each side stream first waits for the work already queued on its device's current
    stream (so the copy sees the values as of the ``save`` call), then copies with
    ``non_blocking=True`` into pinned memory. ``record_stream`` keeps the caching allocator
    from reusing a source's memory before its copy ran, even if the caller frees it.
    Without CUDA this is a plain synchronous ``copy_``.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._events: list[Any] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (any device) into the host view ``dst``."""
        if src.device.type != "cuda":
            dst.copy_(src)
            return
        stream = self._streams.get(src.device)
        if stream is None:
            stream = torch.cuda.Stream(src.device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(src.device))
            self._streams[src.device] = stream
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(stream)

    def record(self) -> None:
        """Mark the end of the copies queued so far (one event per device)."""
        for stream in self._streams.values():
            self._events.append(stream.record_event())

    def wait(self) -> None:
        """Block until every queued copy has landed in host memory."""
        for event in self._events:
            event.synchronize()
        self._events.clear()


def snapshot(flat: Flattened, pool: ArenaPool, overlap: bool = False) -> Snapshot:
    """Copy the data of ``flat`` into an arena from ``pool``.

    By default returns once every byte is in host memory, so the caller may modify or free
    its tensors. With ``overlap=True``, CUDA copies may still be in flight when this returns:
    the caller must not modify CUDA tensors before ``Snapshot.wait_copied()`` (see
    ``Checkpointer.protect``); CPU data is always copied before returning.
    """
    tensors = [_resolved(t) for t, _ in flat.tensors]
    storage_of: dict[tuple[str, int], int] = {}
    sources: list[torch.Tensor | np.ndarray[Any, Any]] = []
    kinds: list[tuple[int, bool, str]] = []
    entries: list[TensorEntry] = []
    for t, (_, key) in zip(tensors, flat.tensors):
        ident = (str(t.device), t.untyped_storage().data_ptr())
        sid = storage_of.get(ident) if t.untyped_storage().nbytes() else None
        if sid is None:
            sid = len(sources)
            storage_of[ident] = sid
            sources.append(_storage_bytes(t))
            kinds.append((*_codec_hint(t.dtype), str(t.device)))
        entries.append(
            TensorEntry(
                storage=sid,
                dtype=dtype_name(t.dtype),
                shape=tuple(t.shape),
                stride=tuple(t.stride()),
                offset=int(t.storage_offset()),
                requires_grad=t.requires_grad,
                parameter=isinstance(t, torch.nn.Parameter),
                key=key,
            )
        )
    arrays: list[ArrayEntry] = []
    for a, key, scalar in flat.arrays:
        contiguous = np.ascontiguousarray(a)
        arrays.append(ArrayEntry(len(sources), a.dtype.str, tuple(a.shape), scalar, key))
        sources.append(contiguous.reshape(-1).view(np.uint8))
        kinds.append((contiguous.dtype.itemsize, a.dtype.kind in "fc", "cpu"))
    return _stage(flat.root, entries, arrays, sources, kinds, pool, overlap)


def _stage(
    root: Any,
    tensors: list[TensorEntry],
    arrays: list[ArrayEntry],
    sources: list[torch.Tensor | np.ndarray[Any, Any]],
    kinds: list[tuple[int, bool, str]],
    pool: ArenaPool,
    overlap: bool,
) -> Snapshot:
    sizes = [int(s.nbytes) if isinstance(s, np.ndarray) else s.numel() for s in sources]
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // _ALIGN) * _ALIGN
    lease = pool.acquire(end)
    copies = DeviceCopies()
    try:
        staged = []
        for src, off, size, (itemsize, is_float, device) in zip(sources, offsets, sizes, kinds):
            dst = lease.buffer[off : off + size]
            copies.copy(dst, torch.from_numpy(src) if isinstance(src, np.ndarray) else src)
            staged.append(StagedStorage(dst, itemsize, is_float, device))
        copies.record()
        if not overlap:
            copies.wait()
    except BaseException:
        copies.record()  # never hand back a buffer that a copy is still writing into
        copies.wait()
        lease.release()
        raise
    return Snapshot(root, tensors, arrays, staged, lease, copies)


def _resolved(t: torch.Tensor) -> torch.Tensor:
    # Lazy conjugate/negative bits are not part of the storage bytes; materialize them.
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _codec_hint(dtype: torch.dtype) -> tuple[int, bool]:
    """(byte-group width, worth grouping) for a dtype; complex groups by component."""
    if dtype.is_complex:
        return dtype.itemsize // 2, True
    return dtype.itemsize, dtype.is_floating_point
