"""Drop-in save markers: a load in any process waits for a save of the same file.

``asyncckpt.save(obj, path)`` returns before ``path`` is written. So that a ``load(path)``
that begins after that ``save`` returned, in *any* process, gets that save's state or a later
one, a small marker ``<path>.ackpending`` (a
:class:`~asyncckpt._versions.pending_record.PendingRecord`) sits beside the file exactly
while a drop-in save of it is in flight:

* :func:`begin` (``save``, before it returns) writes the marker: one direct write on local
  disk (no temp file, no fsync), one PUT on an object store. A second save of the same
  file by this process while the first is in flight shares the marker.
* A heartbeat thread (one per process) has the marker's ``beat`` rewritten every
  ``lease_renew_ms`` (resolved when the marker is created) while a save is pending, on a
  small pool, so that a store that hangs delays the beats of its own files only.
* :class:`MarkerCheck`, entered by the writer right around the publishing step (the rename;
  the final PUT or CompleteMultipartUpload), refuses to publish if the marker no longer
  carries this save's token: a later save of the file by another process replaced it, and
  the later-starting save wins (this one fails with :class:`~asyncckpt.errors.ConflictError`).
* :func:`finish` (the end of the background job, success or failure) deletes the marker
  if it is still this save's.
* :func:`wait_for_saves` (``load``) polls while a marker exists, and gives up with
  :class:`~asyncckpt.errors.CheckpointTimeoutError` if its writer is dead: at once when the
  writer ran on this machine and its process is gone, else once the marker has not changed
  for ``lease_expiry_ms``.

On local disk every write, check and delete of a marker holds an ``flock`` on the parent
directory (:meth:`Storage.marker_lock`), so a marker written by a later save is never
deleted by an earlier one. Object stores have no such lock; docs/PROTOCOL.md ("Drop-in save
and load across processes") states the window that leaves, and what NFS needs.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from asyncckpt import _threads as workers
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt._versions.pending_record import (
    MAX_PENDING_BYTES,
    PENDING_SUFFIX,
    PendingRecord,
    decode_pending,
    encode_pending,
)
from asyncckpt.errors import AsyncCkptError, CheckpointTimeoutError, ConflictError, StorageError

log = logging.getLogger(__name__)

_POLL_FIRST_S = 0.02
_POLL_MAX_S = 1.0
_LOG_EVERY_S = 60.0
_REMOVE_ATTEMPTS = 3

#: Off only for benchmarks and tests (:func:`disabled`): saves then write no marker.
_enabled = True


def marker_of(path: str) -> str:
    """The path of the save marker of file ``path``.

    Example:
        >>> marker_of("/ckpt/model.ackpt")
        '/ckpt/model.ackpt.ackpending'
    """
    return path + PENDING_SUFFIX


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Saves made inside write no marker (for benchmarks measuring what a marker costs)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


# -- who is writing -------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """What tells this machine and pid namespace apart from others (None: unknown)."""

    host: str
    pid_ns: str | None
    boot: str | None


@functools.cache
def this_machine() -> Machine:
    """This machine's host name, pid namespace and boot id."""
    pid_ns = boot = None
    with contextlib.suppress(OSError):
        pid_ns = os.readlink("/proc/self/ns/pid")
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip() or None
    return Machine(socket.gethostname(), pid_ns, boot)


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot; None if there is no such
    process (or no ``/proc``).

    Example:
        >>> process_start(os.getpid()) is None or process_start(os.getpid()) > 0
        True
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold anything, ")" included.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22, counted from field 3 (the state)
    except (IndexError, ValueError):
        return None


@functools.cache
def _own_start(pid: int) -> int | None:
    """This process's start time (keyed by pid: a forked child has its own)."""
    return process_start(pid)


def _new_record(token: str) -> PendingRecord:
    machine = this_machine()
    pid = os.getpid()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return PendingRecord(
        token, machine.host, pid, machine.pid_ns, machine.boot, _own_start(pid), 0, started
    )


