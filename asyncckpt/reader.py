"""Read one file: footer, manifest, then every chunk in parallel, verified, into place.

Every chunk's checksum is verified before it is decoded; a mismatch raises
:class:`~asyncckpt.errors.ChecksumError` naming the file, the chunk and the keys it holds.
Tensors are rebuilt as views over their (possibly shared) storages and placed per
``map_location`` (see :mod:`asyncckpt.placement`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .codec import checksum, decode_chunk
from .errors import ChecksumError, FormatError, TruncatedFileError
from .format import (
    FOOTER_SIZE,
    HEADER_SIZE,
    Chunk,
    Manifest,
    decode_footer,
    decode_header,
    decode_manifest,
)
from .placement import Placement
from .staging import byte_view
from .storage import Storage
from .tree import dtype_name, tensor_paths, torch_dtype, unflatten
from .workers import pool


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


def read_storages(
    opened: OpenedFile,
    threads: int,
    destinations: Sequence[torch.Tensor | None] | None = None,
    pinned: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """Read, verify and decode every storage, in parallel chunks.

    Args:
        opened: the file.
        threads: reader threads.
        destinations: per storage, a 1-D uint8 CPU tensor of exactly its size to read into
            (e.g. the memory of an existing tensor), or None to allocate one.
        pinned: per storage, whether an allocated buffer should be pinned (for a CUDA copy).

    Returns:
        One 1-D uint8 CPU tensor per storage.

    Raises:
        ChecksumError: a chunk is damaged (the first one found).
        FormatError: the declared sizes cannot be allocated.
    """
    storages = opened.manifest.storages
    destinations = destinations or [None] * len(storages)
    pinned = pinned or [False] * len(storages)
    buffers = []
    for entry, dest, pin in zip(storages, destinations, pinned):
        try:
            buffers.append(dest if dest is not None else _allocate(entry.nbytes, pin))
        except RuntimeError as exc:  # out of memory, or a crafted file declaring absurd sizes
            raise FormatError(
                f"{opened.name}: cannot allocate the {entry.nbytes} bytes of a storage"
            ) from exc
    workers = pool("read", threads)
    futures: list[Future[None]] = []
    for sid, (entry, buf) in enumerate(zip(storages, buffers)):
        view = byte_view(buf)
        start = 0
        for index in range(entry.first_chunk, entry.first_chunk + entry.num_chunks):
            chunk = opened.manifest.chunks[index]
            out = view[start : start + chunk.raw_len]
            futures.append(workers.submit(_read_chunk, opened, index, chunk, sid, out))
            start += chunk.raw_len
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return buffers


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
            returned object holds the existing tensor. CPU tensors that match exactly are
            read straight into their memory, without a second copy.

    Raises:
        ValueError: a tensor in ``into`` differs in shape or dtype from the saved one.
    """
    manifest = opened.manifest
    targets = tensor_paths(into) if into is not None else {}
    direct = _direct_targets(manifest, targets)
    destinations = [
        direct[sid][1] if sid in direct else None for sid in range(len(manifest.storages))
    ]
    pins = [placement.wants_pinned(entry.device) for entry in manifest.storages]
    raw = read_storages(opened, threads, destinations, pins)
    placed = [
        buf if sid in direct else placement.place(buf, entry.device)
        for sid, (buf, entry) in enumerate(zip(raw, manifest.storages))
    ]
    tensors = []
    for entry in manifest.tensors:
        target = targets.get(entry.key)
        if target is not None and entry.storage in direct:
            tensors.append(target)
            continue
        view = _view(
            placed[entry.storage],
            entry.dtype,
            entry.shape,
            entry.stride,
            entry.offset,
            entry.requires_grad,
            entry.parameter,
        )
        if target is not None:
            _check_target(opened.name, entry.key, target, view)
            with torch.no_grad():
                target.copy_(view)
            view = target
        tensors.append(view)
    placement.synchronize()
    arrays = [_array(raw[a.storage], a.dtype, a.shape, a.scalar) for a in manifest.arrays]
    return unflatten(manifest.root, tensors, arrays, opened.name)


def _direct_targets(
    manifest: Manifest, targets: dict[str, torch.Tensor]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Storages that can be read straight into an existing tensor: sid -> (tensor, bytes)."""
    users: dict[int, int] = {}
    for entry in manifest.tensors:
        users[entry.storage] = users.get(entry.storage, 0) + 1
    direct = {}
    for entry in manifest.tensors:
        target = targets.get(entry.key)
        storage = manifest.storages[entry.storage]
        if (
            target is None
            or users[entry.storage] != 1
            or target.device.type != "cpu"
            or not target.is_contiguous()
            or dtype_name(target.dtype) != entry.dtype
            or tuple(target.shape) != entry.shape
            or entry.offset != 0
            or target.numel() * target.element_size() != storage.nbytes
            or (target.numel() > 1 and entry.stride != tuple(target.stride()))
        ):
            continue
        data = torch.empty(0, dtype=torch.uint8).set_(
            target.untyped_storage(),
            target.storage_offset() * target.element_size(),
            (storage.nbytes,),
            (1,),
        )
        direct[entry.storage] = (target, data)
    return direct


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
