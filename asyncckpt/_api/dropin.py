"""Drop-in ``save``/``load`` beside ``torch.save``/``torch.load``, and the save handle."""

from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, BinaryIO

from asyncckpt import _config as config
from asyncckpt import _threads as workers
from asyncckpt._device import MapLocation, Placement
from asyncckpt._engine import writer_process
from asyncckpt._engine.arena import ArenaPool
from asyncckpt._engine.decode import Budget, materialize, read_file
from asyncckpt._engine.encode import WriteOptions, write_snapshot
from asyncckpt._engine.snapshot import Snapshot, arena_bytes, snapshot
from asyncckpt._format.codec import check_compression
from asyncckpt._format.tree import flatten
from asyncckpt._settings import Settings
from asyncckpt._storage import AtomicWriter, ReadHandle, Storage, resolve
from asyncckpt._storage.base import errors_as
from asyncckpt._versions import pending
from asyncckpt.errors import AsyncCkptError, CheckpointTimeoutError

log = logging.getLogger(__name__)
PathOrUrl = str | os.PathLike[str]


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
        if not self.total_s:
            return None
        return self.raw_bytes / self.total_s

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


_sequence = itertools.count()
_unobserved_lock = threading.Lock()
_unobserved: list[SaveHandle] = []
_arenas: ArenaPool | None = None


def _arena_pool() -> ArenaPool:
    global _arenas
    with _unobserved_lock:
        if _arenas is None:
            _arenas = ArenaPool(config.tunable("max_inflight", None))
        return _arenas


@workers.after_fork_in_child
def _forget_parent_saves() -> None:
    """In a forked child: its own arenas (the parent's may be in memory shared with the
    parent's writer process, or leased to a save whose thread the child lacks), and none
    of the parent's unobserved failures (they are the parent's to raise)."""
    global _unobserved_lock, _arenas
    _unobserved_lock = threading.Lock()
    workers.keep_from_parent(_arenas, list(_unobserved))
    _unobserved.clear()
    _arenas = None


def reserve(state_or_nbytes: Any) -> threading.Thread | None:
    """Prepare the host arena for saves of a state this big, in a background thread.

    The first save of a process otherwise pays for allocating and faulting in its arena
    while the caller waits (several times the copy itself). Call this once the state
    exists (after building the model and optimizer); saves reuse the arena afterwards.
    With ``writer_processes=1`` the arena is in shared memory and the writer process
    starts here too, so that its start-up is not the first save's either. A
    save that starts before the reservation is done waits for it instead of allocating a
    second arena. ``Checkpointer.reserve`` does the same for a Checkpointer's saves, on the
    ranks that save.

    Args:
        state_or_nbytes: the state to be saved (its exact arena size is computed; nothing
            is copied), or a size in bytes of tensor data (a little is added for alignment).

    Returns:
        The background thread (``join`` it to wait), or None if nothing had to be done.

    Raises:
        UnsupportedObjectError: the state holds something that cannot be stored.

    Example:
        >>> import torch, asyncckpt
        >>> thread = asyncckpt.reserve({"w": torch.zeros(1024)})
        >>> thread is None or thread.join() is None
        True
    """
    if isinstance(state_or_nbytes, int):
        nbytes = state_or_nbytes + state_or_nbytes // 64 + (1 << 20)  # room for alignment
    else:
        nbytes = arena_bytes(flatten(state_or_nbytes))
    options = write_options("none")
    shared = writer_process.wanted(options)
    if shared:
        writer_process.start(options.settings)  # its start-up (an interpreter importing torch) too
    return _arena_pool().reserve(nbytes, shared)