def writer_gone(record: PendingRecord) -> str | None:
    """Why the process that wrote ``record`` is certainly not writing any more, or None.

    Only a writer on this machine (same host name, pid namespace and boot id) can be
    judged: it is gone if its pid no longer exists or now belongs to a process that
    started at another time, or if it is this very process and this process has no save
    of that marker in flight (a marker left by a failed clean-up).

    Example:
        >>> record = _new_record("not-in-flight")
        >>> writer_gone(record) is not None or this_machine().boot is None
        True
    """
    writer = Machine(record.host, record.pid_ns, record.boot)
    if None in (record.pid_ns, record.boot) or writer != this_machine():
        return None
    start = process_start(record.pid)
    if start is None:
        return f"process {record.pid} no longer exists"
    if record.pid_start is not None and start != record.pid_start:
        return f"process {record.pid} has ended (its pid now belongs to another process)"
    if record.pid == os.getpid() and record.token not in _live_tokens:
        return "it is this process, which has no save of the file in flight"
    return None


# -- this process's pending saves -----------------------------------------------------------


@dataclass
class _Slot:
    """This process's saves in flight of one file, and the marker they share."""

    io: threading.Lock = field(default_factory=threading.Lock)  # every marker I/O of the file
    storage: Storage | None = None
    path: str = ""
    token: str | None = None  # None: no save of the file in flight here
    count: int = 0
    record: PendingRecord | None = None
    tag: str | None = None  # what write_marker returned for the marker's current bytes
    beating: bool = False
    renew_s: float = 0.0  # lease_renew_ms, resolved when the marker was created
    due: float = 0.0  # time.monotonic() of the next beat
    busy: bool = False  # a beat of it is queued or running on the beat pool


_lock = threading.Lock()
_slots: dict[tuple[str, str], _Slot] = {}
_live_tokens: set[str] = set()
_heartbeat: threading.Thread | None = None
_wake = threading.Event()  # a marker was created or beaten: the heartbeat recomputes its wait
#: Threads that rewrite markers: a store that hangs (retrying for up to retry_deadline_s)
#: holds up the beats of its own files only, not those of every file.
_BEAT_THREADS = 4


def _slot(storage: Storage, path: str) -> _Slot:
    with _lock:
        return _slots.setdefault(storage.file_key(path), _Slot())


@contextlib.contextmanager
def _held_slot(storage: Storage, path: str) -> Iterator[_Slot]:
    """The file's slot, its ``io`` lock held: the one in :data:`_slots` (a slot dropped
    while this thread waited for its lock is taken anew). On the way out, a slot with no
    save in flight is dropped: a file's bookkeeping lives as long as its saves (a failed
    ``begin`` included), not as long as the process."""
    key = storage.file_key(path)
    while True:
        slot = _slot(storage, path)
        with slot.io:
            with _lock:
                current = _slots.get(key) is slot
            if not current:
                continue
            try:
                yield slot
            finally:
                if slot.token is None:
                    with _lock:
                        if _slots.get(key) is slot:
                            del _slots[key]
            return


@dataclass(frozen=True)
class MarkerCheck:
    """The publish guard of one save (see :data:`asyncckpt._storage.base.PublishGuard`).

    Entered around the step that publishes the data file: holds the marker lock and
    refuses, with ConflictError, unless the marker still carries ``token``. Picklable, so
    that the writer process runs it right before its own rename.
    """

    storage: Storage
    path: str
    token: str

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        marker = marker_of(self.path)
        with self.storage.marker_lock(marker):
            raw = self.storage.read_marker(marker, MAX_PENDING_BYTES)
            record = None if raw is None else decode_pending(raw)
            if record is None or record.token != self.token:
                raise ConflictError(_superseded(self.storage, self.path, raw, record))
            yield


