"""The writer process's side of a background write, and what the two sides exchange.

The child runs :func:`serve` (see :mod:`asyncckpt._engine.writer_process`), each
:class:`WriteJob` with the job's settings. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import os
import pickle
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncckpt._engine.encode import WriteOptions, write_snapshot
from asyncckpt._format.container import ArrayEntry, TensorEntry
from asyncckpt._storage import Storage
from asyncckpt._storage.base import PublishGuard

#: Tunables the child must not take from the caller: it runs at its own priority already
#: (its threads are not lowered again), and it writes on its own threads.
_CHILD_FIXED: dict[str, int | None] = {"writer_nice": 0, "writer_processes": 0}
_HEADER = struct.Struct("<QI")  # payload length, number of file descriptors
_MAX_FDS = 16
_MAX_CAUSES = 8  # links of a ``raise ... from`` chain sent back with an error
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Channel:
    """Pickled messages, each with optional file descriptors, over a Unix stream socket.

    Pickle is safe here: both ends are this library, joined by an anonymous socket pair
    that no other process can open; nothing read from storage ever passes through it (the
    child only writes). Loading never comes here: readers parse data, never pickles
    (docs/FORMAT.md, R11; ``tests/test_packaging.py`` keeps pickle out of every other module).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, payload: bytes, fds: tuple[int, ...] = ()) -> None:
        header = _HEADER.pack(len(payload), len(fds))
        sent = socket.send_fds(self.sock, [header], list(fds)) if fds else 0
        self.sock.sendall(header[sent:])
        self.sock.sendall(payload)

    def send_message(self, message: Any, fds: tuple[int, ...] = ()) -> None:
        self.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), fds)

    def receive(self) -> tuple[Any, list[int]]:
        """The next message and the descriptors sent with it.

        Raises:
            EOFError: the other end closed the socket (or died).
            UnreadableMessage: the message arrived whole but does not unpickle here.
        """
        head, fds, _, _ = socket.recv_fds(self.sock, _HEADER.size, _MAX_FDS)
        if not head:
            raise EOFError("the socket was closed")
        head += self._exactly(_HEADER.size - len(head))
        length, _ = _HEADER.unpack(head)
        data = self._exactly(length)
        try:
            return pickle.loads(data), fds
        except Exception as exc:
            for fd in fds:
                os.close(fd)
            raise UnreadableMessage(f"{type(exc).__name__}: {exc}") from exc

    def _exactly(self, n: int) -> bytes:
        parts = []
        while n:
            part = self.sock.recv(min(n, 1 << 20))
            if not part:
                raise EOFError("the socket was closed mid-message")
            parts.append(part)
            n -= len(part)
        return b"".join(parts)


class UnreadableMessage(Exception):
    """A whole message that does not unpickle in this process: it names a class this
    process cannot import (one defined in the caller's script, its ``__main__``, or in a
    module not on this process's path). The socket stays usable."""


@dataclass(frozen=True)
class StagedRef:
    """Where one staged storage lies in a shared arena (arena 0: an empty storage)."""

    arena: int
    offset: int
    nbytes: int
    itemsize: int
    is_float: bool
    device: str


@dataclass(frozen=True)
class WriteJob:
    """Everything the child needs for one ``write_snapshot``."""

    storage: Storage
    path: str
    options: WriteOptions
    root: Any
    tensors: list[TensorEntry]
    arrays: list[ArrayEntry]
    storages: list[StagedRef]
    live_arenas: frozenset[int]  # the child unmaps every other arena it holds
    progress: bool
    guard: PublishGuard | None = None  # checked right before the file is published


@dataclass(frozen=True)
class _ChildStaged:
    """One staged storage, as the child sees it: a view of a mapped arena."""

    buffer: memoryview
    itemsize: int
    is_float: bool
    device: str

    @property
    def nbytes(self) -> int:
        return len(self.buffer)

    def view(self) -> memoryview:
        return self.buffer


@dataclass(frozen=True)
class _ChildSnapshot:
    """A staged state the caller copied completely before sending the job."""

    root: Any
    tensors: Sequence[TensorEntry]
    arrays: Sequence[ArrayEntry]
    storages: Sequence[_ChildStaged]

    def wait_staged(self, index: int, end: int) -> None:
        """Nothing to wait for: the caller sends a job once its copy has ended."""

    def copied(self) -> bool:
        return True


def serve(fd: int, parent: int) -> None:
    """The child's main loop on its end ``fd`` of the socket pair: map arenas and run
    writes until the socket closes; exit at once if the caller ``parent`` is gone."""
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    arenas: dict[int, memoryview] = {}
    with socket.socket(fileno=fd) as sock:
        channel = Channel(sock)
        while True:
            try:
                message, fds = channel.receive()
            except UnreadableMessage as exc:
                # Only a job can name the caller's classes: the caller writes it on threads.
                channel.send_message(("unreadable", str(exc)))
                continue
            except (EOFError, OSError):
                return
            if message[0] == "map":
                arenas[message[1]] = _mapped(fds[0], message[2])
            elif message[0] == "write":
                _serve_write(message[1], arenas, channel)


def _serve_write(job: WriteJob, arenas: dict[int, memoryview], channel: Channel) -> None:
    for ident in set(arenas) - job.live_arenas:
        del arenas[ident]  # the caller freed it: unmap
    settings = job.options.settings.replace(**_CHILD_FIXED)
    options = dataclasses.replace(job.options, settings=settings)
    try:
        staged = [_staged(ref, arenas) for ref in job.storages]
        snap = _ChildSnapshot(job.root, job.tensors, job.arrays, staged)
        report = (lambda n: channel.send_message(("progress", n))) if job.progress else None
        size = write_snapshot(snap, job.storage, job.path, options, report, job.guard)
    except Exception as exc:
        channel.send_message(("failed", *_portable(exc)))
    else:
        channel.send_message(("done", size))


def _portable(exc: BaseException) -> tuple[list[bytes | None], str, str]:
    """``exc`` and its causes, each pickled (None if it cannot be), a one-line summary, and
    the traceback. One that pickles but does not unpickle (a custom ``__init__``
    signature) is dropped by the parent's :func:`_unpickled`, which never raises."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    blobs: list[bytes | None] = []
    link: BaseException | None = exc
    while link is not None and len(blobs) < _MAX_CAUSES:
        try:
            blobs.append(pickle.dumps(link, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:
            blobs.append(None)
        link = link.__cause__
    return blobs, f"{type(exc).__qualname__}: {exc}", text


def _mapped(fd: int, size: int) -> memoryview:
    try:
        region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)  # the mapping keeps the memory
    return memoryview(region)


def _staged(ref: StagedRef, arenas: dict[int, memoryview]) -> _ChildStaged:
    data = arenas[ref.arena][ref.offset : ref.offset + ref.nbytes] if ref.arena else b""
    return _ChildStaged(memoryview(data), ref.itemsize, ref.is_float, ref.device)


def _die_with(parent: int) -> None:
    """Ask Linux to kill this process when the caller's process ends; exit if it has."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request above was made
        os._exit(0)
