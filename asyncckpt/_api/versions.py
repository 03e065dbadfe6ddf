"""What a :class:`~asyncckpt.Checkpointer` tells and does about its versions as a whole:
which are committed or pending, their metadata (:meth:`~VersionsMixin.info`), the best one
by a metric, and rewinding; and where it stands (its root, rank, whether it is open).

Kept apart from :mod:`asyncckpt._api.checkpointer` (which saves and loads); the retention
rule itself is :mod:`asyncckpt._versions.retention`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from asyncckpt._api import jobs
from asyncckpt._api.collective import check_load_step
from asyncckpt._api.preemption import Preemption
from asyncckpt._device import MapLocation, Placement
from asyncckpt._engine.decode_lazy import LazyCheckpoint
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt._versions.protocol import COMMITTED, SHARDED, StepEntry
from asyncckpt._versions.reading import LoadRequest, RootReader
from asyncckpt._versions.retention import BEST_MODES, RetentionPolicy, ranked
from asyncckpt._versions.rewind import rewind
from asyncckpt._versions.sharded_reading import LazyShardedVersion
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
    _closed: bool
    retention: RetentionPolicy
    writer_rank: int
    read_only: bool

    @property
    def root(self) -> str:
        """The root as a user would write it."""
        return self._storage.describe(self._root)

    @property
    def _distributed(self) -> bool:
        # Resolved on every use, not at construction: a Checkpointer may be built before
        # init_process_group.
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        """This process's rank in the group (0 without an initialized process group)."""
        return dist.get_rank(self._group) if self._distributed else 0

    @property
    def is_writer(self) -> bool:
        """Whether this process is the group's writer rank (it may still be read-only)."""
        return self.rank == self.writer_rank

    def _check_open(self) -> None:
        if self._closed:
            raise AsyncCkptError(f"this Checkpointer for {self.root} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise AsyncCkptError(f"this Checkpointer for {self.root} is read-only (read_only=True)")

    def wait(self, timeout: float | None = None) -> None:
        """Block until this process's pending saves are committed.

        Raises:
            CheckpointTimeoutError: a save is still running after ``timeout`` seconds.
            Exception: the failure of a save of this Checkpointer that nobody observed yet
                (each failure is raised once: by its handle, or here).
        """
        jobs.wait(self, timeout)

    def in_flight(self) -> list[jobs.InFlight]:
        """This process's saves of this Checkpointer that have not ended, oldest first:
        step, phase (``"copying"``, ``"queued"``, ``"writing"``, ``"committing"``), raw
        bytes written so far. A save leaves the list once its version is committed (or it
        failed); ``handle.add_done_callback(fn)`` calls ``fn`` then.

        Example:
            >>> import torch, asyncckpt, tempfile
            >>> with asyncckpt.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ...     handle = ckpt.save(1, {"w": torch.ones(2)})
            ...     [(r.step, r.raw_bytes) for r in ckpt.in_flight()] in ([(1, 8)], [])
            True
        """
        return jobs.in_flight(self)

    def latest(self) -> int | None:
        """The newest committed step, or None if there is none. Changes nothing."""
        return self._reader.latest()

    def versions(self) -> list[int]:
        """Every committed step, ascending. Changes nothing."""
        return self._reader.versions()

    def _newest_expected(self) -> int | None:
        pending = [h.target for h in jobs.tracked(self) if not h.failed() and not h.cancelled()]
        committed = self.latest()
        candidates = [s for s in [*pending, committed] if s is not None]
        return max(candidates) if candidates else None

    def _chosen(self, step: int | None) -> int | None:
        """``step``, or the newest one (on the writer, its own pending saves included)."""
        if step is None and self.is_writer:
            return self._newest_expected()
        return step if step is not None else self.latest()

    def _wait_committed(
        self, step: int, timeout: float | None, poll: bool, writer: str | None = None
    ) -> None:
        """Wait for this process's own save of ``step``, then (if ``poll``) for storage.

        Without ``poll`` the step is known to be committed already (or to be this
        process's own save); if retention removes it meanwhile, the read moves on.
        ``writer``: the token of the writer whose save is awaited (a collective load's
        writer rank), else the current lease holder's.
        """
        if self.is_writer:
            mine = [h for h in jobs.tracked(self) if h.target == step and not h.cancelled()]
            for handle in mine:
                handle.result(timeout)
        if poll:
            expiry_s = self._settings.lease_expiry_ms / 1000
            self._reader.wait(step, timeout, writer, expiry_s=expiry_s)

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
        if (target := self._chosen(step)) is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}")
        self._wait_committed(target, None, poll=False)
        commit = self._reader.commit_of(target)
        if commit is not None and commit.kind == SHARDED:
            return LazyShardedVersion(self._reader, commit, self._load_request(placement))
        return LazyCheckpoint(self._reader.open(target), placement, self._settings)

    def _load_request(self, placement: Placement, **how: Any) -> LoadRequest:
        """A load of this root by this process (its rank, its group, its settings)."""
        return LoadRequest(placement, self._settings, group=self._group, rank=self.rank, **how)

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

    def _committed(self) -> list[StepEntry]:
        """The committed versions with their commit records, ascending."""
        reader = self._reader
        return [StepEntry(s, COMMITTED, commit=reader.commit_of(s)) for s in reader.versions()]

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
        ranking = self.retention.ranking
        name = metric if metric is not None or ranking is None else ranking.metric
        if name is None:
            raise ValueError(
                f"best() needs a metric: pass best(metric=...) or build the Checkpointer for "
                f"{self.root} with best_metric=..."
            )
        how = mode if mode is not None else ranking.mode if ranking else "min"
        if how not in BEST_MODES:
            raise ValueError(f"mode must be 'min' or 'max', got {how!r}")
        order = ranked(self._committed(), name, how)
        return order[0] if order else None

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
