"""Drop-in ``save``/``load``/``wait``/``reserve`` beside ``torch.save``/``torch.load``.

The handle and the job runtime are in :mod:`asyncckpt._api.jobs`, the copy into host
memory in :mod:`asyncckpt._api.staging`, a caller's file object as a storage in
:mod:`asyncckpt._storage.stream`.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Collection
from concurrent.futures import CancelledError
from typing import Any, BinaryIO

from asyncckpt._api import jobs
from asyncckpt._api.jobs import SaveHandle, SaveInfo, SaveStats, completed_handle, stage_and_submit
from asyncckpt._api.staging import reserve_arena, stage, write_options
from asyncckpt._device import MapLocation, Placement
from asyncckpt._engine import writer_process
from asyncckpt._engine.decode import Budget, OpenedFile, materialize, open_file, read_file
from asyncckpt._engine.decode_lazy import LazyCheckpoint
from asyncckpt._engine.encode import WriteOptions, write_snapshot
from asyncckpt._engine.snapshot import Snapshot
from asyncckpt._settings import Settings, SettingsArg
from asyncckpt._storage import Storage, resolve
from asyncckpt._storage.stream import StreamStorage, is_file_object, stream_label
from asyncckpt._versions import loading, paths, pending
from asyncckpt._versions.reading import LoadRequest, RootReader
from asyncckpt.errors import AsyncCkptError, AsyncCkptWarning, PathKindError

#: Re-exported: the public names of handles, and what integrations stage with.
__all__ = ["SaveHandle", "SaveInfo", "SaveStats", "load", "reserve", "save", "stage", "wait"]
__all__ += ["open_checkpoint", "write_options"]

log = logging.getLogger(__name__)
PathOrUrl = str | os.PathLike[str]


def reserve(state_or_nbytes: Any, *, settings: SettingsArg = None) -> threading.Thread | None:
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
        settings: tunables for this call (see the user guide's "Tunables"): an
            :class:`asyncckpt.Settings`, or a dict such as ``{"threads": 4}`` over the
            ``ASYNCCKPT_*`` environment variables; None: the environment.

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
    return reserve_arena(state_or_nbytes, Settings.of(settings))


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
    settings: SettingsArg = None,
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
        settings: tunables for this call (see the user guide's "Tunables"): an
            :class:`asyncckpt.Settings`, or a dict such as ``{"threads": 4}`` over the
            ``ASYNCCKPT_*`` environment variables; None: the environment.

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
    del pickle_module, pickle_protocol, _use_new_zipfile_serialization, _disable_byteorder_record
    started = time.perf_counter()
    resolved = Settings.of(settings)
    jobs.raise_unobserved_failure()
    options = write_options(compression, resolved)
    if not isinstance(f, (str, os.PathLike)):
        return _save_to_file_object(obj, f, options, started)
    storage, path = resolve(f, storage_options, resolved)
    storage.check_writable(path)  # a read-only store fails here, as torch.save would
    marker = _MarkerStart(storage, path, options.settings)
    _, handle = stage_and_submit(
        lambda on_layout: stage(obj, options, on_layout=marker.then(on_layout)),
        lambda snap: marker.write(snap, options),
        storage.describe(path),
        started,
        storage.file_key(path),
        on_cancel=marker.cancel,
        nice=options.settings.writer_nice,
    )
    return handle


class _MarkerStart:
    """A drop-in save's marker (:mod:`asyncckpt._versions.pending`, docs/PROTOCOL.md §8):
    one that cannot be written fails the save's handle, as a failed write would."""

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
                self.finish(exc)
                raise

        return layout

    def cancel(self) -> None:
        """The save was cancelled before its write started: end its marker."""
        self.finish(CancelledError())

    def finish(self, failure: BaseException | None = None) -> None:
        if self.check is not None:
            pending.finish(self.check, failure)

    def write(self, snap: Snapshot, options: WriteOptions) -> int:
        if self.failure is not None:
            raise self.failure
        try:
            job = jobs.running_job()
            progress = None if job is None else job._note_written
            size = writer_process.write(
                snap, self.storage, self.path, options, progress, self.check
            )
        except BaseException as exc:
            self.finish(exc)
            raise
        self.finish()
        return size


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
            f"writing, got {stream_label(f)}; open the file with mode 'wb', or pass its path"
        )
    storage = StreamStorage(f)
    snap = stage(obj, options, in_this_process=True)
    blocking = time.perf_counter() - started
    try:
        stored = write_snapshot(snap, storage, "", options)
    finally:
        snap.release()
    stats = SaveStats(blocking, snap.raw_bytes, time.perf_counter() - started, stored)
    return completed_handle(storage.describe(""), stats)  # a failure was raised above


def wait(timeout: float | None = None) -> None:
    """Block until every pending save of this process is durable.

    Raises:
        CheckpointTimeoutError: some save is still running after ``timeout`` seconds.
        Exception: the first failure among the pending saves, or an earlier unobserved one.
    """
    jobs.wait(jobs.ANY, timeout)


