"""``Reader``: a DCP ``StorageReader`` for checkpoints written by :class:`asyncckpt.dcp.Writer`.

The commit object is JSON, never a pickle; DCP computes the parts each rank reads, so a
checkpoint saved on N ranks loads on M.
"""

from __future__ import annotations

import collections
import io
import math
import os
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from asyncckpt._engine.chunks import Run, read_runs, whole_run
from asyncckpt._engine.decode import Budget, OpenedFile, open_file
from asyncckpt._engine.snapshot import byte_view
from asyncckpt._format.container import TensorEntry
from asyncckpt._format.index import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    ItemLocation,
    decode_metadata,
    is_data_file_name,
    item_key,
)
from asyncckpt._format.tree import empty_of, torch_dtype
from asyncckpt._settings import Settings, SettingsArg
from asyncckpt._storage import Storage, is_temp_name
from asyncckpt._versions.dcp_location import CheckpointLocation
from asyncckpt.errors import (
    CheckpointNotFoundError,
    FormatError,
    IncompleteCheckpointError,
    TruncatedFileError,
)


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
        max_bytes: at most this many bytes of buffers for decoded data per load (a whole
            stored tensor decoded straight into its target needs none); a load that would
            need more raises :class:`~asyncckpt.errors.MemoryBudgetError` before
            allocating. None: no limit besides what the files' sizes bound.
        threads: reader threads (None: the ``threads`` tunable); over ``settings``.
        settings: the tunables, fixed when the reader is built: an
            :class:`asyncckpt.Settings`, or a dict such as ``{"threads": 4}`` over the
            ``ASYNCCKPT_*`` environment variables.

    Raises:
        TypeError: ``url`` is not a path or URL.
        ValueError: ``max_bytes`` is negative, ``threads`` not positive, or a tunable out
            of range.

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
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        max_bytes: int | None = None,
        threads: int | None = None,
        settings: SettingsArg = None,
    ) -> None:
        StorageReader.__init__(self)
        # An entry point: the tunables are resolved once, here (argument > environment).
        resolved = Settings.of(settings).replace(threads=threads)
        CheckpointLocation.__init__(self, url, storage_options, resolved)
        self._load_id = uuid.uuid4().hex
        self._locations: dict[MetadataIndex, ItemLocation] = {}
        self._max_bytes = max_bytes
        self._budget = Budget(max_bytes)

    @classmethod
    def at(
        cls,
        storage: Storage,
        path: str,
        settings: Settings,
        metadata: str | None = None,
        budget: Budget | None = None,
    ) -> Reader:
        """A reader of the checkpoint directory ``path`` on an already opened ``storage``.

        For callers that resolved the storage themselves (``Checkpointer`` reading a
        sharded version, whose ``COMMIT`` names its ``metadata``); the reader pickles as
        ``storage.describe(path)``. ``budget``, if given, is charged with this reader's
        buffers (shared with the caller's other reads), for every load, instead of a
        budget of its own; ``settings`` are the caller's (its entry point's).

        Example:
            >>> from asyncckpt._storage import resolve
            >>> Reader.at(*resolve("memory://ckpt/7", None), Settings()).checkpoint_id
            'memory://ckpt/7'
        """
        reader = cls(storage.describe(path), settings=settings)
        reader._storage, reader._path = storage, path
        reader._metadata_name = metadata
        if budget is not None:
            reader._budget, reader._max_bytes = budget, None
        return reader

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, from ``checkpoint_id`` if given (called by ``dcp.load``)."""
        self._locations = {}
        if checkpoint_id:
            self._open(checkpoint_id)
        self._load_id = uuid.uuid4().hex
        if self._max_bytes is not None:  # a budget of its own: each load has all of it
            self._budget = Budget(self._max_bytes)

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
        path = self.committed_metadata_path()
        try:
            data = self._storage.read_bytes(path, MAX_METADATA_BYTES)
        except CheckpointNotFoundError:
            raise self._not_committed() from None
        metadata = decode_metadata(data, self._storage.describe(path))
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

        Files are read one after the other; within a file, only the chunks the plan's items
        touch, in parallel on the ``threads`` reader pool. An item that asks for a whole
        stored tensor whose target is a contiguous CPU tensor of the stored dtype is
        decoded straight into that target; any other item (a slice, when loading on a
        different number of ranks; another dtype or device) is decoded into a buffer and
        copied. Every item is committed to the planner only after all of its file's chunks
        were verified; after an error, the targets of that file's items may hold part of
        the checkpoint, as after any failed ``dcp.load``.

        Returns:
            A completed future.

        Raises:
            ChecksumError: a chunk does not match its CRC-32 (names file, chunk, keys).
            IncompleteCheckpointError: a file the commit names is missing.
            FormatError: a file is not the one committed (size, tensor table), or an item
                does not fit the tensor stored for it.
            MemoryBudgetError: the buffers would exceed ``max_bytes``.
        """
        per_file: dict[str, list[ReadItem]] = collections.defaultdict(list)
        for req in plan.items:
            where = self._locations.get(req.storage_index)
            if where is None:
                raise FormatError(f"{self._url}: the metadata has no data for {req.storage_index}")
            per_file[where.file].append(req)
        for name, reqs in per_file.items():
            size = self._locations[reqs[0].storage_index].file_size
            with open_data_file(self._storage, self._path, name, size) as opened:
                self._load_file(opened, reqs, planner, self._settings.threads)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _load_file(
        self, opened: OpenedFile, reqs: list[ReadItem], planner: LoadPlanner, threads: int
    ) -> None:
        """Read the chunks ``reqs`` touch in one file, then hand every item to ``planner``."""
        items = [self._item(opened, req, planner) for req in reqs]
        direct = _direct_destinations(opened, items)
        spans = _spans(opened, [item for item in items if item.entry.storage not in direct])
        runs = {sid: whole_run(opened, sid) for sid in direct} | spans
        what = "buffers for its chunks"
        buffers = read_runs(opened, runs, threads, into=direct, budget=self._budget, what=what)
        for item in items:
            sid = item.entry.storage
            if item.target is not None and sid in direct:
                planner.commit_tensor(item.req, item.target)  # decoded in place
            else:
                _deliver(item, buffers[sid], spans[sid].base, planner)

    def _item(self, opened: OpenedFile, req: ReadItem, planner: LoadPlanner) -> _Item:
        """Check ``req`` against the file's tensor table; resolve its target tensor."""
        where = self._locations[req.storage_index]
        tensors = opened.manifest.tensors
        if where.entry >= len(tensors):
            raise FormatError(
                f"{opened.name}: the metadata names tensor {where.entry}; the file has "
                f"{len(tensors)}"
            )
        entry = tensors[where.entry]
        stored = math.prod(entry.shape) * torch_dtype(entry.dtype).itemsize
        if stored != where.nbytes:
            raise FormatError(
                f"{opened.name}: {item_key(req.storage_index)} holds {stored} bytes, the "
                f"metadata says {where.nbytes}"
            )
        if req.type == LoadItemType.BYTE_IO:
            return _Item(req, entry, (0,) * len(entry.shape), entry.shape, None)
        offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
        if len(offsets) != len(entry.shape) or any(
            o < 0 or n < 0 or o + n > size for o, n, size in zip(offsets, lengths, entry.shape)
        ):
            raise FormatError(
                f"{opened.name}: {item_key(req.storage_index)} is {entry.dtype} "
                f"{entry.shape}; the plan asks for {lengths} at {offsets}"
            )
        target = planner.resolve_tensor(req).detach()
        # Sizes must match; dtypes may differ (copy_ casts), as with DCP's own
        # FileSystemReader, so a bf16 model can load a float32 checkpoint.
        if tuple(target.size()) != lengths:
            raise FormatError(
                f"{opened.name}: {item_key(req.storage_index)} is {entry.dtype} "
                f"{lengths} where {target.dtype} {tuple(target.shape)} is expected"
            )
        return _Item(req, entry, offsets, lengths, target)


