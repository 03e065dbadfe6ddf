"""The writer lease on storage: its records under ``_lease/``, created, renewed and read
(docs/PROTOCOL.md, "Roles and the writer lease")."""

from __future__ import annotations

from dataclasses import asdict

from asyncckpt._storage import TEMP_MARK, Storage
from asyncckpt._versions.protocol import LEASE_DIR, LeaseRecord, encode_record, read_record
from asyncckpt.errors import FormatError


def lease_path(storage: Storage, root: str, epoch: int) -> str:
    """Where epoch ``epoch``'s lease record lives."""
    return storage.join(root, LEASE_DIR, f"{epoch:012d}")


def lease_epochs(storage: Storage, root: str) -> list[int]:
    """Every epoch that has a lease record, ascending."""
    names = storage.list_dir(storage.join(root, LEASE_DIR))
    return sorted(int(n) for n in names if len(n) == 12 and n.isascii() and n.isdigit())


def lease_epoch_of(name: str) -> int | None:
    """The epoch a name under ``_lease/`` belongs to: a lease record's, or the record that a
    temp file was being written for; None for anything else.

    Example:
        >>> [lease_epoch_of(n) for n in ("000000000007", "000000000007.acktmp-1f", "x")]
        [7, 7, None]
    """
    record = name.split(TEMP_MARK, 1)[0]
    return int(record) if len(record) == 12 and record.isascii() and record.isdigit() else None


def create_lease(storage: Storage, root: str, epoch: int, writer: str) -> None:
    """Claim ``epoch`` (exclusive create).

    Raises:
        ConflictError: another writer claimed it first.
    """
    record = encode_record(asdict(LeaseRecord(epoch, writer, 0)))
    storage.create_exclusive(lease_path(storage, root, epoch), record)


def renew_lease(storage: Storage, root: str, lease: LeaseRecord) -> None:
    """Rewrite this writer's own lease record with its next heartbeat number."""
    storage.write_bytes(lease_path(storage, root, lease.epoch), encode_record(asdict(lease)))


def current_lease(storage: Storage, root: str) -> LeaseRecord | None:
    """The newest lease record, or None when no writer ever took the root (or unreadable)."""
    epochs = lease_epochs(storage, root)
    if not epochs:
        return None
    try:
        doc = read_record(storage, lease_path(storage, root, epochs[-1]))
    except FormatError:
        return None
    if doc is None or type(doc.get("beat")) is not int or not isinstance(doc.get("writer"), str):
        return None
    return LeaseRecord(epochs[-1], doc["writer"], doc["beat"])
