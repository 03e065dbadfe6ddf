"""``Checkpointer``: versioned, multi-rank checkpoints under one root.

Replaces "save on rank 0, ``dist.barrier()``, load with ``map_location``": the writer rank
saves in the background; ``load`` on any rank returns only committed versions, placed on the
loading rank's own device, and no rank sits in a collective while a write is in progress
(the one collective, a broadcast of a step number, happens before any waiting).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from . import config
from .api import (
    SaveHandle,
    completed_handle,
    raise_unobserved_failure,
    stage,
    submit,
    write_options,
)
from .codec import check_compression
from .errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    ConflictError,
    FormatError,
    IncompleteCheckpointError,
)
from .placement import MapLocation, Placement
from .protocol import (
    CommitRecord,
    VersionRecord,
    committed_steps,
    create_commit,
    data_file_name,
    delete_version,
    latest_step,
    mark_failed,
    read_commit,
    read_version_file,
    remove_temp_files,
    retention_plan,
    step_dir,
    step_dirs,
    wait_for_step,
    write_version_file,
)
from .reader import materialize, open_file
from .staging import Snapshot
from .storage import resolve
from .writer import WriteOptions, write_snapshot

log = logging.getLogger("asyncckpt")


class Checkpointer:
    """Versioned checkpoints of a training run under ``root``, safe across ranks.

    Args:
        root: local directory or fsspec URL holding one directory per step.
        keep_last: keep only the newest N committed versions (None keeps all). Older ones
            are deleted only after a newer one is committed; the version file's is never.
        compression: ``"zstd"`` (default) or ``"none"``.
        storage_options: keyword arguments for the fsspec filesystem of a URL.
        process_group: the group whose ranks share this root (default: the default group,
            when ``torch.distributed`` is initialized).
        writer_rank: the rank (within the group) that writes; other ranks only load.
        overlap: let ``save`` return once device-to-host copies are *queued*, so they
            overlap the next forward and backward; call :meth:`protect` on the optimizer so
            its next ``step()`` waits for the copies. Without CUDA this changes nothing.

    Raises:
        ValueError: a bad ``keep_last`` or ``compression``.
        StorageError: the root cannot be reached.

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
        compression: str = "zstd",
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        writer_rank: int = 0,
        overlap: bool = False,
    ) -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be None or a positive int, got {keep_last!r}")
        self.compression = check_compression(compression)
        self.keep_last = keep_last
        self._storage, self._root = resolve(root, storage_options)
        self._group = process_group
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self._distributed else 0
        self.writer_rank = writer_rank
        self.is_writer = self.rank == writer_rank
        self._token = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._pending: list[tuple[int, SaveHandle]] = []
        self._last_step: int | None = None
        self._known_version: VersionRecord | None = None
        self._closed = False
        self.overlap = overlap
        self._last_snapshot: Snapshot | None = None
        self._agreed_step: int | None = None
        if self.is_writer:
            self._recover()

    @property
    def root(self) -> str:
        """The root as a user would write it."""
        return self._storage.describe(self._root)

    # -- writing ------------------------------------------------------------------------

    def _recover(self) -> None:
        """Continue from what is under the root: drop leftovers, roll the version file on."""
        storage, root = self._storage, self._root
        remove_temp_files(storage, root)
        committed = committed_steps(storage, root)
        for step in step_dirs(storage, root):
            if step not in committed:
                log.info("removing step %d under %s: it was never committed", step, self.root)
                delete_version(storage, root, step)
        for step in committed:  # a crash between an exclusive create and its clean-up
            remove_temp_files(storage, step_dir(storage, root, step))
        record = read_version_file(storage, root)
        if committed and (record is None or record.step != committed[-1]):
            record = VersionRecord(committed[-1], self._token)
            write_version_file(storage, root, record)
        self._known_version = record
        self._last_step = committed[-1] if committed else None
        # No retention here: opening a root (perhaps only to load an old version) never
        # deletes a committed version; the next commit applies keep_last.

    def save(self, step: int, state: Any) -> SaveHandle:
        """Snapshot ``state`` and write it as version ``step`` in the background.

        On ranks other than ``writer_rank`` this copies nothing and returns a completed
        handle, so every rank can run the same code.

        Args:
            step: a non-negative int, greater than every step saved before under this root.
            state: what ``asyncckpt.save`` accepts.

        Returns:
            A :class:`SaveHandle`; its ``result()`` returns once the version is committed.

        Raises:
            ConflictError: ``step`` is already committed under this root.
            ValueError: ``step`` is negative, not an int, or not greater than the last one.
            UnsupportedObjectError: ``state`` holds something that cannot be stored.
        """
        self._check_open()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not self.is_writer:
            return completed_handle(f"{self.root} step {step} (rank {self.rank} does not write)")
        started = time.perf_counter()
        raise_unobserved_failure()
        options = write_options(self.compression)
        with self._lock:
            self._check_new_step(step)
            snap = stage(state, self.overlap)
            self._last_snapshot = snap
            self._last_step = step
            path = self._storage.join(
                step_dir(self._storage, self._root, step), data_file_name(self.rank, self._token)
            )
            handle = submit(
                lambda: self._write_and_commit(step, snap, path, options),
                self._storage.describe(path),
                snap.raw_bytes,
                started,
            )
            self._pending = [(s, h) for s, h in self._pending if not h.done()]
            self._pending.append((step, handle))
        return handle

    def wait_for_snapshot(self) -> None:
        """Block until the last save's device-to-host copies have landed.

        Only needed with ``overlap=True``: before that, the state's tensors must not change.
        """
        snap = self._last_snapshot
        if snap is not None:
            snap.wait_copied()

    def protect(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for the last save's copies (for ``overlap=True``).

        Args:
            optimizer: the optimizer whose ``step`` mutates the saved parameters.

        Returns:
            The hook handle; ``.remove()`` undoes it.

        Example:
            >>> import torch, asyncckpt, tempfile
            >>> model = torch.nn.Linear(2, 2)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> ckpt = asyncckpt.Checkpointer(tempfile.mkdtemp(), overlap=True)
            >>> hook = ckpt.protect(opt)
            >>> _ = ckpt.save(1, model.state_dict())
            >>> model(torch.ones(2)).sum().backward()
            >>> opt.step()  # waits for the snapshot's copies first
            >>> ckpt.close()
        """
        return optimizer.register_step_pre_hook(lambda *_: self.wait_for_snapshot())

    def _check_new_step(self, step: int) -> None:
        if read_commit(self._storage, self._root, step) is not None:
            raise ConflictError(f"step {step} is already committed under {self.root}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"steps must increase: {step} is not greater than {self._last_step}, the last "
                f"step saved under {self.root}"
            )

    def _write_and_commit(self, step: int, snap: Snapshot, path: str, options: WriteOptions) -> int:
        storage, root = self._storage, self._root
        try:
            try:
                size = write_snapshot(snap, storage, path, options)
            finally:
                snap.lease.release()
            self._check_sole_writer(step)
            name = path.replace("\\", "/").rsplit("/", 1)[-1]
            create_commit(storage, root, CommitRecord(step, (name,), self._token))
            record = VersionRecord(step, self._token)
            write_version_file(storage, root, record)
            self._known_version = record
        except ConflictError:
            # Another writer committed this step: its version is intact; remove our data.
            if read_commit(storage, root, step) is not None:
                with contextlib.suppress(AsyncCkptError):
                    storage.delete(path)
            else:
                mark_failed(storage, root, step, ConflictError("two writers on one root"))
            raise
        except BaseException as exc:
            mark_failed(storage, root, step, exc)
            raise
        self._apply_retention(step)
        return size

    def _check_sole_writer(self, step: int) -> None:
        current = read_version_file(self._storage, self._root)
        # A record with our own token is ours, even if we never learned that its write
        # landed (a response lost after the last retry on an object store).
        if current is not None and current != self._known_version and current.writer != self._token:
            raise ConflictError(
                f"another writer (id {current.writer}) moved the version file under "
                f"{self.root} to step {current.step} since this Checkpointer last "
                "committed; only one job may write to a root"
            )
        if current is not None and current.step >= step:
            raise ConflictError(
                f"step {step} is not newer than step {current.step}, "
                f"already committed under {self.root}"
            )

    def _apply_retention(self, pinned: int) -> None:
        storage, root = self._storage, self._root
        try:
            plan = retention_plan(
                committed_steps(storage, root), step_dirs(storage, root), self.keep_last, pinned
            )
            for step in plan:
                if step == self._agreed_step:
                    continue  # a rank may still be reading it (see _agree_on_step)
                delete_version(storage, root, step)
            remove_temp_files(storage, root)
        except AsyncCkptError as exc:  # the new version is committed; do not fail the save
            log.warning(
                "retention under %s failed (will retry after the next save): %s", self.root, exc
            )

    def wait(self, timeout: float | None = None) -> None:
        """Block until this process's pending saves are committed.

        Raises:
            CheckpointTimeoutError: a save is still running after ``timeout`` seconds.
            Exception: the failure of a pending save.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = list(self._pending)
        for _, handle in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            handle.result(left)

    # -- reading ------------------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest committed step (per the version file), or None if there is none."""
        return latest_step(self._storage, self._root)

    def versions(self) -> list[int]:
        """Every committed step, ascending."""
        return committed_steps(self._storage, self._root)

    def load(
        self,
        step: int | None = None,
        *,
        map_location: MapLocation = None,
        timeout: float | None = None,
        collective: bool | None = None,
        into: Any = None,
    ) -> Any:
        """Load a committed version; with a process group, every rank gets the same one.

        With ``torch.distributed`` initialized (and ``collective`` not False) this is a
        collective call: the writer rank broadcasts the step to load (``step``, or the
        newest it has saved or committed), then each rank waits until that step is
        committed (the writer on its own save, others by polling storage) and reads it.
        Without a group, ``load()`` on the writer also waits for its own pending saves and
        returns the newest; elsewhere it returns the newest committed version at once.

        Args:
            step: the step to load; None loads the newest.
            map_location: as in :func:`asyncckpt.load`; None puts CPU tensors on the CPU
                and accelerator tensors on this rank's current device.
            timeout: seconds to wait for the step to be committed (None waits for ever).
            collective: False to load independently even when a group is initialized.
            into: an existing state to load into in place, as in :func:`asyncckpt.load`.

        Returns:
            The saved state.

        Raises:
            CheckpointNotFoundError: nothing is committed under the root.
            CheckpointTimeoutError: ``step`` was not committed within ``timeout``.
            IncompleteCheckpointError: the save of ``step`` failed, or the version was
                deleted while it was being read. On the writer, the failure of its own
                save of ``step`` is raised as it is (e.g. a StorageError).
        """
        self._check_open()
        placement = Placement(map_location)
        use_group = self._distributed and collective is not False
        if collective and not self._distributed:
            raise ValueError("collective=True needs an initialized torch.distributed group")
        if use_group:
            target = self._agree_on_step(step)
        elif step is None and self.is_writer:
            target = self._newest_expected()  # includes this process's own pending saves
        else:
            target = step if step is not None else self.latest()
        if target is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}")
        follow_latest = step is None and not use_group
        self._wait_committed(target, timeout, poll=not follow_latest)
        return self._read(target, placement, follow_latest, into)

    def _newest_expected(self) -> int | None:
        with self._lock:
            pending = [s for s, h in self._pending if not h.failed()]
        committed = self.latest()
        candidates = [s for s in [*pending, committed] if s is not None]
        return max(candidates) if candidates else None

    def _agree_on_step(self, step: int | None) -> int | None:
        proposal = step if step is not None else self._newest_expected() if self.is_writer else None
        backend = dist.get_backend(self._group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        value = torch.tensor(
            [-1 if proposal is None else proposal], dtype=torch.int64, device=device
        )
        src = (
            dist.get_global_rank(self._group, self.writer_rank)
            if self._group is not None
            else self.writer_rank
        )
        dist.broadcast(value, src=src, group=self._group)
        agreed = int(value.item())
        if agreed >= 0:
            # Every rank finished the previous collective load before entering this one, so
            # only the step agreed now can still be in use by a slow rank: retention spares it.
            self._agreed_step = agreed
        if step is not None and agreed != step:
            raise ValueError(
                f"rank {self.rank} asked for step {step} but the writer rank "
                f"asked for {agreed}; pass the same step on every rank"
            )
        return None if agreed < 0 else agreed

    def _wait_committed(self, step: int, timeout: float | None, poll: bool) -> None:
        """Wait for this process's own save of ``step``, then (if ``poll``) for storage.

        Without ``poll`` the step is known to be committed already (or to be this
        process's own save); if retention removes it meanwhile, the read moves on.
        """
        if self.is_writer:
            with self._lock:
                mine = [h for s, h in self._pending if s == step]
            for handle in mine:
                handle.result(timeout)
        if poll:
            wait_for_step(self._storage, self._root, step, timeout)

    def _read(self, step: int, placement: Placement, follow_latest: bool, into: Any) -> Any:
        threads = config.tunable("threads", None)
        while True:
            commit = read_commit(self._storage, self._root, step)
            try:
                if commit is None:
                    raise CheckpointNotFoundError(f"step {step} is not committed")
                if len(commit.files) != 1:
                    raise FormatError(
                        f"step {step} under {self.root} has {len(commit.files)} data files; "
                        "this asyncckpt reads single-writer versions only"
                    )
                path = self._storage.join(
                    step_dir(self._storage, self._root, step), commit.files[0]
                )
                return materialize(open_file(self._storage, path), placement, threads, into)
            except CheckpointNotFoundError as exc:
                newest = self.latest()
                if not follow_latest or newest is None or newest == step:
                    raise IncompleteCheckpointError(
                        f"step {step} under {self.root} was deleted while loading it (by "
                        "retention?); load again to get the newest version"
                    ) from exc
                log.info("step %d was deleted while loading; moving to step %d", step, newest)
                step = newest

    # -- lifetime -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise AsyncCkptError(f"this Checkpointer for {self.root} is closed")

    def close(self) -> None:
        """Wait for pending saves (raising their failure) and stop accepting calls."""
        if not self._closed:
            self._closed = True
            with self._lock:
                pending = list(self._pending)
            for _, handle in pending:
                handle.result()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_exc:  # keep the original error; report the other
            log.error("while closing after an error, a pending save failed: %s", close_exc)

    def __repr__(self) -> str:
        return f"Checkpointer({self.root!r}, rank={self.rank}, writer_rank={self.writer_rank})"
