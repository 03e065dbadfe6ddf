"""The reading side of a checkpoint root: it never creates, deletes, renames or rewrites.

Every process that looks at a root (an evaluator polling it, a notebook, the CLI, the
non-writer ranks of a job, the writer itself when it loads) reads through a
:class:`RootReader`. Nothing here takes a lock or a lease, so a reader can never disturb a
save in progress, however it is scheduled.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any, Final, Protocol

from torch.distributed.checkpoint.api import CheckpointException

from asyncckpt._device import Placement
from asyncckpt._engine.decode import Budget, OpenedFile, materialize, open_file, read_file
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt._versions.protocol import (
    SHARDED,
    CommitRecord,
    committed_steps,
    latest_step,
    read_commit,
    step_dir,
)
from asyncckpt._versions.waiting import wait_for_step
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    FormatError,
    IncompleteCheckpointError,
)

log = logging.getLogger(__name__)

#: How many versions a load of the newest version tries, when retention deletes each one
#: while it is read, before it gives up (a trainer whose ``keep_last`` versions are all
#: written faster than this process reads one).
FOLLOW_ATTEMPTS: Final = 5


class KindReader(Protocol):
    """What a load needs besides the root: how to read a sharded version (rank files, the
    index, DTensors: :mod:`asyncckpt._api.sharded_load`), and what a plain one must refuse.
    """

    def sharded(self, commit: CommitRecord, budget: Budget) -> Any:
        """Load the sharded version ``commit`` describes, charging ``budget``."""

    def check_plain(self, step: int) -> None:
        """Raise if the load cannot take plain version ``step`` (e.g. DTensors in ``into``)."""


class RootReader:
    """Read-only access to the committed versions under ``root`` (a path in ``storage``).

    Example:
        >>> import tempfile
        >>> from asyncckpt._storage import LocalStorage
        >>> RootReader(LocalStorage(), tempfile.mkdtemp()).latest() is None
        True
    """

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage = storage
        self.root = root

    @property
    def where(self) -> str:
        """The root as a user would write it."""
        return self.storage.describe(self.root)

    def latest(self) -> int | None:
        """The newest committed step, or None (:func:`~.protocol.latest_step`)."""
        return latest_step(self.storage, self.root)

    def versions(self) -> list[int]:
        """Every committed step, ascending."""
        return committed_steps(self.storage, self.root)

    def commit_of(self, step: int) -> CommitRecord | None:
        """The commit marker of ``step`` if it is committed (and understood), else None."""
        return read_commit(self.storage, self.root, step)

    def wait(
        self, step: int, timeout: float | None, writer: str | None, *, expiry_s: float
    ) -> None:
        """Block until ``step`` is committed (:func:`~._versions.waiting.wait_for_step`):
        only ``writer``'s failure to save it ends the wait (None: the current lease
        holder's), or a lease not renewed for ``expiry_s`` (the caller's settings')."""
        wait_for_step(self.storage, self.root, step, timeout, writer=writer, expiry_s=expiry_s)

    def load(
        self,
        step: int,
        commit: CommitRecord | None,
        placement: Placement,
        into: Any,
        kinds: KindReader,
        *,
        follow_latest: bool = False,
        max_bytes: int | None = None,
        settings: Settings | None = None,
        keys: Collection[Any] | None = None,
    ) -> Any:
        """Load committed version ``step``, plain or sharded, as its ``COMMIT`` records.

        If retention deletes the version while it is read (its ``COMMIT`` is gone: an
        evaluator loading the newest version while the trainer saves with ``keep_last``), a
        load that asked for the newest version moves on to the newest one, at most
        :data:`FOLLOW_ATTEMPTS` times in all; a load of a given step raises.

        ``commit`` is ``step``'s marker, or None if it was retired since it was chosen;
        ``kinds`` reads a sharded version and says what a plain one must refuse;
        ``follow_latest``: the caller asked for the newest version (no step, not
        collective); ``max_bytes`` is each attempt's budget; ``keys`` selects top-level keys
        of a plain version (``kinds`` selects a sharded version's itself). Returns the saved
        state (after a move, the newer version's).

        Raises:
            MissingKeyError: a key of ``keys`` is not in the version.
            IncompleteCheckpointError: the version was deleted while it was read and
                ``follow_latest`` is false (or nothing newer is committed, or the newest was
                deleted too, :data:`FOLLOW_ATTEMPTS` times); or a file its ``COMMIT`` names
                is missing.
            ChecksumError, FormatError: a damaged or truncated file.
            MemoryBudgetError: the version needs more than ``max_bytes`` (nothing allocated).
        """
        settings = settings or Settings.resolve()
        for _ in range(FOLLOW_ATTEMPTS):
            try:
                if commit is None:  # deleted again before it could be read
                    raise CheckpointNotFoundError(
                        f"step {step} under {self.where} is not committed"
                    )
                budget = Budget(max_bytes)
                if commit.kind == SHARDED:
                    return kinds.sharded(commit, budget)
                kinds.check_plain(step)
                return self._read_plain(step, placement, into, budget, settings, keys)
            except (AsyncCkptError, CheckpointException) as exc:
                step = self._after_deletion(step, follow_latest, exc)
            commit = self.commit_of(step)
        raise IncompleteCheckpointError(
            f"{self.where}: retention deleted {FOLLOW_ATTEMPTS} versions in a row while this "
            f"process loaded them (the last was step {step}); keep more versions (keep_last) "
            "or give load() a step that is kept"
        )

    def _after_deletion(self, step: int, follow_latest: bool, exc: BaseException) -> int:
        """The step to load after ``exc`` interrupted the load of ``step``; else raise.

        Retention removes a version's ``COMMIT`` before its files, so a version whose files
        went missing under a reader but whose ``COMMIT`` is still there was damaged, not
        retired: its error is raised as it is.
        """
        if self.commit_of(step) is not None:
            raise exc
        newest = self.latest()
        if not follow_latest or newest is None or newest == step:
            raise deleted_while_loading(step, self.where) from exc
        log.info("step %d was deleted while loading; moving to step %d", step, newest)
        return newest

    def _read_plain(
        self,
        step: int,
        placement: Placement,
        into: Any,
        budget: Budget,
        settings: Settings,
        keys: Collection[Any] | None,
    ) -> Any:
        """Load committed plain version ``step`` (one data file) within ``budget``."""

        def work(opened: OpenedFile) -> Any:
            return materialize(
                opened, placement, settings.threads, into, budget, settings=settings, keys=keys
            )

        try:
            return read_file(self.storage, self._data_path(step), work, budget)
        except CheckpointNotFoundError as exc:
            raise deleted_while_loading(step, self.where) from exc

    def open(self, step: int) -> OpenedFile:
        """Open committed plain version ``step``'s data file (the caller closes it).

        Raises:
            CheckpointNotFoundError: ``step`` is not committed.
            AsyncCkptError: the version is sharded (several rank files).
        """
        commit = self.commit_of(step)
        if commit is not None and commit.kind == SHARDED:
            raise AsyncCkptError(
                f"step {step} under {self.where} is sharded (saved from DTensors): open() "
                "reads plain versions only; load what you need with load(keys=[...])"
            )
        return open_file(self.storage, self._data_path(step))

    def _data_path(self, step: int) -> str:
        commit = read_commit(self.storage, self.root, step)
        if commit is None:
            raise CheckpointNotFoundError(f"step {step} under {self.where} is not committed")
        if len(commit.files) != 1:
            raise FormatError(
                f"step {step} under {self.where} has {len(commit.files)} data files; this "
                "asyncckpt reads single-writer versions only"
            )
        return self.storage.join(step_dir(self.storage, self.root, step), commit.files[0])


def deleted_while_loading(step: int, where: str) -> IncompleteCheckpointError:
    """The error for a version that retention deleted under a load of it.

    Example:
        >>> str(deleted_while_loading(3, "/ckpt")).split(";")[0]
        'step 3 under /ckpt was deleted while loading it (by retention?)'
    """
    return IncompleteCheckpointError(
        f"step {step} under {where} was deleted while loading it (by retention?); load again "
        "to get the newest version"
    )
