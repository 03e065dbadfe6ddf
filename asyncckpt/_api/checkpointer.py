"""``Checkpointer``: versioned, multi-rank checkpoints under one root.

Replaces "save on rank 0, ``dist.barrier()``, load with ``map_location``": no rank sits in a
collective while a write is in progress (the one collective, a broadcast of a step number,
happens before any waiting).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from asyncckpt._api import jobs
from asyncckpt._api import sharded_save as sharded
from asyncckpt._api.collective import (
    agree_on_step,
    announce_loaded,
    check_load_step,
    collective_device,
    group_timeout,
)
from asyncckpt._api.jobs import SaveHandle, completed_handle, stage_and_submit
from asyncckpt._api.preemption import Preemption
from asyncckpt._api.staging import reserve_arena, stage, start_writer, write_options
from asyncckpt._device import MapLocation, Placement
from asyncckpt._engine import overlap
from asyncckpt._engine.decode import Budget
from asyncckpt._engine.decode_lazy import LazyCheckpoint
from asyncckpt._engine.snapshot import DeviceCopies, Snapshot
from asyncckpt._format.codec import check_compression
from asyncckpt._format.tree import holds_dtensor
from asyncckpt._settings import Settings, SettingsArg
from asyncckpt._storage import resolve
from asyncckpt._versions import loading
from asyncckpt._versions.metrics import Metrics, check_metrics
from asyncckpt._versions.paths import check_root
from asyncckpt._versions.protocol import (
    COMMITTED,
    SHARDED,
    StepEntry,
    data_file_name,
    read_commit,
    step_dir,
)
from asyncckpt._versions.publish import PlainPart, RankPart, write_and_commit
from asyncckpt._versions.ranks import RankJob
from asyncckpt._versions.reading import LoadRequest, RootReader
from asyncckpt._versions.retention import (
    BEST_MODES,
    RetentionRule,
    check_ranked,
    metric_names,
    policy_from,
    ranked,
)
from asyncckpt._versions.rewind import rewind
from asyncckpt._versions.sharded_reading import LazyShardedVersion
from asyncckpt._versions.writing import RootWriter
from asyncckpt.errors import AsyncCkptError, CheckpointNotFoundError, ConflictError

log = logging.getLogger(__name__)


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


class Checkpointer:
    """Versioned checkpoints of a training run under ``root``, safe across ranks and jobs.

    Constructing one, :meth:`latest`, :meth:`versions` and :meth:`load` never change
    anything under the root, on any rank: any number of readers (an evaluator polling the
    root, a notebook) can run beside the job that saves. The first :meth:`save` takes the
    root's writer lease, taking it over from any earlier writer, which is fenced from then
    on (its later commits fail with :class:`~asyncckpt.errors.ConflictError`).

    Args:
        root: local directory or fsspec URL holding one directory per step.
        keep_last: keep the newest N committed versions. Retention runs after each commit
            and keeps the union of what its rules keep (none set: every version); it never
            deletes the newest committed version nor one a collective load may be reading.
        keep_best: keep the K best versions by ``best_metric`` (saved with
            ``save(..., metrics=...)``); versions without the metric are not ranked.
        best_metric: the metric ``keep_best`` and :meth:`best` rank by.
        best_mode: ``"min"`` (default: lower is better) or ``"max"``.
        keep_every: keep every version whose step is a multiple of M, for ever.
        keep_for: keep every version younger than this (seconds or a ``timedelta``).
        keep_total: keep at most N versions in all, the newest and the best by
            ``best_metric`` among them (as the ``transformers`` Trainer counts
            ``save_total_limit``).
        rules: more retention rules (objects with a ``keeps`` method, see
            :class:`~asyncckpt._versions.retention.RetentionRule`), combined with those of the
            keywords: a version stays if any rule keeps it.
        compression: ``"auto"`` (default), ``"zstd"`` or ``"none"``, as for
            :func:`asyncckpt.save`.
        storage_options: keyword arguments for the fsspec filesystem of a URL.
        process_group: the group whose ranks share this root (default: the default group,
            when ``torch.distributed`` is initialized).
        writer_rank: the rank (within the group) that writes; other ranks only load.
        overlap: let ``save`` return once device-to-host copies are *queued*, so they
            overlap the next forward and backward; call :meth:`protect` on the optimizer and
            the model so their next ``step()``/forward waits for the copies. Without CUDA
            this changes nothing.
        read_only: a reader: :meth:`save` raises at once.
        settings: the tunables of this Checkpointer, fixed when it is built (see the user
            guide's "Tunables"): an :class:`asyncckpt.Settings`, or a dict such as
            ``{"threads": 4}`` over the ``ASYNCCKPT_*`` environment variables.

    Raises:
        ValueError: a bad retention argument (the message names it) or ``compression``,
            or a tunable out of range.
        StorageError: the root's URL cannot be resolved.
        PathKindError: ``root`` is a file.

    Example:
        >>> import torch, asyncckpt, tempfile
        >>> with asyncckpt.Checkpointer(tempfile.mkdtemp(), keep_last=2) as ckpt:
        ...     for step in (10, 20, 30):
        ...         _ = ckpt.save(step, {"w": torch.full((2,), step)})
        ...     ckpt.wait()
        ...     print(ckpt.versions(), ckpt.load()["w"].tolist())
        [20, 30] [30, 30]
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        keep_every: int | None = None,
        keep_for: float | datetime.timedelta | None = None,
        keep_total: int | None = None,
        rules: Sequence[RetentionRule] = (),
        compression: str = "auto",
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        writer_rank: int = 0,
        overlap: bool = False,
        read_only: bool = False,
        settings: SettingsArg = None,
    ) -> None:
        retention = {
            "keep_last": keep_last,
            "keep_best": keep_best,
            "best_metric": best_metric,
            "best_mode": best_mode,
            "keep_every": keep_every,
            "keep_for": keep_for,
            "keep_total": keep_total,
        }
        self.retention = policy_from(retention, rules)
        self.compression = check_compression(compression)
        self.keep_last = keep_last
        self._settings = Settings.of(settings)
        self._storage, self._root = resolve(root, storage_options, self._settings)
        check_root(self._storage, self._root)  # a file: say so now, not at the first save
        self._group = process_group
        self.writer_rank = writer_rank
        self.read_only = read_only
        self.overlap = overlap
        self._token = uuid.uuid4().hex[:12]
        self._reader = RootReader(self._storage, self._root)
        self._writer = RootWriter(self._storage, self._root, self._token, self._settings)
        self._lock = threading.Lock()
        self._attempts = sharded.Attempts()
        self._last_step: int | None = None
        self._closed = False
        # Only the last save's copy events: the snapshot would keep its arena alive (on
        # CUDA, page-locked) after a later save replaced it.
        self._last_copies: DeviceCopies | None = None
        # The step of the last collective load, and the work that completes once every rank
        # has finished reading it (None: not yet announced): retention spares it until then.
        self._agreed: tuple[int | None, Any] = (None, None)
        self._metrics_seen: set[str] = set()  # in this Checkpointer's saves
        if self.is_writer and not read_only:
            start_writer(self._storage, self._settings)  # off the first save's stall

    # -- where it stands, and its versions as a whole -----------------------------------

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
        return max((s for s in [*pending, self.latest()] if s is not None), default=None)

    def _chosen(self, step: int | None) -> int | None:
        """``step``, or the newest (on the writer, its own pending saves included)."""
        if step is None and self.is_writer:
            return self._newest_expected()
        return step if step is not None else self.latest()

    def _wait_committed(
        self, step: int, timeout: float | None, poll: bool, writer: str | None = None
    ) -> None:
        """Wait for this process's own save of ``step``, then (if ``poll``) for storage.

        ``writer``: the token of the writer whose save is awaited (None: the lease holder's).
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
        fields = (commit.time, size, dict(commit.metrics), commit.kind, commit.files, commit.writer)
        return VersionInfo(target, *fields)

    def _committed(self) -> list[StepEntry]:
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

    # -- writing ------------------------------------------------------------------------

    def save(
        self, step: int, state: Any, *, metrics: Mapping[str, Any] | None = None
    ) -> SaveHandle:
        """Snapshot ``state`` and write it as version ``step`` in the background.

        On ranks other than ``writer_rank`` this copies nothing and returns a completed
        handle, so every rank can run the same code. On the writer rank, the write follows
        the copy chunk by chunk (with ``pipeline_min_cpus`` CPUs; on fewer, it starts once
        the whole copy has landed); ``save`` returns once the copy is complete. A copy that
        fails midway is raised here and leaves nothing under the root for ``step``.

        A state holding ``DTensor``s (FSDP2, TP) is saved *sharded*: call ``save`` on every
        rank; each writes its own shards and plain values, and the writer rank commits once
        every rank's file is durable (see :mod:`asyncckpt._api.sharded_save`). The first
        sharded save broadcasts a token from the writer rank; nothing else is collective.

        Args:
            step: a non-negative int, greater than every step saved before under this root.
            state: what ``asyncckpt.save`` accepts.
            metrics: small JSON metadata kept in the version's ``COMMIT`` record (finite
                numbers and strings of at most 256 characters, at most 64 names): read by
                :meth:`info`, ``keep_best``, :meth:`best` and ``asyncckpt ls``.

        Returns:
            A :class:`SaveHandle`; its ``result()`` returns once the version is committed.

        Raises:
            ConflictError: ``step`` is already committed under this root; or (from the
                handle) another writer took the root over.
            ValueError: ``step`` is negative, not an int, or not greater than the last one
                (see :meth:`rewind`).
            InvalidMetricsError: ``metrics`` break a rule (the message names the key).
            UnknownMetricError: ``metrics`` lack the metric retention ranks by
                (``best_metric``), and no committed version has it: a typo, most likely.
            UnsupportedObjectError: ``state`` holds something that cannot be stored.
            AsyncCkptError: the Checkpointer is read-only or closed, or WORLD_SIZE says this
                is one of several ranks but no process group is initialized.
            Exception: an earlier save of this process failed and nobody observed it; or
                the copy into host memory failed (``step`` may be saved again).
        """
        self._check_writable()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        checked: Metrics = {}
        if metrics is not None:
            checked = check_metrics(metrics, f"{self.root} step {step}: metrics")
        self._check_ranked_metrics(step, checked)
        self._check_world()
        is_sharded = holds_dtensor(state)
        if is_sharded and not self._distributed:
            raise AsyncCkptError("a state holding DTensors needs torch.distributed initialized")
        if not is_sharded and not self.is_writer:
            return completed_handle(f"{self.root} step {step} (rank {self.rank} does not write)")
        started = time.perf_counter()
        # First, while every rank is sure to get here: a rank raising before the (first
        # sharded save's) broadcast would leave the others waiting in it.
        attempt = self._token
        if is_sharded:
            device = collective_device(self._group)
            attempt = self._attempts.next(step, self._group, self.writer_rank, device)
        jobs.raise_unobserved_failure(self)
        jobs.raise_unobserved_failure()
        plan = sharded.split_state(state) if is_sharded else None
        with self._lock:
            self._check_new_step(step)
            part = self._part(step, attempt, plan)
            snap, handle = self._stage_and_write(
                part, state if plan is None else plan.plain, started, checked
            )
            self._last_copies = snap.copies
            self._last_step = step
        return handle

    def _check_ranked_metrics(self, step: int, metrics: Metrics) -> None:
        """Refuse ``metrics`` that lack a ranked metric no committed version has either (a
        typo in ``best_metric`` would rank nothing, and retention would delete the real best
        version). On every rank, before any collective; reads the records only once."""
        for metric in self.retention.ranked_metrics():
            if not metrics or metric in metrics or metric in self._metrics_seen:
                continue
            names = {*metric_names(self._committed()), *metrics}
            check_ranked(metric, names, f"{self.root} step {step}")
            self._metrics_seen.update(names)  # it is there: later saves read nothing for it
        self._metrics_seen.update(metrics)

    def _part(self, step: int, attempt: str, plan: sharded.RankState | None) -> RankPart:
        """This rank's part of version ``step``: the one file, or its shards' file."""
        storage, options = self._storage, write_options(self.compression, self._settings)
        if plan is None:
            directory = step_dir(storage, self._root, step)
            path = storage.join(directory, data_file_name(self.rank, attempt))
            return PlainPart(storage, path, step, options)
        world = dist.get_world_size(self._group)
        timeout = group_timeout(self._group) if self.is_writer else 0.0
        args = (storage, self._root, step, attempt, self.rank, world, None, sharded.pieces_of(plan))
        job = RankJob(*args, options, self._settings, timeout=timeout)
        job.start_beat()  # before the copy: see _versions.ranks._ProgressWatch
        return job

    def _stage_and_write(
        self, part: RankPart, staged: Any, started: float, metrics: Metrics
    ) -> tuple[Snapshot, SaveHandle]:
        """Stage ``staged`` while this rank's job already writes (the pipelined save): the
        first save's lease and recovery, then the write, overlap the copy."""
        options = part.options
        rank_job = part if isinstance(part, RankJob) else None

        def copy(on_layout: Any) -> Snapshot:
            try:
                return stage(staged, options, self.overlap, on_layout)
            except BaseException as exc:
                if rank_job is not None:
                    rank_job.copy_failed(exc)  # so the writer stops waiting for this rank
                raise

        def job(snap: Snapshot) -> int:
            running = jobs.running_job()  # reports its progress to in_flight()
            if running is not None and isinstance(part, PlainPart):
                part.progress = running._note_written
            if not self.is_writer:
                return part.write(snap)
            on_written = None if running is None else running._note_committing
            return write_and_commit(
                self._writer, part, snap, self.retention, self._spared, metrics, on_written
            )

        # A rank's part of a sharded version cannot be cancelled: the writer waits for it.
        on_cancel = None if rank_job is not None else (lambda: None)
        return stage_and_submit(
            copy,
            job,
            self._storage.describe(part.data_path),
            started,
            part.step,
            nice=self._settings.writer_nice,
            owner=self,
            on_cancel=on_cancel,
        )

    def reserve(self, state_or_nbytes: Any) -> threading.Thread | None:
        """Prepare the host memory of this process's saves, in a background thread.

        The first save of a process otherwise allocates and faults in its host arena while
        the caller waits, several times as long as the copy itself. Call this once the state
        exists in full (after the first optimizer step: Adam creates its moments then); a
        save that starts before the reservation is done waits for it. Where ``save`` copies
        nothing, neither does this (a plain state is reserved on the writer rank only, a
        state holding DTensors on every rank). Nothing under the root changes.

        Args:
            state_or_nbytes: the state to be saved (its exact arena size is computed;
                nothing is copied), or a size in bytes of tensor data.

        Returns:
            The background thread (``join`` it to wait), or None if there is nothing to do
            (this rank does not save, a large enough arena exists, or all are in use).

        Raises:
            AsyncCkptError: the Checkpointer is read-only or closed.
            UnsupportedObjectError: the state holds something that cannot be stored.

        Example:
            >>> import torch, asyncckpt, tempfile
            >>> model = torch.nn.Linear(4, 4)
            >>> with asyncckpt.Checkpointer(tempfile.mkdtemp()) as ckpt:
            ...     _ = ckpt.reserve(model.state_dict())  # while training starts
            ...     _ = ckpt.save(1, model.state_dict())  # its copy lands in reserved memory
        """
        self._check_writable()
        if holds_dtensor(state_or_nbytes):
            return reserve_arena(sharded.split_state(state_or_nbytes).plain, self._settings)
        return reserve_arena(state_or_nbytes, self._settings) if self.is_writer else None

    def _check_world(self) -> None:
        world = os.environ.get("WORLD_SIZE", "1")
        if not self._distributed and world.isdigit() and int(world) > 1:
            raise AsyncCkptError(
                f"WORLD_SIZE={world} but torch.distributed is not initialized: every rank "
                f"would write to {self.root}. Call torch.distributed.init_process_group() "
                "before the first save"
            )

    def wait_for_snapshot(self) -> None:
        """Block until the last save's copies of the state were made (its tensors may change).

        Only needed with ``overlap=True``: before that, the state's tensors must not change
        (:meth:`protect` makes an optimizer's step wait on the device instead).

        Example:
            >>> import tempfile, torch
            >>> with Checkpointer(tempfile.mkdtemp(), overlap=True) as ckpt:
            ...     w = torch.ones(4)
            ...     _ = ckpt.save(1, {"w": w})
            ...     ckpt.wait_for_snapshot()
            ...     _ = w.mul_(2)  # the snapshot holds the ones
        """
        copies = self._last_copies
        if copies is not None:
            copies.wait_released()

    def protect(self, *targets: Any) -> Any:
        """Make everything that mutates saved state wait for the last save's copies.

        For ``overlap=True``: ``optimizer.step()`` changes parameters and moments, and the
        forward pass changes buffers in place (BatchNorm running statistics and
        ``num_batches_tracked``); ``GradScaler.update``/``unscale_`` change its scale. Pass
        the optimizer, the model (a forward pre-hook on it covers its submodules' buffers)
        and the scaler, so none of them can tear the snapshot.

        Args:
            targets: optimizers, modules, ``GradScaler``s, or lists of them.

        Returns:
            One handle; ``.remove()`` undoes every hook.

        Raises:
            TypeError: a target of another type (nothing is installed).

        Example:
            >>> import torch, asyncckpt, tempfile
            >>> model = torch.nn.Linear(2, 2)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> ckpt = asyncckpt.Checkpointer(tempfile.mkdtemp(), overlap=True)
            >>> hook = ckpt.protect(opt, model)
            >>> _ = ckpt.save(1, model.state_dict())
            >>> model(torch.ones(2)).sum().backward()
            >>> opt.step()  # waits for the snapshot's copies first
            >>> ckpt.close()
        """
        return overlap.guard(list(targets), self._order_after_snapshot)

    def _order_after_snapshot(self) -> None:
        """The guard's wait: the devices' streams wait for the last save's copies; the host
        goes on (a host wait here would stall every optimizer step until the copy ends)."""
        copies = self._last_copies
        if copies is not None:
            copies.order_after()

    def _check_new_step(self, step: int) -> None:
        if self._last_step is None:  # the first save: continue from what is committed
            self._last_step = self._reader.latest()
        # After reading the newest: a step committed meanwhile is a conflict, not a step
        # that went backwards. Both name rewind: after a loss spike, going back is routine.
        if read_commit(self._storage, self._root, step) is not None:
            raise ConflictError(
                f"step {step} is already committed under {self.root}: steps only increase; "
                f"to save step {step} again, go back first with {_rewind_hint(self.root, step)}"
            )
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"steps must increase: {step} is not greater than {self._last_step}, the last "
                f"step saved under {self.root}; to go back, wait for the pending saves and "
                f"rewind first: {_rewind_hint(self.root, step)}"
            )

    # -- reading ------------------------------------------------------------------------

    def load(
        self,
        step: int | None = None,
        *,
        map_location: MapLocation = None,
        timeout: float | None = None,
        collective: bool | None = None,
        into: Any = None,
        max_bytes: int | None = None,
        keys: Collection[Any] | None = None,
        weights_only: bool | None = None,
    ) -> Any:
        """Load a committed version; with a process group, every rank gets the same one.

        With ``torch.distributed`` initialized (and ``collective`` not False) this is a
        collective call: one ``all_gather`` agrees on the writer rank's choice (``step``, or
        the newest it has saved or committed), then every rank waits until that step is
        committed and reads it; if the writer fails to choose, or the ranks asked for
        different steps, every rank raises. Without a group, ``load()`` on the writer also
        waits for its own pending saves; elsewhere it returns the newest committed version
        at once, moving on to the newest if retention deletes it mid-read. Loading never
        changes anything under the root.

        A sharded version (saved from DTensors) loads collectively in place into DTensors in
        ``into`` (any sharding or world size), with this rank's own plain values (rank 0's
        if the version was saved by fewer ranks); without them, as the consolidated full
        state (rank 0's plain values, or this rank's own in a group). See
        :mod:`asyncckpt._versions.sharded_reading`.

        Args:
            step: the step to load; None loads the newest.
            map_location: as in :func:`asyncckpt.load`; None puts CPU tensors on the CPU
                and accelerator tensors on this rank's current device.
            timeout: seconds to wait for the step to be committed; None waits for the
                process group's timeout in a collective load, and for ever otherwise. A
                writer that stops renewing its lease (dead or frozen) ends the wait early.
            collective: False to load independently even when a group is initialized.
            into: an existing state to load into in place, as in :func:`asyncckpt.load`
                (DTensors included, for a sharded version).
            max_bytes: at most this many bytes of host memory for decoded data (as in
                :func:`asyncckpt.load`; for a consolidated sharded version, the whole
                tensors count too); None: no limit besides what the files' sizes bound.
            keys: top-level keys of the saved state to load (e.g. ``["model"]`` for an
                evaluation job), as in :func:`asyncckpt.load`: only their chunks are read
                (of a sharded version, only the rank files and chunks holding them).
            weights_only: accepted and ignored, as by :func:`asyncckpt.load`: nothing is
                unpickled, so every load is as safe as ``torch.load(weights_only=True)``.

        Returns:
            The saved state (with ``keys``, the dict of those keys).

        Raises:
            CheckpointNotFoundError: nothing is committed under the root.
            CheckpointTimeoutError: ``step`` was not committed within ``timeout``, or its
                writer stopped renewing its lease.
            IncompleteCheckpointError: the save of ``step`` failed, or the version was
                deleted while it was being read. On the writer, the failure of its own
                save of ``step`` is raised as it is (e.g. a StorageError).
            ValueError: ranks of a collective load asked for different steps, or
                DTensors in ``into`` with ``collective=False`` or a version not sharded,
                a negative ``max_bytes``; ``step`` is negative; ``into`` shares no tensor
                with the version.
            MemoryBudgetError: the version needs more than ``max_bytes``; nothing was
                allocated from it.
            MissingKeyError: a key of ``keys`` is not in the version (lists its keys).
            TypeError: ``step`` is neither None nor an int (e.g. ``"latest"``).
            DeviceUnavailableError: ``map_location`` names a device this machine lacks.
        """
        del weights_only  # torch.load's keyword, so that code written for it runs as is
        self._check_open()
        check_load_step(step)
        Budget(max_bytes)  # a bad value fails here, before any wait
        placement = Placement(map_location)
        use_group = self._distributed and collective is not False
        if collective and not self._distributed:
            raise ValueError("collective=True needs an initialized torch.distributed group")
        writer = None  # whose save of the step is awaited: the current lease holder's
        if use_group:
            target, writer = agree_on_step(
                self._group, self.writer_rank, step, self._newest_expected, self._token, self.root
            )
            if target is not None:
                # Every rank finished the previous collective load before entering this one, so
                # only the step agreed now can still be in use by a slow rank: retention spares it.
                self._agreed = (target, None)
            if timeout is None:
                timeout = group_timeout(self._group)
        else:
            target = self._chosen(step)  # includes this process's own pending saves
        if target is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}")
        follow_latest = step is None and not use_group
        try:
            self._wait_committed(target, timeout, poll=not follow_latest, writer=writer)
            commit = self._reader.commit_of(target)
            request = self._load_request(
                placement,
                into=into,
                keys=keys,
                max_bytes=max_bytes,
                follow_latest=follow_latest,
                collective=use_group,
            )
            # Either kind, and a version retired since it was chosen: the reading side follows.
            return loading.load(self._reader, target, commit, request)
        finally:
            if use_group:  # so that the spare ends once every rank has read it
                self._agreed = (target, announce_loaded(self._group))

    def _spared(self) -> int | None:
        """The step a collective load may still be reading (retention spares it), until every
        rank has announced it has finished (a resumed version is not kept for ever)."""
        step, done = self._agreed
        if step is None or (done is not None and done.is_completed()):
            return None
        return step

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Wait for pending saves (raising a failure nobody observed) and stop.

        A writer applies retention once more: the last save's retention may have spared
        the step of the collective load before it, which no rank can still be reading now.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
            writer = self._writer
            if writer.epoch is not None and writer.published is not None:
                writer.apply_retention(self.retention, writer.published, self._spared())
        finally:
            self._writer.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            self.close()
        except Exception as close_exc:  # keep the original error; report the other
            if exc is None:
                raise
            log.error("while closing after an error, a pending save failed: %s", close_exc)

    def __repr__(self) -> str:
        role = "read-only" if self.read_only else f"writer_rank={self.writer_rank}"
        return f"Checkpointer({self.root!r}, {role})"


def _rewind_hint(root: str, step: int) -> str:
    """How to discard the versions from ``step`` on: rewind to a committed step before it."""
    return (
        f"Checkpointer.rewind(K) or `asyncckpt rewind {root} K --yes`, K a committed step "
        f"below {step} (`asyncckpt ls {root}` lists them)"
    )
