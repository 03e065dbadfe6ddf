"""``Writer``: a DCP ``StorageWriter`` that stores each rank's items as one asyncckpt file.

Sequence (what ``dcp.save`` calls, see ``torch/distributed/checkpoint/storage.py``):

1. ``set_up_storage_writer`` on every rank; the coordinator draws a fresh attempt token.
2. ``prepare_local_plan`` on every rank; the coordinator refuses a directory that already
   holds a committed checkpoint (before anything is written).
3. ``prepare_global_plan`` on the coordinator: each rank's plan is given its file name,
   ``r<rank>-<attempt>.ackpt``, so no two ranks and no two attempts share a name.
4. ``write_data`` on every rank: the rank's tensors and bytes objects, compressed and
   checksummed chunk by chunk, written atomically (temp + fsync + rename on local disk,
   one PUT or a multipart upload completed last on S3). It returns once the file is
   durable.
5. ``finish`` on the coordinator, only after every rank's ``write_data`` succeeded: check
   that every named file is visible with its recorded size, then create the commit object
   (``.metadata``, JSON) with an exclusive create. Readers find a checkpoint only
   through that object, so they never see a partial one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from asyncckpt._api.dropin import write_options
from asyncckpt._engine.arena import ArenaPool
from asyncckpt._engine.encode import write_snapshot
from asyncckpt._engine.snapshot import DeviceCopies, Snapshot, StagedStorage, codec_hint
from asyncckpt._format.container import TensorEntry
from asyncckpt._format.index import (
    ItemLocation,
    data_file_name,
    encode_metadata,
    is_data_file_name,
    item_key,
)
from asyncckpt._format.tree import dtype_name
from asyncckpt._settings import Settings, SettingsArg
from asyncckpt._threads import pool
from asyncckpt._versions.dcp_location import CheckpointLocation
from asyncckpt.errors import AsyncCkptError, ConflictError, IncompleteCheckpointError

#: The version of DCP's metadata this writer produces (the one FileSystemWriter records).
DCP_VERSION = "1.0.0"
#: ``write_snapshot`` takes a staged snapshot, which owns a lease on a host arena. Items
#: here are written from their own (compact, CPU) memory, so each save borrows a token-size
#: arena instead of copying the state into a big one.
_NO_ARENA = ArenaPool(max_inflight=1 << 20)


class Writer(CheckpointLocation, StorageWriter):
    """Store a ``torch.distributed.checkpoint`` save as asyncckpt files plus a JSON commit.

    Each rank writes one file, ``r<rank>-<attempt>.ackpt``, in asyncckpt's format (chunked,
    byte-grouped zstd, a CRC-32 per chunk); the coordinator then creates
    ``.metadata`` (JSON) with an exclusive create (``link()`` on local disk, a conditional
    PUT on S3). A directory holds at most one committed checkpoint: saving again into it
    raises :class:`~asyncckpt.errors.ConflictError`.

    Args:
        url: the checkpoint directory: a local path or any fsspec URL (``s3://b/ckpt/7``).
            ``dcp.save(..., checkpoint_id=...)`` replaces it.
        storage_options: keyword arguments for the fsspec filesystem (endpoint, ...).
        compression: ``"auto"`` (default), ``"zstd"`` or ``"none"``, as for
            :func:`asyncckpt.save`.
        settings: the tunables, fixed when the writer is built: an
            :class:`asyncckpt.Settings`, or a dict such as ``{"chunk_bytes": 1 << 24}``
            over the ``ASYNCCKPT_*`` environment variables.

    Raises:
        ValueError: an unknown ``compression``, or a tunable out of range.
        TypeError: ``url`` is not a path or URL.

    Example:
        >>> import os, tempfile, torch, warnings
        >>> import torch.distributed.checkpoint as dcp
        >>> import asyncckpt.dcp
        >>> url = os.path.join(tempfile.mkdtemp(), "step-1")
        >>> with warnings.catch_warnings():  # "no process group: single process"
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"w": torch.arange(4.0)}, storage_writer=asyncckpt.dcp.Writer(url))
        ...     state = {"w": torch.zeros(4)}
        ...     dcp.load(state, storage_reader=asyncckpt.dcp.Reader(url))
        >>> state["w"]
        tensor([0., 1., 2., 3.])
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        compression: str = "auto",
        settings: SettingsArg = None,
    ) -> None:
        StorageWriter.__init__(self)
        resolved = Settings.of(settings)  # once: the entry point (argument > environment)
        self._options = write_options(compression, resolved)  # validates `compression` now
        CheckpointLocation.__init__(self, url, storage_options, resolved)
        self._save_id = uuid.uuid4().hex
        self._attempt = uuid.uuid4().hex
        self._coordinator = True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save, into ``checkpoint_id`` if given (called by ``dcp.save``)."""
        if checkpoint_id:
            self._open(checkpoint_id)
        self._save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        """Identifies this save in DCP's metadata (the URL and a save id)."""
        return StorageMeta(checkpoint_id=self._url, save_id=self._save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record this rank's role; the coordinator draws this attempt's token.

        Raises:
            ValueError: ``use_collectives=False``: without the final gather there is no
                moment at which one rank knows that every rank's file is durable, so there
                is nothing to commit on.
        """
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                "asyncckpt.dcp.Writer needs use_collectives=True: the coordinator commits "
                "the checkpoint once every rank's file is durable"
            )
        self._coordinator = is_coordinator
        # A fresh token per attempt, so a retry into the same directory never writes over
        # the files of an earlier (failed or still running) attempt.
        self._attempt = uuid.uuid4().hex

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Fail early, before anything is written, if the directory is already committed.

        Raises:
            ConflictError: ``.metadata`` exists at the URL.
        """
        if self._coordinator and self._storage.exists(self.metadata_path):
            raise ConflictError(
                f"{self._storage.describe(self.metadata_path)} exists: this directory already "
                "holds a committed checkpoint; save into a new checkpoint_id"
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Name each rank's data file (coordinator only)."""
        return [
            dataclasses.replace(plan, storage_data=data_file_name(rank, self._attempt))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items as one asyncckpt file; returns once it is durable.

        Args:
            plan: this rank's final plan; ``storage_data`` is its file name.
            planner: resolves each item to a tensor (any device, maybe a view) or BytesIO.

        Returns:
            A completed future of one ``WriteResult`` per item, whose ``storage_data`` is
            an :class:`ItemLocation`.

        Raises:
            ValueError: the plan was not prepared by this writer's ``prepare_global_plan``.
            StorageError: the backend failed (nothing is left under the file's name).
        """
        name = plan.storage_data
        if not isinstance(name, str) or not is_data_file_name(name):
            raise ValueError(
                f"the save plan names no asyncckpt data file ({name!r}); was it prepared by "
                "asyncckpt.dcp.Writer.prepare_global_plan?"
            )
        results: list[WriteResult] = []
        if plan.items:
            entries, storages = [], []
            for entry, item in enumerate(plan.items):
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    if not isinstance(data, io.BytesIO):
                        raise TypeError(f"{item.index.fqn}: a BYTE_IO item resolved to {data!r}")
                    tensor, device = _bytes_tensor(data), "cpu"
                else:
                    if not isinstance(data, torch.Tensor):
                        raise TypeError(f"{item.index.fqn}: a tensor item resolved to {data!r}")
                    # The source device is recorded for `asyncckpt inspect`; readers here
                    # always decode on the CPU and copy into DCP's target tensors.
                    tensor, device = _compact_cpu(data), str(data.device)
                entries.append(_entry(entry, tensor, item_key(item.index)))
                storages.append(_staged(tensor, device))
            size = self._write(name, entries, storages)
            for entry, (item, staged) in enumerate(zip(plan.items, storages)):
                where = ItemLocation(name, size, entry, staged.data.numel())
                results.append(WriteResult(item.index, staged.data.numel(), where))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write(self, name: str, entries: list[TensorEntry], storages: list[StagedStorage]) -> int:
        # The object tree is {item key: tensor}, so a data file is also an ordinary
        # asyncckpt file: `asyncckpt.load`, `asyncckpt inspect` and `verify` read it.
        root = {"dict": [[e.key, {"tensor": i}] for i, e in enumerate(entries)]}
        lease = _NO_ARENA.acquire(0)
        try:
            snap = Snapshot(root, entries, [], storages, lease, DeviceCopies())
            return write_snapshot(
                snap, self._storage, self._storage.join(self._path, name), self._options
            )
        finally:
            lease.release()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: create ``.metadata`` once every rank's file is visible and whole.

        Called on the coordinator after every rank's ``write_data`` returned, i.e. after
        every file is durable.

        Args:
            metadata: DCP's global metadata; its ``storage_data`` is filled in here.
            results: every rank's write results.

        Raises:
            IncompleteCheckpointError: a rank's file is missing or has another size (the
                URL is not storage that every rank shares?); nothing is committed.
            ConflictError: another save committed this directory first; this attempt's
                files are removed.
            UnsupportedObjectError: the metadata holds something the JSON schema cannot
                represent; nothing is committed.
        """
        locations: dict[MetadataIndex, ItemLocation] = {}
        files: dict[str, int] = {}
        for rank_results in results:
            for result in rank_results:
                where = result.storage_data
                if not isinstance(where, ItemLocation):
                    raise TypeError(f"write result for {result.index} is not from asyncckpt.dcp")
                locations[result.index] = where
                files[where.file] = where.file_size
        metadata.version = DCP_VERSION
        metadata.storage_data = locations
        metadata.storage_meta = self.storage_meta()
        body = encode_metadata(metadata, self._attempt)  # fails before anything is committed
        self._check_files(files)
        try:
            self._storage.create_exclusive(self.metadata_path, body)
        except ConflictError:
            # Someone else's commit won: these files are named by no commit, ever.
            for name in files:
                with contextlib.suppress(AsyncCkptError, OSError):  # best effort
                    self._storage.delete(self._storage.join(self._path, name))
            raise ConflictError(
                f"{self._storage.describe(self.metadata_path)} was created by another save "
                "while this one was writing; this attempt's files were removed"
            ) from None

    def _check_files(self, files: dict[str, int]) -> None:
        """Every file a commit names must be visible, with its size, from the coordinator.

        Catches storage that is not shared (each node writing to its own local disk) and
        stores whose listings lag, before a commit could name a file readers cannot find.
        """

        def check(name: str, size: int) -> str | None:
            path = self._storage.join(self._path, name)
            try:
                found = self._storage.size(path)
            except FileNotFoundError:
                return f"{self._storage.describe(path)} is missing"
            if found != size:
                return f"{self._storage.describe(path)} is {found} bytes, written as {size}"
            return None

        workers = pool("dcp-check", self._settings.threads)
        futures = [workers.submit(check, name, size) for name, size in files.items()]
        problems = [p for p in (f.result() for f in futures) if p is not None]
        if problems:
            raise IncompleteCheckpointError(
                f"not committing {self._storage.describe(self._path)}: "
                + "; ".join(problems[:5])
                + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
                + ". Every rank must write to storage the coordinator can read."
            )


def _bytes_tensor(data: io.BytesIO) -> torch.Tensor:
    with data.getbuffer() as raw:
        if not raw.nbytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _compact_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a CPU tensor that owns exactly its elements, contiguous, from offset 0.

    DCP may hand over views (only the projection is to be saved) or device tensors; a
    compact CPU tensor is stored as is, without another copy.
    """
    t = t.detach().resolve_conj().resolve_neg()  # each returns t itself if its bit is unset
    compact = (
        t.device.type == "cpu"
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )
    if compact:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t)
    return out


def _entry(index: int, t: torch.Tensor, key: str) -> TensorEntry:
    return TensorEntry(
        storage=index,
        dtype=dtype_name(t.dtype),
        shape=tuple(t.shape),
        stride=tuple(t.stride()),
        offset=0,
        requires_grad=False,
        parameter=False,
        key=key,
    )


def _staged(t: torch.Tensor, device: str) -> StagedStorage:
    data = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return StagedStorage(data, *codec_hint(t.dtype), device)