def _superseded(
    storage: Storage, path: str, raw: bytes | None, record: PendingRecord | None
) -> str:
    where = storage.describe(path)
    if record is not None:
        return (
            f"a later save of {where} by pid {record.pid} on host {record.host} superseded "
            f"this one: {where} was left to that save"
        )
    if raw is None:
        return (
            f"a later save of {where} by another process superseded this one and has "
            f"finished (or {storage.describe(marker_of(path))} was deleted by hand): "
            f"{where} was left to that save"
        )
    return (
        f"another save of {where} replaced this one's marker (unreadable now): {where} was "
        "not replaced"
    )


def begin(storage: Storage, path: str, *, settings: Settings) -> MarkerCheck | None:
    """Write the marker of a save of ``path`` that is starting (before ``save`` returns).

    If this process already has a save of ``path`` in flight whose marker is still its
    own, the new save shares that marker (saves of one process run in order: the marker
    stays until the last of them ends). The marker beats every ``lease_renew_ms`` of
    ``settings``.

    Returns:
        The save's publish guard (pass it to the write, then to :func:`finish`); None
        where no marker is kept (files in this process's memory, or markers disabled).

    Raises:
        StorageError: the marker could not be written (the save cannot start).
    """
    if not _enabled or storage.process_local:
        return None
    marker = marker_of(path)
    with _held_slot(storage, path) as slot, storage.marker_lock(marker):
        if slot.token is not None and _carries(storage, marker, slot.token):
            slot.count += 1
            return MarkerCheck(storage, path, slot.token)
        token = uuid.uuid4().hex
        record = _new_record(token)
        with _lock:
            _live_tokens.add(token)  # before the write: a load here may see it at once
        try:
            tag = storage.write_marker(marker, encode_pending(record))
        except BaseException:
            with _lock:
                _live_tokens.discard(token)
            raise
        with _lock:
            if slot.token is not None:
                _live_tokens.discard(slot.token)  # superseded by another process
        slot.storage, slot.path, slot.token, slot.count = storage, path, token, 1
        slot.record, slot.tag, slot.beating = record, tag, True
        slot.renew_s = settings.lease_renew_ms / 1000
        slot.due = time.monotonic() + slot.renew_s
    _start_heartbeat()
    return MarkerCheck(storage, path, token)


def _carries(storage: Storage, marker: str, token: str) -> bool:
    raw = storage.read_marker(marker, MAX_PENDING_BYTES)
    record = None if raw is None else decode_pending(raw)
    return record is not None and record.token == token


def finish(check: MarkerCheck, failure: BaseException | None = None) -> None:
    """End one save that :func:`begin` started; delete the marker if it was the last one
    of this process in flight and the marker is still its own.

    ``failure`` is the save's error, if it failed: then a marker that cannot be deleted is
    only logged (and noted on ``failure``), since the save's own error is what matters.

    Raises:
        StorageError: the save succeeded but its marker could not be deleted (loads of the
            file would wait for it, then fail).
    """
    storage, marker = check.storage, marker_of(check.path)
    with _held_slot(storage, check.path) as slot:
        if slot.token != check.token:
            return  # superseded: the marker belongs to a later save
        slot.count -= 1
        if slot.count > 0:
            return
        slot.token, slot.record, slot.tag, slot.beating = None, None, None, False
        try:
            _remove_if_ours(storage, marker, check.token)
        except AsyncCkptError as exc:
            if failure is None:
                raise StorageError(
                    f"{storage.describe(check.path)} was saved, but its save marker could not "
                    f"be deleted ({exc}); loads of it wait for the marker and then fail: "
                    f"delete {storage.describe(marker)}"
                ) from exc
            log.warning("could not delete the save marker %s: %s", storage.describe(marker), exc)
            if hasattr(failure, "add_note"):
                failure.add_note(f"its save marker {storage.describe(marker)} is left: {exc}")
        finally:
            with _lock:
                _live_tokens.discard(check.token)
            _wake.set()  # the heartbeat ends if this was the last save in flight


def _remove_if_ours(storage: Storage, marker: str, token: str) -> None:
    """Delete ``marker`` if it carries ``token``, retrying a failed request a few times."""
    for attempt in range(_REMOVE_ATTEMPTS):
        try:
            with storage.marker_lock(marker):
                if _carries(storage, marker, token):
                    storage.delete(marker)
            return
        except AsyncCkptError:
            if attempt == _REMOVE_ATTEMPTS - 1:
                raise


