"""The background-job runtime of every save: handles, the one tracker, the exit hook.

Every save (``asyncckpt.save``, ``Checkpointer.save`` on each rank) runs its background
part as a *job* on the save thread and returns a :class:`SaveHandle`. One tracker records
every job that has not settled (still running, or failed with nobody told), with its
*owner*: None for the module-level API, the ``Checkpointer`` for its saves. Each failure
is raised exactly once: by its handle (``result``/``exception``), or else by the next
``save``/``wait`` that looks at its owner's jobs (the module-level functions look at every
owner's), or else by the exit hook, which fails the process.

Example:
    >>> import time
    >>> handle = submit(lambda: 3, "demo", 0, time.perf_counter(), nice=0)
    >>> handle.result().stats.stored_bytes
    3
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any, Final, cast

from asyncckpt import _threads as workers
from asyncckpt._engine import writer_process
from asyncckpt._engine.snapshot import Snapshot
from asyncckpt.errors import CheckpointTimeoutError

log = logging.getLogger(__name__)

#: ``owner`` of the module-level API's saves; ``ANY`` selects every owner's jobs.
ANY: Final = object()


@dataclass(frozen=True)
class SaveStats:
    """Figures for one save. Fields that need the write to finish are None until it has.

    Attributes:
        blocking_s: seconds ``save`` blocked the caller (validation + snapshot copy).
        total_s: seconds from the call until the file was durable.
        raw_bytes: bytes of tensor and array data in the state.
        stored_bytes: size of the file written.
    """

    blocking_s: float
    raw_bytes: int
    total_s: float | None = None
    stored_bytes: int | None = None

    @property
    def throughput(self) -> float | None:
        """Raw bytes per second from the call until durable, once known."""
        return self.raw_bytes / self.total_s if self.total_s else None

    @property
    def ratio(self) -> float | None:
        """``stored_bytes / raw_bytes`` once known (lower is better)."""
        if self.stored_bytes is None or not self.raw_bytes:
            return None
        return self.stored_bytes / self.raw_bytes


@dataclass(frozen=True)
class SaveInfo:
    """What ``SaveHandle.result()`` returns: where the file is and how the save went."""

    path: str
    stats: SaveStats


#: The phases of a save in flight, in order (see :class:`InFlight`).
PHASES: Final = ("copying", "queued", "writing", "committing")


@dataclass(frozen=True)
class InFlight:
    """One save that has not ended, as :func:`in_flight` sees it at that moment.

    Attributes:
        target: what it writes: the file, or a Checkpointer version's data file.
        step: the Checkpointer step, or None for ``asyncckpt.save``.
        phase: ``"copying"`` (``save`` is still copying the state into host memory; the
            write may already follow the copy), ``"queued"`` (copied, waiting behind an
            earlier save), ``"writing"``, or ``"committing"`` (the data is durable; the
            version file and retention are being written).
        bytes_written: raw bytes of tensor data written so far (0 throughout for a rank's
            part of a sharded version: its writes do not report progress yet).
        raw_bytes: raw bytes of tensor data in the state.
        started: when ``save`` was called, as ``time.time()``.

    Example:
        >>> InFlight("ckpt/step-1/data", 1, "writing", 4096, 8192, 0.0).bytes_written
        4096
    """

    target: str
    step: int | None
    phase: str
    bytes_written: int
    raw_bytes: int
    started: float


class SaveHandle(Future[SaveInfo]):
    """A save running in the background: a ``concurrent.futures.Future`` (as the one
    ``torch.distributed.checkpoint.async_save`` returns), so ``concurrent.futures.wait``,
    ``as_completed`` and ``asyncio.wrap_future`` take it.

    ``result``/``exception`` wait and report the outcome (and count as observing it: the
    failure is then not raised again by ``wait`` or at exit; a timeout raises
    ``CheckpointTimeoutError``, a ``TimeoutError``); ``done``, ``running`` and
    ``cancelled`` ask without waiting; ``add_done_callback`` calls ``fn(handle)`` once the
    save has ended (at once if it has). ``cancel`` stops a save whose job has not started
    yet (it waits behind an earlier save on the save thread): its file is never written,
    its host memory is freed, ``result`` raises ``CancelledError``, ``wait`` and
    ``as_completed`` count it as done at once, and nothing is reported as a failure. It
    returns False once the job runs or has ended, and for a save other processes wait for
    (a rank's part of a sharded version).

    Example:
        >>> import torch, asyncckpt, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.ackpt")
        >>> handle = asyncckpt.save({"w": torch.ones(2)}, path)
        >>> handle.result().stats.raw_bytes
        8
        >>> handle.done(), handle.cancel()
        (True, False)
    """

    def __init__(self, path: str, stats: SaveStats, owner: Any = None, target: Any = None) -> None:
        super().__init__()
        self.path = path
        self.owner = owner
        #: What the save writes (a file, a Checkpointer's step): loads of it wait for it.
        self.target = target
        self._stats = stats
        self._observed = False
        # Orders ``cancel`` against the job's start (and stats updates). Re-entrant: a done
        # callback that a successful ``cancel`` runs may itself call ``cancel``.
        self._gate = threading.RLock()
        self._on_cancel: Callable[[], None] | None = None
        # What in_flight() reports: the wall-clock start, and the job's progress.
        self._started_wall = time.time() - stats.blocking_s
        self._copying = False
        self._committing = False
        self._written = 0

    @property
    def stats(self) -> SaveStats:
        """Blocking time and raw size now; total time and stored size once done."""
        return self._stats

    @property
    def observed(self) -> bool:
        """Whether someone has seen the outcome through ``result``/``exception``."""
        return self._observed

    def failed(self) -> bool:
        """Whether the save has ended with an error (does not count as observing it)."""
        return self.done() and self._failure() is not None

    def cancel(self) -> bool:
        """Stop the save if its job has not started; see the class. Returns whether it did."""
        with self._gate:
            # ``_on_cancel`` is set exactly while the job may still be stopped: ``_start``
            # drops it, under this lock, as it moves the future to running.
            on_cancel, self._on_cancel = self._on_cancel, None
            if on_cancel is None:
                return self.cancelled()
            super().cancel()
            # The stdlib counts a cancelled future as done for ``wait``/``as_completed``
            # only once its executor notices it; this save's job would notice only after
            # the saves queued before it. Notify now (``_start`` then never runs it).
            self.set_running_or_notify_cancel()
        self._observed = True
        on_cancel()
        return True

    def add_done_callback(self, fn: Callable[[SaveHandle], object]) -> None:
        """Call ``fn(self)`` once the save has ended (from the save thread, or at once)."""
        super().add_done_callback(cast(Callable[[Future[SaveInfo]], object], fn))

    def result(self, timeout: float | None = None) -> SaveInfo:
        """Wait until the file is durable.

        Args:
            timeout: seconds to wait at most; None waits for ever.

        Returns:
            The file's path and the save's stats.

        Raises:
            CheckpointTimeoutError: still running after ``timeout`` (the save goes on).
            CancelledError: the save was cancelled.
            Exception: whatever made the background write fail (e.g. StorageError).
        """
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return SaveInfo(self.path, self._stats)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait like :meth:`result`, but return the failure instead of raising it.

        Raises:
            CheckpointTimeoutError: still running after ``timeout``.
            CancelledError: the save was cancelled.
        """
        try:
            exc = super().exception(timeout)
        except CancelledError:
            self._observed = True
            raise CancelledError(f"the save to {self.path} was cancelled") from None
        except FutureTimeout:
            raise CheckpointTimeoutError(
                f"save to {self.path} still running after {timeout} s"
            ) from None
        self._observed = True
        return exc

    def _failure(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the end; the failure (None if written or cancelled), not observed."""
        try:
            return super().exception(timeout)
        except CancelledError:
            return None

    def _record(self, **fields: Any) -> None:
        """Update some of the stats (the caller's thread and the job's may both write)."""
        with self._gate:
            self._stats = replace(self._stats, **fields)

    def _note_written(self, nbytes: int) -> None:
        """Count ``nbytes`` more raw bytes written (a ``progress`` callback of the write)."""
        with self._gate:
            self._written += nbytes

    def _note_committing(self) -> None:
        """The data is durable; the commit starts."""
        self._committing = True

    def _in_flight(self) -> InFlight:
        """This save now, for :func:`in_flight`."""
        with self._gate:
            if self._copying:
                phase = "copying"
            elif not self.running():
                phase = "queued"
            else:
                phase = "committing" if self._committing else "writing"
            step = self.target if self.owner is not None else None
            return InFlight(
                self.path, step, phase, self._written, self._stats.raw_bytes, self._started_wall
            )

    def _start(self) -> bool:
        """Called by the job as it starts: False if it was cancelled (it must not run)."""
        with self._gate:
            if self.cancelled():
                return False
            # It can no longer be cancelled: drop what the undo holds (the snapshot, whose
            # arena, page-locked on CUDA, a kept handle would otherwise keep alive).
            self._on_cancel = None
            return self.set_running_or_notify_cancel()

    def _finish(self) -> None:
        exc = self._failure()
        if self.cancelled():
            log.info("save to %s cancelled", self.path)
        elif exc is None:
            stats = self._stats
            log.info(
                "saved %s: blocked %.3f s, durable after %.3f s, %d bytes raw, %d stored "
                "(%.1f%%), %.1f MB/s",
                self.path,
                stats.blocking_s,
                stats.total_s or 0.0,
                stats.raw_bytes,
                stats.stored_bytes or 0,
                100 * (stats.ratio or 0),
                (stats.throughput or 0) / 1e6,
            )
        else:
            log.error("background save to %s failed: %s", self.path, exc)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<SaveHandle {self.path} {state}>"


# ------------------------------------------------------------------ the tracker


class _Tracker:
    """Every job not settled yet: running, or failed and not observed. One per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: list[SaveHandle] = []

    def add(self, handle: SaveHandle) -> None:
        self.forget_settled(handle.owner)
        with self.lock:
            self.jobs.append(handle)
        # A job that ends with nothing to report leaves at once: the tracker must not keep
        # its owner (a Checkpointer, and through it the lease heartbeat) alive after the
        # user dropped it. A failure stays until it is observed (or printed at exit).
        handle.add_done_callback(self._drop_if_settled)

    def _drop_if_settled(self, handle: SaveHandle) -> None:
        if _settled(handle):
            with self.lock:
                self.jobs = [h for h in self.jobs if h is not handle]

    def of(self, owner: Any) -> list[SaveHandle]:
        """``owner``'s jobs (every owner's for :data:`ANY`) not settled, oldest first."""
        with self.lock:
            return [h for h in self.jobs if _owned(h, owner)]

    def forget_settled(self, owner: Any) -> None:
        with self.lock:
            self.jobs = [h for h in self.jobs if not (_owned(h, owner) and _settled(h))]

    def take_failure(self, owner: Any) -> SaveHandle | None:
        """The oldest unobserved failure of ``owner``, marked observed; None if none."""
        with self.lock:
            for handle in self.jobs:
                if _owned(handle, owner) and handle.failed() and not handle.observed:
                    handle._observed = True
                    return handle
        return None


_tracker = _Tracker()
# The handle of the job running on this thread (the save thread), for its progress.
_running = threading.local()


def _owned(handle: SaveHandle, owner: Any) -> bool:
    return owner is ANY or handle.owner is owner


def _settled(handle: SaveHandle) -> bool:
    """Ended, and nothing left to report: succeeded, cancelled, or failed and observed."""
    return handle.done() and (not handle.failed() or handle.observed)


@workers.after_fork_in_child
def _forget_parent_jobs() -> None:
    """In a forked child: none of the parent's jobs (they are the parent's to report)."""
    global _tracker
    workers.keep_from_parent(_tracker.jobs)
    _tracker = _Tracker()


def pending(owner: Any = ANY) -> list[SaveHandle]:
    """The jobs of ``owner`` (default: every owner) that have not ended, oldest first."""
    return [h for h in _tracker.of(owner) if not h.done()]


def in_flight(owner: Any = ANY) -> list[InFlight]:
    """The saves of ``owner`` (default: every owner's) that have not ended, oldest first:
    what each writes, its phase and how many bytes it has written so far.

    Public as ``asyncckpt.in_flight()`` (every save of this process) and
    ``Checkpointer.in_flight()`` (that Checkpointer's). A save leaves the list once it has
    ended; ``handle.add_done_callback`` tells when (for a Checkpointer: once its version is
    committed).

    Example:
        >>> import torch, asyncckpt, tempfile, os
        >>> handle = asyncckpt.save({"w": torch.ones(2)}, os.path.join(tempfile.mkdtemp(), "w"))
        >>> all(r.phase in PHASES for r in asyncckpt.in_flight())
        True
        >>> _ = handle.result()
        >>> [r for r in asyncckpt.in_flight() if r.target == handle.path]
        []
    """
    return [h._in_flight() for h in pending(owner)]


def running_job() -> SaveHandle | None:
    """The handle of the save whose job runs on this thread (for its progress), else None."""
    handle: SaveHandle | None = getattr(_running, "handle", None)
    return handle


def tracked(owner: Any) -> list[SaveHandle]:
    """The jobs of ``owner`` not settled yet (running, or failed and unobserved)."""
    return _tracker.of(owner)


def raise_unobserved_failure(owner: Any = ANY) -> None:
    """Raise the oldest failure of ``owner``'s saves (default: any) nobody has seen.

    Each failure is raised once; later ones stay queued for the next ``save``/``wait``.
    """
    handle = _tracker.take_failure(owner)
    _tracker.forget_settled(owner)
    if handle is not None:
        exc = handle._failure()
        assert exc is not None
        raise exc


def wait(owner: Any = ANY, timeout: float | None = None) -> None:
    """Block until ``owner``'s pending saves have ended; raise the first failure not seen.

    Raises:
        CheckpointTimeoutError: a save is still running after ``timeout`` seconds.
        Exception: the oldest failure among them nobody observed (then it is observed).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    failure: BaseException | None = None
    for handle in _tracker.of(owner):
        if handle.cancelled():
            continue
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        seen = handle.observed
        exc = handle.exception(left)  # marks it observed: so it is raised here, once
        if failure is None and exc is not None and not seen:
            failure = exc
    _tracker.forget_settled(owner)
    if failure is not None:
        raise failure


def submit(
    job: Callable[[], int],
    label: str,
    raw_bytes: int,
    started: float,
    target: Any = None,
    *,
    nice: int,
    owner: Any = None,
    on_cancel: Callable[[], None] | None = None,
    copying: bool = False,
) -> SaveHandle:
    """Run ``job`` (which returns the bytes written) on the save thread; return its handle.

    ``job`` must release its snapshot's arena. ``nice`` (``writer_nice``) is fixed when the
    process's first save creates the save thread. ``on_cancel`` frees what the caller
    prepared for ``job`` if the handle is cancelled before ``job`` starts (None: it cannot
    be cancelled); with ``copying``, the caller clears ``handle._copying`` once done.
    """
    stats = SaveStats(time.perf_counter() - started, raw_bytes)
    handle = SaveHandle(label, stats, owner, target)
    handle._on_cancel = on_cancel
    handle._copying = copying

    def run() -> None:
        # The handle is the save's future: this sets its outcome (the pool's own future,
        # which would only ever hold None, is dropped).
        if not handle._start():
            return  # cancelled: ``cancel`` undid what was prepared and notified waiters
        _running.handle = handle
        try:
            stored = job()
        except BaseException as exc:  # as an executor does: the handle reports it
            handle.set_exception(exc)
            return
        finally:
            _running.handle = None
        # Before the future completes: its waiters wake before its done callbacks run, so
        # stats completed in a callback could still be missing when ``result()`` returns.
        total = time.perf_counter() - started
        handle._record(total_s=total, stored_bytes=stored)
        handle.set_result(SaveInfo(handle.path, handle.stats))

    workers.save_queue(nice).submit(run)
    _tracker.add(handle)
    handle.add_done_callback(SaveHandle._finish)
    return handle


def completed_handle(label: str, stats: SaveStats | None = None) -> SaveHandle:
    """A handle for a save that has ended already (nothing to do, or written in place)."""
    stats = stats or SaveStats(0.0, 0, 0.0, 0)
    handle = SaveHandle(label, stats)
    handle.set_result(SaveInfo(label, stats))
    handle._observed = True  # nothing can fail later
    return handle


def stage_and_submit(
    copy: Callable[[Callable[[Snapshot], None]], Snapshot],
    job: Callable[[Snapshot], int],
    label: str,
    started: float,
    target: Any = None,
    *,
    nice: int,
    owner: Any = None,
    on_cancel: Callable[[], None] | None = None,
) -> tuple[Snapshot, SaveHandle]:
    """Snapshot a state while its background job already runs: the pipelined save.

    ``copy(on_layout)`` stages the state; ``on_layout`` submits ``job`` as soon as the arena
    is leased, so the job follows the copy chunk by chunk (``Snapshot.wait_staged``) and the
    time until durable is the longer of copy and write, not their sum. Returns once the copy
    is complete. The arena is never released before the copy has ended: a job that fails
    early (a refused lease, a full disk) must not lend it to another save while the copy
    still writes into it. The other arguments are :func:`submit`'s.

    Raises:
        Exception: whatever ``copy`` raised, here, once: the job's own failure (the aborted
            write) is then swallowed, and a versioned job leaves no trace of the step (see
            ``Snapshot.copy_error``).

    Example:
        >>> import torch, tempfile, os, time
        >>> from asyncckpt._api.staging import stage, write_options
        >>> from asyncckpt._engine.encode import write_snapshot
        >>> from asyncckpt._storage import resolve
        >>> storage, path = resolve(os.path.join(tempfile.mkdtemp(), "x.ackpt"), None)
        >>> from asyncckpt._settings import Settings
        >>> options = write_options("none", Settings())
        >>> snap, handle = stage_and_submit(
        ...     lambda on_layout: stage(
        ...         {"w": torch.ones(2)}, options, on_layout=on_layout, in_this_process=True
        ...     ),
        ...     lambda snap: write_snapshot(snap, storage, path, options),
        ...     path,
        ...     time.perf_counter(),
        ...     nice=0,
        ... )
        >>> handle.result().stats.raw_bytes
        8
    """
    handles: list[SaveHandle] = []
    copied = threading.Event()

    def release(snap: Snapshot) -> None:
        copied.wait()  # the copy has ended, and the caller has recorded its stall
        snap.release()

    def run(snap: Snapshot) -> int:
        try:
            return job(snap)
        finally:
            release(snap)

    def cancelled(snap: Snapshot) -> None:
        if on_cancel is not None:
            on_cancel()
        threading.Thread(target=release, args=(snap,), daemon=True).start()

    def start(snap: Snapshot) -> None:
        undo = None if on_cancel is None else (lambda: cancelled(snap))
        work = lambda: run(snap)  # noqa: E731
        handles.append(
            submit(
                work,
                label,
                snap.raw_bytes,
                started,
                target,
                nice=nice,
                owner=owner,
                on_cancel=undo,
                copying=True,  # until the copy below ends
            )
        )

    try:
        snap = copy(start)
    except BaseException:
        copied.set()
        for handle in handles:  # the copy failed: its error is raised here, not later
            handle._observed = True
            handle._failure()  # the job aborts its file and frees the arena
        raise
    handle = handles[0]
    handle._record(blocking_s=time.perf_counter() - started, raw_bytes=snap.raw_bytes)
    handle._copying = False
    copied.set()
    return snap, handle


# ------------------------------------------------------------------ the exit hook

#: How long the exit hook waits for worker threads to drop their last task's tensors.
_EXIT_IDLE_WAIT_S = 10.0
#: How long it waits for torch.distributed's own worker threads to finish theirs.
_EXIT_TORCH_QUIET_S = 2.0


@atexit.register
def _finish_at_exit() -> None:
    """Wait for pending saves; report every failure nobody observed, and fail the exit.

    The library's and torch.distributed's worker threads are let finish first: dropping a
    tensor during finalization aborts the process. A failed checkpoint must not look like a
    successful run, and ``atexit`` cannot change the exit status: after printing to stderr
    (the logger has no handler by default), the remaining exit hooks run here, then
    ``os._exit(1)``.
    """
    waiting = pending()
    if waiting:
        log.warning("interpreter exiting: waiting for %d pending checkpoint save(s)", len(waiting))
    for handle in waiting:
        handle._failure()  # wait, without marking it observed
    workers.wait_idle(_EXIT_IDLE_WAIT_S)
    workers.wait_torch_threads_quiet(_EXIT_TORCH_QUIET_S)
    writer_process.stop()  # nothing is pending: its socket closed and the child reaped
    failed = [h for h in _tracker.of(ANY) if h.failed() and not h.observed]
    if not failed:
        return
    for handle in failed:
        exc = handle._failure()
        print(
            f"asyncckpt: background save to {handle.path} failed: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
    print(
        f"asyncckpt: {len(failed)} checkpoint save(s) failed and nobody called result() "
        "on them; exiting with status 1",
        file=sys.stderr,
    )
    atexit.unregister(_finish_at_exit)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to add
            stream.flush()
    os._exit(1)
