"""Reading a sharded version (written by :mod:`asyncckpt._api.sharded_save`) of a root.

Two ways, chosen by what the load's ``into`` holds:

* **into DTensors** (``into`` holds DTensors, e.g. from ``get_state_dict`` of the current
  model, any sharding or world size): ``torch.distributed.checkpoint.load`` with
  :class:`asyncckpt.dcp.Reader` on the step directory loads every DTensor in place (DCP
  plans the resharding from the version's ``.metadata``), then this rank's plain values
  come from its own file: rank ``r``'s file if the version has one, else rank 0's.
* **consolidated** (no DTensor in ``into``, e.g. one process without a group): every
  tensor of the metadata is built whole, read from the chunks of every rank's file
  (``dcp.load`` with ``no_dist=True``), and put into rank 0's plain values (or this rank's
  own, in a group) where the DTensor was.

Every chunk read is verified against its checksum; DCP's ``CheckpointException`` is
unwrapped, so a damaged file raises :class:`~asyncckpt.errors.ChecksumError`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Collection
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from asyncckpt._device import cuda
from asyncckpt._engine.decode import Budget, OpenedFile, materialize
from asyncckpt._engine.decode_lazy import LazyEntries
from asyncckpt._engine.decode_select import top_level
from asyncckpt._format.container import MAX_DEPTH
from asyncckpt._format.index import saved_path, tied_names, value_bytes
from asyncckpt._format.names import rank_of_data_file
from asyncckpt._format.tree import (
    ROOT_NAME,
    Path,
    child_path,
    dtensor_leaves,
    fqn_of,
    tensor_paths,
    torch_dtype,
)
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt._versions.dcp_reader import Reader, open_data_file
from asyncckpt._versions.protocol import CommitRecord, step_dir
from asyncckpt._versions.reading import LoadRequest, RootReader
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    FormatError,
    IncompleteCheckpointError,
)


def read_sharded(
    reader: RootReader, commit: CommitRecord, request: LoadRequest, budget: Budget
) -> Any:
    """Load the sharded version ``commit`` describes on this rank, charging ``budget``.

    DTensors in ``request.into`` are loaded in place (collectively), its other tensors at
    matching key paths receive this rank's plain values in place. Only the tensors under
    ``request.keys`` are read (so only the rank files and chunks that hold them).

    Returns:
        The state as saved by the rank whose plain values are used, each DTensor replaced
        by the one in ``into`` (loaded) or by the full tensor (consolidated). A DTensor
        that was saved but is not in ``into`` (when ``into`` holds DTensors) is not
        loaded: it is None there.

    Raises:
        ValueError: ``into`` holds DTensors but the load is not collective.
        IncompleteCheckpointError: a file the ``COMMIT`` names is missing, or the version
            was deleted while it was read.
        ChecksumError, FormatError: a damaged or truncated file.
        MemoryBudgetError: the version needs more than the budget (nothing allocated).
    """
    keys, settings, into = request.keys, request.settings, request.into
    directory = step_dir(reader.storage, reader.root, commit.step)
    dcp_reader, metadata = version_metadata(reader.storage, directory, commit, settings, budget)
    dtensors = {path: dt for path, _key, dt in dtensor_leaves(into) if _kept(path, keys)}
    if dtensors and not request.collective:
        raise ValueError(
            "loading into DTensors is collective: call load() on every rank of the group "
            "(not with collective=False)"
        )
    opened, skip = rank_file(reader, request.rank, commit, directory, metadata)
    with opened:
        if dtensors:
            flat = {fqn_of(path): dt for path, dt in dtensors.items()}
            _dcp_load(flat, dcp_reader, request.group, no_dist=False)
            loaded: dict[Path, Any] = dict(dtensors)
        else:
            # Whole tensors go where this rank's shards were saved from, as placed (its
            # own device by default), like the plain values beside them: never the CPU
            # for some and a GPU for the others.
            saved = shards_device(opened, skip)
            loaded = _consolidated(metadata, dcp_reader, request, budget, saved)
        replaced = {key_path(path) for path in loaded}
        plain = materialize(
            opened,
            request.placement,
            settings,
            into,
            budget,
            skip=skip,
            replaced=replaced,
            keys=keys,
        )
    return substituted(plain, loaded, opened.name)


def version_metadata(
    storage: Storage,
    directory: str,
    commit: CommitRecord | None,
    settings: Settings,
    budget: Budget | None = None,
) -> tuple[Reader, Metadata]:
    """A reader of the sharded checkpoint in ``directory`` (the version ``commit`` describes,
    or, without it, an ``asyncckpt.dcp`` directory) and its metadata.

    Raises:
        IncompleteCheckpointError: no metadata: not committed, or (a version) deleted since
            its ``COMMIT`` was read (``load()`` tells how).
    """
    metadata_file = None if commit is None else commit.metadata_file
    reader = Reader.at(storage, directory, settings, metadata_file, budget)
    try:
        return reader, reader.read_metadata()
    except CheckpointNotFoundError as exc:
        deleted = "" if commit is None else "; the version was deleted"
        raise IncompleteCheckpointError(f"{exc}{deleted}") from exc


def _dcp_load(state: dict[str, Any], reader: Reader, group: Any, no_dist: bool) -> None:
    """``dcp.load``, with the asyncckpt error of any rank raised as it is."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavail)")
            dcp_load(state, storage_reader=reader, process_group=group, no_dist=no_dist)
    except CheckpointException as exc:
        for error, _trace in exc.failures.values():
            if isinstance(error, AsyncCkptError):
                raise error from exc
        raise