def _wait_for_writes_to(storage: Storage, path: str) -> None:
    """Wait for this process's saves to ``path``; raise the failure of one nobody saw.

    Returning the old file while swallowing the failure of the save that should have
    replaced it would lose that failure for good.
    """
    target = storage.file_key(path)
    # Not only the saves still running: one that already failed, unobserved, counts too.
    for handle in jobs.tracked(jobs.ANY):
        if handle.target == target and not handle.cancelled():
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
    keys: Collection[Any] | None = None,
    dead_writer: str = "raise",
    weights_only: bool | None = None,
    mmap: bool | None = None,
    max_bytes: int | None = None,
    settings: SettingsArg = None,
    **pickle_load_args: Any,
) -> Any:
    """Load an object saved by :func:`save`, verifying every checksum. Never unpickles.

    If this process has a save to ``f`` still in flight, the load waits for it first, and
    raises that save's failure if nobody has seen it yet. A save to ``f`` by another
    process that returned before this load began is waited for too (its marker
    ``f.ackpending``; see docs/PROTOCOL.md §8).

    Args:
        f: a local path, ``os.PathLike``, fsspec URL, or a readable binary file object
            (read from its current position to its end). A path may also name a
            Checkpointer root (its newest committed version), ``ROOT@STEP`` (that
            version), a Hugging Face run's ``output_dir`` or ``checkpoint-N`` folder, or a
            folder holding one checkpoint, as the command line reads them
            (:mod:`asyncckpt._versions.paths`).
        map_location: as for ``torch.load``: a device string, ``torch.device``, a dict
            mapping saved locations to new ones, or a callable ``(storage, location)``.
            None (the default) puts CPU tensors on the CPU and accelerator tensors on this
            process's *current* device (unlike ``torch.load``; see the user guide).
        pickle_module: accepted for ``torch.load`` compatibility and ignored.
        storage_options: keyword arguments for the fsspec filesystem of a URL.
        into: an existing state (e.g. ``model.state_dict()``) to load into, in place: each
            saved tensor whose key path matches a tensor there is copied into it (CPU
            tensors of the same shape and dtype are read straight into their memory, with
            no second copy) and the returned object holds those tensors. If the file holds
            a dict, only the top-level entries ``into`` has are read (and those that hold
            no tensor or array, such as a step count): the rest, e.g. ``"optim"`` for
            ``into={"model": ...}``, is neither read nor returned.
        keys: top-level keys of the saved dict to load (e.g. ``["model"]``); only their
            chunks are read and the result is the dict of those keys. None: all of it.
        dead_writer: what to do when a save of ``f`` was in flight in a process that is now
            dead (it left its marker): ``"raise"`` ``CheckpointTimeoutError`` (default), or
            ``"load"`` the file as it is, the previous save's state, with a warning: for a
            job resuming after that very process crashed.
        weights_only: accepted and ignored: loading is always as safe as
            ``weights_only=True`` because nothing is unpickled.
        mmap: not honoured (data is checksummed and possibly compressed, so it is read
            into memory rather than mapped): ``mmap=True`` warns once per process
            (:class:`~asyncckpt.errors.AsyncCkptWarning`) and loads into memory.
        max_bytes: at most this many bytes of host memory for the decoded data (the sum of
            the file's storages, all read into fresh buffers); a file that needs more
            raises :class:`~asyncckpt.errors.MemoryBudgetError` before anything is
            allocated. None (the default): no limit besides the one every file has, its
            size times ``MAX_EXPANSION`` (the best a chunk can compress). For files from
            elsewhere.
        settings: tunables for this call (see the user guide's "Tunables"): an
            :class:`asyncckpt.Settings`, or a dict such as ``{"threads": 4}`` over the
            ``ASYNCCKPT_*`` environment variables; None: the environment.
        **pickle_load_args: the keyword arguments ``torch.load`` passes on to the unpickler
            (``encoding``, ``errors``, ``fix_imports``, ``buffers``; see
            :data:`IGNORED_PICKLE_LOAD_ARGS`): accepted and ignored. Any other keyword is a
            ``TypeError``, as for any function.

    Returns:
        The saved object, with tensors on their target devices.

    Raises:
        CheckpointNotFoundError: no file at ``f`` (or ``ROOT@STEP`` is not committed, or
            a folder holds no checkpoint).
        PathKindError: ``f`` is a folder of several checkpoints or an ``asyncckpt.dcp``
            directory, or ``NAME@STEP`` names both an existing path and a version of root
            ``NAME`` (the message names what is there).
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
        MissingKeyError: a key of ``keys`` is not a top-level key of the file (a
            ``KeyError``; the message lists the file's keys).
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
    if mmap:
        warn_mmap_once()
    del pickle_module, weights_only, mmap, pickle_load_args
    budget = Budget(max_bytes)
    placement = Placement(map_location)
    resolved = Settings.of(settings)  # an entry point: once, here (argument > environment)
    source = _load_source(f, storage_options, dead_writer, resolved)
    if isinstance(source, paths.Target):  # ROOT, ROOT@STEP, a Hugging Face run
        step, commit = paths.version_of(source)
        request = LoadRequest(
            placement,
            resolved,
            into=into,
            keys=keys,
            max_bytes=max_bytes,
            follow_latest=source.step is None,
        )
        return loading.load(RootReader(source.storage, source.path), step, commit, request)
    storage, path = source

    def work(opened: OpenedFile) -> Any:
        return materialize(opened, placement, resolved, into, budget, keys=keys)

    return read_file(storage, path, work, budget)


def open_checkpoint(
    f: PathOrUrl | BinaryIO,
    map_location: MapLocation = None,
    *,
    storage_options: dict[str, Any] | None = None,
    dead_writer: str = "raise",
    settings: SettingsArg = None,
) -> LazyCheckpoint:
    """Open a saved dict for reading one top-level key at a time (``asyncckpt.open``).

    Like safetensors' ``safe_open``: opening reads only the manifest (keys, shapes and
    dtypes: ``tensors()``); ``ckpt[key]`` reads and verifies that entry's chunks. The file
    is held open (one handle, pinned) until the mapping is closed: use it as a context
    manager. A save to ``f`` in flight is waited for first, as :func:`load` does.

    Args:
        f: a local path, ``os.PathLike``, fsspec URL (or a root, ``ROOT@STEP`` ... as
            for :func:`load`), or a readable binary file object.
        map_location: as for :func:`load`.
        storage_options: keyword arguments for the fsspec filesystem of a URL.
        dead_writer: as for :func:`load`.
        settings: as for :func:`load`.

    Returns:
        A read-only :class:`~collections.abc.Mapping` of the file's top-level keys.

    Raises:
        CheckpointNotFoundError: no file at ``f``.
        FormatError: the file is not a complete asyncckpt file.
        AsyncCkptError: the file does not hold a dict.
        MissingKeyError: (on ``ckpt[key]``) a key the file does not have.

    Example:
        >>> import torch, asyncckpt, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.ackpt")
        >>> _ = asyncckpt.save({"model": {"w": torch.ones(2)}, "step": 3}, path).result()
        >>> with asyncckpt.open(path) as ckpt:
        ...     print(list(ckpt), ckpt.tensors(), ckpt["model"]["w"])
        ['model', 'step'] {"state['model']['w']": (torch.Size([2]), torch.float32)} tensor([1., 1.])
    """
    placement = Placement(map_location)
    resolved = Settings.of(settings)  # an entry point: once, here
    source = _load_source(f, storage_options, dead_writer, resolved)
    if isinstance(source, paths.Target):  # ROOT, ROOT@STEP, a Hugging Face run
        step, _ = paths.version_of(source)
        opened = RootReader(source.storage, source.path).open(step)
        return LazyCheckpoint(opened, placement, resolved)
    storage, path = source
    return LazyCheckpoint(open_file(storage, path), placement, resolved)


_mmap_warned = threading.Event()


def warn_mmap_once() -> None:
    """Say once per process that ``mmap=True`` is not honoured (never ignore it silently)."""
    if _mmap_warned.is_set():
        return
    _mmap_warned.set()
    warnings.warn(
        "asyncckpt.load ignores mmap=True: every chunk is checksummed (and may be "
        "compressed), so tensors are read into memory, not mapped from the file. To read "
        "less, load only what you need: keys=[...], or asyncckpt.open(path) for one entry "
        "at a time",
        AsyncCkptWarning,
        stacklevel=3,
    )


def _load_source(
    f: PathOrUrl | BinaryIO,
    storage_options: dict[str, Any] | None,
    dead_writer: str,
    settings: Settings,
) -> tuple[Storage, str] | paths.Target:
    """The storage and path a load reads, once this and other processes' saves to it are
    done (a file object: from its position); or the checkpoint root the path names
    (:func:`asyncckpt._versions.paths.find`). Raises as :func:`load` says."""
    if dead_writer not in pending.DEAD_WRITER_CHOICES:
        raise ValueError(
            f"dead_writer must be one of {pending.DEAD_WRITER_CHOICES}, got {dead_writer!r}"
        )
    if isinstance(f, (str, os.PathLike)):
        target = paths.find(f, storage_options, settings)
        if target.kind == paths.FOLDER:
            target = paths.one_checkpoint(target)
        if target.kind == paths.ROOT:
            return target
        if target.kind == paths.DCP:
            raise PathKindError(
                f"{target.name} is an asyncckpt.dcp directory (one sharded checkpoint): load "
                "it with torch.distributed.checkpoint.load(state, storage_reader="
                "asyncckpt.dcp.Reader(...)), or make one file of it with 'asyncckpt convert'"
            )
        storage, path = target.storage, target.path  # a file, or nothing yet: saves may come
        _wait_for_writes_to(storage, path)
        pending.wait_for_saves(storage, path, dead_writer, settings=settings)  # other processes
        return storage, path
    if is_file_object(f, "read") and not isinstance(f, io.TextIOBase):
        return StreamStorage(f), ""
    raise TypeError(
        f"expected a path, os.PathLike, fsspec URL or binary file object open for "
        f"reading, got {stream_label(f)}; open the file with mode 'rb', or pass its path"
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
