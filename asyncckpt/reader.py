"""Read one file: footer, manifest, then every chunk in parallel, verified, into place.

Every chunk's checksum is verified before it is decoded; a mismatch raises
:class:`~asyncckpt.errors.ChecksumError` naming the file, the chunk and the keys it holds.
Tensors are rebuilt as views over their (possibly shared) storages and placed per
``map_location`` (see :mod:`asyncckpt.placement`).
"""

from __future__ import annotations

import sys
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
from .tree import torch_dtype, unflatten
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


def read_storages(opened: OpenedFile, threads: int) -> list[torch.Tensor]:
    """Read, verify and decode every storage into a fresh CPU uint8 tensor."""
    manifest = opened.manifest
    total = sum(s.nbytes for s in manifest.storages)
    try:
        buffers = [torch.empty(s.nbytes, dtype=torch.uint8) for s in manifest.storages]
    except RuntimeError as exc:  # out of memory, or a crafted file declaring absurd sizes
        raise FormatError(f"{opened.name}: cannot allocate the {total} bytes it declares") from exc
    workers = pool("read", threads)
    futures: list[Future[None]] = []
    for sid, (entry, buf) in enumerate(zip(manifest.storages, buffers)):
        view = byte_view(buf)
        start = 0
        for index in range(entry.first_chunk, entry.first_chunk + entry.num_chunks):
            chunk = manifest.chunks[index]
            out = view[start : start + chunk.raw_len]
            futures.append(workers.submit(_read_chunk, opened, index, chunk, sid, out))
            start += chunk.raw_len
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return buffers


def _read_chunk(opened: OpenedFile, index: int, chunk: Chunk, sid: int, out: memoryview) -> None:
    itemsize = opened.manifest.storages[sid].itemsize
    if chunk.codec == "raw":
        got = opened.storage.read_into(opened.path, chunk.offset, out)
        stored: bytes | memoryview = out[:got]
    else:
        stored = opened.storage.read_range(opened.path, chunk.offset, chunk.stored_len)
        got = len(stored)
    keys = opened.manifest.keys_of_storage(sid)
    if got != chunk.stored_len:
        raise ChecksumError(
            opened.name, index, keys, f"only {got} of {chunk.stored_len} bytes could be read"
        )
    if checksum(stored) != chunk.crc32:
        raise ChecksumError(opened.name, index, keys, "checksum mismatch")
    if chunk.codec != "raw":
        try:
            decode_chunk(stored, chunk.codec, itemsize, out)
        except FormatError as exc:
            raise ChecksumError(opened.name, index, keys, str(exc)) from exc


def materialize(opened: OpenedFile, placement: Placement, threads: int) -> Any:
    """Read everything and rebuild the saved object, tensors placed per ``placement``."""
    manifest = opened.manifest
    raw = read_storages(opened, threads)
    placed = [placement.place(buf, entry.device) for buf, entry in zip(raw, manifest.storages)]
    tensors = [
        _view(placed[t.storage], t.dtype, t.shape, t.stride, t.offset, t.requires_grad, t.parameter)
        for t in manifest.tensors
    ]
    arrays = [_array(raw[a.storage], a.dtype, a.shape, a.scalar) for a in manifest.arrays]
    return unflatten(manifest.root, tensors, arrays, opened.name)


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