def _consolidated(
    metadata: Metadata, reader: Reader, request: LoadRequest, budget: Budget, saved: str
) -> dict[Path, torch.Tensor]:
    """Every tensor of the version, whole, by its path in the saved state.

    Names stored alike (a tied weight) share one tensor, allocated once, as a single-file
    load gives tied tensors back; a name with a target in ``into`` loads into it. Tensors
    without a target are allocated where ``placement`` puts storages saved on ``saved``.
    """
    placement = request.placement
    targets = tensor_paths(request.into) if request.into is not None else {}
    device = torch.device("cpu") if callable(placement.map_location) else None
    full: dict[str, torch.Tensor] = {}
    paths: dict[Path, torch.Tensor] = {}
    for names in tied_names(metadata):
        md = metadata.state_dict_metadata[names[0]]
        if not isinstance(md, TensorStorageMetadata):
            continue
        shared: torch.Tensor | None = None
        for fqn in names:
            path = saved_path(metadata, fqn)
            if not _kept(path, request.keys):
                continue  # not asked for: its chunks are never read
            target = targets.get(key_path(path))
            if target is None:
                if shared is None:
                    need = value_bytes(metadata, fqn)
                    budget.charge(reader.checkpoint_id, need, f"the whole of {fqn}")
                    where = device or placement.device_for(saved)
                    shared = cuda().empty(md.size, md.properties.dtype, where)
                target = shared
            elif (target.shape, target.dtype) != (md.size, md.properties.dtype):
                raise ValueError(
                    f"cannot load {fqn} into the given tensor: saved {md.properties.dtype} "
                    f"{tuple(md.size)}, target {target.dtype} {tuple(target.shape)}"
                )
            full[fqn] = paths[path] = target
    _dcp_load(full, reader, None, no_dist=True)
    return paths


def shards_device(opened: OpenedFile, skip: set[int]) -> str:
    """The device this rank's shards were saved from (its rank file's DTensor entries),
    ``"cpu"`` if it stored none."""
    manifest = opened.manifest
    for i in sorted(skip):
        if 0 <= i < len(manifest.tensors):
            return manifest.storages[manifest.tensors[i].storage].device
    return "cpu"


def _kept(path: Path, keys: Collection[Any] | None) -> bool:
    """Whether the leaf at ``path`` is under one of the top-level ``keys`` (None: all)."""
    return keys is None or (bool(path) and path[0] in keys)


def key_path(path: Path) -> str:
    """The key path ``flatten`` gives the leaf at ``path`` (an int key prints as an index).

    Example:
        >>> key_path(("model", 0))
        "state['model'][0]"
    """
    return functools.reduce(child_path, path, ROOT_NAME)


def rank_file(
    reader: RootReader, rank: int, commit: CommitRecord, directory: str, metadata: Metadata
) -> tuple[OpenedFile, set[int]]:
    """This rank's file of the version (:func:`rank_file_name`), opened (the caller closes
    it), with the entries of its tensor table that are shards of DTensors."""
    name, size = rank_file_name(commit, rank, f"{reader.where} step {commit.step}")
    opened = open_data_file(reader.storage, directory, name, size)
    return opened, {loc.entry for loc in metadata.storage_data.values() if loc.file == name}


