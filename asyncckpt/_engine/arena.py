"""Arenas: the reused host buffers a snapshot is copied into, in shared memory for a
writer process.

Fresh memory would cost page faults on every save and grow the process, so a save copies
into an *arena* leased from an :class:`ArenaPool` and given back once its write is done. At
most ``max_inflight`` arenas exist; a save that finds none free waits for the oldest pending
write to finish, which bounds host memory to ``max_inflight`` x the state size. With
``writer_processes=1`` an arena is a memfd mapping (:class:`SharedRegion`) that the writer
process maps too.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncckpt import _threads as workers
from asyncckpt._device import Cuda, cuda

log = logging.getLogger(__name__)

#: Bytes; every staged storage starts at a multiple of this inside the arena (cache lines).
ALIGN = 64
_PAGE = 4096


def aligned(nbytes: int, to: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return -(-nbytes // to) * to


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
        self._reserving = False
        self._cond = threading.Condition()

    def acquire(
        self, nbytes: int, shared: bool = False, pin: int | None = None, lock_later: bool = False
    ) -> ArenaLease:
        """Take a buffer of at least ``nbytes``, waiting while all are leased.

        ``shared``: the buffer must be in shared memory (see :func:`shared_region`), for a
        writer process to read; a free buffer of the other kind is replaced. ``pin``: the
        CUDA device the buffer must be page-locked for; None for host-only snapshots. A
        buffer that is too small is replaced by one at least :data:`GROWTH` times its size,
        so that a state growing a little at each save does not reallocate (and re-register)
        on every one. ``lock_later``: a buffer allocated
        for ``pin`` is neither faulted in nor page-locked yet (the caller does it with
        :func:`page_lock`, off the save's path); ignored once a late page-lock has failed.

        Raises:
            Exception: the allocation's error (ENOMEM, EMFILE...); the lease is returned
                first, so later saves are not blocked by it.
        """
        with self._cond:
            # A reservation in progress is the arena this save should get: wait for it
            # rather than allocating a second one beside it.
            while self._leased >= self.max_inflight or self._reserving:
                self._cond.wait()
            self._leased += 1
            buffer = self._free.pop() if self._free else None
        try:
            if not _fits(buffer, nbytes, shared, pin):
                grown = nbytes if buffer is None else max(nbytes, int(buffer.numel() * GROWTH))
                del buffer  # drop the unfit one before allocating, to cap peak memory
                buffer = _allocate(grown, shared, pin, lock_later and _lock_later_works)
        except BaseException:
            with self._cond:  # a lease counted for no buffer would block every later save
                self._leased -= 1
                self._cond.notify_all()
            raise
        assert buffer is not None
        return ArenaLease(self, buffer)

    def reserve(
        self, nbytes: int, shared: bool = False, pin: int | None = None
    ) -> threading.Thread | None:
        """Allocate and pre-fault an arena of ``nbytes`` (``shared``, ``pin``: as for
        ``acquire``) in a background thread; return it, to join, or None if there was
        nothing to do (a free arena fits, a reservation is running, all are leased).

        Takes the page faults of a first save off its critical path: call it as soon as the
        state's size is known (e.g. once the model is built). A save that starts meanwhile
        waits for the reservation instead of allocating beside it.
        """
        with self._cond:
            free_slots = self.max_inflight - self._leased
            fit = self.has_free(nbytes, shared, pin)
            if self._reserving or free_slots <= 0 or fit:
                return None
            self._reserving = True
            # Replace the largest free arena that is too small (drop it first: peak memory).
            small = self._free.pop() if len(self._free) >= free_slots else None
        del small

        def work() -> None:
            buffer: torch.Tensor | None = None
            try:
                buffer = _allocate(nbytes, shared, pin)  # registered under `pin`, not device 0
                populate(buffer)  # reserved ahead: its pages too, not the first copy's
            finally:
                with self._cond:
                    if buffer is not None:
                        self._free.append(buffer)
                    self._reserving = False
                    self._cond.notify_all()

        thread = threading.Thread(target=work, name="asyncckpt-reserve", daemon=True)
        thread.start()
        return thread

    def has_free(self, nbytes: int, shared: bool = False, pin: int | None = None) -> bool:
        """Whether a free buffer would serve ``acquire(nbytes, shared, pin)`` as it is."""
        with self._cond:
            return any(_fits(b, nbytes, shared, pin) for b in self._free)

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._leased -= 1
            self._free.append(buffer)
            self._cond.notify_all()


#: A too-small arena is replaced by one this many times its size (or the size asked for).
GROWTH = 1.5


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


def _fits(buffer: torch.Tensor | None, nbytes: int, shared: bool, pin: int | None) -> bool:
    if buffer is None or buffer.numel() < nbytes:
        return False
    if pin is not None and pinned_for(buffer) != pin:
        return False  # pageable (or pinned for another device): device copies would crawl
    return not shared or shared_region(buffer) is not None


_pinned_lock = threading.Lock()
#: address -> the mmap behind a host arena, while it lives (for _note_pinned).
_mappings: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()
_pinned: dict[int, int] = {}  # address of a page-locked arena -> its CUDA device


def pinned_for(buffer: torch.Tensor) -> int | None:
    """The CUDA device ``buffer`` (an arena) is page-locked for, or None if it is pageable."""
    with _pinned_lock:
        return _pinned.get(buffer.data_ptr())


def _allocate(
    nbytes: int, shared: bool = False, pin: int | None = None, lock_later: bool = False
) -> torch.Tensor:
    """A host buffer of at least ``nbytes``, every page already faulted in.

    An anonymous mapping advised to use transparent huge pages, then touched once per page;
    with ``pin`` (a CUDA device), page-locked with ``cudaHostRegister`` of its exact size,
    under that device (a helper thread's current device is 0: registering there would
    create a context on GPU 0 in every rank). Not ``pin_memory=True``: torch's caching
    host allocator rounds every request up to a power of two and keeps it pinned for the
    life of the process. Huge pages make touching about 6x cheaper (0.07 s instead of
    0.41 s for 1 GiB on the 2-core benchmark machine) and halve the TLB misses of every
    later copy into the arena.

    ``shared``: a memfd mapping another process can map too (:func:`shared_region`), pinned
    by registration on CUDA. Raises OSError where memfd does not exist (not Linux). Without
    ``pin`` its pages are *not* faulted in (:func:`unfilled` is true): zeroing them and then
    copying over them would cost a first save twice what :func:`fill` costs.

    ``lock_later``: with ``pin``, the buffer is left as without it, and not faulted in: its
    user page-locks it with :func:`page_lock` (which faults every page in itself).
    """
    size = max(ALIGN, aligned(nbytes, _PAGE))
    if lock_later and pin is not None:
        return _shared_arena(size, None) if shared else _host_arena(size, fault=False)
    if shared:
        return _shared_arena(size, pin)
    buffer = _host_arena(size)
    if pin is None:
        return buffer
    if _register(buffer, size, pin):
        return buffer
    log.warning(
        "CUDA could not page-lock a %d-byte arena (cudaHostRegister) on cuda:%d; using "
        "torch's pinned memory instead",
        size,
        pin,
    )
    del buffer
    return _torch_pinned(size, pin)


def _torch_pinned(size: int, pin: int) -> torch.Tensor:
    """Torch's pinned memory for device ``pin``: where ``cudaHostRegister`` failed."""
    with cuda().on_device(pin):
        fallback = cuda().pinned_empty(size)
    _note_pinned(fallback, pin, registered=False)
    return fallback


#: False once a late page-lock failed: arenas are then page-locked as they are allocated
#: (where a failure falls back to torch's pinned memory) instead of re-trying at each save.
_lock_later_works = True


def page_lock(buffer: torch.Tensor, pin: int) -> bool:
    """Page-lock an arena that ``acquire(..., lock_later=True)`` allocated, for device ``pin``.

    Slow: the kernel faults in and locks every page (about 0.8 s per GiB on an H200
    machine, 40 times the device-to-host copy it serves), hence off the save's path. Returns
    False if CUDA refuses: the buffer stays pageable (copies into it are synchronous, still
    correct) and later arenas are page-locked when allocated.

    Example:
        >>> arena = _allocate(4096, pin=0, lock_later=True)
        >>> pinned_for(arena) is None  # nothing locked yet: no CUDA call was made
        True
    """
    global _lock_later_works
    if _register(buffer, buffer.numel(), pin):
        found = shared_region(buffer)
        if found is not None:  # its pages are in now (and locked)
            with _shared_lock:
                _unfilled.discard(found[0].ident)
        return True
    _lock_later_works = False
    log.warning(
        "CUDA could not page-lock a %d-byte arena (cudaHostRegister) on cuda:%d; this "
        "save's copies are synchronous, later arenas are locked when allocated",
        buffer.numel(),
        pin,
    )
    return False


#: Pinned load buffers at least this large are registered at their exact size; smaller ones
#: come from torch's caching host allocator (a mapping and a registration each would cost
#: more than its power-of-two rounding wastes).
EXACT_PIN_MIN = 1 << 20


def pinned_host(nbytes: int, device: int) -> torch.Tensor:
    """A host buffer of ``nbytes`` page-locked for ``device``, for a load's reads: from
    :data:`EXACT_PIN_MIN` up, registered at its exact size (see :func:`_allocate`) and
    unregistered when dropped; pageable if registration fails."""
    if nbytes < EXACT_PIN_MIN:
        with cuda().on_device(device):
            return cuda().pinned_empty(nbytes)
    size = aligned(nbytes, _PAGE)
    buffer = _host_arena(size)
    _register(buffer, size, device)  # False: stays pageable (the copy is then synchronous)
    return buffer[:nbytes]


def _register(buffer: torch.Tensor, size: int, pin: int) -> bool:
    """Page-lock ``buffer`` for device ``pin`` until it is freed; keep its mapping out of
    forked children (``MADV_DONTFORK``): the kernel copies a DMA-pinned private page into
    the child at the fork itself, so every DataLoader worker started after a save would
    copy the whole arena. The child gets an inaccessible placeholder at the same addresses
    instead (:func:`_placeholders_in_child`)."""
    address = buffer.data_ptr()
    with cuda().on_device(pin):
        if not cuda().register(address, size):
            return False
    _note_pinned(buffer, pin, registered=True)
    region = _mappings.get(address)
    if region is not None and hasattr(mmap, "MADV_DONTFORK"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_DONTFORK)
            with _pinned_lock:
                _not_forked[address] = len(region)
    return True


#: address -> length of each mapping kept out of forked children, while it lives.
_not_forked: dict[int, int] = {}


@workers.after_fork_in_child
def _placeholders_in_child() -> None:
    """In a forked child: map an inaccessible placeholder where each ``MADV_DONTFORK``
    arena was. The child still holds the parent's objects for those arenas (kept, unused,
    by ``workers.keep_from_parent``); one freed there unmaps its range, which must be the
    placeholder, never a mapping the child made since at an address the fork left free."""
    global _pinned_lock
    _pinned_lock = threading.Lock()
    _pinned.clear()  # the child's CUDA, if any, is its own: nothing of it is page-locked
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
    for address, length in _not_forked.items():
        libc.mmap(address, length, _PROT_NONE, flags, -1, 0)
    _not_forked.clear()


_MAP_FIXED = 0x10  # Linux, every architecture (the mmap module does not export it)
_PROT_NONE = 0


def _note_pinned(buffer: torch.Tensor, pin: int, registered: bool) -> None:
    address = buffer.data_ptr()
    with _pinned_lock:
        _pinned[address] = pin
    # Unpinned when the memory goes: the mapping outlives every view of it (a load's
    # storages are slices of its buffer), so it, not the tensor object, is watched.
    owner: Any = _mappings.get(address, buffer)
    # The seam that pinned it unpins it (a test's fake may be gone by then).
    finalizer = weakref.finalize(owner, _unpin, address, pin, registered, cuda())
    finalizer.atexit = False  # at exit the process's memory goes anyway, and CUDA may be gone


def _unpin(address: int, pin: int, registered: bool, backend: Cuda) -> None:
    with _pinned_lock:
        _pinned.pop(address, None)
        _not_forked.pop(address, None)
    if registered:
        with backend.on_device(pin):  # the device it was registered on, from any thread
            backend.unregister(address)


def _host_arena(size: int, fault: bool = True) -> torch.Tensor:
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if not flags:  # not POSIX: the allocator's own memory
        return torch.empty(size, dtype=torch.uint8)
    try:
        region = mmap.mmap(-1, size, flags=flags)
    except (OSError, ValueError):
        return torch.empty(size, dtype=torch.uint8)
    return _faulted_in(region, fault)


def _faulted_in(region: mmap.mmap, fault: bool = True) -> torch.Tensor:
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP disabled or unsupported: small pages
            region.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the mapping's buffer: it is unmapped when the last view goes away.
    buffer = torch.frombuffer(region, dtype=torch.uint8)
    _mappings[buffer.data_ptr()] = region
    if fault:
        _fault_in(region)  # every page now, not during a save's copy
    return buffer


#: ``madvise`` advice that faults a range in, writable, in one call (Linux 5.14).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: Slices of an arena faulted in by one thread; threads are bounded by the usable CPUs.
_FAULT_SLICE = 64 << 20


def _fault_in(region: mmap.mmap) -> None:
    """Fault every page of ``region`` in, on up to 8 usable CPUs: faulting zeroes each
    page, about half the work of the copy that follows, which a first save without
    ``reserve`` pays. ``MADV_POPULATE_WRITE`` faults a whole slice in one system call
    instead of one trap per page (a memfd arena has no huge pages: 262,144 traps per GiB);
    where it does not exist, each page is written once."""
    size = len(region)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(1, min(cpus or 1, 8, size // _FAULT_SLICE))
    step = aligned(-(-size // workers), _PAGE)
    ranges = [(start, min(step, size - start)) for start in range(0, size, step)]
    if workers == 1:
        _fault_range(region, *ranges[0])
        return
    threads = [threading.Thread(target=_fault_range, args=(region, *r)) for r in ranges]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _fault_range(region: mmap.mmap, start: int, length: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            region.madvise(_MADV_POPULATE_WRITE, start, length)
            return
        except (OSError, ValueError):  # an older kernel: write to every page instead
            pass
    pages = np.frombuffer(region, dtype=np.uint8, count=length, offset=start)
    pages[::_PAGE] = 0


@dataclass(frozen=True)
class SharedRegion:
    """An arena in shared memory: another process maps ``fd`` to read what was staged."""

    ident: int  # unique in this process, for as long as the arena lives
    fd: int  # the memfd holding the arena's pages (closed when the arena is freed)
    size: int  # bytes
    address: int  # the arena's first byte in this process


_shared_lock = threading.Lock()
_shared: dict[int, SharedRegion] = {}  # ident -> region, while the arena lives
_shared_ids = itertools.count(1)


@workers.after_fork_in_child
def _forget_parent_regions() -> None:
    """In a forked child: the parent's shared arenas stay the parent's (kept alive by the
    parent's pool, see ``workers.keep_from_parent``); the child registers its own."""
    global _shared_lock
    _shared_lock = threading.Lock()
    _shared.clear()
    _unfilled.clear()


def shared_memory_supported() -> bool:
    """Whether arenas can live in shared memory here (memfd: Linux), and, with CUDA, be
    pinned there (once that has failed, arenas stay pinned and unshared)."""
    return hasattr(os, "memfd_create") and hasattr(mmap, "MAP_SHARED") and not _unpinnable


#: Set once CUDA refused to pin a shared arena: device copies into pageable memory would be
#: slow, so arenas are pinned process memory from then on (and writes stay on threads).
_unpinnable = False


def shared_region(data: torch.Tensor) -> tuple[SharedRegion, int] | None:
    """The shared arena holding ``data``'s bytes, and their offset in it; None if none does.

    Example:
        >>> shared_region(torch.zeros(4)) is None
        True
    """
    start = data.data_ptr()
    end = start + data.numel() * data.element_size()
    with _shared_lock:
        for region in _shared.values():
            if region.address <= start and end <= region.address + region.size:
                return region, start - region.address
    return None


def shared_regions() -> list[SharedRegion]:
    """Every shared arena alive in this process."""
    with _shared_lock:
        return list(_shared.values())


def _shared_arena(size: int, pin: int | None) -> torch.Tensor:
    fd = os.memfd_create("asyncckpt-arena", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        buffer = _faulted_in(region, fault=pin is not None)
    except BaseException:
        os.close(fd)
        raise
    address = buffer.data_ptr()
    if pin is not None and not _register(buffer, size, pin):
        global _unpinnable
        _unpinnable = True
        log.warning(
            "CUDA could not pin a shared-memory arena (cudaHostRegister); arenas are pinned "
            "process memory from now on, and background writes run on threads"
        )
        del buffer, region
        os.close(fd)
        return _torch_pinned(size, pin)
    ident = next(_shared_ids)
    with _shared_lock:
        _shared[ident] = SharedRegion(ident, fd, size, address)
        if pin is None:
            _unfilled.add(ident)
    # Dropped by the pool (replaced by a larger arena): forget it, close the memfd (its
    # registration, if any, is undone by _register's own finalizer).
    finalizer = weakref.finalize(buffer, _forget_shared, ident, fd)
    finalizer.atexit = False  # at exit the process's memory goes anyway, and CUDA may be gone
    return buffer


def _forget_shared(ident: int, fd: int) -> None:
    with _shared_lock:
        _shared.pop(ident, None)
        _unfilled.discard(ident)
    with contextlib.suppress(OSError):
        os.close(fd)


# ----------------------------------------------------------------------------- filling

#: Idents of shared arenas whose pages were never faulted in (see :func:`fill`).
_unfilled: set[int] = set()
#: Bytes one ``pwrite`` of :func:`fill` moves: a writer following the copy sees each land.
FILL_STEP = 8 << 20


def unfilled(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is a new shared arena whose pages are not in memory yet: its
    first copy should be :func:`fill`, which allocates each page as it writes it.

    Example:
        >>> unfilled(torch.zeros(4))
        False
    """
    found = shared_region(buffer)
    with _shared_lock:
        return found is not None and found[0].ident in _unfilled


def fill(
    buffer: torch.Tensor,
    pieces: list[tuple[int, torch.Tensor]],
    progress: Callable[[int], None] | None = None,
) -> None:
    """Copy host ``pieces`` (byte offset in ``buffer``, 1-D contiguous uint8 CPU tensor)
    into the unfilled shared arena ``buffer`` by writing its memfd (``pwrite``).

    A first save into fresh memory otherwise pays twice: the kernel zeroes each page as it
    is faulted in, then the copy writes it again; through the file, each page is allocated
    and filled in one pass (about 1.5x faster here). ``progress(end)`` is called once, at
    the end (a first save is not worth serializing for a writer following the copy).
    Afterwards this process's mapping is faulted in on a background thread, for the next
    save.

    Example:
        >>> if shared_memory_supported():
        ...     arena = _allocate(4096, shared=True)
        ...     fill(arena, [(64, torch.arange(4, dtype=torch.uint8))])
        ...     print(arena[64:68].tolist(), unfilled(arena))
        ... else:
        ...     print([0, 1, 2, 3], False)
        [0, 1, 2, 3] False
    """
    found = shared_region(buffer)
    assert found is not None, "fill() needs a shared arena"
    region, base = found
    steps = [
        (base + at + start, data[start : start + FILL_STEP])
        for at, data in pieces
        for start in range(0, data.numel(), FILL_STEP)
    ]
    if len(steps) < 2:
        for offset, data in steps:
            _pwrite(region.fd, offset, data)
    else:
        _on_threads(region.fd, steps)
    if progress is not None and steps:  # all of it at once: the threads finish out of order
        progress(max(offset - base + data.numel() for offset, data in steps))
    with _shared_lock:
        _unfilled.discard(region.ident)
    mapping = _mappings.get(region.address)
    if mapping is not None:  # the next save copies into it: its page tables, off its path
        threading.Thread(target=_populate_quietly, args=(mapping,), daemon=True).start()


def _pwrite(fd: int, offset: int, data: torch.Tensor) -> None:
    view = memoryview(data.numpy())  # type: ignore[arg-type]
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _on_threads(fd: int, steps: list[tuple[int, torch.Tensor]]) -> None:
    """``_pwrite`` every step, on as many threads as there are usable CPUs (at most 8)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with ThreadPoolExecutor(min(cpus or 1, 8, len(steps))) as pool:
        for written in [pool.submit(_pwrite, fd, *step) for step in steps]:
            written.result()  # the first error, on the caller's thread


def populate(buffer: torch.Tensor) -> None:
    """Fault an unfilled shared arena in now (what ``reserve`` does ahead of a save)."""
    found = shared_region(buffer)
    if found is None or not unfilled(buffer):
        return
    mapping = _mappings.get(found[0].address)
    if mapping is not None:
        _fault_in(mapping)
    with _shared_lock:
        _unfilled.discard(found[0].ident)


def _populate_quietly(mapping: mmap.mmap) -> None:
    # Only the advice: _fault_range's fallback writes zeros, over the data just filled in.
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, ValueError):  # unmapped meanwhile, old kernel
            mapping.madvise(_MADV_POPULATE_WRITE, 0, len(mapping))
