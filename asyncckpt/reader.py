"""Read one file: footer, manifest, then every chunk in parallel, verified, into place.

Every chunk's checksum is verified before it is decoded; a mismatch raises
:class:`~asyncckpt.errors.ChecksumError` naming the file, the chunk and the keys it holds.
Tensors are rebuilt as views over their (possibly shared) storages and placed per
``map_location`` (see :mod:`asyncckpt.placement`).
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import config
from .codec import checksum, decode_chunk
from .errors import ChecksumError, FormatError, TruncatedFileError
from .format import (
    FOOTER_SIZE,
    HEADER_SIZE,
    Chunk,
    Manifest,
    StorageEntry,
    decode_footer,
    decode_header,
    decode_manifest,
)
from .placement import Placement, device_types, known_device
from .staging import byte_view
from .storage import Storage
from .tree import tensor_paths, torch_dtype, unflatten
from .workers import DaemonPool, pool


@dataclass(frozen=True)
class OpenedFile:
    """A file whose footer and manifest have been read and validated."""

    storage: Storage
    path: str
    size: int
    manifest: Manifest

    @property
    def name(self) -> str:
        return self.storage.describe(self.path)


def open_file(storage: Storage, path: str) -> OpenedFile:
    """Read and validate a file's header, footer and manifest (three small reads).

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        TruncatedFileError, FormatError: the file is not a complete asyncckpt file.
    """
    name = storage.describe(path)
    size = storage.size(path)
    if size < HEADER_SIZE + FOOTER_SIZE:
        raise TruncatedFileError(f"{name}: {size} bytes is too short for an asyncckpt file")
    decode_header(storage.read_range(path, 0, HEADER_SIZE), name)
    footer = decode_footer(storage.read_range(path, size - FOOTER_SIZE, FOOTER_SIZE), size, name)
    body = storage.read_range(path, footer.manifest_offset, footer.manifest_length)
    manifest = decode_manifest(body, footer, name)
    if manifest.byteorder != sys.byteorder:
        raise FormatError(
            f"{name}: written on a {manifest.byteorder}-endian machine; this one is "
            f"{sys.byteorder}-endian and asyncckpt does not swap bytes"
        )
    return OpenedFile(storage, path, size, manifest)


#: Default bound on the host memory pinned by one load (page-locked memory cannot be
#: swapped, so a file claiming huge CUDA tensors must not pin all of RAM). Storages past
#: the budget are read into ordinary memory; their copy to the device is then synchronous.
#: zstd's best case: a 128 KiB block stored as a 3-byte header and one repeated byte. A
#: chunk claiming more raw bytes per stored byte cannot be genuine.
MAX_EXPANSION = 32_768
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

    Returns:
        One 1-D uint8 CPU tensor per storage.

    Raises:
        ChecksumError: a chunk is damaged (the first one found).
        FormatError: the declared sizes cannot be justified by the file, or allocated.

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt.storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"w": torch.arange(3)}, path).result()
        >>> [b.numel() for b in read_storages(open_file(*resolve(path, None)), threads=2)]
        [24]
    """
    storages = opened.manifest.storages
    check_sizes(opened)
    destinations = destinations or [None] * len(storages)
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
    """Refuse a manifest whose chunks claim more bytes than the file can hold.

    Chunks must not share bytes of the file, and no chunk may decode to more than
    :data:`MAX_EXPANSION` times its stored length, so the total raw size is bounded by the
    file's size before anything is allocated from it.

    Raises:
        FormatError: chunks overlap, or a chunk's raw length is impossible.

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt.storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"w": torch.zeros(1000)}, path).result()
        >>> check_sizes(open_file(*resolve(path, None)))
    """
    chunks = opened.manifest.chunks
    for index, chunk in enumerate(chunks):
        if chunk.raw_len > max(chunk.stored_len, 1) * MAX_EXPANSION:
            raise FormatError(
                f"{opened.name}: chunk {index} claims {chunk.raw_len} bytes from "
                f"{chunk.stored_len} stored bytes, more than any chunk can decode to"
            )
    end = 0
    for chunk in sorted(chunks, key=lambda c: c.offset):
        if chunk.stored_len and chunk.offset < end:
            raise FormatError(f"{opened.name}: chunks overlap at byte {chunk.offset}")
        end = max(end, chunk.offset + chunk.stored_len)


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
        got = opened.storage.read_into(opened.path, chunk.offset, out)
        stored = out[:got]
    else:
        stored = _stored_scratch(chunk.stored_len)
        got = opened.storage.read_into(opened.path, chunk.offset, stored)
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


def materialize(opened: OpenedFile, placement: Placement, threads: int, into: Any = None) -> Any:
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

    Returns:
        The saved object.

    Raises:
        FormatError: a storage names an unknown device type, or sizes the file cannot hold.
        ChecksumError: a chunk is damaged.
        ValueError: a tensor in ``into`` differs in shape or dtype from the saved one, or
            ``into`` shares no tensor with the file (see :func:`check_overlap`).

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt.storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"w": torch.arange(3)}, path).result()
        >>> state = {"w": torch.zeros(3, dtype=torch.int64)}
        >>> _ = materialize(open_file(*resolve(path, None)), Placement("cpu"), 2, into=state)
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
    raw = read_storages(opened, threads, None, pins)
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
        >>> from asyncckpt.storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"w": torch.arange(3)}, path).result()
        >>> check_devices(open_file(*resolve(path, None)))
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