def rank_file_name(commit: CommitRecord, rank: int, where: str) -> tuple[str, int | None]:
    """The name and committed size of rank ``rank``'s file of ``commit``'s version, or of
    the lowest rank's if it was saved by fewer ranks.

    Raises:
        FormatError: the ``COMMIT`` names no rank file (``where`` names the version).
    """
    sizes = commit.sizes or [None] * len(commit.files)
    files = [(rank_of_data_file(name), name, size) for name, size in zip(commit.files, sizes)]
    by_rank = {saved_by: (name, size) for saved_by, name, size in files if saved_by is not None}
    if not by_rank:
        raise FormatError(f"{where}: the COMMIT names no rank file")
    return by_rank[rank if rank in by_rank else min(by_rank)]


def substituted(tree: Any, values: dict[Path, Any], name: str) -> Any:
    """``tree`` with the value at each path of ``values`` replaced (dict levels created).

    Raises:
        FormatError: a path runs through a value that is not a dict.
    """
    placed: set[Path] = set()
    above = {path[:i] for path in values for i in range(len(path))}

    def walk(node: Any, path: Path) -> Any:
        if path in values:
            placed.add(path)
            return values[path]
        if path not in above or len(path) >= MAX_DEPTH:
            return node
        if isinstance(node, dict):
            for k in list(node):
                node[k] = walk(node[k], (*path, k))
            return node
        if isinstance(node, (list, tuple)):
            items = [walk(v, (*path, i)) for i, v in enumerate(node)]
            return items if isinstance(node, list) else tuple(items)
        return node

    tree = walk(tree, ())
    for path in values.keys() - placed:  # saved by other ranks only: add the levels
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {}) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            raise FormatError(f"{name}: no place for {fqn_of(path)} in the saved state")
        node[path[-1]] = values[path]
    return tree


class LazyShardedVersion(LazyEntries):
    """A committed sharded version as a read-only mapping over its top-level keys
    (``Checkpointer.open`` of a version saved from DTensors).

    Opening reads this rank's file's manifest and the version's metadata; ``version[key]``
    loads that key alone (not collective): its DTensors consolidated into whole tensors on
    ``map_location``, its other values as this rank saved them, every chunk verified, nothing
    cached. A committed version never changes; one that retention deletes meanwhile raises
    ``IncompleteCheckpointError``.
    """

    def __init__(self, reader: RootReader, commit: CommitRecord, request: LoadRequest) -> None:
        self._reader, self._commit, self._request = reader, commit, request
        directory = step_dir(reader.storage, reader.root, commit.step)
        _, metadata = version_metadata(reader.storage, directory, commit, request.settings)
        opened, shards = rank_file(reader, request.rank, commit, directory, metadata)
        with opened:
            pairs = top_level(opened.manifest.root, opened.name)
            plain = [e for i, e in enumerate(opened.manifest.tensors) if i not in shards]
            storages = opened.manifest.storages
        name = f"{reader.where} step {commit.step}"
        if pairs is None:
            raise AsyncCkptError(f"{name}: open() reads a saved dict; load it instead")
        super().__init__(name, [key for key, _node in pairs])
        self._tensors = {e.key: (torch.Size(e.shape), torch_dtype(e.dtype)) for e in plain}
        self._nbytes = sum(storages[i].nbytes for i in {e.storage for e in plain})
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                path = saved_path(metadata, fqn)
                self._tensors[key_path(path)] = (md.size, md.properties.dtype)
                self._nbytes += value_bytes(metadata, fqn)

    def __getitem__(self, key: Any) -> Any:
        """Load, verify and return the entry ``key`` (DTensors as whole tensors).

        Raises:
            MissingKeyError: the version has no top-level ``key``.
            IncompleteCheckpointError: the version was deleted meanwhile.
        """
        request = dataclasses.replace(self._request, keys=[key])
        try:
            got = read_sharded(self._reader, self._commit, request, Budget(None))
        except (AsyncCkptError, CheckpointException) as exc:
            raise self._reader.interrupted(self._commit.step, exc) from exc
        return got[key]

    def tensors(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Every tensor's key path with its shape and dtype (a DTensor's whole shape)."""
        return dict(self._tensors)

    def nbytes(self) -> int:
        """The bytes a whole load of this rank allocates (DTensors whole)."""
        return self._nbytes

    def __repr__(self) -> str:
        return f"<asyncckpt open {self.name!r} (sharded): {len(self)} keys>"
