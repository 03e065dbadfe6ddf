"""Read one file: footer, manifest, then every chunk in parallel, verified, into place.

Every chunk's checksum is verified before it is decoded; a mismatch raises
:class:`~asyncckpt.errors.ChecksumError` naming the file, the chunk and the keys it holds.
Tensors are rebuilt as views over their (possibly shared) storages and placed per
``map_location`` (see :mod:`asyncckpt._device`).
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from asyncckpt import _config as config
from asyncckpt._device import Placement, device_types, known_device
from asyncckpt._engine.snapshot import byte_view
from asyncckpt._format.codec import checksum, decode_chunk
from asyncckpt._format.container import (
    FOOTER_SIZE,
    HEADER_SIZE,
    MAX_EXPANSION,
    Chunk,
    Manifest,
    StorageEntry,
    decode_footer,
    decode_header,
    decode_manifest,
)
from asyncckpt._format.tree import tensor_paths, torch_dtype, unflatten
from asyncckpt._storage import ReadHandle, Storage
from asyncckpt._threads import DaemonPool, pool
from asyncckpt.errors import (
    ChecksumError,
    FileReplacedError,
    FormatError,
    MemoryBudgetError,
    TruncatedFileError,
)

log = logging.getLogger(__name__)


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


def open_file(storage: Storage, path: str) -> OpenedFile:
    """Open ``path`` (one handle, see :meth:`Storage.open_read`) and read and validate its
    header, footer and manifest (three small reads through the handle).

    Returns:
        The opened file; the caller closes it (``with open_file(...) as opened:``).

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        TruncatedFileError, FormatError: the file is not a complete asyncckpt file.
        FileReplacedError: the file was replaced between two of the reads (object stores).
    """
    handle = storage.open_read(path)
    try:
        return _opened(storage, path, handle)
    except BaseException:
        handle.close()
        raise


def _opened(storage: Storage, path: str, handle: ReadHandle) -> OpenedFile:
    name, size = storage.describe(path), handle.size
    if size < HEADER_SIZE + FOOTER_SIZE:
        raise TruncatedFileError(f"{name}: {size} bytes is too short for an asyncckpt file")
    decode_header(handle.read_range(0, HEADER_SIZE), name)
    footer = decode_footer(handle.read_range(size - FOOTER_SIZE, FOOTER_SIZE), size, name)
    body = handle.read_range(footer.manifest_offset, footer.manifest_length)
    manifest = decode_manifest(body, footer, name)
    if manifest.byteorder != sys.byteorder:
        raise FormatError(
            f"{name}: written on a {manifest.byteorder}-endian machine; this one is "
            f"{sys.byteorder}-endian and asyncckpt does not swap bytes"
        )
    return OpenedFile(storage, path, size, manifest, handle)


#: How many times a load starts over on a file replaced under it (an object store's
#: ``412``) before it gives up with :class:`~asyncckpt.errors.FileReplacedError`.
REPLACED_ATTEMPTS = 5

T = TypeVar("T")


def read_file(
    storage: Storage,
    path: str,
    work: Callable[[OpenedFile], T],
    budget: Budget | None = None,
) -> T:
    """Open ``path``, run ``work`` on it, close it; start over if it is replaced meanwhile.

    On local disk and ``memory://`` the opened version stays readable however often the
    file is replaced, so ``work`` runs once. On an object store a read of a replaced object
    fails (``If-Match``), and the whole of ``work`` runs again on the new object, at most
    :data:`REPLACED_ATTEMPTS` times in all; ``budget`` is given back what an abandoned
    attempt charged.

    Args:
        storage: where the file is.
        path: the file.
        work: what to do with it (read it, check it): called with the opened file.
        budget: the memory budget ``work`` charges, if any.

    Returns:
        What ``work`` returns.

    Raises:
        FileReplacedError: the file was replaced during every attempt.
        Exception: whatever ``open_file`` or ``work`` raised.

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt._storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"w": torch.arange(3)}, path).result()
        >>> read_file(*resolve(path, None), lambda opened: len(opened.manifest.tensors))
        1
    """
    used = budget.used if budget is not None else 0
    for attempt in range(1, REPLACED_ATTEMPTS + 1):
        try:
            with open_file(storage, path) as opened:
                return work(opened)
        except FileReplacedError as exc:
            if budget is not None:
                budget.used = used  # what the abandoned attempt allocated is dropped
            if attempt == REPLACED_ATTEMPTS:
                raise FileReplacedError(
                    exc.path,
                    f"the file was replaced while it was being loaded, {attempt} times in "
                    "a row (every load started over on the new file, which was replaced "
                    "again): something keeps overwriting it; load it once that stops, or "
                    f"load a file nobody writes ({exc})",
                ) from exc
            log.info("%s was replaced while loading it; loading it again", exc.path)
    raise AssertionError("unreachable")  # pragma: no cover


#: Chunks queued per reader thread ahead of the oldest unfinished one; buffers are
#: allocated as their first chunk is queued, so a damaged file fails before most of them.
_QUEUED_PER_THREAD = 4


def pin_budget_bytes() -> int:
    """The pinned-memory budget of one load (the ``pin_budget_bytes`` tunable).

    Example:
        >>> pin_budget_bytes() == config.DEFAULTS["pin_budget_bytes"][0]  # variable unset
        True
    """
    return config.tunable("pin_budget_bytes", None)


def read_storages(
    opened: OpenedFile,
    threads: int,
    destinations: Sequence[torch.Tensor | None] | None = None,
    pinned: Sequence[bool] | None = None,
    budget: Budget | None = None,
) -> list[torch.Tensor]:
    """Read, verify and decode every storage, in parallel chunks.

    Buffers are allocated as reading reaches them, after the declared sizes were checked
    against the file's size, so a crafted file cannot make the reader allocate more than
    its bytes can decode to.

    Args:
        opened: the file.
        threads: reader threads.
        destinations: per storage, a 1-D uint8 CPU tensor of exactly its size to read into,
            or None to allocate one.
        pinned: per storage, whether an allocated buffer should be pinned (for a CUDA copy);
            honoured up to :func:`pin_budget_bytes` in all, in storage order.
        budget: charged with the buffers allocated here, before the first one is.

    Returns:
        One 1-D uint8 CPU tensor per storage.

    Raises:
        ChecksumError: a chunk is damaged (the first one found).
        FormatError: the declared sizes cannot be justified by the file, or allocated.
        MemoryBudgetError: the buffers would exceed ``budget``.

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt._storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"w": torch.arange(3)}, path).result()
        >>> with open_file(*resolve(path, None)) as opened:
        ...     [b.numel() for b in read_storages(opened, threads=2)]
        [24]
    """
    storages = opened.manifest.storages
    check_sizes(opened)
    destinations = destinations or [None] * len(storages)
    if budget is not None:
        fresh = sum(e.nbytes for e, dest in zip(storages, destinations) if dest is None)
        budget.charge(opened.name, fresh, "its storages")
    pins = _within_budget(storages, pinned or [False] * len(storages), pin_budget_bytes())
    queue = _Queue(pool("read", threads), threads * _QUEUED_PER_THREAD)
    buffers = []
    try:
        for sid, (entry, dest, pin) in enumerate(zip(storages, destinations, pins)):
            buf = dest if dest is not None else _allocate_for(opened, entry.nbytes, pin)
            buffers.append(buf)
            view, start = byte_view(buf), 0
            for index in range(entry.first_chunk, entry.first_chunk + entry.num_chunks):
                chunk = opened.manifest.chunks[index]
                out = view[start : start + chunk.raw_len]
                queue.submit(_read_chunk, opened, index, chunk, sid, out)
                start += chunk.raw_len
        queue.drain()
    finally:
        queue.cancel()
    return buffers


def check_sizes(opened: OpenedFile) -> None:
    """Refuse a file whose chunks claim to decode to more than its size can justify.

    The manifest's validation already holds every chunk to :data:`MAX_EXPANSION` times its
    stored bytes, chunks to disjoint bytes of the file and storages to disjoint runs of
    chunks; this states the consequence against the file's actual size, so that nothing is
    allocated from a manifest that contradicts it.

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
    """The memory one load may allocate for decoded data, over all the files it reads.

    Args:
        max_bytes: the limit in bytes (``max_bytes`` of ``load``); None: no limit besides
            what the files' sizes bound.

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


def _within_budget(
    storages: Sequence[StorageEntry], wanted: Sequence[bool], budget: int
) -> list[bool]:
    """Pin the storages that want it, in order, while the budget lasts."""
    pins = []
    for entry, want in zip(storages, wanted):
        pin = want and entry.nbytes <= budget
        budget -= entry.nbytes if pin else 0
        pins.append(pin)
    return pins


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
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _stored_scratch(size: int) -> memoryview:
    """A per-thread buffer for compressed chunk bytes, reused across chunks."""
    buf: bytearray | None = getattr(_local, "stored", None)
    if buf is None or len(buf) < size:
        buf = _local.stored = bytearray(size)
    return memoryview(buf)[:size]


_local = threading.local()


def _read_chunk(opened: OpenedFile, index: int, chunk: Chunk, sid: int, out: memoryview) -> None:
    if chunk.codec == "raw":
        got = opened.read_into(chunk.offset, out)
        stored = out[:got]
    else:
        stored = _stored_scratch(chunk.stored_len)
        got = opened.read_into(chunk.offset, stored)
        stored = stored[:got]
    if got != chunk.stored_len:
        detail = f"only {got} of {chunk.stored_len} bytes could be read"
        raise ChecksumError(opened.name, index, opened.manifest.keys_of_storage(sid), detail)
    if checksum(stored) != chunk.crc32:
        raise ChecksumError(
            opened.name, index, opened.manifest.keys_of_storage(sid), "checksum mismatch"
        )
    if chunk.codec != "raw":
        try:
            decode_chunk(stored, chunk.codec, opened.manifest.storages[sid].itemsize, out)
        except FormatError as exc:
            keys = opened.manifest.keys_of_storage(sid)
            raise ChecksumError(opened.name, index, keys, str(exc)) from exc


def materialize(
    opened: OpenedFile,
    placement: Placement,
    threads: int,
    into: Any = None,
    budget: Budget | None = None,
) -> Any:
    """Read everything and rebuild the saved object, tensors placed per ``placement``.

    Args:
        opened: the file.
        placement: where tensors go.
        threads: reader threads.
        into: optional existing state (e.g. ``model.state_dict()``); each saved tensor whose
            key path matches a tensor there is loaded into that tensor, in place, and the
            returned object holds the existing tensor. Nothing in ``into`` changes unless
            every chunk was verified and every target matches, so a failed load leaves it
            as it was.
        budget: charged with every storage (all are read into fresh buffers) before any
            is allocated.

    Returns:
        The saved object.

    Raises:
        FormatError: a storage names an unknown device type, or sizes the file cannot hold.
        MemoryBudgetError: the storages would exceed ``budget``.
        ChecksumError: a chunk is damaged.
        ValueError: a tensor in ``into`` differs in shape or dtype from the saved one, or
            ``into`` shares no tensor with the file (see :func:`check_overlap`).

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt._storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"w": torch.arange(3)}, path).result()
        >>> state = {"w": torch.zeros(3, dtype=torch.int64)}
        >>> with open_file(*resolve(path, None)) as opened:
        ...     _ = materialize(opened, Placement("cpu"), 2, into=state)
        >>> state["w"]
        tensor([0, 1, 2])
    """
    manifest = opened.manifest
    check_devices(opened)
    targets = tensor_paths(into) if into is not None else {}
    if into is not None:
        check_overlap(opened, into, targets)
    pins = [placement.wants_pinned(entry.device) for entry in manifest.storages]
    # Read into fresh buffers, never into `into` itself: a chunk found damaged late must
    # not leave the caller's tensors half overwritten.
    raw = read_storages(opened, threads, None, pins, budget)
    placed = [placement.place(buf, entry.device) for buf, entry in zip(raw, manifest.storages)]
    tensors, copies = [], []
    for entry in manifest.tensors:
        view = _view(
            placed[entry.storage],
            entry.dtype,
            entry.shape,
            entry.stride,
            entry.offset,
            entry.requires_grad,
            entry.parameter,
        )
        target = targets.get(entry.key)
        if target is not None:
            _check_target(opened.name, entry.key, target, view)
            copies.append((target, view))
            view = target
        tensors.append(view)
    with torch.no_grad():
        for target, view in copies:
            target.copy_(view)
    placement.synchronize()
    arrays = [_array(raw[a.storage], a.dtype, a.shape, a.scalar) for a in manifest.arrays]
    return unflatten(manifest.root, tensors, arrays, opened.name)


def check_overlap(opened: OpenedFile, into: Any, targets: dict[str, torch.Tensor]) -> None:
    """Refuse an ``into`` that would receive nothing from a file that holds tensors.

    ``load(f, into=model.state_dict())`` of a file saved as ``{"model": ..., "optim": ...}``
    matches no key path and would otherwise load nothing into the model, silently.

    Raises:
        ValueError: no tensor of the file has a key path that holds a tensor in ``into``;
            names the file and both sides' top-level keys.
    """
    saved = [entry.key for entry in opened.manifest.tensors]
    if not saved or any(key in targets for key in saved):
        return
    theirs = _top_level_keys(opened.manifest.root)
    ours = list(into) if isinstance(into, dict) else type(into).__qualname__
    raise ValueError(
        f"{opened.name}: into= shares no tensor with the file, so nothing would be loaded "
        f"into it: the file's top-level keys are {theirs}, into's are {ours}. Pass the part "
        "of into that matches (e.g. into={'model': model.state_dict()} for a file saved as "
        "{'model': ..., 'optim': ...}), or load without into"
    )


def _top_level_keys(root: Any) -> Any:
    """The keys of the file's root dict, as saved (strings and ints as themselves)."""
    if not isinstance(root, dict) or not ({"dict", "odict"} & set(root)):
        return "(not a dict)"
    pairs = root.get("dict", root.get("odict"))
    if not isinstance(pairs, list):
        return "(not a dict)"
    return [
        p[0] if isinstance(p, list) and p and not isinstance(p[0], dict) else "?" for p in pairs
    ]


