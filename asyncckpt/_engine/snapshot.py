"""Snapshot: copy every tensor and array into reused host memory before ``save`` returns.

The copy is the only part of a save the caller waits for, so it goes into an *arena*, a
host buffer reused across saves (:mod:`asyncckpt._engine.arena`), not into fresh memory
(the leak users report with other async checkpointers). Storages shared by several tensors
are copied once; device copies go through :class:`DeviceCopies` only.

A writer may follow the copy (``on_layout``), waiting on :class:`CopyProgress` for each byte
range it reads. Pieces are announced one by one only for host copies on machines with
``pipeline_min_cpus`` CPUs; on fewer, the writer waits for the whole copy (encoders running
beside it slow the copy down, which is what the caller waits for).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncckpt._device import cuda
from asyncckpt._engine.arena import (
    ArenaLease,
    ArenaPool,
    aligned,
    fill,
    page_lock,
    pinned_for,
    unfilled,
)
from asyncckpt._format.container import ArrayEntry, TensorEntry
from asyncckpt._format.tree import Flattened, dtype_name
from asyncckpt._settings import Settings
from asyncckpt.errors import DeviceCopyError

log = logging.getLogger(__name__)

#: CPU sources are copied in pieces of this size, each announced to a waiting writer: small
#: enough that the writer starts early, large enough that the bookkeeping costs nothing.
_COPY_STEP = 8 << 20


class SnapshotFailedError(Exception):
    """Raised in the writer when the copy it was waiting for failed (the save raises the
    copy's own error: this never reaches a user)."""


class CopyProgress:
    """How far the copy into the arena has come, for a writer that starts before it ends.

    Positions are byte offsets in the arena: everything below :attr:`position` has landed.
    The copying thread advances it; a writer calls :meth:`wait_until` before reading a range.
    """

    def __init__(self, offsets: list[int], total: int) -> None:
        self.offsets = offsets  # arena offset of each staged storage
        self.total = total
        self.position = 0
        self.done_at: float | None = None  # perf_counter() when the last byte landed
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def advance(self, position: int) -> None:
        """Announce that every byte below ``position`` is in the arena."""
        with self._cond:
            if position > self.position:
                self.position = position
                self._cond.notify_all()

    def finish(self) -> None:
        """Announce the whole snapshot."""
        with self._cond:
            self.done_at = time.perf_counter()
            self.position = max(self.position, self.total)
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The copy failed: wake the writer so that it aborts its file."""
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def outcome(self) -> BaseException | None:
        """Block until the copy has finished or failed; return its error (None: finished)."""
        with self._cond:
            while self.done_at is None and self._error is None:
                self._cond.wait()
            return self._error

    def wait_until(self, index: int, end: int) -> None:
        """Block until byte ``end`` of staged storage ``index`` has landed.

        Raises:
            SnapshotFailedError: the copy failed; nothing more will land.
        """
        target = self.offsets[index] + end
        with self._cond:
            while self.position < target and self._error is None:
                self._cond.wait()
            if self.position < target:
                raise SnapshotFailedError(f"the snapshot copy failed: {self._error!r}")


@dataclass
class StagedStorage:
    """One storage's bytes, copied into the arena."""

    data: torch.Tensor  # 1-D uint8 CPU view into the arena
    itemsize: int  # byte-group width for the codec
    is_float: bool
    device: str  # where the bytes came from

    @property
    def nbytes(self) -> int:
        """The storage's length in bytes."""
        return self.data.numel()

    def view(self) -> memoryview:
        """The staged bytes (see :func:`byte_view`)."""
        return byte_view(self.data)


@dataclass
class Snapshot:
    """Everything the background writer needs; independent of the caller's tensors."""

    root: Any
    tensors: list[TensorEntry]
    arrays: list[ArrayEntry]
    storages: list[StagedStorage]
    lease: ArenaLease
    copies: DeviceCopies
    #: None: every byte was in the arena before the snapshot was handed out.
    progress: CopyProgress | None = None

    def wait_copied(self) -> None:
        """Block until the device-to-host copies have landed (a no-op once they have)."""
        self.copies.wait()

    def release(self) -> None:
        """Give the arena back once no copy can write into it any more.

        A write may fail before it waited for the copies (its first write refused): a first
        save's copies may then still be landing in the arena, and the next save must not
        get it until they are in. A failed copy is the save's error, raised elsewhere.
        """
        with contextlib.suppress(Exception):
            self.copies.wait()
        self.lease.release()

    def wait_staged(self, index: int, end: int) -> None:
        """Block until bytes ``[0, end)`` of ``storages[index]`` are in host memory.

        Raises:
            SnapshotFailedError: the copy feeding a pipelined writer failed.
        """
        if self.progress is not None:
            self.progress.wait_until(index, end)
        self.copies.wait()  # device copies: progress only covers their queueing

    def copied(self) -> bool:
        """Whether every byte of the snapshot is in host memory (not only queued to be)."""
        return self.progress is None or self.progress.done_at is not None

    def copy_error(self) -> BaseException | None:
        """Block until the copy into the arena has ended; return its error, or None.

        For a writer that failed while the copy went on: if the copy failed too, the caller
        of ``save`` gets the copy's error and no handle, so the writer must leave no trace.
        """
        return None if self.progress is None else self.progress.outcome()

    @property
    def raw_bytes(self) -> int:
        return sum(s.data.numel() for s in self.storages)


def byte_view(data: torch.Tensor) -> memoryview:
    """A writable memoryview of a 1-D uint8 CPU tensor's bytes (empty tensors included)."""
    if data.numel() == 0:
        return memoryview(bytearray())
    return memoryview(data.numpy())  # type: ignore[arg-type]


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of all of ``t``'s storage, on ``t``'s device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class DeviceCopies:
    """Device-to-host copies, on asyncckpt's one copy stream per CUDA device.

    Before its first copy from a device, the copy stream waits (on the device) for the work
    already queued on that device's current stream, so the copy sees the values as of the
    ``save`` call; then copies with ``non_blocking=True`` into pinned memory.
    ``record_stream`` keeps the caching allocator from reusing a source's memory before its
    copy ran, even if the caller frees it. :meth:`record` puts one event per device after
    the copies, which the caller's tensors (:meth:`wait_released`, :meth:`order_after`)
    and the arena's readers (:meth:`wait`) wait for. A CUDA error in any of these is raised
    as :class:`~asyncckpt.errors.DeviceCopyError` naming the device.

    ``unlocked``: a new arena that is not page-locked yet (a process's first save). Each
    copy is then made in device memory first (at device speed), and :meth:`land` moves the
    copies into the arena from a background thread that page-locks it first: the caller of
    ``save`` waits for neither (page-locking costs some 40 times the copy).
    """

    def __init__(self, unlocked: tuple[torch.Tensor, int] | None = None) -> None:
        self._streams: dict[int, Any] = {}
        self._events: list[tuple[int, Any]] = []
        self._unlocked = unlocked
        self._in_device: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # device, dst, copy
        self._landing: threading.Thread | None = None
        self._landing_error: BaseException | None = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (any device) into the host view ``dst``."""
        device = cuda().device_of(src)
        if device.type != "cuda":
            dst.copy_(src)
            return
        index = device.index or 0
        with _device_errors(index, "copy to host memory"):
            stream = self._streams.get(index)
            if stream is None:
                stream = cuda().copy_stream(index)
                cuda().wait_stream(stream, cuda().current_stream(index))
                self._streams[index] = stream
            if self._unlocked is not None:
                self._in_device.append((index, dst, cuda().clone_async(src, stream)))
            else:
                cuda().copy_async(dst, src, stream)
            cuda().record_stream(src, stream)

    def record(self) -> None:
        """Mark the end of the copies queued so far (one event per device)."""
        for index, stream in self._streams.items():
            with _device_errors(index, "event after the copies"):
                self._events.append((index, cuda().record_event(stream)))

    def land(self) -> None:
        """Start moving the copies made in device memory into the arena (see the class)."""
        if self._in_device and self._landing is None:
            self._landing = threading.Thread(target=self._land, name="asyncckpt-land", daemon=True)
            self._landing.start()

    def _land(self) -> None:
        assert self._unlocked is not None
        try:
            page_lock(*self._unlocked)  # pageable if refused: the copies are then synchronous
            for index, stream in self._streams.items():
                with _device_errors(index, "copy to host memory"), cuda().on_device(index):
                    for _, dst, in_device in (c for c in self._in_device if c[0] == index):
                        cuda().copy_async(dst, in_device, stream)
                    cuda().synchronize_event(cuda().record_event(stream))
        except BaseException as exc:
            self._landing_error = exc
        finally:
            self._in_device.clear()  # the device memory goes back to torch's cache

    def wait_released(self) -> None:
        """Block until the caller's tensors are free to change (their copies were made)."""
        for index, event in list(self._events):
            with _device_errors(index, "wait for the copies"):
                cuda().synchronize_event(event)
        self._events.clear()

    def wait(self) -> None:
        """Block until every queued copy has landed in host memory.

        Safe to call from the writer and the caller at once (both only ever wait).
        """
        try:
            self.wait_released()
        finally:  # even then: whoever waits may free the arena the landing writes into
            if self._landing is not None:
                self._landing.join()
        if self._landing is not None:
            error = self._landing_error
            if isinstance(error, DeviceCopyError):
                raise error
            if error is not None:
                raise DeviceCopyError(f"moving the snapshot into host memory failed: {error}")

    def order_after(self) -> None:
        """Make each device's current stream wait for the copies' events (no host wait)."""
        for index, event in list(self._events):
            with _device_errors(index, "wait for the copies"):
                cuda().stream_wait_event(cuda().current_stream(index), event)


@contextlib.contextmanager
def _device_errors(index: int, what: str) -> Iterator[None]:
    """Raise a CUDA runtime error as :class:`DeviceCopyError`, naming the device."""
    try:
        yield
    except DeviceCopyError:
        raise
    except RuntimeError as exc:  # torch's CUDA errors (AcceleratorError too) are these
        raise DeviceCopyError(f"cuda:{index}: {what} failed: {exc}") from exc


@dataclass
class _Source:
    """One stored region: ``nbytes`` bytes assembled from pieces at byte offsets."""

    nbytes: int
    pieces: list[tuple[int, torch.Tensor]]  # (offset in the region, 1-D uint8 source bytes)
    itemsize: int
    is_float: bool
    device: str


@dataclass
class _Span:
    """A distinct storage byte range ``[start, end)`` on ``device`` and its tensors."""

    device: str
    start: int
    end: int
    data: torch.Tensor  # 1-D uint8 view of the whole storage
    tensors: list[int]  # indices into the tensor table


def snapshot(
    flat: Flattened,
    pool: ArenaPool,
    overlap: bool = False,
    on_layout: Callable[[Snapshot], None] | None = None,
    shared: bool = False,
    *,
    settings: Settings,
) -> Snapshot:
    """Copy the data of ``flat`` into an arena from ``pool``.

    Storages are de-duplicated by byte range, not by identity: tensors built over one
    buffer (``torch.frombuffer``, ``torch.from_numpy``) may have distinct storages that
    start at the same address or overlap; overlapping ranges are stored once as their
    union when every tensor's offset in it is a whole number of elements, else apart.

    By default returns once every byte is copied (into host memory, or, on a first save
    with a new arena for CUDA data, into device memory first: see :class:`DeviceCopies`),
    so the caller may modify or free its tensors. With ``overlap=True``, CUDA copies may
    still be in flight: the caller must not modify CUDA tensors before they were made
    (``Checkpointer.wait_for_snapshot``, ``Checkpointer.protect``).

    ``on_layout``, if given, gets the snapshot once its arena is leased, before any byte is
    copied, so that a writer can start while the rest is copied (reading through
    ``Snapshot.wait_staged``). If the copy then fails, the writer's waits raise
    :class:`SnapshotFailedError` and this raises the copy's error; the writer's job
    releases the arena.

    ``shared=True`` stages into shared memory, for a writer process. ``settings``: the
    save's (``pipeline_min_cpus``: whether a writer may follow the copy piece by piece).

    Example:
        >>> from asyncckpt._format.tree import flatten
        >>> buf = bytearray(16)
        >>> state = {"a": torch.frombuffer(buf, dtype=torch.int32, count=1),
        ...          "b": torch.frombuffer(buf, dtype=torch.int32)}
        >>> snap = snapshot(flatten(state), ArenaPool(1), settings=Settings())
        >>> [s.data.numel() for s in snap.storages], [t.storage for t in snap.tensors]
        ([16], [0, 0])
        >>> snap.release()
    """
    tensors = [_resolved(t) for t, _ in flat.tensors]
    sources, placed = _regions(tensors)
    entries = [
        TensorEntry(
            storage=sid,
            dtype=dtype_name(t.dtype),
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
            offset=int(t.storage_offset()) + shift,
            requires_grad=t.requires_grad,
            parameter=isinstance(t, torch.nn.Parameter),
            key=key,
        )
        for t, (_, key), (sid, shift) in zip(tensors, flat.tensors, placed)
    ]
    arrays: list[ArrayEntry] = []
    for a, key, scalar in flat.arrays:
        contiguous = np.ascontiguousarray(a)
        arrays.append(ArrayEntry(len(sources), a.dtype.str, tuple(a.shape), scalar, key))
        data = torch.from_numpy(contiguous.reshape(-1).view(np.uint8))
        hint = (contiguous.dtype.itemsize, a.dtype.kind in "fc")
        sources.append(_Source(data.numel(), [(0, data)], *hint, "cpu"))
    stream = (os.cpu_count() or 1) >= settings.pipeline_min_cpus
    return _stage(flat.root, entries, arrays, sources, pool, overlap, on_layout, shared, stream)


def snapshot_device(flat: Flattened) -> int | None:
    """The CUDA device a snapshot of ``flat`` copies from first (its arena is page-locked
    for it), or None if it holds no CUDA tensor."""
    for t, _ in flat.tensors:
        device = cuda().device_of(t)
        if device.type == "cuda":
            return device.index or 0
    return None


def arena_bytes(flat: Flattened) -> int:
    """Bytes of arena a snapshot of ``flat`` takes (for :meth:`ArenaPool.reserve`)."""
    sources, _ = _regions([_resolved(t) for t, _ in flat.tensors])
    sizes = [src.nbytes for src in sources] + [a.nbytes for a, _, _ in flat.arrays]
    return sum(aligned(n) for n in sizes)


def _regions(tensors: list[torch.Tensor]) -> tuple[list[_Source], list[tuple[int, int]]]:
    """Group tensors into stored regions: the regions, and per tensor (region index,
    element offset of its storage there)."""
    spans: dict[tuple[str, int, int], _Span] = {}
    empty: list[int] = []
    for i, t in enumerate(tensors):
        memory = t.untyped_storage()
        if not memory.nbytes():
            empty.append(i)  # no address to compare; each stands alone
            continue
        start = memory.data_ptr()
        ident = (str(cuda().device_of(t)), start, start + memory.nbytes())
        if ident not in spans:
            spans[ident] = _Span(*ident, _storage_bytes(t), [])
        spans[ident].tensors.append(i)
    regions = [
        region
        for group in _overlapping(list(spans.values()))
        for region in _mergeable(group, tensors)
    ]
    regions += [
        [_Span(str(cuda().device_of(tensors[i])), 0, 0, _storage_bytes(tensors[i]), [i])]
        for i in empty
    ]
    # First-seen order, as the tensors appear in the state, keeps files deterministic.
    regions.sort(key=lambda region: min(i for span in region for i in span.tensors))
    sources: list[_Source] = []
    placed: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    for region in regions:
        _add_region(region, tensors, sources, placed)
    return sources, placed


def _overlapping(spans: list[_Span]) -> list[list[_Span]]:
    """Split spans into groups whose byte ranges chain into one overlapping union."""
    groups: list[list[_Span]] = []
    end: dict[str, int] = {}
    last: dict[str, list[_Span]] = {}
    for span in sorted(spans, key=lambda s: (s.device, s.start, -s.end)):
        if span.device in last and span.start < end[span.device]:
            last[span.device].append(span)
            end[span.device] = max(end[span.device], span.end)
        else:
            last[span.device] = [span]
            end[span.device] = span.end
            groups.append(last[span.device])
    return groups


def _mergeable(group: list[_Span], tensors: list[torch.Tensor]) -> list[list[_Span]]:
    """The group as one region if every storage sits a whole element from its start."""
    base = group[0].start
    aligned = all(
        (span.start - base) % tensors[i].element_size() == 0 for span in group for i in span.tensors
    )
    return [group] if aligned else [[span] for span in group]


def _add_region(
    region: list[_Span],
    tensors: list[torch.Tensor],
    sources: list[_Source],
    placed: list[tuple[int, int]],
) -> None:
    base = region[0].start
    pieces: list[tuple[int, torch.Tensor]] = []
    covered = base
    for span in region:  # sorted by start: a span ending inside the covered part adds nothing
        if span.end > covered or not pieces:
            pieces.append((span.start - base, span.data))
            covered = span.end
        for i in span.tensors:
            placed[i] = (len(sources), (span.start - base) // tensors[i].element_size())
    first = tensors[region[0].tensors[0]]
    nbytes = max(span.end for span in region) - base
    sources.append(_Source(nbytes, pieces, *codec_hint(first.dtype), region[0].device))


def _stage(
    root: Any,
    tensors: list[TensorEntry],
    arrays: list[ArrayEntry],
    sources: list[_Source],
    pool: ArenaPool,
    overlap: bool,
    on_layout: Callable[[Snapshot], None] | None = None,
    shared: bool = False,
    pipeline: bool = False,
) -> Snapshot:
    offsets, end = [], 0
    for src in sources:
        offsets.append(end)
        end += aligned(src.nbytes)
    devices = [int(src.device[5:] or 0) for src in sources if src.device.startswith("cuda:")]
    # Page-locked for the device copied from (the first: a rank saves from its own); a new
    # arena after the save returns, where the device has room for a copy of the state.
    pin = devices[0] if devices else None
    new_arena = pin is not None and not pool.has_free(end, shared, pin)
    later = new_arena and pin is not None and _room_on_device(sources, pin)
    lease = pool.acquire(end, shared, pin, lock_later=later)
    unlocked = later and pin is not None and pinned_for(lease.buffer) != pin
    copies = DeviceCopies((lease.buffer, pin) if unlocked and pin is not None else None)
    staged = [
        StagedStorage(lease.buffer[off : off + src.nbytes], src.itemsize, src.is_float, src.device)
        for src, off in zip(sources, offsets)
    ]
    progress = CopyProgress(offsets, end) if on_layout is not None else None
    snap = Snapshot(root, tensors, arrays, staged, lease, copies, progress)
    # Only host copies are announced piece by piece (see the module docstring); device
    # copies are merely queued here, so a writer is let in once all of them are recorded.
    stream = progress is not None and all(src.device == "cpu" for src in sources) and pipeline
    handed_out = False
    try:
        if on_layout is not None:
            on_layout(snap)
            handed_out = True
        # A new shared arena for host data: written through its memfd, which allocates each
        # page as it fills it, instead of faulting it in (zeroed) and then copying over it.
        filled = unfilled(lease.buffer) and all(src.device == "cpu" for src in sources)
        if filled:
            pieces = [
                (off + at, data) for src, off in zip(sources, offsets) for at, data in src.pieces
            ]
            fill(lease.buffer, pieces, progress.advance if stream and progress else None)
        for src, off in zip(sources, offsets):
            if not filled:
                for at, data in src.pieces:
                    _copy_piece(copies, lease.buffer, off + at, data, progress if stream else None)
            if stream and progress is not None:
                progress.advance(off + src.nbytes)
        copies.record()
        if not overlap:
            copies.wait_released()
        # After the caller's own waits: on an H200, with the locking started before the
        # event wait above, the first save still blocked for most of the locking (CUDA
        # calls seem to queue behind a registration).
        copies.land()
        if progress is not None:
            progress.finish()
    except BaseException as exc:
        try:
            copies.record()  # never hand back a buffer that a copy is still writing into
            copies.wait()
        except DeviceCopyError as device_error:
            # A sticky CUDA error fails every later call too: no copy will run again, so
            # the arena is free; the writer and the caller must still hear of it.
            log.debug("after a failed snapshot copy: %s", device_error)
        finally:
            if progress is not None:
                progress.fail(exc)
            if not handed_out:  # a writer that has the snapshot releases the arena when done
                lease.release()
        raise
    return snap


def _room_on_device(sources: list[_Source], device: int) -> bool:
    """Whether a copy of the sources can wait in device memory while a new arena is locked:
    all on ``device``, and at most half of its free memory (the rest is training's)."""
    wanted = f"cuda:{device}"
    if any(src.device not in ("cpu", wanted) for src in sources):
        return False
    nbytes = sum(src.nbytes for src in sources if src.device == wanted)
    with _device_errors(device, "reading the free device memory"):
        return 2 * nbytes <= cuda().free_memory(device)


def _copy_piece(
    copies: DeviceCopies,
    arena: torch.Tensor,
    at: int,
    data: torch.Tensor,
    progress: CopyProgress | None,
) -> None:
    """Copy ``data`` to ``arena[at:]``; with ``progress``, in steps a writer can follow."""
    n = data.numel()
    if progress is None:
        copies.copy(arena[at : at + n], data)
        return
    for start in range(0, n, _COPY_STEP):
        stop = min(n, start + _COPY_STEP)
        copies.copy(arena[at + start : at + stop], data[start:stop])
        progress.advance(at + stop)


def _resolved(t: torch.Tensor) -> torch.Tensor:
    # Lazy conjugate/negative bits are not part of the storage bytes; materialize them
    # (each resolve returns ``t`` itself where its bit is not set).
    return t.resolve_conj().resolve_neg()


def codec_hint(dtype: torch.dtype) -> tuple[int, bool]:
    """(byte-group width, worth grouping) for a dtype; complex groups by component."""
    if dtype.is_complex:
        return dtype.itemsize // 2, True
    return dtype.itemsize, dtype.is_floating_point
