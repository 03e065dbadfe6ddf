"""Loading a sharded version (written by :mod:`asyncckpt._api.sharded_save`).

Two ways, chosen by ``Checkpointer.load``:

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

import logging
import re
import warnings
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from asyncckpt import _config as config
from asyncckpt._api.sharded_save import Path, dtensor_leaves, fqn_of, holds_dtensor
from asyncckpt._device import Placement
from asyncckpt._engine.decode import Budget, OpenedFile, check_devices, open_file
from asyncckpt._format.container import MAX_DEPTH, TensorEntry
from asyncckpt._format.index import tied_names, value_bytes
from asyncckpt._format.tree import ROOT_NAME, child_path, tensor_paths, torch_dtype, unflatten
from asyncckpt._versions.dcp_reader import Reader, read_storage_ids
from asyncckpt._versions.protocol import SHARDED, CommitRecord, step_dir
from asyncckpt._versions.reading import deleted_while_loading
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    FormatError,
    IncompleteCheckpointError,
    TruncatedFileError,
)

if TYPE_CHECKING:
    from asyncckpt._api.checkpointer import Checkpointer

log = logging.getLogger(__name__)

_RANK_FILE = re.compile(r"r([0-9]{5,9})-[0-9a-f]{32}\.ackpt")
#: How many versions a load of the newest version tries, when retention deletes each one
#: while it is read, before it gives up (a trainer whose ``keep_last`` versions are all
#: written faster than this process reads one).
FOLLOW_ATTEMPTS: Final = 5


def load(
    ckpt: Checkpointer,
    step: int,
    commit: CommitRecord | None,
    placement: Placement,
    into: Any,
    use_group: bool,
    *,
    follow_latest: bool = False,
    max_bytes: int | None = None,
) -> Any:
    """Load version ``step`` on this rank: sharded, or single-file when following the newest.

    If retention deletes the version while it is read (its ``COMMIT`` is gone: an evaluator
    loading the newest version while the trainer saves with ``keep_last``), a load that
    asked for the newest version moves on to the newest one, at most
    :data:`FOLLOW_ATTEMPTS` times in all, as a single-file load does; a load of a given
    step raises.

    Args:
        ckpt: the Checkpointer (its storage, root, group and rank).
        step: the version to load.
        commit: its commit marker, or None if it was retired since it was chosen.
        placement: where plain tensors (and consolidated ones) go.
        into: a state to load into: DTensors are loaded in place (collectively); other
            tensors at matching key paths receive this rank's plain values in place.
        use_group: whether this is a collective load (needed for DTensors in ``into``).
        follow_latest: the caller asked for the newest version (no step, not collective).
        max_bytes: the memory budget of each attempt (see :class:`asyncckpt._engine.decode.Budget`).

    Returns:
        The state as saved by the rank whose plain values are used, each DTensor replaced
        by the one in ``into`` (loaded) or by the full tensor (consolidated). A DTensor
        that was saved but is not in ``into`` (when ``into`` holds DTensors) is not
        loaded: it is None there. After a move, the newer version, as
        ``Checkpointer.load`` returns it (sharded or not).

    Raises:
        ValueError: ``into`` holds DTensors but the load is not collective.
        IncompleteCheckpointError: the version was deleted while it was read and
            ``follow_latest`` is false (or nothing newer is committed, or the newest was
            deleted too, :data:`FOLLOW_ATTEMPTS` times); or a file its ``COMMIT`` names
            is missing.
        ChecksumError, FormatError: a damaged or truncated file.
        MemoryBudgetError: the version needs more than ``max_bytes`` (nothing allocated).

    Example:
        >>> import tempfile
        >>> from asyncckpt import Checkpointer
        >>> ckpt = Checkpointer(tempfile.mkdtemp())
        >>> ckpt.latest() is None  # a sharded root is loaded through ckpt.load()
        True
    """
    current = commit
    for _ in range(FOLLOW_ATTEMPTS):
        try:
            return _load_step(ckpt, step, current, placement, into, use_group, Budget(max_bytes))
        except (AsyncCkptError, CheckpointException) as exc:
            step = _after_deletion(ckpt, step, follow_latest, exc)
        current = ckpt._reader.commit_of(step)
    raise IncompleteCheckpointError(
        f"{ckpt.root}: retention deleted {FOLLOW_ATTEMPTS} versions in a row while this "
        f"process loaded them (the last was step {step}); keep more versions (keep_last) "
        "or give load() a step that is kept"
    )


def _load_step(
    ckpt: Checkpointer,
    step: int,
    commit: CommitRecord | None,
    placement: Placement,
    into: Any,
    use_group: bool,
    budget: Budget,
) -> Any:
    """One attempt at loading ``step`` (``commit``), sharded or (after a move) not."""
    if commit is None:  # deleted again before it could be read
        raise CheckpointNotFoundError(f"step {step} under {ckpt.root} is not committed")
    if commit.kind != SHARDED:
        refuse_dtensors(step, ckpt.root, into)
        return ckpt._reader.read(step, placement, into, budget)
    return _load_sharded(ckpt, commit, placement, into, use_group, budget)


def refuse_dtensors(step: int, root: str, into: Any) -> None:
    """Raise ValueError if ``into`` holds DTensors: version ``step`` is not sharded."""
    if holds_dtensor(into):
        raise ValueError(
            f"step {step} under {root} was not saved from DTensors; load it without DTensors "
            "in `into`"
        )


def _after_deletion(ckpt: Checkpointer, step: int, follow_latest: bool, exc: BaseException) -> int:
    """The step to load after ``exc`` interrupted the load of ``step``; else raise.

    Retention removes a version's ``COMMIT`` before its files, so a version whose files
    went missing under a reader but whose ``COMMIT`` is still there was damaged, not
    retired: its error is raised as it is.
    """
    if ckpt._reader.commit_of(step) is not None:
        raise exc
    newest = ckpt._reader.latest()
    if not follow_latest or newest is None or newest == step:
        raise deleted_while_loading(step, ckpt.root) from exc
    log.info("step %d was deleted while loading; moving to step %d", step, newest)
    return newest


def _load_sharded(
    ckpt: Checkpointer,
    commit: CommitRecord,
    placement: Placement,
    into: Any,
    use_group: bool,
    budget: Budget,
) -> Any:
    storage = ckpt._storage
    directory = step_dir(storage, ckpt._root, commit.step)
    named = commit.metadata_file  # the metadata of exactly this version, as COMMIT names it
    reader = Reader.at(storage, directory, named, budget)
    metadata = _read(reader.read_metadata)
    dtensors = {path: dt for path, _key, dt in dtensor_leaves(into)}
    if dtensors and not use_group:
        raise ValueError(
            "loading into DTensors is collective: call load() on every rank of the group "
            "(not with collective=False)"
        )
    if dtensors:
        flat = {fqn_of(path): dt for path, dt in dtensors.items()}
        _dcp_load(flat, Reader.at(storage, directory, named, budget), ckpt._group, no_dist=False)
        loaded: dict[Path, Any] = dict(dtensors)
    else:
        reader = Reader.at(storage, directory, named, budget)
        loaded = _consolidated(metadata, reader, placement, into, budget, reader.checkpoint_id)
    opened, name = _rank_file(ckpt, commit, directory)
    with opened:
        skip = {loc.entry for loc in metadata.storage_data.values() if loc.file == name}
        plain = read_plain(opened, skip, placement, into, set(loaded), budget)
    return _substituted(plain, loaded, opened.name)


def _read(fn: Any) -> Metadata:
    try:
        metadata: Metadata = fn()
    except CheckpointNotFoundError as exc:  # deleted meanwhile (load() tells how)
        raise IncompleteCheckpointError(f"{exc}; the version was deleted") from exc
    return metadata


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
    metadata: Metadata,
    reader: Reader,
    placement: Placement,
    into: Any,
    budget: Budget,
    name: str,
) -> dict[Path, torch.Tensor]:
    """Every tensor of the version, whole, by its path in the saved state.

    Names stored alike (a tied weight) share one tensor, allocated once, as a single-file
    load gives tied tensors back; a name with a target in ``into`` loads into it.
    """
    targets = tensor_paths(into) if into is not None else {}
    device = torch.device("cpu") if callable(placement.map_location) else None
    full: dict[str, torch.Tensor] = {}
    paths: dict[Path, torch.Tensor] = {}
    for names in tied_names(metadata):
        md = metadata.state_dict_metadata[names[0]]
        if not isinstance(md, TensorStorageMetadata):
            continue
        shared: torch.Tensor | None = None
        for fqn in names:
            path = tuple((metadata.planner_data or {}).get(fqn, (fqn,)))
            target = targets.get(_key_path(path))
            if target is None:
                if shared is None:
                    budget.charge(name, value_bytes(metadata, fqn), f"the whole of {fqn}")
                    where = device or placement.device_for("cpu")
                    shared = torch.empty(md.size, dtype=md.properties.dtype, device=where)
                target = shared
            elif (target.shape, target.dtype) != (md.size, md.properties.dtype):
                raise ValueError(
                    f"cannot load {fqn} into the given tensor: saved {md.properties.dtype} "
                    f"{tuple(md.size)}, target {target.dtype} {tuple(target.shape)}"
                )
            full[fqn] = paths[path] = target
    _dcp_load(full, reader, None, no_dist=True)
    return paths


def _key_path(path: Path) -> str:
    """The key path ``flatten`` gives the leaf at ``path`` (an int key prints as an index)."""
    key = ROOT_NAME
    for k in path:
        key = child_path(key, k)
    return key


def _rank_file(ckpt: Checkpointer, commit: CommitRecord, directory: str) -> tuple[OpenedFile, str]:
    """This rank's file of the version, or rank 0's if the version has no file of this rank
    (it was saved by fewer ranks); opened (the caller closes it) and checked against its
    committed size."""
    by_rank = {}
    for name, size in zip(commit.files, commit.sizes or [None] * len(commit.files)):
        match = _RANK_FILE.fullmatch(name)
        if match:
            by_rank[int(match.group(1))] = (name, size)
    if not by_rank:
        raise FormatError(f"{ckpt.root}: step {commit.step} names no rank file")
    rank = ckpt.rank if ckpt.rank in by_rank else min(by_rank)
    name, size = by_rank[rank]
    path = ckpt._storage.join(directory, name)
    try:
        opened = open_file(ckpt._storage, path)
    except CheckpointNotFoundError as exc:
        raise IncompleteCheckpointError(
            f"{ckpt._storage.describe(path)}: named by step {commit.step}'s COMMIT but missing"
        ) from exc
    if size is not None and opened.size != size:
        opened.close()
        kind = TruncatedFileError if opened.size < size else FormatError
        raise kind(f"{opened.name}: {opened.size} bytes, but {size} were committed")
    return opened, name


def read_plain(
    opened: OpenedFile,
    skip: set[int],
    placement: Placement,
    into: Any,
    replaced: set[Path],
    budget: Budget | None = None,
) -> Any:
    """Rebuild a rank file's state without reading the tensors ``skip`` (DTensor chunks).

    Args:
        opened: the rank's file.
        skip: entries of its tensor table not to read; they come back as None.
        placement: where the tensors read go.
        into: tensors at matching key paths are loaded in place (and returned).
        replaced: paths whose values come from elsewhere: never loaded into ``into``.
        budget: charged with the buffers read.

    Raises:
        ChecksumError: a chunk read is damaged (nothing in ``into`` has changed then).
        MemoryBudgetError: the buffers would exceed ``budget``.
        ValueError: a tensor of ``into`` differs in shape or dtype from the saved one.
    """
    manifest = opened.manifest
    check_devices(opened)
    wanted = [i for i in range(len(manifest.tensors)) if i not in skip]
    sids = {manifest.tensors[i].storage for i in wanted} | {a.storage for a in manifest.arrays}
    raw = read_storage_ids(opened, sids, config.tunable("threads", None), budget)
    skipped_keys = {_key_path(p) for p in replaced}
    targets = {k: t for k, t in tensor_paths(into).items() if k not in skipped_keys}
    tensors: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    copies = []
    for i in wanted:
        entry = manifest.tensors[i]
        storage = manifest.storages[entry.storage]
        view = _view(placement.place(raw[entry.storage], storage.device), entry)
        target = targets.get(entry.key)
        if target is not None:
            if (target.shape, target.dtype) != (view.shape, view.dtype):
                raise ValueError(
                    f"{opened.name}: cannot load {entry.key} into the given tensor: saved "
                    f"{view.dtype} {tuple(view.shape)}, target {target.dtype} {tuple(target.shape)}"
                )
            copies.append((target, view))
            view = target
        tensors[i] = view
    with torch.no_grad():
        for target, view in copies:
            target.copy_(view)
    placement.synchronize()
    arrays = [_array(raw[a.storage], a.dtype, a.shape, a.scalar) for a in manifest.arrays]
    # Skipped entries are None: the caller puts the DTensors' values there.
    return unflatten(manifest.root, tensors, arrays, opened.name)  # type: ignore[arg-type]


def _view(buf: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    t = torch.empty(0, dtype=torch_dtype(entry.dtype), device=buf.device)
    t.set_(buf.untyped_storage(), entry.offset, entry.shape, entry.stride)
    if entry.parameter:
        return torch.nn.Parameter(t, requires_grad=entry.requires_grad)
    return t.requires_grad_(entry.requires_grad) if entry.requires_grad else t


def _array(buf: torch.Tensor, dtype: str, shape: tuple[int, ...], scalar: bool) -> Any:
    array = buf.numpy().view(np.dtype(dtype)).reshape(shape)
    return array[()] if scalar else array


def _substituted(tree: Any, values: dict[Path, Any], name: str) -> Any:
    """``tree`` with the value at each path of ``values`` replaced (dict levels created)."""
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
            if not isinstance(node, dict):
                raise FormatError(f"{name}: no place for {fqn_of(path)} in the saved state")
            node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise FormatError(f"{name}: no place for {fqn_of(path)} in the saved state")
        node[path[-1]] = values[path]
    return tree
