"""The one commit path of a version, for a world of one rank or of many.

Plan -> stage (pipelined with the write) -> each rank writes its file -> the writer rank
commits once every rank's file is durable; a plain version is one rank with nothing to
wait for. What differs is a :class:`RankPart` (how this rank's file is written, what the
writer gathers before the commit); the lease, racer detection, clean-up after a failed
copy, the ``FAILED`` marker, fencing and retention exist once, here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from asyncckpt import _liveness as liveness
from asyncckpt._engine import writer_process
from asyncckpt._engine.encode import WriteOptions
from asyncckpt._engine.snapshot import Snapshot
from asyncckpt._storage import Storage
from asyncckpt._versions.protocol import read_commit
from asyncckpt._versions.retention import RetentionPolicy
from asyncckpt._versions.writing import Gathered, RootWriter
from asyncckpt.errors import AsyncCkptError, ConflictError, FencedError


class RankPart(Protocol):
    """One rank's part of a version (see the module)."""

    step: int
    options: WriteOptions

    @property
    def data_path(self) -> str:
        """This rank's data file."""

    def write(self, snap: Snapshot) -> int:
        """Write this rank's file (and what tells the writer it is durable); its size."""

    def gather(self, writer: RootWriter, size: int, started: float) -> Gathered:
        """On the writer rank: wait for every rank's file; what to commit.

        ``started``: ``liveness.clock().now()`` when the writer rank's job started.
        """

    def refused(self) -> None:
        """The writer lease was refused before anything was written: stop what runs."""


@dataclass
class PlainPart:
    """A plain version: one file, written by the writer rank, nothing to wait for."""

    storage: Storage
    path: str
    step: int
    options: WriteOptions
    #: Called with the raw bytes of each chunk once written (the save's in-flight figure).
    progress: Callable[[int], None] | None = None

    @property
    def data_path(self) -> str:
        """The version's one file."""
        return self.path

    def write(self, snap: Snapshot) -> int:
        """Write the file (every byte read: the next save may copy during the commit)."""
        size = writer_process.write(snap, self.storage, self.path, self.options, self.progress)
        snap.release()
        return size

    def gather(self, writer: RootWriter, size: int, started: float) -> Gathered:
        """The one file."""
        return Gathered((self.path.replace("\\", "/").rsplit("/", 1)[-1],), (size,))

    def refused(self) -> None:
        """Nothing runs besides the job."""


def write_and_commit(
    writer: RootWriter,
    part: RankPart,
    snap: Snapshot,
    policy: RetentionPolicy | None,
    spare: Callable[[], int | None],
    metrics: Mapping[str, float | int | str] | None = None,
    on_written: Callable[[], None] | None = None,
) -> int:
    """The writer rank's job of a save: lease (first save only), write, gather, commit,
    retention; runs while ``snap`` is still being copied. ``spare`` is asked, when retention
    runs, for the step a collective load may still read. Returns this rank's file's size.

    Raises:
        FencedError: another writer took the root over (no marker is left in it).
        ConflictError: another writer committed ``step`` while this one wrote it.
        Exception: the write or commit failed (``step`` is then marked ``FAILED``); or the
            copy failed (then the step's directory is removed if empty).
    """
    started = liveness.clock().now()  # the other ranks' records are awaited from here
    step = part.step
    try:
        # First save only; before writing, since it cleans up. If it fails, this is not the
        # root's writer (refused, or lost a takeover race): no marker.
        writer.acquire()
    except BaseException:
        part.refused()
        raise
    try:
        size = part.write(snap)
        gathered = part.gather(writer, size, started)
        if on_written is not None:
            on_written()
        writer.commit(step, gathered, metrics)
    except FencedError:
        raise  # the root is another writer's now: leave no marker in it
    except BaseException as exc:
        if snap.copy_error() is not None:
            # The caller raises the copy's error and returns no handle: leave no trace.
            writer.remove_empty_step(step)
            raise
        _report_failure(writer, step, exc)
        raise
    writer.apply_retention(policy or RetentionPolicy(), step, spare())
    return size


def _report_failure(writer: RootWriter, step: int, exc: BaseException) -> None:
    """Mark ``step`` failed for pollers (only if it has no COMMIT, while the lease holds).

    Raises:
        ConflictError: another writer committed ``step`` while this one wrote it (its
            commit swept our partial files): a lost race, not a storage failure.
    """
    if isinstance(exc, AsyncCkptError):
        winner = read_commit(writer.storage, writer.root, step)
        if winner is not None and winner.writer != writer.token:
            raise ConflictError(
                f"step {step} was committed under {writer.storage.describe(writer.root)} by "
                f"another writer (id {winner.writer}) while this one was writing it"
            ) from exc
    writer.mark_failed(step, exc)  # names this attempt
