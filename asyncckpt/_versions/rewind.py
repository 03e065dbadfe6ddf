"""Rewind: the lease holder discards every version newer than a committed step.

After a loss spike, users go back to an earlier step and continue from it; steps only
increase, so the newer versions must go first. Only the writer lease holder may do it,
and each deletion and the final move of the version file are fenced like a commit: a
writer that another job took the root from changes nothing more.

Order (docs/PROTOCOL.md §5): newer steps are deleted newest first, each commit record
before its data (:func:`~asyncckpt._versions.protocol.delete_version`), so at every moment
readers' newest version (:func:`~asyncckpt._versions.protocol.latest_step` falls back to the
newest verified marker when the version file names a deleted step) is a whole one; then the
version file is moved back to ``step`` with a compare-and-swap.
"""

from __future__ import annotations

from asyncckpt._versions.protocol import (
    VersionRecord,
    delete_version,
    list_steps,
    publish_version,
    read_commit_strict,
    read_version_tagged,
    verify_commit,
)
from asyncckpt._versions.writing import RootWriter
from asyncckpt.errors import CheckpointNotFoundError, ConflictError, FencedError


def rewind(writer: RootWriter, step: int) -> list[int]:
    """Delete every step directory newer than ``step`` and publish ``step`` as the newest.

    Takes the writer lease first (as a first save does) if ``writer`` does not hold it;
    the caller has no save in flight. Returns the steps deleted, newest first.

    Raises:
        CheckpointNotFoundError: ``step`` is not committed, or its files do not verify
            (nothing is deleted).
        FencedError: another writer took the root over meanwhile; it deleted nothing more.
        ConflictError: the lease could not be taken.
    """
    writer.acquire()
    storage, root = writer.storage, writer.root
    commit = read_commit_strict(storage, root, step)
    if commit is None:
        raise CheckpointNotFoundError(
            f"step {step} under {writer.where} is not committed: rewind goes back to a "
            "committed version (asyncckpt ls lists them)"
        )
    # The target becomes the newest version: were its data damaged, rewinding would delete
    # every version that loads (the one rule of docs/PROTOCOL.md §5: the newest version
    # that verifies is never deleted).
    problem = verify_commit(storage, root, commit)
    if problem is not None:
        raise CheckpointNotFoundError(
            f"step {step} under {writer.where} does not verify ({problem}): rewind goes back "
            "only to a version that loads; nothing was deleted"
        )
    newer = [e.step for e in reversed(list_steps(storage, root)) if e.step > step]
    for doomed in newer:
        _fence(writer, f"deleting step {doomed}")
        delete_version(storage, root, doomed)
    record, tag = _fence(writer, f"moving the version file back to step {step}")
    try:
        publish_version(storage, root, VersionRecord(step, writer.token, record.epoch), tag)
    except ConflictError as exc:
        raise FencedError(
            f"another writer took {writer.where} over while rewinding it to step {step}: the "
            "version file was not moved"
        ) from exc
    writer.published = step
    return newer


def _fence(writer: RootWriter, what: str) -> tuple[VersionRecord, str | None]:
    """The version file's record and tag, if it still names this writer; else raise."""
    record, tag = read_version_tagged(writer.storage, writer.root)
    if record is None or record.epoch != writer.epoch or record.writer != writer.token:
        raise FencedError(f"another writer took {writer.where} over: rewind stopped before {what}")
    return record, tag