# -- the heartbeat --------------------------------------------------------------------------


def _start_heartbeat() -> None:
    """Start the process's heartbeat thread if it is not running; wake it up."""
    global _heartbeat
    with _lock:
        if _heartbeat is None or not _heartbeat.is_alive():
            _heartbeat = threading.Thread(
                target=_beat_forever, name="asyncckpt-marker", daemon=True
            )
            _heartbeat.start()
    _wake.set()


def _beat_forever() -> None:
    """Hand each marker that is due to the beat pool; sleep until the next one is due.
    Ends once no save is in flight here (the next :func:`begin` starts another): decided
    under the lock that :func:`_start_heartbeat` checks, after ``begin`` set its token."""
    global _heartbeat
    while True:
        now = time.monotonic()
        with _lock:
            if not any(s.token is not None for s in _slots.values()):
                if _heartbeat is threading.current_thread():
                    _heartbeat = None
                return
            slots = [s for s in _slots.values() if s.token is not None and s.beating]
        for slot in slots:
            if slot.due <= now and not slot.busy:
                slot.busy = True
                workers.pool("marker-beats", _BEAT_THREADS).submit(_beat_when_due, slot)
        waiting = [s.due for s in slots if not s.busy]
        _wake.wait(None if not waiting else max(0.001, min(waiting) - now))
        _wake.clear()


def _beat_when_due(slot: _Slot) -> None:
    try:
        with slot.io:
            if slot.token is not None and slot.beating:
                _beat(slot)
                slot.due = time.monotonic() + slot.renew_s
    finally:
        slot.busy = False
        _wake.set()


def beat_all() -> int:
    """Rewrite the marker of every save in flight here with its next beat, now, in the
    calling thread (the heartbeat thread beats each one every ``lease_renew_ms``, on a
    small pool); returns how many were rewritten.

    A marker found replaced by another process is not beaten again: its saves fail at
    their check. A failed rewrite is logged; the next beat tries again.
    """
    with _lock:
        slots = list(_slots.values())
    done = 0
    for slot in slots:
        with slot.io:
            if slot.token is not None and slot.beating:
                done += _beat(slot)
    return done


def _beat(slot: _Slot) -> int:
    storage, record = slot.storage, slot.record
    assert storage is not None and record is not None
    marker = marker_of(slot.path)
    record = replace(record, beat=record.beat + 1)
    try:
        with storage.marker_lock(marker):
            tag = storage.write_marker(marker, encode_pending(record), replacing=slot.tag)
    except ConflictError:
        slot.beating = False
        log.info("%s was replaced by another save; not renewing it", storage.describe(marker))
        return 0
    except Exception as exc:  # a missed beat only lets loaders give up sooner
        log.warning("could not renew the save marker %s: %s", storage.describe(marker), exc)
        return 0
    slot.record, slot.tag = record, tag
    return 1


def _forget_after_fork() -> None:
    """In a forked child: the saves in flight, their markers and the heartbeat are the
    parent's (a child must never delete or renew them)."""
    global _lock, _slots, _live_tokens, _heartbeat, _wake
    _lock = threading.Lock()
    _slots, _live_tokens, _heartbeat, _wake = {}, set(), None, threading.Event()


workers.after_fork_in_child(_forget_after_fork)


# -- loading --------------------------------------------------------------------------------


#: What a load does about a save whose writer died: raise, or load the file as it is.
DEAD_WRITER_CHOICES = ("raise", "load")


