"""``Reader``: a DCP ``StorageReader`` for checkpoints written by :class:`asyncckpt.dcp.Writer`.

``read_metadata`` reads the JSON commit object (never a pickle) and rebuilds DCP's
``Metadata``; ``read_data`` reads, per data file, only the tensors the plan asks for: the
file's footer and manifest first, then those tensors' chunks in parallel, each verified
against its CRC-32 before it is decoded, then copies the requested slices into DCP's
target tensors (any device, any sharding: DCP computes the slices, so a checkpoint saved
on N ranks loads on M).
"""

from __future__ import annotations

import collections
import io
import os
import uuid
from collections.abc import Mapping
from concurrent.futures import Future as ThreadFuture
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import config
from ..codec import checksum, decode_chunk
from ..errors import (
    CheckpointNotFoundError,
    ChecksumError,
    FormatError,
    IncompleteCheckpointError,
    TruncatedFileError,
)
from ..format import TensorEntry
from ..reader import OpenedFile, check_sizes, open_file
from ..staging import byte_view
from ..storage import Storage, is_temp_name
from ..tree import torch_dtype
from ..workers import pool
from .location import CheckpointLocation
from .schema import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    ItemLocation,
    decode_metadata,
    is_data_file_name,
    item_key,
)

#: Chunks queued per reader thread ahead of the oldest unfinished one.
_QUEUED_PER_THREAD = 4


