"""The record of a drop-in save marker (``<path>.ackpending``): pure encoding and decoding
(docs/PROTOCOL.md, "Drop-in save and load across processes")."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, get_args, get_type_hints

from asyncckpt._versions.protocol import decode_record, encode_record
from asyncckpt.errors import FormatError

#: Suffix of the marker that sits beside a file while a drop-in ``save`` of it is in flight.
PENDING_SUFFIX = ".ackpending"
#: The ``kind`` of a drop-in save marker record.
DROP_IN_SAVE = "drop-in-save"
#: Markers are a few hundred bytes; a reader reads at most this many.
MAX_PENDING_BYTES = 64 << 10


@dataclass(frozen=True)
class PendingRecord:
    """The content of a drop-in save marker (``<file>.ackpending``): who is writing the file
    (docs/PROTOCOL.md §8 says what each field holds). ``token`` is unique to one writer
    process's run of saves of the file: the save publishes only if the marker still
    carries it; the pid with ``pid_ns``, ``boot`` and ``pid_start`` (None where unknown)
    tell a reader on the same machine a dead writer, or a reused pid, from a live one."""

    token: str
    host: str
    pid: int
    pid_ns: str | None
    boot: str | None
    pid_start: int | None
    beat: int
    started: str


#: Each field of a marker's record and the JSON types it may have (its annotation's).
_FIELDS = {k: get_args(t) or (t,) for k, t in get_type_hints(PendingRecord).items()}


def encode_pending(record: PendingRecord) -> bytes:
    """A drop-in save marker's bytes (JSON; ``time`` makes every rewrite's bytes unique).

    Example:
        >>> record = PendingRecord("t1", "node1", 42, None, None, None, 0, "2024-01-01")
        >>> decode_pending(encode_pending(record)) == record
        True
    """
    return encode_record({"kind": DROP_IN_SAVE, **asdict(record)})


def decode_pending(raw: bytes) -> PendingRecord | None:
    """The record in a marker's bytes, or None if they are not a whole record (one being
    rewritten in place, so empty or cut short; or of a kind or protocol unknown here).

    Example:
        >>> decode_pending(b'{"protocol": 1, "kind": "drop-in-sa') is None
        True
    """
    try:
        doc = decode_record(raw, "save marker")
    except FormatError:
        return None
    values: dict[str, Any] = {name: doc.get(name) for name in _FIELDS}
    if doc.get("kind") != DROP_IN_SAVE or any(type(values[k]) not in t for k, t in _FIELDS.items()):
        return None
    return PendingRecord(**values)