def open_data_file(storage: Storage, directory: str, name: str, size: int | None) -> OpenedFile:
    """The data file ``name`` of the checkpoint in ``directory``, which its commit names,
    opened (the caller closes it) and checked against its committed ``size`` (None: not
    known yet; see :func:`size_error`).

    Raises:
        IncompleteCheckpointError: the file is missing: the checkpoint was partly deleted.
        FormatError: the file is not ``size`` bytes (:class:`TruncatedFileError`: fewer).
    """
    path = storage.join(directory, name)
    try:
        opened = open_file(storage, path)
    except CheckpointNotFoundError as exc:
        raise IncompleteCheckpointError(
            f"{storage.describe(path)}: named by the committed checkpoint but missing; the "
            "checkpoint was partly deleted"
        ) from exc
    if size is not None and opened.size != size:
        opened.close()
        raise size_error(opened, size)
    return opened


def size_error(opened: OpenedFile, size: int) -> FormatError:
    """What to raise for a data file that is not the ``size`` bytes its metadata records."""
    kind = TruncatedFileError if opened.size < size else FormatError
    return kind(
        f"{opened.name}: {opened.size} bytes, but {size} were committed; the file was replaced "
        "or damaged after the save"
    )


class _Item(NamedTuple):
    """One read item of a file: its stored tensor, the part asked for, and its target."""

    req: ReadItem
    entry: TensorEntry
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    target: torch.Tensor | None  # None for a bytes item


