"""The reading side of a checkpoint root: it never creates, deletes, renames or rewrites.

Every process that looks at a root (an evaluator polling it, a notebook, the CLI, the
non-writer ranks of a job, the writer itself when it loads) reads through a
:class:`RootReader`. Nothing here takes a lock or a lease, so a reader can never disturb a
save in progress, however it is scheduled.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from asyncckpt._device import Placement
from asyncckpt._engine.decode import Budget, OpenedFile, materialize, open_file, read_file
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt._versions.lease import wait_for_step
from asyncckpt._versions.protocol import (
    SHARDED,
    CommitRecord,
    committed_steps,
    latest_step,
    read_commit,
    step_dir,
)
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    FormatError,
    IncompleteCheckpointError,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadRequest:
    """One load, planned once by the entry point that takes it and carried down unchanged:
    where its tensors go, what it loads into, which keys, its memory budget, its settings,
    and this process's place in a collective load.

    Attributes:
        placement: where each tensor goes (``map_location`` resolved).
        settings: the tunables, resolved at the entry point.
        into: an existing state to load into in place (DTensors too), or None.
        keys: the top-level keys to load (None: all).
        max_bytes: the budget of host memory for decoded data (None: none).
        follow_latest: the caller asked for the newest version, so a load whose version
            retention deletes meanwhile moves on to the newest one.
        collective: every rank of ``group`` takes part (DTensors load in place).
        group: the process group of a collective load (None: the default group).
        rank: this process's rank (which rank file of a sharded version holds its plain
            values).

    Example:
        >>> LoadRequest(Placement(None), Settings()).follow_latest
        False
    """

    placement: Placement
    settings: Settings
    into: Any = None
    keys: Collection[Any] | None = None
    max_bytes: int | None = None
    follow_latest: bool = False
    collective: bool = False
    group: Any = None
    rank: int = 0


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
        """The commit record of ``step`` if it is committed (and understood), else None."""
        return read_commit(self.storage, self.root, step)

    def wait(
        self, step: int, timeout: float | None, writer: str | None, *, expiry_s: float
    ) -> None:
        """Block until ``step`` is committed (:func:`~._versions.lease.wait_for_step`):
        only ``writer``'s failure to save it ends the wait (None: the current lease
        holder's), or a lease not renewed for ``expiry_s`` (the caller's settings')."""
        wait_for_step(self.storage, self.root, step, timeout, writer=writer, expiry_s=expiry_s)

    def interrupted(self, step: int, exc: BaseException) -> BaseException:
        """What to raise when ``exc`` interrupted a load of ``step``: the error itself if
        ``step`` is still committed (retention removes a version's ``COMMIT`` before its
        files, so a file gone under a committed version is damage, not retirement), else
        that the version was deleted while it was read."""
        if self.commit_of(step) is not None:
            return exc
        return deleted_while_loading(step, self.where)

    def read_plain(self, step: int, request: LoadRequest, budget: Budget) -> Any:
        """Load committed plain version ``step`` (one data file) within ``budget``."""

        def work(opened: OpenedFile) -> Any:
            return materialize(
                opened, request.placement, request.settings, request.into, budget, keys=request.keys
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