def wait_for_saves(
    storage: Storage, path: str, dead_writer: str = "raise", *, settings: Settings
) -> None:
    """Return once no drop-in save of ``path`` is in flight in any process.

    One read of the marker when there is none (the common case). While there is one, it
    is read again with backoff (20 ms doubling to 1 s, with jitter).

    ``dead_writer``: ``"raise"``: a save whose writer is dead raises; ``"load"``: it is
    logged (a warning) and this returns, so that the file is loaded as it is (the previous
    save's state): for a job resuming after that very writer crashed. A marker unchanged
    for the ``lease_expiry_ms`` of ``settings`` is a dead writer's.

    Raises:
        CheckpointTimeoutError: the saving process is dead: it ran on this machine and is
            gone, or its marker has not changed for ``lease_expiry_ms``. The message names
            the file, the writer and how long this waited, and how to clear it.
        StorageError: the marker could not be read.
        ValueError: ``dead_writer`` is not one of :data:`DEAD_WRITER_CHOICES`.
    """
    if dead_writer not in DEAD_WRITER_CHOICES:
        raise ValueError(f"dead_writer must be one of {DEAD_WRITER_CHOICES}, got {dead_writer!r}")
    if storage.process_local:
        return
    marker = marker_of(path)
    raw = storage.read_marker(marker, MAX_PENDING_BYTES)
    if raw is None:
        return
    started = changed = next_log = time.monotonic()
    next_log += _LOG_EVERY_S
    expiry = settings.lease_expiry_ms / 1000
    delay, seen = _POLL_FIRST_S, raw
    while raw is not None:
        record = decode_pending(raw)
        now = time.monotonic()
        if raw != seen:  # rewritten (a beat, or another save): the writer is alive
            seen, changed = raw, now
        gone = None if record is None else writer_gone(record)
        if gone is None and now - changed >= expiry:
            gone = (
                f"its marker has not changed for {now - changed:.1f} s (lease_expiry_ms="
                f"{settings.lease_expiry_ms}), so it died, froze or lost its storage"
            )
        if gone is not None:
            message = _gave_up(storage, path, record, gone, now - started)
            if dead_writer == "raise":
                raise CheckpointTimeoutError(message)
            log.warning("loading %s as it is: %s", storage.describe(path), message)
            return
        if now >= next_log:
            log.info("still waiting for a save of %s to finish", storage.describe(path))
            next_log = now + _LOG_EVERY_S
        pause = delay * (0.5 + random.random())
        time.sleep(max(0.0, min(pause, changed + expiry - now)))
        delay = min(delay * 2, _POLL_MAX_S)
        raw = storage.read_marker(marker, MAX_PENDING_BYTES)


def _gave_up(
    storage: Storage, path: str, record: PendingRecord | None, why: str, waited: float
) -> str:
    where, marker = storage.describe(path), storage.describe(marker_of(path))
    writer = "an unknown process"
    if record is not None:
        writer = f"pid {record.pid} on host {record.host} (started {record.started})"
    try:
        previous = "the previous save's state" if storage.exists(path) else "nothing yet"
        holds = f"{where} holds {previous}"
    except AsyncCkptError:
        holds = f"{where} holds whatever an earlier save left"
    return (
        f"gave up loading {where} after waiting {waited:.1f} s for its save by {writer}: "
        f"{why}. {holds}; to clear this, save {where} again (a new save replaces the "
        f"marker) or delete {marker}"
    )


def describe_pending(storage: Storage, path: str) -> str | None:
    """A line about the save of ``path`` in flight, if its marker exists (for the CLI).

    Example:
        >>> from asyncckpt._storage import LocalStorage
        >>> describe_pending(LocalStorage(), "/nonexistent/model.ackpt") is None
        True
    """
    if storage.process_local:
        return None
    raw = storage.read_marker(marker_of(path), MAX_PENDING_BYTES)
    if raw is None:
        return None
    record = decode_pending(raw)
    marker = storage.describe(marker_of(path))
    if record is None:
        return f"a save of this file is in flight ({marker} is being rewritten)"
    gone = writer_gone(record)
    who = (
        f"a save of this file by pid {record.pid} on host {record.host}, started {record.started},"
    )
    if gone is None:
        return f"{who} is in flight ({marker})"
    return (
        f"{who} never finished: its writer is dead ({gone}) and left {marker}; loads of the "
        "file raise until it is saved again or that marker is deleted"
    )
