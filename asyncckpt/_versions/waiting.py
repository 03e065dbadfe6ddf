"""Waiting for a step to be committed: polling with backoff, the writer's failure and a lease
that stopped changing end the wait (docs/PROTOCOL.md)."""

from __future__ import annotations

import logging
import random
import time

from asyncckpt._settings import Settings
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

log = logging.getLogger(__name__)


class _LeaseWatch:
    """Notices a writer that stopped renewing its lease, on the reader's own clock."""

    def __init__(self, storage: Storage, root: str, expiry_s: float) -> None:
        self.storage, self.root = storage, root
        self.expiry_s = expiry_s
        self.seen: LeaseRecord | None = current_lease(storage, root)
        self.since = time.monotonic()

    def stale_for(self) -> float | None:
        """Seconds since the lease last changed, if longer than the expiry; else None."""
        lease = current_lease(self.storage, self.root)
        now = time.monotonic()
        if lease is None or lease != self.seen:  # no writer yet, or it is alive
            self.seen, self.since = lease, now
            return None
        waited = now - self.since
        return waited if waited >= self.expiry_s else None


def wait_for_step(
    storage: Storage,
    root: str,
    step: int,
    timeout: float | None,
    writer: str | None = None,
    *,
    expiry_s: float | None = None,
) -> None:
    """Poll, with exponential backoff and jitter, until ``step`` is committed, for at most
    ``timeout`` seconds (None: for ever, or until the lease goes stale).

    ``writer`` is the token of the writer whose save of ``step`` is awaited (a collective
    load knows it): only that writer's ``FAILED`` marker ends the wait. None: only a
    marker of the current lease's epoch does, so a marker an earlier job left never stops
    a wait for the current writer's save of the same step. A lease unchanged for
    ``expiry_s`` seconds is stale (the ``lease_expiry_ms`` of the caller's settings;
    None: resolved now).

    Raises:
        IncompleteCheckpointError: the awaited attempt recorded that the save of ``step``
            failed, or the version file passed ``step`` without it being committed.
        CheckpointTimeoutError: not committed within ``timeout`` seconds, or the writer
            stopped renewing its lease (it died or froze) while ``step`` was not committed.
    """
    where = storage.describe(root)
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    delay, next_log = 0.02, started + 60
    if expiry_s is None:  # for tools and tests; the package passes its settings'
        expiry_s = Settings.resolve().lease_expiry_ms / 1000
    watch = _LeaseWatch(storage, root, expiry_s)
    while read_commit(storage, root, step) is None:
        stale = watch.stale_for()  # also brings watch.seen (the current lease) up to date
        failure = read_failure(storage, root, step)
        if failure is not None and _awaited(failure, writer, watch.seen):
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
        now = time.monotonic()
        if stale is not None:
            raise CheckpointTimeoutError(
                f"gave up waiting for step {step} under {where} after {now - started:.1f} s: "
                f"the writer (epoch {watch.seen.epoch if watch.seen else '?'}) has not renewed "
                f"its lease for {stale:.1f} s, so it died or froze before committing the step"
            )
        if deadline is not None and now >= deadline:
            raise CheckpointTimeoutError(
                f"step {step} was not committed under {where} within {timeout} s; "
                f"committed steps: {committed_steps(storage, root) or 'none'}"
            )
        if now >= next_log:
            log.info("still waiting for step %d under %s", step, where)
            next_log = now + 60
        pause = delay * (0.5 + random.random())
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - now)))
        delay = min(delay * 2, 2.0)


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
