"""Drop-in save markers: a load in any process waits for a save of the same file.

The marker ``<path>.ackpending`` sits beside the file while a drop-in save of it is in
flight: :func:`begin` writes it (a beat of the liveness kernel), :class:`MarkerCheck`
refuses to publish once a later save replaced it, :func:`finish` deletes it,
:func:`wait_for_saves` waits while it exists and its writer is alive (docs/PROTOCOL.md §8).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from asyncckpt import _liveness as liveness
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


#: This process's start time (keyed by pid: a forked child has its own).
_own_start = functools.cache(process_start)


def _new_record(token: str) -> PendingRecord:
    machine, pid = this_machine(), os.getpid()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return PendingRecord(
        token, machine.host, pid, machine.pid_ns, machine.boot, _own_start(pid), 0, started
    )


def writer_gone(record: PendingRecord) -> str | None:
    """Why the process that wrote ``record`` is certainly not writing any more, or None.

    Only a writer on this machine can be judged (docs/PROTOCOL.md §8, step 5); this very
    process is one with no save of that marker in flight (a failed clean-up left it).

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
    token: str | None = None  # None: no save of the file in flight here
    count: int = 0
    record: PendingRecord | None = None
    tag: str | None = None  # what write_marker returned for the marker's current bytes
    beat: liveness.Beat | None = None  # its renewal by the process's heartbeat


_lock = threading.Lock()
_slots: dict[tuple[str, str], _Slot] = {}
_live_tokens: set[str] = set()


@contextlib.contextmanager
def _held_slot(storage: Storage, path: str) -> Iterator[_Slot]:
    """The file's slot, its ``io`` lock held (one dropped while this thread waited for it
    is taken anew). On the way out, a slot with no save in flight is dropped: a file's
    bookkeeping lives as long as its saves (a failed ``begin``'s too), not the process."""
    key = storage.file_key(path)
    while True:
        with _lock:
            slot = _slots.setdefault(key, _Slot())
        with slot.io:
            with _lock:
                current = _slots.get(key) is slot
            if not current:
                continue
            try:
                yield slot
            finally:
                with _lock:
                    if slot.token is None and _slots.get(key) is slot:
                        del _slots[key]
            return


@dataclass(frozen=True)
class MarkerCheck:
    """The publish guard of one save (:data:`asyncckpt._storage.base.PublishGuard`), around
    the step that publishes the data file: under the marker lock, a ConflictError unless
    the marker still carries ``token``. Picklable: the writer process runs it too."""

    storage: Storage
    path: str
    token: str

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        marker = marker_of(self.path)
        with self.storage.marker_lock(marker):
            raw, record = _read(self.storage, marker)
            if record is None or record.token != self.token:
                raise ConflictError(_superseded(self.storage, self.path, raw, record))
            yield


def _superseded(
    storage: Storage, path: str, raw: bytes | None, record: PendingRecord | None
) -> str:
    where = storage.describe(path)
    if record is not None:
        who = _who(record)
        return f"a later save of {where} by {who} superseded this one: {where} was left to it"
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

    A save of ``path`` this process has in flight, its marker still its own, shares it
    with the new one (docs/PROTOCOL.md §8, step 1). It beats every ``lease_renew_ms``.

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
        superseded = slot.beat
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
        slot.token, slot.count = token, 1
        slot.record, slot.tag = record, tag
        renew = functools.partial(_renew, slot, storage, marker, token)
        name = f"the save marker {storage.describe(marker)}"
        slot.beat = liveness.heartbeat().add(name, settings.lease_renew_ms / 1000, renew)
    if superseded is not None:  # outside the slot's lock, which a renewal takes
        superseded.stop()
    return MarkerCheck(storage, path, token)


def _read(storage: Storage, marker: str) -> tuple[bytes | None, PendingRecord | None]:
    raw = storage.read_marker(marker, MAX_PENDING_BYTES)
    return raw, None if raw is None else decode_pending(raw)


def _carries(storage: Storage, marker: str, token: str) -> bool:
    return getattr(_read(storage, marker)[1], "token", None) == token