def check_devices(opened: OpenedFile) -> None:
    """Refuse storages whose device type is not one torch can place data on.

    A device string from a file must never reach ``getattr(torch, kind)``: names such as
    ``_dynamo`` would import torch subpackages.

    Raises:
        FormatError: names the file, the storage's keys and the device.

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt._storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"w": torch.arange(3)}, path).result()
        >>> with open_file(*resolve(path, None)) as opened:
        ...     check_devices(opened)
    """
    for sid, entry in enumerate(opened.manifest.storages):
        if not known_device(entry.device):
            keys = ", ".join(opened.manifest.keys_of_storage(sid)[:5]) or f"storage {sid}"
            raise FormatError(
                f"{opened.name}: {keys}: device {entry.device!r} is not a known device type "
                f"(one of {', '.join(sorted(device_types()))})"
            )


def _check_target(name: str, key: str, target: torch.Tensor, loaded: torch.Tensor) -> None:
    if target.shape != loaded.shape or target.dtype != loaded.dtype:
        raise ValueError(
            f"{name}: cannot load {key} into the given tensor: saved {loaded.dtype} "
            f"{tuple(loaded.shape)}, target {target.dtype} {tuple(target.shape)}"
        )


def _view(
    storage: torch.Tensor,
    dtype_name: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    requires_grad: bool,
    parameter: bool,
) -> torch.Tensor:
    dtype = torch_dtype(dtype_name)
    t = torch.empty(0, dtype=dtype, device=storage.device)
    t.set_(storage.untyped_storage(), offset, shape, stride)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _array(buf: torch.Tensor, dtype: str, shape: tuple[int, ...], scalar: bool) -> Any:
    array = buf.numpy().view(np.dtype(dtype)).reshape(shape)
    return array[()] if scalar else array
