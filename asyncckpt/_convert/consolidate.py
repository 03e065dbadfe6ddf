"""Consolidate a sharded checkpoint offline, one tensor at a time.

A sharded checkpoint (a sharded ``Checkpointer`` version, or an :class:`asyncckpt.dcp.Writer`
directory) spreads each tensor's chunks over the ranks' files. :attr:`ShardedSource.skeleton`
is the saved state with each sharded tensor a zero-element *placeholder* (selecting a part
and laying out an output cost nothing); :meth:`ShardedSource.full` builds one whole tensor
from only its chunks. Writers that stream ask for the tensors in file order and drop each
once written, so peak memory is the largest tensor plus in-flight chunks, not the
checkpoint; ``torch.save`` output (:func:`materialize_all`) is the exception
(``docs/sharded.md``).

Example:
    >>> import os, tempfile, torch, warnings
    >>> import torch.distributed.checkpoint as dcp
    >>> import asyncckpt.dcp
    >>> from asyncckpt._storage import resolve
    >>> url = os.path.join(tempfile.mkdtemp(), "step-1")
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     _ = dcp.save({"w": torch.ones(2, 3)}, storage_writer=asyncckpt.dcp.Writer(url))
    >>> from asyncckpt._settings import Settings
    >>> src = ShardedSource.open(*resolve(url, None), None, Settings())
    >>> placeholder = src.skeleton["w"]
    >>> placeholder.numel(), src.full(placeholder).sum().item()
    (0, 6.0)
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from asyncckpt._convert.safetensors import flat_bytes, safetensors_dtype, safetensors_header
from asyncckpt._device import Placement
from asyncckpt._engine.decode import OpenedFile, check_devices, materialize, read_storages
from asyncckpt._engine.encode import WriteOptions, write_chunks, write_manifest
from asyncckpt._engine.snapshot import StagedStorage, codec_hint
from asyncckpt._format.container import ArrayEntry, Chunk, StorageEntry, TensorEntry, encode_header
from asyncckpt._format.index import ItemLocation, saved_path, tied_names
from asyncckpt._format.tree import Path, dtype_name, empty_of, flatten, torch_dtype
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt._versions.dcp_reader import open_data_file, size_error
from asyncckpt._versions.protocol import SHARDED, CommitRecord
from asyncckpt._versions.sharded_reading import rank_file_name, substituted, version_metadata
from asyncckpt.errors import FormatError

__all__ = [
    "ShardedSource",
    "materialize_all",
    "safetensors_dtype",
    "safetensors_header",
    "write_ackpt_stream",
]


@dataclass
class ShardedSource:
    """A sharded checkpoint opened for consolidation (see the module docstring).

    Attributes:
        storage: where the checkpoint is.
        directory: the directory holding the metadata and the rank files.
        metadata: the checkpoint's DCP metadata (``storage_data``: item locations).
        skeleton: the saved state; sharded tensors are zero-element placeholders.
        name: how to name the checkpoint in messages.
        settings: the tunables its reads use, the entry point's.
    """

    storage: Storage
    directory: str
    metadata: Metadata
    skeleton: Any
    name: str
    settings: Settings
    _fqn_of: dict[int, str] = field(default_factory=dict)
    _files: dict[str, OpenedFile] = field(default_factory=dict)

    @classmethod
    def open(
        cls, storage: Storage, directory: str, commit: CommitRecord | None, settings: Settings
    ) -> ShardedSource:
        """Open the checkpoint in ``directory`` (a sharded version's, ``commit``'s, or an
        ``asyncckpt.dcp`` one). Rank 0's plain values come from its file; without ``commit``
        the skeleton is built from the metadata's key paths. Rank files stay open, pinned,
        until :meth:`close`.

        Raises:
            IncompleteCheckpointError: no metadata (not committed).
            FormatError: the metadata or a rank file is malformed.
        """
        _, metadata = version_metadata(storage, directory, commit, settings)
        src = cls(storage, directory, metadata, None, storage.describe(directory), settings)
        placeholders: dict[Path, torch.Tensor] = {}
        for names in tied_names(metadata):
            md = metadata.state_dict_metadata[names[0]]
            if isinstance(md, TensorStorageMetadata):
                # A distinct zero-element tensor per stored tensor: ``flatten`` and the
                # writers tell placeholders apart by identity, and it costs no memory.
                # Names stored alike (a tied weight) share one: it is built once, and
                # written once by the writers, which keep ties.
                placeholder = empty_of(md.properties.dtype)
                src._fqn_of[id(placeholder)] = names[0]
                for fqn in names:
                    placeholders[saved_path(metadata, fqn)] = placeholder
        try:
            src.skeleton = src._skeleton(commit, placeholders)
        except BaseException:
            src.close()
            raise
        return src

    def _skeleton(self, commit: CommitRecord | None, placeholders: dict[Path, torch.Tensor]) -> Any:
        if commit is not None and commit.kind == SHARDED:
            return self._with_plain(commit, placeholders)
        values: dict[Path, Any] = dict(placeholders)
        for fqn, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                values[saved_path(self.metadata, fqn)] = self._bytes_item(fqn)
        return substituted({}, values, self.name)  # nested dicts holding each value

    def close(self) -> None:
        """Close the rank files opened so far (idempotent; a later read opens them again)."""
        files, self._files = self._files, {}
        for opened in files.values():
            opened.close()

    def __enter__(self) -> ShardedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _with_plain(self, commit: CommitRecord, placeholders: dict[Path, torch.Tensor]) -> Any:
        """Rank 0's plain state with the placeholders where its DTensors were."""
        name, size = rank_file_name(commit, 0, self.name)
        opened = self._opened(name, size)
        check_devices(opened)
        skip = {loc.entry for loc in self.metadata.storage_data.values() if loc.file == name}
        plain = materialize(opened, Placement("cpu"), self.settings, skip=skip)
        return substituted(plain, dict(placeholders), opened.name)

    def _opened(self, name: str, size: int | None) -> OpenedFile:
        """A rank file, opened once (footer and manifest) and checked against its size; it
        stays open, pinned, until :meth:`close`."""
        opened = self._files.get(name)
        if opened is None:
            opened = self._files[name] = open_data_file(self.storage, self.directory, name, size)
        elif size is not None and opened.size != size:
            raise size_error(opened, size)
        return opened

    def _bytes_item(self, fqn: str) -> Any:
        where = self.metadata.storage_data[MetadataIndex(fqn)]
        raw = self._entry_bytes(where)
        # DCP's planner stores non-tensor values as torch.save bytes; weights_only refuses
        # anything that is not plain data, so no arbitrary pickle runs here.
        return torch.load(io.BytesIO(raw.numpy().tobytes()), weights_only=True)

    def _entry_bytes(self, where: ItemLocation) -> torch.Tensor:
        """The tensor at ``where``, read (only its storage) and verified."""
        opened = self._opened(where.file, where.file_size)
        manifest = opened.manifest
        if where.entry >= len(manifest.tensors):
            raise FormatError(f"{opened.name}: no tensor {where.entry} in the file")
        entry = manifest.tensors[where.entry]
        buf = read_storages(opened, self.settings.threads, sids={entry.storage})
        t = empty_of(torch_dtype(entry.dtype))
        t.set_(buf[entry.storage].untyped_storage(), entry.offset, entry.shape, entry.stride)
        if t.numel() * t.element_size() != where.nbytes:
            raise FormatError(f"{opened.name}: tensor {where.entry} is not {where.nbytes} bytes")
        return t

    def is_placeholder(self, t: torch.Tensor) -> bool:
        """Whether ``t`` stands for a sharded tensor of this checkpoint."""
        return id(t) in self._fqn_of

    def fqn_of(self, t: torch.Tensor) -> str:
        """The metadata's name of the sharded tensor placeholder ``t`` stands for.

        Raises:
            KeyError: ``t`` is no placeholder of this checkpoint.
        """
        return self._fqn_of[id(t)]

    def spec(self, t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
        """The dtype and shape ``t`` has once built (itself for a plain tensor)."""
        if not self.is_placeholder(t):
            return t.dtype, tuple(t.shape)
        md = self.metadata.state_dict_metadata[self._fqn_of[id(t)]]
        assert isinstance(md, TensorStorageMetadata)
        return md.properties.dtype, tuple(md.size)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor a placeholder stands for (a plain tensor is returned as is).

        Reads only this tensor's chunks, each chunk's storage on its own, so at most one
        chunk buffer is alive besides the result.

        Raises:
            ChecksumError: a chunk is damaged (names file, chunk and keys).
            FormatError: a chunk's stored shape differs from the metadata.
        """
        if not self.is_placeholder(t):
            return t
        fqn = self._fqn_of[id(t)]
        md = self.metadata.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata)
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for chunk in md.chunks:
            where = self.metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
            piece = self._entry_bytes(where)
            if tuple(piece.shape) != tuple(chunk.sizes) or piece.dtype != out.dtype:
                raise FormatError(
                    f"{self.name}: {fqn} chunk at {tuple(chunk.offsets)} is stored as "
                    f"{piece.dtype} {tuple(piece.shape)}, the metadata says "
                    f"{out.dtype} {tuple(chunk.sizes)}"
                )
            target = out
            for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                target = target.narrow(dim, start, length)
            target.copy_(piece)
            del piece, target  # the chunk buffer goes now, before the next one is read
        return out

    def raw_bytes(self, tree: Any) -> tuple[int, int, int]:
        """``(tensors, bytes, largest tensor's bytes)`` of ``tree`` once built (placeholders
        included)."""
        specs = [self.spec(t) for t, _ in flatten(tree).tensors]
        sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in specs]
        return len(sizes), sum(sizes), max(sizes, default=0)


def materialize_all(src: ShardedSource, tree: Any) -> Any:
    """``tree`` with every placeholder replaced by its whole tensor (all held at once).

    For ``torch.save`` output, which pickles one object: the whole state is in memory.
    Placeholders shared between paths become one tensor.
    """
    built: dict[int, torch.Tensor] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor) and src.is_placeholder(node):
            if id(node) not in built:
                built[id(node)] = src.full(node)
            return built[id(node)]
        if isinstance(node, dict):
            out = type(node)((k, walk(v)) for k, v in node.items())
            if hasattr(node, "_metadata"):
                out._metadata = node._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(node, (list, tuple)):
            items = [walk(v) for v in node]
            return items if isinstance(node, list) else tuple(items)
        return node

    return walk(tree)


# -- .ackpt, streamed ------------------------------------------------------------------------


def write_ackpt_stream(
    src: ShardedSource,
    tree: Any,
    storage: Storage,
    path: str,
    options: WriteOptions,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write ``tree`` as one asyncckpt file, building one tensor at a time.

    The layout is the one ``write_snapshot`` produces (header, each storage's chunks in
    order, manifest, footer), with one storage per tensor; each tensor is built, encoded
    (``inflight_chunks`` chunks in parallel) and written, then dropped before the next is
    built. Numpy arrays of the plain state follow the tensors. Returns the file's size.
    """
    flat = flatten(tree)
    tensor_entries: list[TensorEntry] = []
    storages: list[StorageEntry] = []
    chunks: list[Chunk] = []
    with storage.atomic_write(path) as out:
        header = encode_header()
        out.write(header)
        offset = len(header)

        def put(staged: StagedStorage) -> None:
            nonlocal offset
            first = len(chunks)
            offset = write_chunks(out, offset, [staged], options, chunks, progress)
            storages.append(
                StorageEntry(
                    staged.data.numel(), staged.itemsize, "cpu", first, len(chunks) - first
                )
            )

        for t, key in flat.tensors:
            whole = src.full(t).detach().contiguous()
            put(StagedStorage(flat_bytes(whole), *codec_hint(whole.dtype), "cpu"))
            tensor_entries.append(
                TensorEntry(
                    storage=len(storages) - 1,
                    dtype=dtype_name(whole.dtype),
                    shape=tuple(whole.shape),
                    stride=tuple(whole.stride()),
                    offset=0,
                    requires_grad=t.requires_grad,
                    parameter=isinstance(t, torch.nn.Parameter),
                    key=key,
                )
            )
            del whole  # the next tensor is built only after this one is out
        arrays: list[ArrayEntry] = []
        for a, key, scalar in flat.arrays:
            contiguous = np.ascontiguousarray(a)
            data = torch.from_numpy(contiguous.reshape(-1).view(np.uint8))
            put(StagedStorage(data, contiguous.dtype.itemsize, a.dtype.kind in "fc", "cpu"))
            arrays.append(ArrayEntry(len(storages) - 1, a.dtype.str, tuple(a.shape), scalar, key))
        tables = (chunks, storages, tensor_entries, arrays)
        return offset + write_manifest(out, offset, *tables, flat.root, torch.__version__)
