"""Read one file and rebuild what was saved: tensors as views over their (possibly shared)
storages, placed per ``map_location`` (see :mod:`asyncckpt._device`).

The chunks are read by the one chunk engine (:mod:`asyncckpt._engine.chunks`); this module
chooses which storages to read (all, or those of the entries selected), reads them into
fresh buffers, and only then loads them into the caller's tensors, so that a damaged chunk
leaves those as they were.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from asyncckpt._device import Placement, device_types, known_device
from asyncckpt._engine.chunks import read_runs, whole_run
from asyncckpt._engine.decode_select import Selection, for_into, select, top_level
from asyncckpt._engine.device_load import stream_to_device, streamable
from asyncckpt._engine.opened import Budget, OpenedFile, check_sizes, open_file
from asyncckpt._format.container import ArrayEntry, StorageEntry, TensorEntry
from asyncckpt._format.tree import (
    empty_of,
    tensor_paths,
    tensor_paths_all,
    torch_dtype,
    unflatten,
)
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt.errors import FileReplacedError, FormatError

__all__ = [
    "REPLACED_ATTEMPTS",
    "Budget",
    "OpenedFile",
    "check_devices",
    "check_overlap",
    "check_sizes",
    "materialize",
    "open_file",
    "read_file",
    "read_storages",
]


log = logging.getLogger(__name__)

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

    On an object store a read of a replaced object fails (``If-Match``) and ``work`` runs
    again on the new object, at most :data:`REPLACED_ATTEMPTS` times in all (a local file
    stays readable once opened); ``budget`` (the one ``work`` charges, if any) is given
    back what an abandoned attempt charged.

    Raises:
        FileReplacedError: the file was replaced during every attempt.

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


def read_storages(
    opened: OpenedFile,
    threads: int,
    *,
    sids: Collection[int] | None = None,
    pinned: Sequence[bool] | None = None,
    budget: Budget | None = None,
    pin_budget: int = 0,
) -> dict[int, torch.Tensor]:
    """Read, verify and decode the storages ``sids`` (None: all) into fresh buffers
    (:func:`.chunks.read_runs`): ``{storage index: 1-D uint8 CPU tensor of its bytes}``.

    ``pinned`` says per storage of the file whether its buffer should be pinned (for a CUDA
    copy), honoured up to ``pin_budget`` bytes in all, in storage order; ``budget`` is
    charged with the buffers before the first one is allocated.

    Raises:
        ChecksumError: a chunk is damaged (the first one found).
        FormatError: the declared sizes cannot be justified by the file, or allocated; a
            storage index the file does not have.
        MemoryBudgetError: the buffers would exceed ``budget``.

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt._storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"w": torch.arange(3)}, path).result()
        >>> with open_file(*resolve(path, None)) as opened:
        ...     [b.numel() for b in read_storages(opened, threads=2).values()]
        [24]
    """
    storages = opened.manifest.storages
    wanted = range(len(storages)) if sids is None else sorted(sids)
    runs = {sid: whole_run(opened, sid) for sid in wanted}
    pins = _within_budget(storages, pinned or [False] * len(storages), pin_budget)
    chosen = {sid for sid in runs if pins[sid]}
    return read_runs(opened, runs, threads, pinned=chosen, budget=budget)


def _within_budget(
    storages: Sequence[StorageEntry], wanted: Sequence[bool], budget: int
) -> list[bool]:
    pins = []
    for entry, want in zip(storages, wanted):
        pin = want and entry.nbytes <= budget
        budget -= entry.nbytes if pin else 0
        pins.append(pin)
    return pins


def materialize(
    opened: OpenedFile,
    placement: Placement,
    settings: Settings,
    into: Any = None,
    budget: Budget | None = None,
    *,
    skip: Collection[int] = (),
    replaced: Collection[str] = (),
    keys: Collection[Any] | None = None,
) -> Any:
    """Read what was saved (all of it, the top-level ``keys``, or all but the entries
    ``skip``) and rebuild it, tensors placed per ``placement``, with the load's
    ``settings``. Returns the saved object (with ``keys``, the dict of those keys). A
    partial load (``skip``, ``keys``, or an ``into`` dict that lacks some top-level subtree
    of a saved dict) fetches only the storages of the entries it returns.

    Args:
        into: optional existing state (e.g. ``model.state_dict()``); each saved tensor whose
            key path matches a tensor there is loaded into that tensor, in place, and the
            returned object holds the existing tensor. Nothing in ``into`` changes unless
            every chunk was verified and every target matches, so a failed load leaves it
            as it was. If both ``into`` and the saved object are dicts (and no
            ``keys``), only the top-level subtrees ``into`` has are read, and the top-level
            values holding no tensor or array: the others are left out of the result.
        budget: charged with every storage read, before any is allocated.
        skip: indices into the file's tensor table not to read; they come back as None
            (a sharded version's DTensor pieces, loaded by the caller).
        replaced: key paths whose values the caller puts in place itself: never loaded
            into ``into``. With ``skip`` or ``replaced``, ``into`` may share no tensor with
            the file.
        keys: top-level keys of the saved dict to load (see
            :mod:`asyncckpt._engine.decode_select`); the result holds only those.

    Raises:
        MissingKeyError: a key of ``keys`` is not in the file (the message lists its keys).
        FormatError: a storage names an unknown device type, or sizes the file cannot hold.
        MemoryBudgetError: the storages would exceed ``budget``.
        ChecksumError: a chunk is damaged.
        ValueError: a tensor in ``into`` differs in shape or dtype from the saved one, or
            ``into`` shares no tensor with the file (see :func:`check_overlap`).

    Example:
        >>> import asyncckpt, os, tempfile, torch
        >>> from asyncckpt._storage import resolve
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"w": torch.arange(3), "v": torch.ones(2)}, path).result()
        >>> state = {"w": torch.zeros(3, dtype=torch.int64)}
        >>> with open_file(*resolve(path, None)) as opened:
        ...     got = materialize(opened, Placement("cpu"), Settings(), into=state, skip={1})
        >>> state["w"], got["v"]
        (tensor([0, 1, 2]), None)
    """
    manifest = opened.manifest
    check_devices(opened)
    replaced = set(replaced)  # not rebuilt per key below
    targets = tensor_paths(into) if into is not None else {}
    targets = {k: t for k, t in targets.items() if k not in replaced}
    whole_into = into is not None and not skip and not replaced
    if whole_into:
        check_overlap(opened, into, targets)
    # What the load returns: the keys asked for, the subtrees into has, or all.
    chosen = select(manifest, keys, opened.name) if keys is not None else None
    if chosen is None and whole_into:
        chosen = for_into(manifest, into, opened.name)
    if chosen is None:
        everything = frozenset(range(len(manifest.tensors)))
        chosen = Selection(manifest.root, everything, frozenset(range(len(manifest.arrays))))
    wanted = sorted(i for i in chosen.tensors if i not in skip)
    sids = None
    if len(wanted) < len(manifest.tensors) or len(chosen.arrays) < len(manifest.arrays):
        sids = {manifest.tensors[i].storage for i in wanted}
        sids |= {manifest.arrays[i].storage for i in chosen.arrays}
    pins = [placement.wants_pinned(entry.device) for entry in manifest.storages]
    every = range(len(manifest.storages)) if sids is None else sorted(sids)
    streamed: dict[int, torch.Tensor] = {}
    if not targets:  # fresh device tensors only: see below, and _engine/device_load.py
        to_stream = streamable(opened, placement, every)
        if budget is not None and to_stream:
            nbytes = sum(manifest.storages[sid].nbytes for sid in to_stream)
            budget.charge(opened.name, nbytes, "its storages")
        window = settings.pin_budget_bytes
        streamed = stream_to_device(opened, placement, to_stream, settings.threads, window)
    # Into fresh buffers, never into `into` itself (see the module docstring).
    raw = read_storages(
        opened,
        settings.threads,
        sids=[sid for sid in every if sid not in streamed],
        pinned=pins,
        budget=budget,
        pin_budget=settings.pin_budget_bytes,
    )
    # Every key path of each tensor: a tensor saved at two paths ({"model": sd, "ema": sd},
    # tied weights) is one table entry, and into's tensor at each of its paths gets it.
    paths = {}
    if targets:
        paths = key_paths(manifest.root, len(manifest.tensors), len(manifest.arrays), opened.name)
    goes_into = {
        i: [targets[p] for p in paths.get(i, [manifest.tensors[i].key]) if p in targets]
        for i in wanted
    }
    # A storage all of whose tensors go into targets is copied from host memory straight
    # into them: placing it first would hold a second copy of the state on the device.
    to_place = {manifest.tensors[i].storage for i in wanted if not goes_into[i]}
    placed = {
        sid: placement.place(buf, manifest.storages[sid].device) if sid in to_place else buf
        for sid, buf in raw.items()
    }
    placed.update(streamed)
    tensors: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    copies = []
    for i in wanted:
        entry = manifest.tensors[i]
        view = _view(placed[entry.storage], entry)
        for target in goes_into[i]:
            _check_target(opened.name, entry.key, target, view)
            copies.append((target, view))
        tensors[i] = goes_into[i][0] if goes_into[i] else view
    with torch.no_grad():
        for target, view in copies:
            placement.copy_into(target, view)
    placement.synchronize()
    arrays = [
        _array(raw[a.storage], a) if i in chosen.arrays else None
        for i, a in enumerate(manifest.arrays)
    ]
    # Skipped entries are None: the caller puts their values there.
    return unflatten(chosen.root, tensors, arrays, opened.name)  # type: ignore[arg-type]


def key_paths(root: Any, tensors: int, arrays: int, name: str) -> dict[int, list[str]]:
    """Every key path at which the tree ``root`` holds each tensor of its table (of
    ``tensors`` entries; ``arrays``: the length of its array table).

    Example:
        >>> key_paths({"dict": [["a", {"tensor": 0}], ["b", {"tensor": 0}]]}, 1, 0, "f")
        {0: ["state['a']", "state['b']"]}
    """
    markers = [torch.empty(0) for _ in range(tensors)]
    index = {id(t): i for i, t in enumerate(markers)}
    rebuilt = unflatten(root, markers, [None] * arrays, name)
    found: dict[int, list[str]] = {}
    for path, t in sorted(tensor_paths_all(rebuilt)):
        found.setdefault(index[id(t)], []).append(path)
    return found


def check_overlap(opened: OpenedFile, into: Any, targets: dict[str, torch.Tensor]) -> None:
    """Refuse an ``into`` that would receive nothing from a file that holds tensors.

    ``load(f, into=model.state_dict())`` of a file saved as ``{"model": ..., "optim": ...}``
    matches no key path and would otherwise load nothing into the model, silently.

    Raises:
        ValueError: naming the file and both sides' top-level keys.
    """
    saved = [entry.key for entry in opened.manifest.tensors]
    if not saved or any(key in targets for key in saved):
        return
    pairs = top_level(opened.manifest.root, opened.name)
    theirs = "(not a dict)" if pairs is None else [key for key, _node in pairs]
    ours = list(into) if isinstance(into, dict) else type(into).__qualname__
    raise ValueError(
        f"{opened.name}: into= shares no tensor with the file, so nothing would be loaded "
        f"into it: the file's top-level keys are {theirs}, into's are {ours}. Pass the part "
        "of into that matches (e.g. into={'model': model.state_dict()} for a file saved as "
        "{'model': ..., 'optim': ...}), or load without into"
    )


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


def _view(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    t = empty_of(torch_dtype(entry.dtype), buffer.device)
    t.set_(buffer.untyped_storage(), entry.offset, entry.shape, entry.stride)
    if entry.parameter:
        return torch.nn.Parameter(t, requires_grad=entry.requires_grad)
    return t.requires_grad_(True) if entry.requires_grad else t


def _array(buf: torch.Tensor, entry: ArrayEntry) -> Any:
    array = buf.numpy().view(np.dtype(entry.dtype)).reshape(entry.shape)
    return array[()] if entry.scalar else array
