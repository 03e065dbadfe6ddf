"""Sharded saves: what one rank stores of a state that holds ``DTensor``s.

``Checkpointer.save`` asks this module when the state holds ``DTensor``s (FSDP2, TP, their
optimizer states from ``get_state_dict``): :func:`split_state` replaces each DTensor by the
local shard this rank stores (or None where another rank stores that replicated piece),
:func:`pieces_of` describes those shards for the version's index, and :class:`Attempts`
names the save, the same on every rank. The rank's write, its markers and the writer
rank's wait are in :mod:`asyncckpt._versions.ranks`; the commit, the same for every
version, in :mod:`asyncckpt._versions.publish`. ``docs/sharded.md`` describes the protocol.
"""

from __future__ import annotations

import hashlib
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist

from asyncckpt._format.tree import Path, dtensor_leaves, dtype_name, flatten, fqn_of
from asyncckpt._versions.rank_records import Piece
from asyncckpt.errors import UnsupportedObjectError

# ------------------------------------------------------------------ the caller's part


class Attempts:
    """The attempt ids of one Checkpointer's sharded saves, the same on every rank.

    Every rank calls ``save`` the same number of times, so the counter agrees; the token
    (broadcast from the writer rank on the first sharded save, the one collective of a
    save) differs per Checkpointer, so a restarted job never reuses a name.
    """

    def __init__(self) -> None:
        self.token: str | None = None
        self.saves = 0

    def next(self, step: int, group: Any, writer_rank: int, device: torch.device) -> str:
        """This save's attempt id (a broadcast on the first call only)."""
        if self.token is None:
            token = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8)
            token = token.to(device)
            dist.broadcast(token, group=group, group_src=writer_rank)
            self.token = bytes(token.cpu().tolist()).hex()
        self.saves += 1
        seed = f"{self.token}:{step}:{self.saves}".encode()
        return hashlib.blake2b(seed, digest_size=16).hexdigest()


@dataclass
class RankState:
    """One rank's part of a state: what it stages, and the DTensor chunks it stores.

    Attributes:
        plain: the state with each DTensor replaced by its local shard, or by None where
            another rank stores that (replicated) piece.
        stored: ``(path, key path, DTensor, local shard)`` of each chunk this rank stores.
    """

    plain: Any
    stored: list[tuple[Path, str, Any, torch.Tensor]]


def split_state(state: Any) -> RankState:
    """Replace every DTensor of ``state`` by what this rank stores of it.

    A DTensor's local shard is stored by this rank unless the placement replicates it
    over a mesh dimension on which this rank's coordinate is not 0 (another rank holds the
    same values), or it is empty while the tensor is not.

    Raises:
        UnsupportedObjectError: a DTensor with ``Partial`` placements (reduce it first),
            several local chunks, or a key that is not a str or int; names the key path.
    """
    local: dict[int, torch.Tensor] = {}
    stored: list[tuple[Path, str, Any, torch.Tensor]] = []
    replaced: dict[Path, torch.Tensor | None] = {}
    names: dict[str, Path] = {}
    for path, key, dt in dtensor_leaves(state):
        fqn = fqn_of(path)
        if names.setdefault(fqn, path) != path:
            raise UnsupportedObjectError(key, f"another DTensor has the same name {fqn!r}")
        if not _stores(dt, key):
            replaced[path] = None
            continue
        if id(dt) not in local:  # tied weights: one shard object, stored once
            with torch.no_grad():
                local[id(dt)] = dt.to_local()
        replaced[path] = local[id(dt)]
        stored.append((path, key, dt, local[id(dt)]))
    above = {path[:i] for path in replaced for i in range(len(path))}
    return RankState(_rebuilt(state, (), replaced, above), stored)


#: Local chunk lists by mesh, then (placements, global shape): together they determine them
#: on a rank. Computing one costs tens of microseconds per DTensor (hundreds of DTensors in
#: a model and its optimizer state: milliseconds of every save's stall), and a training
#: state has the same few keys at every save. The mesh is held weakly: a DeviceMesh holds
#: its ProcessGroups, and a cache that kept it would keep them, and their worker threads,
#: alive after ``destroy_process_group()``, into the interpreter's shutdown.
_chunk_cache: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], list[Any]]]
_chunk_cache = weakref.WeakKeyDictionary()
_CHUNK_CACHE_MAX: Final = 4096


def _chunks(dt: Any) -> list[Any]:
    """``dt.__create_chunk_list__()``, from :data:`_chunk_cache` when it was seen before."""
    by_layout = _chunk_cache.setdefault(dt.device_mesh, {})
    key = (tuple(dt.placements), dt.shape)
    chunks = by_layout.get(key)
    if chunks is None:
        chunks = dt.__create_chunk_list__()
        if len(by_layout) >= _CHUNK_CACHE_MAX:
            by_layout.clear()
        by_layout[key] = chunks
    return chunks


def _stores(dt: Any, key: str) -> bool:
    try:
        chunks = _chunks(dt)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        raise UnsupportedObjectError(key, f"DTensor {dt.placements}: {exc}") from None
    if len(chunks) != 1:
        raise UnsupportedObjectError(key, f"a DTensor with {len(chunks)} local chunks")
    coordinate = dt.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the DTensor's mesh
        return False
    if dt.numel() == 0:  # every shard is empty: one rank records the tensor's shape
        return all(c == 0 for c in coordinate)
    if chunks[0].sizes.numel() == 0:
        return False
    return all(c == 0 for c, p in zip(coordinate, dt.placements) if p.is_replicate())


def _rebuilt(node: Any, path: Path, replaced: dict[Path, Any], above: set[Path]) -> Any:
    """A copy of the containers ``above`` a replaced leaf; everything else is shared."""
    if path in replaced:
        return replaced[path]
    if path not in above:
        return node
    if isinstance(node, dict):
        pairs = [(k, _rebuilt(v, (*path, k), replaced, above)) for k, v in node.items()]
        out = OrderedDict(pairs) if isinstance(node, OrderedDict) else dict(pairs)
        if hasattr(node, "_metadata"):
            out._metadata = node._metadata  # type: ignore[attr-defined]
        return out
    items = [_rebuilt(v, (*path, i), replaced, above) for i, v in enumerate(node)]
    return items if isinstance(node, list) else tuple(items)


def pieces_of(rank_state: RankState) -> list[Piece]:
    """The chunks this rank stores, with their entries in its file's tensor table.

    The table is ``flatten``'s (the one ``stage`` writes): tensors in order of first
    appearance, each object once.
    """
    table = {id(t): i for i, (t, _) in enumerate(flatten(rank_state.plain).tensors)}
    pieces = []
    for path, _key, dt, shard in rank_state.stored:
        (chunk,) = _chunks(dt)
        pieces.append(
            Piece(
                fqn=fqn_of(path),
                path=path,
                shape=tuple(dt.shape),
                dtype=dtype_name(dt.dtype),
                offsets=tuple(chunk.offsets),
                sizes=tuple(chunk.sizes),
                entry=table[id(shard)],
                nbytes=shard.numel() * shard.element_size(),
            )
        )
    return pieces