class SaveHandle:
    """A save running in the background; a ``concurrent.futures.Future``-like view of it.

    Example:
        >>> import torch, asyncckpt, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.ackpt")
        >>> handle = asyncckpt.save({"w": torch.ones(2)}, path)
        >>> handle.result().stats.raw_bytes
        8
    """

    def __init__(self, path: str, future: Future[int], stats: SaveStats, started: float):
        self.path = path
        self.sequence = next(_sequence)
        self._future = future
        self._stats = stats
        self._started = started
        self._observed = False
        self.target: Any = None

    @property
    def stats(self) -> SaveStats:
        """Blocking time and raw size now; total time and stored size once done."""
        return self._stats

    @property
    def observed(self) -> bool:
        """Whether someone has seen the outcome through ``result``/``exception``."""
        return self._observed

    def done(self) -> bool:
        """Whether the save has finished, successfully or not."""
        return self._future.done()

    def failed(self) -> bool:
        """Whether the save has finished with an error (does not count as observing it)."""
        return self._future.done() and self._future.exception() is not None

    def result(self, timeout: float | None = None) -> SaveInfo:
        """Wait until the file is durable.

        Args:
            timeout: seconds to wait at most; None waits for ever.

        Returns:
            The file's path and the save's stats.

        Raises:
            CheckpointTimeoutError: still running after ``timeout`` (the save goes on).
            Exception: whatever made the background write fail (e.g. StorageError).
        """
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return SaveInfo(self.path, self._stats)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait like :meth:`result`, but return the failure instead of raising it."""
        try:
            exc = self._future.exception(timeout)
        except FutureTimeout:
            raise CheckpointTimeoutError(
                f"save to {self.path} still running after {timeout} s"
            ) from None
        self._observed = True
        return exc

    def _finish(self, future: Future[int]) -> None:
        exc = future.exception()
        if exc is None:
            total = time.perf_counter() - self._started
            self._stats = SaveStats(
                self._stats.blocking_s, self._stats.raw_bytes, total, future.result()
            )
            log.info(
                "saved %s: blocked %.3f s, durable after %.3f s, %d bytes raw, %d stored "
                "(%.1f%%), %.1f MB/s",
                self.path,
                self._stats.blocking_s,
                total,
                self._stats.raw_bytes,
                future.result(),
                100 * (self._stats.ratio or 0),
                (self._stats.throughput or 0) / 1e6,
            )
        else:
            log.error("background save to %s failed: %s", self.path, exc)
            with _unobserved_lock:
                _unobserved.append(self)
        workers.untrack(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<SaveHandle {self.path} {state}>"


def raise_unobserved_failure() -> None:
    """Raise the oldest background failure nobody has seen through ``result``/``exception``.

    Each failure is raised once; later ones stay queued for the next ``save``/``wait``.
    """
    # A failed save is done() before its done-callback has recorded it in _unobserved.
    settling = [h for h in workers.pending() if h.failed() and not h._observed]
    with _unobserved_lock:
        _unobserved[:] = [h for h in _unobserved if not h._observed]
        failed = _unobserved + [h for h in settling if h not in _unobserved]
        if not failed:
            return
        first = failed[0]
        first._observed = True
        _unobserved[:] = [h for h in _unobserved if h is not first]
    exc = first._future.exception()
    assert exc is not None
    raise exc


def submit(
    job: Callable[[], int],
    label: str,
    raw_bytes: int,
    started: float,
    target: Any = None,
    *,
    nice: int,
) -> SaveHandle:
    """Run ``job`` (which returns the bytes written) on the save thread; return its handle.

    Args:
        job: the background part of a save; must release its snapshot's arena.
        label: what the handle reports as its path.
        raw_bytes: the state's data size, for the stats.
        started: ``time.perf_counter()`` when the caller entered ``save``.
        target: an identifier of the file written, so loads of it wait for the save.
        nice: the save's ``writer_nice`` (for the save thread, when it starts).
    """
    stats = SaveStats(time.perf_counter() - started, raw_bytes)
    future = workers.save_queue(nice).submit(job)
    handle = SaveHandle(label, future, stats, started)
    handle.target = target
    workers.track(handle)
    future.add_done_callback(handle._finish)
    return handle


def completed_handle(label: str) -> SaveHandle:
    """A handle for a save that had nothing to do (e.g. on a rank that does not write)."""
    future: Future[int] = Future()
    future.set_result(0)
    handle = SaveHandle(label, future, SaveStats(0.0, 0, 0.0, 0), time.perf_counter())
    handle._observed = True
    return handle


def write_options(compression: str, settings: Settings | None = None) -> WriteOptions:
    """The options of one save: ``compression`` checked, and its settings (None: resolved
    now, from the environment)."""
    return WriteOptions(check_compression(compression), settings or Settings.resolve())


def stage(
    obj: Any,
    overlap: bool = False,
    on_layout: Callable[[Snapshot], None] | None = None,
    options: WriteOptions | None = None,
) -> Snapshot:
    """Validate ``obj`` and copy its data into a host arena (the blocking part of a save).

    ``on_layout`` lets a writer start before the copy ends (see ``staging.snapshot``).
    ``options``: those of the background write that follows; if they ask for a writer
    process, the arena is in shared memory and the process is started (if need be).
    Without them (a write on this thread), the arena is in shared memory all the same
    when writer processes are on: the saves that follow reuse it instead of replacing it.
    """
    settings = Settings.resolve() if options is None else options.settings
    if options is None:
        shared = writer_process.shares_arenas(settings)
    elif shared := writer_process.wanted(options):
        writer_process.start(settings)
    return snapshot(flatten(obj), _arena_pool(), overlap, on_layout, shared, settings=settings)


def save(
    obj: Any,
    f: PathOrUrl | BinaryIO,
    pickle_module: Any = None,
    pickle_protocol: Any = None,
    _use_new_zipfile_serialization: Any = None,
    _disable_byteorder_record: Any = None,
    *,
    compression: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> SaveHandle:
    """Save ``obj`` to ``f`` in the background; return once ``obj`` is snapshotted.

    After this returns the caller may modify or free every tensor in ``obj``: the file holds
    the values as of the call. Encoding, compression, checksums and the atomic write happen
    on a background thread. The target is replaced atomically: readers see the old file or
    the new one, never a mixture.

    A file object (``io.BytesIO``, a file opened ``"wb"``) is written *synchronously*, as
    ``torch.save`` writes it: the whole file is encoded and written into it, from its
    current position, before ``save`` returns a handle that is already done. There is no
    atomic replacement there (the object is the caller's); if the save fails, a seekable
    object is truncated back to where it was. It is flushed, not closed.

    Args:
        obj: plain data: dicts, lists, tuples, numbers, strings, bytes, tensors, numpy
            arrays, ``torch.Size``/``dtype``/``device`` (see the user guide for the list).
        f: a local path, ``os.PathLike``, fsspec URL (``memory://``, ``file://``, ...), or a
            writable binary file object.
        pickle_module: accepted for ``torch.save`` compatibility and ignored: nothing is
            pickled.
        pickle_protocol: accepted and ignored, likewise.
        _use_new_zipfile_serialization: accepted and ignored (the format is asyncckpt's own).
        _disable_byteorder_record: accepted and ignored (the byte order is always recorded).
        compression: ``"auto"`` (default: compress a byte plane only where the write
            time it saves exceeds its encode time on the cores the rest of the machine
            leaves idle, as measured; see the user guide), ``"zstd"`` (byte-grouped for
            floats, every plane that shrinks; the smallest file, the same bytes for the
            same state) or ``"none"``.
        storage_options: keyword arguments for the fsspec filesystem of a URL.

    Returns:
        A :class:`SaveHandle`; ``handle.result()`` waits until the file is durable (at once
        for a file object).

    Raises:
        UnsupportedObjectError: ``obj`` holds something that cannot be stored; nothing was
            written. The message names the key path.
        TypeError: ``f`` is neither a path, URL nor writable binary file object.
        StorageError: writing into a file object failed (raised here, not on the handle).
        Exception: a previous background save failed and nobody observed it.

    Example:
        >>> import io, torch, asyncckpt, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "model.ackpt")
        >>> handle = asyncckpt.save({"w": torch.zeros(3)}, path)
        >>> asyncckpt.load(path)["w"].tolist()
        [0.0, 0.0, 0.0]
        >>> buffer = io.BytesIO()
        >>> asyncckpt.save({"w": torch.ones(2)}, buffer).done()  # written before returning
        True
        >>> asyncckpt.load(io.BytesIO(buffer.getvalue()))["w"].tolist()
        [1.0, 1.0]
    """
    del pickle_module, pickle_protocol, _use_new_zipfile_serialization
    del _disable_byteorder_record
    started = time.perf_counter()
    raise_unobserved_failure()
    options = write_options(compression)
    if not isinstance(f, (str, os.PathLike)):
        return _save_to_file_object(obj, f, options, started)
    storage, path = resolve(f, storage_options)
    marker = _MarkerStart(storage, path, options.settings)
    _, handle = stage_and_submit(
        lambda on_layout: stage(obj, on_layout=marker.then(on_layout), options=options),
        lambda snap: marker.write(snap, options),
        storage.describe(path),
        started,
        _target(storage, path),
        nice=options.settings.writer_nice,
    )
    return handle


class _MarkerStart:
    """A drop-in save's marker (``asyncckpt._versions.pending``): written once the state is
    validated and its arena leased, before ``save`` returns and before the background
    write can publish; checked right before the write publishes; deleted when it ends.

    A marker that cannot be written fails the save's handle (as a failed write would),
    and the file is left alone.
    """

    def __init__(self, storage: Storage, path: str, settings: Settings) -> None:
        self.storage, self.path, self.settings = storage, path, settings
        self.check: pending.MarkerCheck | None = None
        self.failure: AsyncCkptError | None = None

    def then(self, on_layout: Callable[[Snapshot], None]) -> Callable[[Snapshot], None]:
        def layout(snap: Snapshot) -> None:
            try:
                self.check = pending.begin(self.storage, self.path, settings=self.settings)
            except AsyncCkptError as exc:
                self.failure = exc
            try:
                on_layout(snap)
            except BaseException as exc:  # no job will end this save: end it here
                if self.check is not None:
                    pending.finish(self.check, exc)
                raise

        return layout

    def write(self, snap: Snapshot, options: WriteOptions) -> int:
        if self.failure is not None:
            raise self.failure
        check = self.check
        try:
            size = writer_process.write(snap, self.storage, self.path, options, guard=check)
        except BaseException as exc:
            if check is not None:
                pending.finish(check, exc)
            raise
        if check is not None:
            pending.finish(check)
        return size


def stage_and_submit(
    copy: Callable[[Callable[[Snapshot], None]], Snapshot],
    job: Callable[[Snapshot], int],
    label: str,
    started: float,
    target: Any = None,
    *,
    nice: int,
) -> tuple[Snapshot, SaveHandle]:
    """Snapshot a state while its background job already runs: the pipelined save.

    ``copy(on_layout)`` stages the state (``lambda on_layout: stage(obj, overlap,
    on_layout)``); ``on_layout`` submits ``job`` as soon as the arena is leased, so the job
    (a writer reading through ``Snapshot.wait_staged``, as ``write_snapshot`` does) follows
    the copy chunk by chunk where there are cores for it (``pipeline_min_cpus``), and the
    time until durable is the longer of copy and write, not their sum. This returns only
    once the copy is complete, as ``stage`` does.

    The arena is released after the job, and never before the copy has ended: a job that
    fails early (a refused lease, a full disk) must not lend the arena to another save while
    the copy still writes into it. The job may release it sooner once it has read every byte.
    The handle settles only once the caller's blocking time is recorded.

    Args:
        copy: stages the state, calling its argument once the layout is known.
        job: the background part of the save; returns the bytes written.
        label: what the handle reports as its path.
        started: ``time.perf_counter()`` when the caller entered its ``save``.
        target: an identifier of the file written, so loads of it wait for the save.
        nice: the save's ``writer_nice`` (see :func:`submit`).

    Returns:
        The snapshot (complete) and the save's handle.

    Raises:
        Exception: whatever ``copy`` raised. If the copy failed after the job started, the
            job's own failure (the aborted write) is swallowed: the copy's error is the one
            the caller sees, here, once; a job that writes into a versioned root must leave
            no trace of the step (see ``Snapshot.copy_error``).

    Example:
        >>> import torch, tempfile, os, time
        >>> from asyncckpt._storage import resolve
        >>> storage, path = resolve(os.path.join(tempfile.mkdtemp(), "x.ackpt"), None)
        >>> options = write_options("none")
        >>> snap, handle = stage_and_submit(
        ...     lambda on_layout: stage({"w": torch.ones(2)}, on_layout=on_layout),
        ...     lambda snap: write_snapshot(snap, storage, path, options),
        ...     path,
        ...     time.perf_counter(),
        ...     nice=options.settings.writer_nice,
        ... )
        >>> handle.result().stats.raw_bytes
        8
    """
    handles: list[SaveHandle] = []
    copied = threading.Event()

    def run(snap: Snapshot) -> int:
        try:
            return job(snap)
        finally:
            copied.wait()  # the copy has ended, and the caller has recorded its stall
            with contextlib.suppress(Exception):  # a failed device copy is reported elsewhere
                snap.wait_copied()  # overlap: device copies may still land in the arena
            snap.lease.release()

    def start(snap: Snapshot) -> None:
        handles.append(submit(lambda: run(snap), label, snap.raw_bytes, started, target, nice=nice))

    try:
        snap = copy(start)
    except BaseException:
        copied.set()
        for handle in handles:  # the copy failed: its error is raised here, not later
            handle._observed = True
            handle._future.exception()  # the job aborts its file and frees the arena
        raise
    handle = handles[0]
    handle._stats = SaveStats(time.perf_counter() - started, snap.raw_bytes)
    copied.set()
    return snap, handle


def is_file_object(f: object, method: str) -> bool:
    """Whether ``f`` is a file object (not a path or URL) with the method ``method``.

    Example:
        >>> import io
        >>> is_file_object(io.BytesIO(), "write"), is_file_object("x.ackpt", "write")
        (True, False)
    """
    return not isinstance(f, (str, bytes, os.PathLike)) and callable(getattr(f, method, None))


def _save_to_file_object(obj: Any, f: Any, options: WriteOptions, started: float) -> SaveHandle:
    """Snapshot, encode and write ``obj`` into ``f`` now; return a completed handle."""
    writable = getattr(f, "writable", None)
    if (
        not is_file_object(f, "write")
        or isinstance(f, io.TextIOBase)
        or (callable(writable) and not writable())
    ):
        raise TypeError(
            f"expected a path, os.PathLike, fsspec URL or binary file object open for "
            f"writing, got {_stream_label(f)}; open the file with mode 'wb', or pass its path"
        )
    storage = StreamStorage(f)
    snap = stage(obj)
    blocking = time.perf_counter() - started
    try:
        stored = write_snapshot(snap, storage, "", options)
    finally:
        snap.lease.release()
    stats = SaveStats(blocking, snap.raw_bytes, time.perf_counter() - started, stored)
    future: Future[int] = Future()
    future.set_result(stored)
    handle = SaveHandle(storage.describe(""), future, stats, started)
    handle._observed = True  # nothing can fail later: a failure was raised above
    return handle


def _stream_label(f: Any) -> str:
    name = getattr(f, "name", None)
    return name if isinstance(name, str) else f"<{type(f).__name__}>"


class _StreamWriter(AtomicWriter):
    """Writes into a caller's file object; on abort, truncates back where it started."""

    def __init__(self, storage: StreamStorage) -> None:
        self.storage = storage
        self.f = storage.f
        self.start: int | None = None
        with contextlib.suppress(Exception):
            if self.f.seekable():
                self.start = self.f.tell()

    def write(self, data: bytes | memoryview) -> None:
        with errors_as(self.storage, "", "write"):
            view = memoryview(data).cast("B")
            while view:
                n = self.f.write(view)
                # Buffered files write everything or raise; raw files may write less.
                view = view[len(view) if n is None else n :]

    def commit(self) -> None:
        with errors_as(self.storage, "", "flush"):
            self.f.flush()

    def abort(self) -> None:
        if self.start is not None:
            with contextlib.suppress(Exception):
                self.f.seek(self.start)
                self.f.truncate()


class StreamStorage(Storage):
    """A caller's file object seen as one file (path ``""``), for ``save`` and ``load``.

    Reads cover the object from its position when opened to its end; they seek and read
    under a lock, because a load reads chunks from several threads. A stream that cannot
    seek is read into memory first.

    Args:
        f: a binary file object: writable to save into it, readable to load from it.

    Example:
        >>> import io
        >>> storage = StreamStorage(io.BytesIO(b"..abc"))
        >>> storage.size(""), storage.read_range("", 2, 5)
        (5, b'abc')
    """

    process_local = True

    def __init__(self, f: Any) -> None:
        self.f = f
        self.label = _stream_label(f)
        self._lock = threading.Lock()
        self._base: int | None = None
        self._size: int | None = None

    def describe(self, path: str) -> str:
        return self.label

    def open_atomic(self, path: str) -> AtomicWriter:
        return _StreamWriter(self)

    def _measure(self) -> tuple[int, int]:
        if self._base is None or self._size is None:
            with errors_as(self, "", "read"):
                seekable = bool(getattr(self.f, "seekable", lambda: False)())
                if not seekable:  # a pipe or socket: read it all once
                    self.f = io.BytesIO(self.f.read())
                self._base = self.f.tell()
                self._size = self.f.seek(0, io.SEEK_END) - self._base
        return self._base, self._size

    def size(self, path: str) -> int:
        return self._measure()[1]

    def read_range(self, path: str, start: int, length: int) -> bytes:
        base, size = self._measure()
        length = max(0, min(length, size - start))
        parts: list[bytes] = []
        with self._lock, errors_as(self, "", "read"):
            self.f.seek(base + start)
            while length > 0:
                part = self.f.read(length)
                if not part:
                    break
                parts.append(part)
                length -= len(part)
        return b"".join(parts)

    def open_read(self, path: str) -> ReadHandle:
        """The object from its position when first measured to its end, read under the lock
        (the caller's object is the one version there is)."""
        return _StreamHandle(self)

    def exists(self, path: str) -> bool:
        return True

    def delete(self, path: str) -> None:
        raise TypeError("a file object cannot be deleted")

    def create_exclusive(self, path: str, data: bytes) -> None:
        raise TypeError("a file object cannot be created exclusively")

    def list_dir(self, path: str) -> list[str]:
        return []

    def delete_tree(self, path: str) -> None:
        raise TypeError("a file object cannot be deleted")


class _StreamHandle(ReadHandle):
    """A caller's file object, read through its :class:`StreamStorage`."""

    def __init__(self, storage: StreamStorage) -> None:
        super().__init__(storage.describe(""), storage.size(""))
        self.storage = storage

    def read_range(self, start: int, length: int) -> bytes:
        return self.storage.read_range("", start, length)


def _target(storage: Storage, path: str) -> tuple[str, str]:
    return (type(storage).__name__, storage.describe(path))


def wait(timeout: float | None = None) -> None:
    """Block until every pending save of this process is durable.

    Raises:
        CheckpointTimeoutError: some save is still running after ``timeout`` seconds.
        Exception: the first failure among the pending saves, or an earlier unobserved one.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    failure: BaseException | None = None
    for handle in workers.pending():
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        seen = handle._observed
        exc = handle.exception(left)  # marks the handle observed: raise its failure here
        if failure is None and not seen:
            failure = exc
    if failure is not None:
        raise failure
    raise_unobserved_failure()


def _wait_for_writes_to(storage: Storage, path: str) -> None:
    """Wait for this process's saves to ``path``; raise the failure of one nobody saw.

    Returning the old file while swallowing the failure of the save that should have
    replaced it would lose that failure for good.
    """
    target = _target(storage, path)
    for handle in workers.pending():
        if handle.target == target:
            seen = handle.observed
            exc = handle.exception()
            if exc is not None and not seen:
                raise exc


def load(
    f: PathOrUrl | BinaryIO,
    map_location: MapLocation = None,
    pickle_module: Any = None,
    *,
    storage_options: dict[str, Any] | None = None,
    into: Any = None,
    dead_writer: str = "raise",
    weights_only: bool | None = None,
    mmap: bool | None = None,
    max_bytes: int | None = None,
    **pickle_load_args: Any,
) -> Any:
    """Load an object saved by :func:`save`, verifying every checksum. Never unpickles.

    If this process has a save to ``f`` still in flight, the load waits for it first, and
    raises that save's failure if nobody has seen it yet. A save to ``f`` by another
    process that returned before this load began is waited for too (its marker
    ``f.ackpending``; see docs/PROTOCOL.md §8).

    Args:
        f: a local path, ``os.PathLike``, fsspec URL, or a readable binary file object
            (read from its current position to its end).
        map_location: as for ``torch.load``: a device string, ``torch.device``, a dict
            mapping saved locations to new ones, or a callable ``(storage, location)``.
            None (the default) puts CPU tensors on the CPU and accelerator tensors on this
            process's *current* device (unlike ``torch.load``; see the user guide).
        pickle_module: accepted for ``torch.load`` compatibility and ignored.
        storage_options: keyword arguments for the fsspec filesystem of a URL.
        into: an existing state (e.g. ``model.state_dict()``) to load into, in place: each
            saved tensor whose key path matches a tensor there is copied into it (CPU
            tensors of the same shape and dtype are read straight into their memory, with
            no second copy) and the returned object holds those tensors.
        dead_writer: what to do when a save of ``f`` was in flight in a process that is now
            dead (it left its marker): ``"raise"`` ``CheckpointTimeoutError`` (default), or
            ``"load"`` the file as it is, the previous save's state, with a warning: for a
            job resuming after that very process crashed.
        weights_only: accepted and ignored: loading is always as safe as
            ``weights_only=True`` because nothing is unpickled.
        mmap: accepted and ignored: data is checksummed and possibly compressed, so it is
            read into memory rather than mapped.
        max_bytes: at most this many bytes of host memory for the decoded data (the sum of
            the file's storages, all read into fresh buffers); a file that needs more
            raises :class:`~asyncckpt.errors.MemoryBudgetError` before anything is
            allocated. None (the default): no limit besides the one every file has, its
            size times ``MAX_EXPANSION`` (the best a chunk can compress). For files from
            elsewhere.
        **pickle_load_args: the keyword arguments ``torch.load`` passes on to the unpickler
            (``encoding``, ``errors``, ``fix_imports``, ``buffers``; see
            :data:`IGNORED_PICKLE_LOAD_ARGS`): accepted and ignored. Any other keyword is a
            ``TypeError``, as for any function.

    Returns:
        The saved object, with tensors on their target devices.

    Raises:
        CheckpointNotFoundError: no file at ``f``.
        CheckpointTimeoutError: a save of ``f`` by another process is in flight and that
            process is dead (``dead_writer="raise"``): on this machine its pid is gone, or
            its marker has not changed for ``lease_expiry_ms``.
        ChecksumError: a chunk is corrupt (names the chunk and the keys in it).
        FormatError: the file is not a complete asyncckpt file.
        StorageError: the backend failed.
        Exception: a save of this process to ``f`` failed and nobody observed it.
        ValueError: a tensor in ``into`` differs in shape or dtype from the saved one, or
            ``max_bytes`` is negative, or ``dead_writer`` is neither ``"raise"`` nor
            ``"load"``, or ``into`` shares no tensor with the file (its top-level keys are
            named).
        MemoryBudgetError: the file needs more than ``max_bytes`` (a ``FormatError``).
        TypeError: a keyword argument that neither ``load`` nor ``torch.load`` takes.
        DeviceUnavailableError: ``map_location`` names a device this machine does not have
            (checked before anything is read).

    Example:
        >>> import torch, asyncckpt, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"step": 3, "w": torch.arange(2)}, path).result()
        >>> asyncckpt.load(path, map_location="cpu")
        {'step': 3, 'w': tensor([0, 1])}
    """
    _refuse_unknown_keywords(pickle_load_args)
    del pickle_module, weights_only, mmap, pickle_load_args
    budget = Budget(max_bytes)
    if dead_writer not in pending.DEAD_WRITER_CHOICES:
        raise ValueError(
            f"dead_writer must be one of {pending.DEAD_WRITER_CHOICES}, got {dead_writer!r}"
        )
    placement = Placement(map_location)
    storage: Storage
    if isinstance(f, (str, os.PathLike)):
        storage, path = resolve(f, storage_options)
        _wait_for_writes_to(storage, path)
        settings = Settings.resolve()
        pending.wait_for_saves(storage, path, dead_writer, settings=settings)  # other processes
    elif is_file_object(f, "read") and not isinstance(f, io.TextIOBase):
        # From its position to its end, as torch.load reads.
        storage, path = StreamStorage(f), ""
    else:
        raise TypeError(
            f"expected a path, os.PathLike, fsspec URL or binary file object open for "
            f"reading, got {_stream_label(f)}; open the file with mode 'rb', or pass its path"
        )
    threads = config.tunable("threads", None)
    return read_file(
        storage, path, lambda opened: materialize(opened, placement, threads, into, budget), budget
    )


#: The keyword arguments of ``torch.load`` beyond its named parameters that ``load``
#: accepts and ignores: what ``torch.load`` passes on to ``pickle.Unpickler`` (nothing is
#: unpickled here). ``pickle_module``, ``weights_only`` and ``mmap`` are parameters of their
#: own. The user guide's migration table lists them.
IGNORED_PICKLE_LOAD_ARGS = frozenset({"encoding", "errors", "fix_imports", "buffers"})


def _refuse_unknown_keywords(extras: dict[str, Any]) -> None:
    unknown = sorted(set(extras) - IGNORED_PICKLE_LOAD_ARGS)
    if unknown:
        raise TypeError(
            f"load() got an unexpected keyword argument {unknown[0]!r} (besides its own, "
            f"load accepts and ignores only torch.load's {sorted(IGNORED_PICKLE_LOAD_ARGS)})"
        )


#: How long the exit hook waits for worker threads to drop their last task's tensors.
_EXIT_IDLE_WAIT_S = 10.0
#: How long it waits for torch.distributed's own worker threads to finish theirs.
_EXIT_TORCH_QUIET_S = 2.0


@atexit.register
def _finish_at_exit() -> None:
    """Wait for pending saves; report every failure nobody observed, and fail the exit.

    Before the interpreter finalizes, the library's threads and torch.distributed's native
    worker threads are let finish what they hold (``workers.wait_idle``,
    ``workers.wait_torch_threads_quiet``): either, dropping a tensor during finalization,
    aborts the process.

    A failed checkpoint must not look like a successful run: the failures go to stderr
    (the library's logger has no handler by default) and the process exits with status 1.
    ``atexit`` cannot change the exit status, so after printing, the remaining exit hooks
    run here and the process ends with ``os._exit(1)``.
    """
    waiting = workers.pending()
    if waiting:
        log.warning("interpreter exiting: waiting for %d pending checkpoint save(s)", len(waiting))
    for handle in waiting:
        handle._future.exception()  # wait, without marking it observed
    workers.wait_idle(_EXIT_IDLE_WAIT_S)
    workers.wait_torch_threads_quiet(_EXIT_TORCH_QUIET_S)
    with _unobserved_lock:
        failed = [h for h in _unobserved if not h.observed]
    failed += [h for h in waiting if h.failed() and not h.observed and h not in failed]
    if not failed:
        return
    for handle in failed:
        exc = handle._future.exception()
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