def finish(check: MarkerCheck, failure: BaseException | None = None) -> None:
    """End one save that :func:`begin` started; delete the marker if it was the last one
    of this process in flight and the marker is still its own. After a failed save (its
    error: ``failure``), a marker that cannot be deleted is only logged and noted on it.

    Raises:
        StorageError: the save succeeded but its marker could not be deleted (loads of the
            file would wait for it, then fail).
    """
    storage, marker = check.storage, marker_of(check.path)
    beat: liveness.Beat | None = None
    try:
        with _held_slot(storage, check.path) as slot:
            if slot.token != check.token:
                return  # superseded: the marker belongs to a later save
            slot.count -= 1
            if slot.count > 0:
                return
            beat, slot.beat = slot.beat, None
            slot.token, slot.record, slot.tag = None, None, None
            try:
                _remove_if_ours(storage, marker, check.token)
            except AsyncCkptError as exc:
                if failure is None:
                    raise StorageError(
                        f"{storage.describe(check.path)} was saved, but its save marker could not "
                        f"be deleted ({exc}); loads of it wait for the marker and then fail: "
                        f"delete {storage.describe(marker)}"
                    ) from exc
                log.warning(
                    "could not delete the save marker %s: %s", storage.describe(marker), exc
                )
                if hasattr(failure, "add_note"):
                    failure.add_note(f"its save marker {storage.describe(marker)} is left: {exc}")
            finally:
                with _lock:
                    _live_tokens.discard(check.token)
    finally:
        if beat is not None:  # outside the slot's lock, which a renewal takes
            beat.stop()


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


def _renew(slot: _Slot, storage: Storage, marker: str, token: str) -> bool:
    """One beat of the marker of save ``token``; False once it ended or was replaced."""
    with slot.io:
        if slot.token != token or slot.record is None:
            return False
        record = replace(slot.record, beat=slot.record.beat + 1)
        try:
            with storage.marker_lock(marker):
                tag = storage.write_marker(marker, encode_pending(record), replacing=slot.tag)
        except ConflictError:
            log.info("%s was replaced by another save; not renewing it", storage.describe(marker))
            return False
        slot.record, slot.tag = record, tag
        return True


@workers.after_fork_in_child
def _forget_after_fork() -> None:
    """In a forked child: the saves in flight and their markers are the parent's (a child
    must never delete them; the heartbeat forgets their beats)."""
    global _lock, _slots, _live_tokens
    _lock = threading.Lock()
    _slots, _live_tokens = {}, set()


# -- loading --------------------------------------------------------------------------------


#: What a load does about a save whose writer died: raise, or load the file as it is.
DEAD_WRITER_CHOICES = ("raise", "load")


def wait_for_saves(
    storage: Storage, path: str, dead_writer: str = "raise", *, settings: Settings
) -> None:
    """Return once no drop-in save of ``path`` is in flight in any process: one read when
    there is no marker, else polled (docs/PROTOCOL.md §8, step 5).

    ``dead_writer`` (one of :data:`DEAD_WRITER_CHOICES`, which ``load`` checks): a save
    whose writer is dead (gone from this machine, or its marker stale for the
    ``lease_expiry_ms`` of ``settings``) raises, or (``"load"``) is logged and this
    returns, so that the file is loaded as it is.

    Raises:
        CheckpointTimeoutError: the saving process is dead (the message names the file,
            the writer, how long this waited and how to clear it).
        StorageError: the marker could not be read.
    """
    if storage.process_local:
        return
    marker = marker_of(path)
    first = [_read(storage, marker)]
    if first[0][0] is None:
        return
    watch = liveness.Staleness(settings.lease_expiry_ms / 1000)
    started = liveness.clock().now()

    def ended() -> bool | None:
        raw, record = first.pop() if first else _read(storage, marker)
        if raw is None:
            return True
        stale = watch.stale_for(marker, raw)  # a beat, or another save: alive
        gone = None if record is None else writer_gone(record)
        if gone is None and stale is not None:
            gone = (
                f"its marker has not changed for {stale:.1f} s (lease_expiry_ms="
                f"{settings.lease_expiry_ms}), so it died, froze or lost its storage"
            )
        if gone is None:
            return None
        message = _gave_up(storage, path, record, gone, liveness.clock().now() - started)
        if dead_writer == "raise":
            raise CheckpointTimeoutError(message)
        log.warning("loading %s as it is: %s", storage.describe(path), message)
        return True

    what = f"a save of {storage.describe(path)} to finish"
    liveness.poll(ended, timeout=None, cap=1.0, watch=watch, what=what)


def _gave_up(
    storage: Storage, path: str, record: PendingRecord | None, why: str, waited: float
) -> str:
    where, marker = storage.describe(path), storage.describe(marker_of(path))
    writer = "an unknown process" if record is None else _who(record)
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
    raw, record = _read(storage, marker_of(path))
    if raw is None:
        return None
    marker = storage.describe(marker_of(path))
    if record is None:
        return f"a save of this file is in flight ({marker} is being rewritten)"
    gone, who = writer_gone(record), f"a save of this file by {_who(record)}"
    if gone is None:
        return f"{who} is in flight ({marker})"
    return (
        f"{who} never finished: its writer is dead ({gone}) and left {marker}; loads of the "
        "file raise until it is saved again or that marker is deleted"
    )


def _who(record: PendingRecord) -> str:
    return f"pid {record.pid} on host {record.host} (started {record.started})"
