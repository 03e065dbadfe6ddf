"""Waiting for a step to be committed: the writer's failure and a lease that stopped
changing end the wait (docs/PROTOCOL.md; the liveness kernel's poll and stale rule)."""

from __future__ import annotations

from asyncckpt import _liveness as liveness
from asyncckpt._storage import Storage
from asyncckpt._versions.lease import current_lease
from asyncckpt._versions.protocol import (
    FailureRecord,
    LeaseRecord,
    committed_steps,
    read_commit,
    read_failure,
    read_version_file,
)
from asyncckpt.errors import (
    CheckpointTimeoutError,
    IncompleteCheckpointError,
)


def wait_for_step(
    storage: Storage,
    root: str,
    step: int,
    timeout: float | None,
    writer: str | None = None,
    *,
    expiry_s: float,
) -> None:
    """Poll (:func:`~asyncckpt._liveness.poll`) until ``step`` is committed, for at most
    ``timeout`` seconds (None: for ever, or until the lease goes stale).

    ``writer`` is the token of the writer whose save of ``step`` is awaited (a collective
    load knows it): only that writer's ``FAILED`` marker ends the wait. None: only a
    marker of the current lease's epoch does, so a marker an earlier job left never stops
    a wait for the current writer's save of the same step. A lease record unchanged for
    ``expiry_s`` seconds is stale (the ``lease_expiry_ms`` of the caller's settings).

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
    """Whether ``failure`` is that of the save attempt a waiter waits for.

    The attempt of ``writer`` when the waiter knows it; else the current lease holder's
    (the epoch of the newest lease record; 0 on a root no writer ever took a lease on).

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
