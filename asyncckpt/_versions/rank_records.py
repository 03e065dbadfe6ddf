"""The records a sharded version's ranks write (``.done``, ``.failed``, ``.beat``) and the
DCP metadata built from them: pure encoding, decoding and checks (docs/sharded.md; the
protocol that writes and waits for them is :mod:`asyncckpt._versions.ranks`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from asyncckpt._format.container import DTYPE_ITEMSIZE, MAX_DEPTH, MAX_NDIM
from asyncckpt._format.index import ItemLocation, data_file_name, decode_metadata, encode_metadata
from asyncckpt._format.tree import torch_dtype
from asyncckpt._versions.protocol import decode_record, encode_record
from asyncckpt.errors import FormatError

DONE: Final = ".done"
FAILED: Final = ".failed"
BEAT: Final = ".beat"
#: The DCP metadata version recorded (the one DCP's FileSystemWriter writes).
_DCP_VERSION: Final = "1.0.0"
Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Piece:
    """One chunk of a DTensor stored in one rank's file: the DTensor's flat name (DCP's)
    and key path, its global shape and dtype name, where the chunk starts in it and its
    shape, its index in the file's tensor table and its raw length (docs/sharded.md)."""

    fqn: str
    path: Path
    shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    entry: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        """The piece as a JSON object (in a ``.done`` record)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items()}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> Piece:
        """Parse and check one piece of a record.

        Raises:
            FormatError: a field is missing, of the wrong type or out of range.

        Example:
            >>> p = Piece("w", ("w",), (4,), "float32", (2,), (2,), 0, 8)
            >>> Piece.from_json(p.to_json(), "x") == p
            True
        """
        bad = FormatError(f"{where}: malformed piece {str(doc)[:200]}")
        if not isinstance(doc, dict):
            raise bad
        path, dims = doc.get("path"), [doc.get(k) for k in ("shape", "offsets", "sizes")]
        scalars = [doc.get("entry"), doc.get("nbytes")]
        if not (
            isinstance(doc.get("fqn"), str)
            and isinstance(path, list)
            and 0 < len(path) <= MAX_DEPTH
            and all(type(k) in (str, int) for k in path)
            and isinstance(doc.get("dtype"), str)
            and doc["dtype"] in DTYPE_ITEMSIZE
            and all(_dims(d) for d in dims)
            and len({len(d) for d in dims}) == 1  # type: ignore[arg-type]
            and all(type(v) is int and v >= 0 for v in scalars)
        ):
            raise bad
        shape, offsets, sizes = (tuple(d) for d in dims)  # type: ignore[arg-type]
        if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise bad
        entry, nbytes = doc["entry"], doc["nbytes"]
        return cls(doc["fqn"], tuple(path), shape, doc["dtype"], offsets, sizes, entry, nbytes)


def _dims(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_NDIM
        and all(type(v) is int and 0 <= v < 1 << 62 for v in value)
    )


@dataclass(frozen=True)
class RankDone:
    """A rank's completion record: its data ``file`` (``size`` bytes) is durable and
    holds ``pieces``, the DTensor chunks it stores (``rank`` is in the Checkpointer's
    group)."""

    rank: int
    file: str
    size: int
    pieces: tuple[Piece, ...] = field(default_factory=tuple)

    def encode(self, step: int, attempt: str) -> bytes:
        """The record as bytes (:func:`~asyncckpt._versions.protocol.encode_record`)."""
        doc = {"kind": "rank-done", "step": step, "attempt": attempt, **vars(self)}
        return encode_record({**doc, "pieces": [p.to_json() for p in self.pieces]})

    @classmethod
    def decode(cls, raw: bytes, where: str, step: int, attempt: str, rank: int) -> RankDone:
        """Parse and check a completion record.

        Raises:
            FormatError: malformed, or written for another step, attempt or rank.
        """
        doc = decode_record(raw, where)
        file, size, pieces = doc.get("file"), doc.get("size"), doc.get("pieces")
        if (
            doc.get("kind") != "rank-done"
            or (doc.get("step"), doc.get("attempt"), doc.get("rank")) != (step, attempt, rank)
            or file != data_file_name(rank, attempt)
            or type(size) is not int
            or size < 0
            or not isinstance(pieces, list)
        ):
            raise FormatError(f"{where}: not the completion record of rank {rank}'s save")
        return cls(rank, file, size, tuple(Piece.from_json(p, where) for p in pieces))


def record_name(rank: int, attempt: str, suffix: str) -> str:
    """The name of a rank's record of one attempt (suffix :data:`DONE`, ``FAILED``, ``BEAT``).

    Example:
        >>> record_name(3, "ab" * 16, DONE)
        'r00003-abababababababababababababababab.done'
    """
    return data_file_name(rank, attempt).removesuffix(".ackpt") + suffix


def metadata_bytes(records: dict[int, RankDone], attempt: str, where: str) -> bytes:
    """DCP's metadata for every rank's pieces, as ``asyncckpt.dcp``'s JSON.

    Raises:
        FormatError: ranks disagree on a tensor's shape or dtype, store a chunk twice, or
            leave part of a tensor unstored (the checks every reader makes).
    """
    tensors: dict[str, TensorStorageMetadata] = {}
    locations: dict[MetadataIndex, ItemLocation] = {}
    paths: dict[str, Path] = {}
    for _, record in sorted(records.items()):
        for piece in record.pieces:
            dtype = torch_dtype(piece.dtype)
            described = tensors.setdefault(
                piece.fqn,
                TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(piece.shape), []),
            )
            same = (tuple(described.size), described.properties.dtype) == (piece.shape, dtype)
            if not same or paths.setdefault(piece.fqn, piece.path) != piece.path:
                raise FormatError(f"{where}: ranks disagree on what {piece.fqn!r} is")
            described.chunks.append(
                ChunkStorageMetadata(torch.Size(piece.offsets), torch.Size(piece.sizes))
            )
            index = MetadataIndex(piece.fqn, piece.offsets)
            if index in locations:
                raise FormatError(f"{where}: {piece.fqn!r} at {piece.offsets} is stored twice")
            locations[index] = ItemLocation(record.file, record.size, piece.entry, piece.nbytes)
    metadata = Metadata(
        state_dict_metadata=dict(tensors),
        planner_data=dict(paths),
        storage_data=locations,
        storage_meta=StorageMeta(checkpoint_id=where, save_id=attempt),
        version=_DCP_VERSION,
    )
    body = encode_metadata(metadata, attempt)
    decode_metadata(body, f"{where} metadata")  # a reader's checks, before the commit
    return body
