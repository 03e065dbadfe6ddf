"""The reading side of a checkpoint root: it never creates, deletes, renames or rewrites.

Every process that looks at a root (an evaluator polling it, a notebook, the CLI, the
non-writer ranks of a job, the writer itself when it loads) reads through a
:class:`RootReader`. Nothing here takes a lock or a lease, so a reader can never disturb a
save in progress, however it is scheduled.
"""

from __future__ import annotations

from typing import Any

from asyncckpt import _config as config
from asyncckpt._device import Placement
from asyncckpt._engine.decode import Budget, materialize, read_file
from asyncckpt._storage import Storage
from asyncckpt._versions.protocol import (
    CommitRecord,
    committed_steps,
    latest_step,
    read_commit,
    step_dir,
    wait_for_step,
)
from asyncckpt.errors import CheckpointNotFoundError, FormatError, IncompleteCheckpointError


class RootReader:
    """Read-only access to the committed versions under ``root``.

    Args:
        storage: the storage that holds the root.
        root: the root's path within ``storage``.

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

    def wait(self, step: int, timeout: float | None, writer: str | None = None) -> None:
        """Block until ``step`` is committed (:func:`~._versions.protocol.wait_for_step`):
        only ``writer``'s failure to save it ends the wait (None: the current lease
        holder's)."""
        wait_for_step(self.storage, self.root, step, timeout, writer=writer)

    def read(self, step: int, placement: Placement, into: Any, budget: Budget | None = None) -> Any:
        """Load committed version ``step``.

        Args:
            step: a committed step.
            placement: where tensors go.
            into: an existing state to load into, or None.
            budget: the memory the load may allocate for decoded data.

        Raises:
            IncompleteCheckpointError: ``step`` is not (or no longer) committed.
            FormatError: the version has more than one data file.
            MemoryBudgetError: it needs more than ``budget`` (nothing was allocated).
        """
        threads = config.tunable("threads", None)
        try:
            return read_file(
                self.storage,
                self._data_path(step),
                lambda opened: materialize(opened, placement, threads, into, budget),
                budget,
            )
        except CheckpointNotFoundError as exc:
            raise deleted_while_loading(step, self.where) from exc

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