def _direct_destinations(opened: OpenedFile, items: list[_Item]) -> dict[int, torch.Tensor]:
    """``{storage index: the bytes to decode it into}`` for the items read in place (a
    storage that several items read gets a buffer of its own)."""
    readers = collections.Counter(item.entry.storage for item in items)
    alone = [item for item in items if readers[item.entry.storage] == 1]
    dests = {item.entry.storage: _direct_destination(opened, item) for item in alone}
    return {sid: dest for sid, dest in dests.items() if dest is not None}


def _direct_destination(opened: OpenedFile, item: _Item) -> torch.Tensor | None:
    """The bytes of ``item``'s target, if its storage can be decoded straight into them:
    a whole row-major tensor filling its storage, into a plain contiguous CPU tensor of its
    dtype, so that both are the same byte sequence."""
    target, entry = item.target, item.entry
    dtype = torch_dtype(entry.dtype)
    if (
        target is None
        or type(target) is not torch.Tensor
        or target.device.type != "cpu"
        or target.dtype != dtype
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
    ):
        return None
    nbytes = opened.manifest.storages[entry.storage].nbytes
    whole = not any(item.offsets) and item.lengths == entry.shape and entry.offset == 0
    if not whole or nbytes != target.numel() * dtype.itemsize:
        return None
    if not _row_major(entry.shape, entry.stride):
        return None
    return torch.empty(0, dtype=torch.uint8).set_(
        target.untyped_storage(), target.storage_offset() * dtype.itemsize, (nbytes,), (1,)
    )


def _row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _spans(opened: OpenedFile, items: list[_Item]) -> dict[int, Run]:
    """Per storage, the chunks under the bytes ``items`` ask for (a slice, when loading on
    another number of ranks, reads only those; each is still verified whole)."""
    wanted: dict[int, tuple[int, int]] = {}
    for item in items:
        lo, hi = _byte_range(item)
        old = wanted.setdefault(item.entry.storage, (lo, hi))
        if lo >= hi:  # nothing from this item
            continue
        if old[0] < old[1]:
            lo, hi = min(lo, old[0]), max(hi, old[1])
        wanted[item.entry.storage] = (lo, hi)
    spans = {sid: _chunk_span(opened, sid, lo, hi) for sid, (lo, hi) in wanted.items()}
    for item in items:
        span = spans[item.entry.storage]
        if span.base % torch_dtype(item.entry.dtype).itemsize:
            # A view cannot start inside an element: read from the storage's start.
            storage = opened.manifest.storages[item.entry.storage]
            spans[item.entry.storage] = Run(storage.first_chunk, span.stop, 0)
    return spans


def _byte_range(item: _Item) -> tuple[int, int]:
    """The bytes of its storage that ``item``'s part of its tensor spans: ``[lo, hi)``."""
    entry = item.entry
    if 0 in item.lengths:
        return 0, 0
    itemsize = torch_dtype(entry.dtype).itemsize
    first = entry.offset + sum(o * s for o, s in zip(item.offsets, entry.stride))
    last = first + sum((n - 1) * s for n, s in zip(item.lengths, entry.stride))
    return first * itemsize, (last + 1) * itemsize


def _chunk_span(opened: OpenedFile, sid: int, lo: int, hi: int) -> Run:
    """The run of storage ``sid``'s chunks that covers its bytes ``[lo, hi)``."""
    storage, chunks = opened.manifest.storages[sid], opened.manifest.chunks
    first, stop, base, start = -1, -1, 0, 0
    for index in range(storage.first_chunk, storage.first_chunk + storage.num_chunks):
        end = start + chunks[index].raw_len
        if start < hi and end > lo:
            if first < 0:
                first, base = index, start
            stop = index + 1
        start = end
    if first < 0:  # nothing asked for
        return Run(storage.first_chunk, storage.first_chunk, 0)
    return Run(first, stop, base)


def _deliver(item: _Item, buf: torch.Tensor, base: int, planner: LoadPlanner) -> None:
    """Copy ``item``'s part of a decoded (partial) storage into its target."""
    src = _slice(buf, base, item)
    if item.target is None:
        data = bytes(byte_view(src.contiguous().reshape(-1).view(torch.uint8)))
        planner.load_bytes(item.req, io.BytesIO(data))
        return
    item.target.copy_(src)
    planner.commit_tensor(item.req, item.target)


def _slice(buf: torch.Tensor, base: int, item: _Item) -> torch.Tensor:
    """``item``'s part of its tensor, as a view of ``buf``, which starts at byte ``base`` of
    the storage."""
    entry = item.entry
    dtype = torch_dtype(entry.dtype)
    if 0 in item.lengths:
        return empty_of(dtype).reshape(item.lengths)
    first = entry.offset + sum(o * s for o, s in zip(item.offsets, entry.stride))
    t = empty_of(dtype)
    return t.set_(buf.untyped_storage(), first - base // dtype.itemsize, item.lengths, entry.stride)
