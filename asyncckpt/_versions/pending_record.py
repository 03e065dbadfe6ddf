"""The record of a drop-in save marker (``<path>.ackpending``): pure encoding and decoding
(docs/PROTOCOL.md, "Drop-in save and load across processes")."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

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
    """The content of a drop-in save marker (``<file>.ackpending``): who is writing the file.

    Attributes:
        token: unique to one writer process's run of saves of the file; the save publishes
            only if the marker still carries it.
        host: the writer's host name.
        pid: the writer's process id (the process that called ``save``).
        pid_ns: the writer's pid namespace (``/proc/self/ns/pid``), None where unknown.
        boot: the writer's boot id (``/proc/sys/kernel/random/boot_id``), None where unknown.
        pid_start: the writer's start time in clock ticks after boot (``/proc/<pid>/stat``
            field 22), None where unknown: with the three above, a reader on the same
            machine tells a dead writer (or a reused pid) from a live one.
        beat: how often the writer has rewritten the marker since it created it.
        started: when the marker was created (ISO 8601, UTC).
    """

    token: str
    host: str
    pid: int
    pid_ns: str | None
    boot: str | None
    pid_start: int | None
    beat: int
    started: str


#: Each field of a marker's record and the JSON types it may have.
_FIELDS = {
    "token": (str,),
    "host": (str,),
    "pid": (int,),
    "pid_ns": (str, type(None)),
    "boot": (str, type(None)),
    "pid_start": (int, type(None)),
    "beat": (int,),
    "started": (str,),
}


def encode_pending(record: PendingRecord) -> bytes:
    """A drop-in save marker's bytes (JSON; ``time`` makes every rewrite's bytes unique).

    Example:
        >>> record = PendingRecord("t1", "node1", 42, None, None, None, 0, "2024-01-01")
        >>> decode_pending(encode_pending(record)) == record
        True
    """
    return encode_record({"kind": DROP_IN_SAVE, **asdict(record)})


def decode_pending(raw: bytes) -> PendingRecord | None:
    """The record in a marker's bytes, or None if they are not a whole record.

    A marker is rewritten in place (no temp file), so a reader may see it empty or cut
    short; None then means "a save is pending, and its marker is being rewritten". So does
    a record of a kind or protocol this code does not know.

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
