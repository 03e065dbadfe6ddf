"""What a :class:`~asyncckpt.Checkpointer` tells and does about its versions as a whole:
their metadata (:meth:`~VersionsMixin.info`), the best one by a metric, and rewinding.

Kept apart from :mod:`asyncckpt._api.checkpointer` (which saves and loads); the retention
rule itself is :mod:`asyncckpt._versions.retention`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncckpt._api.collective import check_load_step
from asyncckpt._api.preemption import Preemption
from asyncckpt._api.sharded_load import LazyShardedVersion, ShardedRoot
from asyncckpt._device import MapLocation, Placement
from asyncckpt._engine.decode_lazy import LazyCheckpoint
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt._versions.protocol import COMMITTED, SHARDED, StepEntry
from asyncckpt._versions.reading import RootReader
from asyncckpt._versions.retention import BEST_MODES, RetentionPolicy, ranked
from asyncckpt._versions.rewind import rewind
from asyncckpt._versions.writing import RootWriter
from asyncckpt.errors import AsyncCkptError, CheckpointNotFoundError


@dataclass(frozen=True)
class VersionInfo:
    """A committed version's metadata, read from its ``COMMIT`` record alone.

    Attributes:
        step: the version's step.
        time: when it was committed (ISO 8601, UTC), or None if the record has no time.
        size: the bytes of its files, as recorded (None in records without sizes).
        metrics: what was passed as ``save(..., metrics=...)`` (empty if nothing).
        kind: ``"single"`` (one data file) or ``"sharded"`` (one per rank).
        files: its files, relative to the step's directory.
        writer: the id of the writer that committed it.
    """

    step: int
    time: str | None
    size: int | None
    metrics: Mapping[str, float | int | str]
    kind: str
    files: tuple[str, ...]
    writer: str


class VersionsMixin:
    """The Checkpointer's version-wide methods (see the module)."""

    _storage: Storage
    _root: str
    _reader: RootReader
    _writer: RootWriter
    _lock: threading.Lock
    _settings: Settings
    _group: Any
    _last_step: int | None
    retention: RetentionPolicy

    @property
    def root(self) -> str:  # pragma: no cover - Checkpointer's
        """The root as a user would write it."""
        raise NotImplementedError

    @property
    def rank(self) -> int:  # pragma: no cover - Checkpointer's
        """This process's rank."""
        raise NotImplementedError

    @property
    def is_writer(self) -> bool:  # pragma: no cover - Checkpointer's
        """Whether this process is the writer rank."""
        raise NotImplementedError

    def _check_writable(self) -> None:  # pragma: no cover - Checkpointer's
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> None:  # pragma: no cover
        """Block until this process's pending saves are committed."""
        raise NotImplementedError

    def _check_open(self) -> None:  # pragma: no cover - Checkpointer's
        raise NotImplementedError

    def _newest_expected(self) -> int | None:  # pragma: no cover - Checkpointer's
        raise NotImplementedError

    def _wait_committed(  # pragma: no cover - Checkpointer's
        self, step: int, timeout: float | None, poll: bool, writer: str | None = None
    ) -> None:
        raise NotImplementedError

    def latest(self) -> int | None:  # pragma: no cover - Checkpointer's
        """The newest committed step."""
        raise NotImplementedError

    def open(
        self, step: int | None = None, *, map_location: MapLocation = None
    ) -> LazyCheckpoint | LazyShardedVersion:
        """Open a committed version for reading one top-level key at a time, as
        :func:`asyncckpt.open` opens a file (not collective; waits for nothing but this
        process's own pending save of the step). Of a sharded version, each key's DTensors
        come back as whole tensors and its other values as this rank saved them.

        Args:
            step: the version; None: the newest (this process's pending saves included).
            map_location: as in :func:`asyncckpt.load`.

        Returns:
            A read-only mapping (a context manager holding the version's file open).

        Raises:
            CheckpointNotFoundError: nothing (or not ``step``) is committed.
        """
        self._check_open()
        check_load_step(step)
        placement = Placement(map_location)
        target = self._newest_expected() if step is None and self.is_writer else step
        if (target := self.latest() if target is None else target) is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}")
        self._wait_committed(target, None, poll=False)
        commit = self._reader.commit_of(target)
        if commit is not None and commit.kind == SHARDED:
            return LazyShardedVersion(self._sharded_root(), commit, placement, self._settings)
        return LazyCheckpoint(self._reader.open(target), placement, self._settings)

    def _sharded_root(self) -> ShardedRoot:
        """What a sharded load of this root needs (the root, this rank, its group)."""
        parts = (self._reader, self._storage, self._root, self.root, self._group, self.rank)
        return ShardedRoot(*parts)

    def info(self, step: int | None = None) -> VersionInfo:
        """A committed version's metadata (step, time, size, metrics, kind), read from its
        ``COMMIT`` record without loading the state. Changes nothing.

        Args:
            step: the step (None: the newest committed one).

        Returns:
            Its :class:`VersionInfo`.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed (or nothing is).

        Example:
            >>> import torch, asyncckpt, tempfile
            >>> with asyncckpt.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ...     _ = ckpt.save(1, {"w": torch.ones(2)}, metrics={"eval_loss": 0.31})
            ...     ckpt.wait()
            ...     print(ckpt.info(1).metrics)
            {'eval_loss': 0.31}
        """
        target = self._reader.latest() if step is None else step
        commit = None if target is None else self._reader.commit_of(target)
        if target is None or commit is None:
            what = "nothing is" if target is None else f"step {target} is not"
            raise CheckpointNotFoundError(f"{what} committed under {self.root}")
        size = sum(commit.sizes) if commit.sizes else None
        return VersionInfo(
            target,
            commit.time,
            size,
            dict(commit.metrics),
            commit.kind,
            commit.files,
            commit.writer,
        )

    def best(self, metric: str | None = None, mode: str | None = None) -> int | None:
        """The committed step with the best value of a metric. Changes nothing.

        Only versions saved with the metric as a number count; of equal values, the newer
        step wins (as in ``keep_best``).

        Args:
            metric: the metric's name (None: the Checkpointer's ``best_metric``).
            mode: ``"min"`` or ``"max"`` (None: the Checkpointer's ``best_mode``).

        Returns:
            The step, or None if no committed version has the metric.

        Raises:
            ValueError: no metric is given and the Checkpointer has no ``best_metric``, or
                a bad ``mode``.
        """
        name = metric if metric is not None else self.retention.best_metric
        if name is None:
            raise ValueError(
                f"best() needs a metric: pass best(metric=...) or build the Checkpointer for "
                f"{self.root} with best_metric=..."
            )
        how = mode if mode is not None else self.retention.best_mode
        if how not in BEST_MODES:
            raise ValueError(f"mode must be 'min' or 'max', got {how!r}")
        entries = [StepEntry(s, COMMITTED, commit=self._reader.commit_of(s)) for s in self._steps()]
        order = ranked(entries, name, how)
        return order[0] if order else None

    def _steps(self) -> list[int]:
        return self._reader.versions()

    def rewind(self, step: int) -> list[int]:
        """Go back to committed version ``step``: delete every newer version, so that
        training resumes from ``step`` and saves ``step + 1`` (or any later step) next.

        For a loss spike: load ``step``, rewind to it, continue. Only the writer may do it
        (it takes the root's writer lease, as a first save does, fencing any other writer);
        it first waits for this process's pending saves. Readers loading a deleted version
        at that moment get :class:`~asyncckpt.errors.IncompleteCheckpointError`.

        Args:
            step: a committed step.

        Returns:
            The steps deleted, newest first.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed (nothing is deleted).
            FencedError: another writer took the root over meanwhile.
            AsyncCkptError: this process is not the writer rank, or the Checkpointer is
                read-only or closed.

        Example:
            >>> import torch, asyncckpt, tempfile
            >>> with asyncckpt.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ...     for step in (1, 2, 3):
            ...         _ = ckpt.save(step, {"w": torch.full((1,), step)})
            ...     print(ckpt.rewind(1), ckpt.versions())
            ...     _ = ckpt.save(2, {"w": torch.zeros(1)})  # steps go on from 1
            [3, 2] [1]
        """
        self._check_writable()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not self.is_writer:
            raise AsyncCkptError(f"only the writer rank may rewind {self.root}")
        self.wait()
        with self._lock:
            removed = rewind(self._writer, step)
            self._last_step = step
        return removed

    def on_preemption(self, signals: Iterable[int] = (signal.SIGTERM,)) -> Preemption:
        """Catch SIGTERM (SLURM, Kubernetes) as a flag, so a write in flight can finish and
        the loop can save one last version within the grace period.

        Call from the main thread; check ``.requested`` in the loop. A second signal ends
        the process as usual. See the guide's "Preemption" section.

        Args:
            signals: the signals to catch.

        Returns:
            The :class:`~asyncckpt._api.preemption.Preemption` (``.remove()`` restores the
            previous handlers).

        Example:
            >>> import asyncckpt, tempfile, torch
            >>> ckpt = asyncckpt.Checkpointer(tempfile.mkdtemp())
            >>> stop = ckpt.on_preemption()
            >>> for step in range(1, 4):
            ...     if step % 2 == 0 or stop.requested:  # one last save when preempted
            ...         _ = ckpt.save(step, {"w": torch.ones(1)})
            ...     if stop.requested:
            ...         break
            >>> ckpt.close(); stop.remove()
        """
        return Preemption(signals, self.root)
