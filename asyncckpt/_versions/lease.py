"""The writer lease on storage: its records under ``_lease/``, and the wait for a step that
the writer's failure or a stale lease ends (docs/PROTOCOL.md §0 and §0b).
"""

from __future__ import annotations

from dataclasses import asdict

from asyncckpt import _liveness as liveness
from asyncckpt._storage import TEMP_MARK, Storage
from asyncckpt._versions.protocol import (
    LEASE_DIR,
    FailureRecord,
    LeaseRecord,
    committed_steps,
    encode_record,
    read_commit,
    read_failure,
    read_record,
    read_version_file,
)
from asyncckpt.errors import CheckpointTimeoutError, FormatError, IncompleteCheckpointError


def lease_path(storage: Storage, root: str, epoch: int) -> str:
    """Where epoch ``epoch``'s lease record lives."""
    return storage.join(root, LEASE_DIR, f"{epoch:012d}")


def lease_epochs(storage: Storage, root: str) -> list[int]:
    """Every epoch that has a lease record, ascending."""
    names = storage.list_dir(storage.join(root, LEASE_DIR))
    return sorted(e for n in names if TEMP_MARK not in n and (e := lease_epoch_of(n)) is not None)


def lease_epoch_of(name: str) -> int | None:
    """The epoch a name under ``_lease/`` belongs to: a lease record's, or the record that a
    temp file was being written for; None for anything else.

    Example:
        >>> [lease_epoch_of(n) for n in ("000000000007", "000000000007.acktmp-1f", "x")]
        [7, 7, None]
    """
    record = name.split(TEMP_MARK, 1)[0]
    return int(record) if len(record) == 12 and record.isascii() and record.isdigit() else None


def write_lease(storage: Storage, root: str, lease: LeaseRecord, create: bool = False) -> None:
    """Write ``lease``'s record: claim its epoch with an exclusive create (``create``;
    ConflictError: another writer claimed it first), or rewrite it with its next beat."""
    path, record = lease_path(storage, root, lease.epoch), encode_record(asdict(lease))
    (storage.create_exclusive if create else storage.write_bytes)(path, record)


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


def wait_for_step(
    storage: Storage,
    root: str,
    step: int,
    timeout: float | None,
    writer: str | None = None,
    *,
    expiry_s: float,
) -> None:
    """Poll until ``step`` is committed, for at most ``timeout`` seconds (None: for ever, or
    until the lease, unchanged for ``expiry_s`` seconds, is stale).

    Only the ``FAILED`` marker of the awaited attempt ends the wait (:func:`_awaited`;
    ``writer``: that writer's token, where known), so one an earlier job left never does.

    Raises:
        IncompleteCheckpointError: the awaited attempt recorded that the save of ``step``
            failed, or the version file passed ``step`` without it being committed.
        CheckpointTimeoutError: not committed within ``timeout`` seconds, or the writer
            stopped renewing its lease (it died or froze) while ``step`` was not committed.
    """
    where = storage.describe(root)
    watch = liveness.Staleness(expiry_s)
    started = liveness.clock().now()

    def committed() -> bool | None:
        if read_commit(storage, root, step) is not None:
            return True
        lease = current_lease(storage, root)
        stale = watch.stale_for("lease", lease)  # None: no writer yet, nothing to judge
        failure = read_failure(storage, root, step)
        if failure is not None and _awaited(failure, writer, lease):
            raise IncompleteCheckpointError(
                f"the save of step {step} under {where} failed: {failure.error}"
            )
        newer = read_version_file(storage, root)
        passed = newer.step if newer is not None and newer.step is not None else -1
        if passed > step and read_commit(storage, root, step) is None:
            # Steps only increase, so a step passed over by the version file never commits.
            raise IncompleteCheckpointError(
                f"step {step} under {where} was never committed (or was deleted); step "
                f"{passed} is the newest"
            )
        if stale is not None:
            raise CheckpointTimeoutError(
                f"gave up waiting for step {step} under {where} after "
                f"{liveness.clock().now() - started:.1f} s: the writer (epoch "
                f"{lease.epoch if lease else '?'}) has not renewed its lease for {stale:.1f} s, "
                "so it died or froze before committing the step"
            )
        return None

    def expired(waited: float) -> CheckpointTimeoutError:
        return CheckpointTimeoutError(
            f"step {step} was not committed under {where} within {timeout} s; "
            f"committed steps: {committed_steps(storage, root) or 'none'}"
        )

    what = f"step {step} under {where}"
    liveness.poll(committed, timeout=timeout, expired=expired, cap=2.0, watch=watch, what=what)


def _awaited(failure: FailureRecord, writer: str | None, lease: LeaseRecord | None) -> bool:
    """Whether ``failure`` is that of the awaited attempt: ``writer``'s when the waiter knows
    it; else the current lease holder's (its epoch; 0 on a root never leased).

    Example:
        >>> old = FailureRecord(3, "disk full", "a1", epoch=1)
        >>> _awaited(old, "b2", None), _awaited(old, None, LeaseRecord(2, "b2", 0))
        (False, False)
        >>> _awaited(old, "a1", None), _awaited(old, None, LeaseRecord(1, "a1", 7))
        (True, True)
    """
    if writer is not None:
        return failure.writer == writer
    return failure.epoch == (0 if lease is None else lease.epoch)