class Reader(CheckpointLocation, StorageReader):
    """Load a checkpoint written by :class:`asyncckpt.dcp.Writer` with ``dcp.load``.

    Only a committed checkpoint loads: one whose ``.metadata`` (JSON) exists. Every chunk
    read is verified against its CRC-32; a damaged one raises
    :class:`~asyncckpt.errors.ChecksumError` naming the file, the chunk and the keys it
    holds. DCP reports errors from a storage reader wrapped in its own
    ``CheckpointException``: the original is ``exc.failures[rank][0]``.

    Args:
        url: the checkpoint directory: a local path or any fsspec URL.
            ``dcp.load(..., checkpoint_id=...)`` replaces it.
        storage_options: keyword arguments for the fsspec filesystem.

    Raises:
        TypeError: ``url`` is not a path or URL.

    Example:
        >>> import os, tempfile, torch, warnings
        >>> import torch.distributed.checkpoint as dcp
        >>> import asyncckpt.dcp
        >>> url = os.path.join(tempfile.mkdtemp(), "step-1")
        >>> with warnings.catch_warnings():  # "no process group: single process"
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"b": torch.ones(2, 3)}, storage_writer=asyncckpt.dcp.Writer(url))
        >>> md = asyncckpt.dcp.Reader(url).read_metadata()
        >>> md.state_dict_metadata["b"].size
        torch.Size([2, 3])
    """

    def __init__(
        self, url: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        StorageReader.__init__(self)
        CheckpointLocation.__init__(self, url, storage_options)
        self._load_id = uuid.uuid4().hex
        self._locations: dict[MetadataIndex, ItemLocation] = {}

    @classmethod
    def at(cls, storage: Storage, path: str) -> Reader:
        """A reader of the checkpoint directory ``path`` on an already opened ``storage``.

        For callers that resolved the storage themselves (``Checkpointer`` reading a
        sharded version); the reader pickles as ``storage.describe(path)``.

        Example:
            >>> from asyncckpt.storage import resolve
            >>> Reader.at(*resolve("memory://ckpt/7", None)).checkpoint_id
            'memory://ckpt/7'
        """
        reader = cls(storage.describe(path))
        reader._storage, reader._path = storage, path
        return reader

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, from ``checkpoint_id`` if given (called by ``dcp.load``)."""
        self._locations = {}
        if checkpoint_id:
            self._open(checkpoint_id)
        self._load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read and validate the commit object.

        Returns:
            DCP's ``Metadata``; ``storage_data`` maps each ``MetadataIndex`` to an
            :class:`~asyncckpt.dcp.ItemLocation`.

        Raises:
            IncompleteCheckpointError: data files but no commit object: a save is still
                writing, or failed before its commit.
            CheckpointNotFoundError: nothing was saved at the URL.
            FormatError: the commit object is malformed, oversized or from a newer schema.
        """
        name = self._storage.describe(self.metadata_path)
        try:
            data = self._storage.read_bytes(self.metadata_path, MAX_METADATA_BYTES)
        except CheckpointNotFoundError:
            raise self._not_committed() from None
        metadata = decode_metadata(data, name)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self._load_id
        return metadata

    def _not_committed(self) -> Exception:
        where = self._storage.describe(self._path)
        names = self._storage.list_dir(self._path)
        data = [n for n in names if is_data_file_name(n) or is_temp_name(n)]
        if data:
            return IncompleteCheckpointError(
                f"{where}: no committed checkpoint: {len(data)} data file(s) but no "
                f"{METADATA_NAME}; a save is still writing it, or failed before its commit"
            )
        return CheckpointNotFoundError(f"{where}: no checkpoint ({METADATA_NAME} missing)")

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep the item locations of ``metadata`` (as returned by :meth:`read_metadata`).

        Raises:
            FormatError: ``metadata`` did not come from :meth:`read_metadata`.
        """
        locations = metadata.storage_data
        if not isinstance(locations, dict) or not all(
            isinstance(v, ItemLocation) for v in locations.values()
        ):
            raise FormatError(
                "metadata given to asyncckpt.dcp.Reader was not read by "
                "asyncckpt.dcp.Reader.read_metadata"
            )
        self._locations = locations

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """No storage-specific planning: items are found through the metadata."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """No storage-specific planning."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``, verified, into the planner's targets.

        Files are read one after the other; within a file, the needed chunks in parallel.
        A file's items are copied into their targets only after all of that file's chunks
        were verified.

        Returns:
            A completed future.

        Raises:
            ChecksumError: a chunk does not match its CRC-32 (names file, chunk, keys).
            IncompleteCheckpointError: a file the commit names is missing.
            FormatError: a file is not the one committed (size, tensor table).
        """
        per_file: dict[str, list[ReadItem]] = collections.defaultdict(list)
        for req in plan.items:
            where = self._locations.get(req.storage_index)
            if where is None:
                raise FormatError(f"{self._url}: the metadata has no data for {req.storage_index}")
            per_file[where.file].append(req)
        threads = config.tunable("threads", None)
        for name, reqs in per_file.items():
            opened = self._open_data_file(name, self._locations[reqs[0].storage_index])
            wanted = {self._locations[r.storage_index].entry for r in reqs}
            tensors = _read_entries(opened, wanted, threads)
            for req in reqs:
                where = self._locations[req.storage_index]
                src = tensors[where.entry]
                if src.numel() * src.element_size() != where.nbytes:
                    raise FormatError(
                        f"{opened.name}: {item_key(req.storage_index)} holds "
                        f"{src.numel() * src.element_size()} bytes, the metadata says "
                        f"{where.nbytes}"
                    )
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(src.numpy().tobytes()))
                    continue
                src = _narrow(src, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                # Sizes must match; dtypes may differ (copy_ casts), as with DCP's own
                # FileSystemReader, so a bf16 model can load a float32 checkpoint.
                if target.size() != src.size():
                    raise FormatError(
                        f"{opened.name}: {item_key(req.storage_index)} is {src.dtype} "
                        f"{tuple(src.shape)} where {target.dtype} {tuple(target.shape)} is "
                        "expected"
                    )
                target.copy_(src)
                planner.commit_tensor(req, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _open_data_file(self, name: str, where: ItemLocation) -> OpenedFile:
        path = self._storage.join(self._path, name)
        try:
            opened = open_file(self._storage, path)
        except CheckpointNotFoundError as exc:
            raise IncompleteCheckpointError(
                f"{self._storage.describe(path)}: named by the committed "
                f"{METADATA_NAME} but missing; the checkpoint was partly deleted"
            ) from exc
        if opened.size != where.file_size:
            kind = TruncatedFileError if opened.size < where.file_size else FormatError
            raise kind(
                f"{opened.name}: {opened.size} bytes, but {where.file_size} were committed; "
                "the file was replaced or damaged after the save"
            )
        return opened


def _read_entries(opened: OpenedFile, wanted: set[int], threads: int) -> dict[int, torch.Tensor]:
    """Read, verify and decode the storages of the tensors ``wanted``; return those tensors.

    Raises:
        FormatError: a wanted tensor is not in the file, or sizes the file cannot hold.
        ChecksumError: a chunk is damaged (the first one found).
    """
    manifest = opened.manifest
    for wanted_entry in wanted:
        if wanted_entry >= len(manifest.tensors):
            raise FormatError(
                f"{opened.name}: the metadata names tensor {wanted_entry}; the file has "
                f"{len(manifest.tensors)}"
            )
    buffers = read_storage_ids(opened, {manifest.tensors[e].storage for e in wanted}, threads)
    return {e: _view(buffers[manifest.tensors[e].storage], manifest.tensors[e]) for e in wanted}


def read_storage_ids(opened: OpenedFile, sids: set[int], threads: int) -> dict[int, torch.Tensor]:
    """Read, verify and decode only the storages ``sids`` of a file, in parallel chunks.

    Args:
        opened: the file.
        sids: indices into its storage table.
        threads: reader threads.

    Returns:
        ``{storage index: 1-D uint8 CPU tensor of its bytes}``.

    Raises:
        FormatError: the file's sizes are impossible.
        ChecksumError: a chunk is damaged (the first one found).

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt.reader import open_file
        >>> from asyncckpt.storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"a": torch.arange(3), "b": torch.ones(2)}, path).result()
        >>> opened = open_file(*resolve(path, None))
        >>> {sid: buf.numel() for sid, buf in read_storage_ids(opened, {1}, 2).items()}
        {1: 8}
    """
    manifest = opened.manifest
    check_sizes(opened)  # bounds every allocation below by the file's size
    storages = sorted(sids)
    if storages and not 0 <= storages[0] <= storages[-1] < len(manifest.storages):
        raise FormatError(f"{opened.name}: no storage {storages} among {len(manifest.storages)}")
    buffers: dict[int, torch.Tensor] = {}
    workers = pool("read", threads)
    pending: collections.deque[ThreadFuture[None]] = collections.deque()
    try:
        for sid in storages:
            storage = manifest.storages[sid]
            buffers[sid] = buf = torch.empty(storage.nbytes, dtype=torch.uint8)
            view, start = byte_view(buf), 0
            for index in range(storage.first_chunk, storage.first_chunk + storage.num_chunks):
                raw_len = manifest.chunks[index].raw_len
                while len(pending) >= threads * _QUEUED_PER_THREAD:
                    pending.popleft().result()  # the oldest chunk's error comes first
                out = view[start : start + raw_len]
                pending.append(workers.submit(_read_chunk, opened, index, sid, out))
                start += raw_len
        while pending:
            pending.popleft().result()
    finally:
        # After a failure, queued chunks must not write into buffers being dropped.
        for future in pending:
            future.cancel()
        for future in pending:
            if not future.cancelled():
                future.exception()
    return buffers


def _read_chunk(opened: OpenedFile, index: int, sid: int, out: memoryview) -> None:
    chunk = opened.manifest.chunks[index]
    # A raw chunk is read straight into its place; it is checked there before use.
    stored = out if chunk.codec == "raw" else memoryview(bytearray(chunk.stored_len))
    got = opened.storage.read_into(opened.path, chunk.offset, stored)
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


def _view(buf: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    t = torch.empty(0, dtype=torch_dtype(entry.dtype))
    return t.set_(buf.untyped_storage(), entry.offset, entry.shape, entry.stride)


def _narrow(t: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    """The part of a stored chunk a read item asks for (DCP's resharding slices)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != t.size(dim):
            t = t.narrow(dim, start, length)
    return t
