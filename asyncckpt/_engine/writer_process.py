"""Background writes in a child process, so that they never take the caller's GIL.

With ``writer_processes=1`` (the default), a save stages its state into a shared-memory
arena (a memfd) and its background job sends the layout, storage and options over a Unix
socket (with each arena's memfd the first time); the child maps the arena, runs
:func:`asyncckpt._engine.encode.write_snapshot` and answers with the file's size or the
error. The caller's save thread only waits on the socket, which releases the GIL: with
threads, the writer's Python parts take it at every switch interval, and GIL time is stall
where kernel launches are Python.

The copy into the arena stays in the caller's process, and for a versioned root the commit,
the lease and its heartbeat, and retention: a lease must belong to the process that holds
the training state.

The child
  * is started by a dedicated thread on first need, off the caller's path; it imports no
    torch (about 0.2 CPU-seconds and 50 MB resident, against 2-3 s and 300 MB), and runs
    ``writer_nice`` below the caller's main thread, as the writer threads would;
  * dies with the caller's process (``PR_SET_PDEATHSIG``): a write must not outlive the
    process whose lease and snapshot it carries; it runs in a session of its own and
    ignores ``SIGINT``, so a signal to the caller's process group (torchrun's ``killpg``,
    SLURM, a Ctrl-C) is the caller's to handle: with ``on_preemption()`` the write in
    flight finishes and commits;
  * runs one write at a time; if it dies, that write fails with
    :class:`~asyncckpt.errors.WriterProcessError` (the target untouched, the temp file
    removed) and the next save starts a new child;
  * takes its tunables from each job, never from its environment (started without the
    caller's ``ASYNCCKPT_*``).

A write stays on this process's threads when the child could not do it: a storage living in
this process's memory (``memory://``, a file object), one that cannot be pickled or whose
classes the child cannot import (defined in the caller's ``__main__``: the child answers so,
and lives on), an arena not in shared memory, or no memfd. That is said once per reason: a
warning if the caller set ``writer_processes``, a debug message if it is the default.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from asyncckpt import _cpu as cpu
from asyncckpt import _threads as workers
from asyncckpt._engine import arena
from asyncckpt._engine.encode import WriteOptions, write_snapshot
from asyncckpt._engine.snapshot import SnapshotFailedError
from asyncckpt._engine.writer_child import Channel, StagedRef, UnreadableMessage, WriteJob
from asyncckpt._settings import ENV_PREFIX, Settings
from asyncckpt._storage import Storage
from asyncckpt._storage.base import TEMP_MARK, PublishGuard
from asyncckpt.errors import WriterProcessError

if TYPE_CHECKING:
    from asyncckpt._engine.snapshot import Snapshot

log = logging.getLogger(__name__)

#: The child's entry point: lower its priority before anything starts a thread (threads,
#: such as a BLAS pool started at import, inherit it), then import the writer as a module
#: of this very package (``PYTHONPATH`` leads with its directory, see
#: :func:`_child_environ`).
_CHILD_MAIN = """
import os, sys
try:
    os.setpriority(os.PRIO_PROCESS, 0, int(sys.argv[2]))
except (AttributeError, OSError):
    pass
from asyncckpt._engine.writer_child import serve
serve(int(sys.argv[1]), int(sys.argv[3]))
"""
_EXIT_WAIT_S = 5.0  # how long to wait for a dead child's exit status


class JobUnreadable(Exception):
    """The writer process could not unpickle a job (it wrote nothing): the job names a
    class that process cannot import, such as a filesystem defined in the caller's script."""


class WriterProcess:
    """A child process running background writes, one at a time, ``nice`` steps below the
    calling process's main thread; :func:`write` starts it and falls back to threads.

    Raises:
        WriterProcessError: the child could not be started.
    """

    def __init__(self, nice: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            argv = [sys.executable, "-c", _CHILD_MAIN, str(theirs.fileno())]
            argv += [str(_niceness_below_main(nice)), str(os.getpid())]
            # Its own session (see the module docstring), not just a group: no
            # controlling terminal to stop it (SIGTTOU) or hang it up.
            self.process = subprocess.Popen(
                argv,
                pass_fds=(theirs.fileno(),),
                env=_child_environ(),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            raise WriterProcessError(f"could not start the writer process: {exc}") from exc
        finally:
            theirs.close()
        self.pid = self.process.pid
        self.jobs = 0  # writes this child has finished, successfully or not
        self.lost: str | None = None  # why this child can no longer write
        self._channel = Channel(ours)
        self._mapped: set[int] = set()
        self._lock = threading.Lock()

    def write(
        self,
        payload: bytes,
        job: WriteJob,
        where: str,
        progress: Callable[[int], None] | None,
    ) -> int:
        """Have the child run ``job`` (pickled as ``payload``; ``where`` names its file);
        return the file's size.

        Raises:
            WriterProcessError: the child died (or had died) before answering.
            JobUnreadable: the child cannot unpickle ``payload``; it wrote nothing.
            Exception: whatever the write raised in the child.
        """
        with self._lock:
            if self.lost is not None:
                raise WriterProcessError(self.lost)
            try:
                answer = self._exchange(payload, job, progress)
            except (EOFError, OSError, UnreadableMessage) as exc:
                self.jobs += 1
                raise WriterProcessError(self._lose(where)) from exc
            if answer[0] == "unreadable":
                raise JobUnreadable(answer[1])
            self.jobs += 1
        if answer[0] == "done":
            return int(answer[1])
        raise _rebuilt(answer, self.pid, where)

    def close(self) -> None:
        """Close the socket: the child exits once it sees that."""
        with contextlib.suppress(OSError):
            self._channel.sock.close()

    def _exchange(
        self, payload: bytes, job: WriteJob, progress: Callable[[int], None] | None
    ) -> tuple[Any, ...]:
        regions = {r.ident: r for r in arena.shared_regions()}
        self._mapped &= set(regions)
        for ident in {ref.arena for ref in job.storages} - self._mapped - {0}:
            region = regions[ident]
            self._channel.send_message(("map", ident, region.size), (region.fd,))
            self._mapped.add(ident)
        self._channel.send(payload)
        while True:
            message, _ = self._channel.receive()
            if message[0] == "progress" and progress is not None:
                progress(int(message[1]))
            elif message[0] in ("done", "failed", "unreadable"):
                return tuple(message)

    def _lose(self, where: str) -> str:
        """Mark the child unusable after its socket failed; describe what happened."""
        self.lost = (
            f"the writer process (pid {self.pid}) {_death(self.reap())} while writing {where}; "
            "that file was not replaced. The next save starts a new writer process"
        )
        return self.lost

    def reap(self) -> int:
        """Close the socket, then wait for the child's exit status; kill a child that has
        not exited in time (alive but not answering: it cannot be trusted)."""
        self.close()
        try:
            return self.process.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def usable(self) -> bool:
        """Whether the child can take a write: not lost, and not dead since its last one
        (a child killed between saves is replaced before the next, which then succeeds)."""
        return self.lost is None and self.process.poll() is None


def _death(code: int) -> str:
    """How a child that ended with ``Popen.returncode`` ``code`` died, in words.

    Example:
        >>> _death(-9), _death(3)
        ('was killed by SIGKILL', 'exited with status 3')
    """
    if code >= 0:
        return f"exited with status {code}"
    number = -code
    try:
        return f"was killed by {signal.Signals(number).name}"
    except ValueError:  # a real-time signal has no name of its own
        offset = number - signal.SIGRTMIN
        name = f"SIGRTMIN+{offset}" if 0 < offset <= signal.SIGRTMAX - signal.SIGRTMIN else "?"
        return f"was killed by signal {number} ({name})"


def _rebuilt(answer: tuple[Any, ...], pid: int, where: str) -> BaseException:
    """The child's exception, as raised there if it survived pickling, with its causes
    (``raise ... from``, which pickling drops) and its traceback as a note."""
    _, blobs, summary, text = answer
    chain = [_unpickled(blob) for blob in blobs]
    exc = chain[0] if chain else None
    if exc is None:
        exc = WriterProcessError(f"writing {where} failed in the writer process: {summary}")
    link = exc
    for cause in chain[1:]:
        if cause is None:
            break
        link.__cause__ = cause
        link = cause
    if hasattr(exc, "add_note"):
        exc.add_note(f"raised in the writer process (pid {pid}):\n{text}")
    return exc


def _unpickled(blob: bytes | None) -> BaseException | None:
    if blob is None:
        return None
    with contextlib.suppress(Exception):
        exc = pickle.loads(blob)
        if isinstance(exc, BaseException):
            return exc
    return None


def _niceness_below_main(nice: int) -> int:
    """The niceness ``nice`` steps below this process's main thread (whose id is the pid)."""
    try:
        return min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
    except (AttributeError, OSError):
        return nice


#: The asyncckpt package's directory (this module is in its ``_engine``): the child imports
#: this very package, from wherever this process found it.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_environ() -> dict[str, str]:
    """The caller's environment without its ``ASYNCCKPT_*`` variables: the child's
    tunables come with each job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    here = os.path.dirname(_PACKAGE_DIR)
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    return env


# ----------------------------------------------------------------------------- the caller


_lock = threading.Lock()
_current: Future[WriterProcess] | None = None
_warned: set[str] = set()


def wanted(options: WriteOptions) -> bool:
    """Whether saves with ``options`` should stage into shared memory for a child to write.

    Example:
        >>> from asyncckpt._engine.encode import WriteOptions
        >>> wanted(WriteOptions("zstd", Settings(writer_processes=0)))
        False
    """
    if not options.settings.writer_processes:
        return False
    if not arena.shared_memory_supported():
        _warn_once("writer_processes=1 needs memfd (Linux); writing on threads instead", options)
        return False
    return True


def shares_arenas(settings: Settings) -> bool:
    """Whether arenas go in shared memory: writer processes are on (``writer_processes`` of
    ``settings``) and memfd exists. Saves written on threads take such an arena as well.

    Example:
        >>> isinstance(shares_arenas(Settings()), bool)
        True
    """
    return settings.writer_processes == 1 and arena.shared_memory_supported()


def start(settings: Settings) -> Future[WriterProcess]:
    """Start the writer process if none is running; return it (as a future: it may still
    be starting), with the ``writer_nice`` of ``settings``. A dedicated thread starts it: on
    Linux the child's death signal follows the thread that started it, which must live as
    long as the process.

    Example:
        >>> process = start(Settings()).result()
        >>> process.pid != os.getpid()
        True
    """
    global _current
    with _lock:
        if _current is None or _broken(_current):
            nice = settings.writer_nice
            _current = workers.pool("writer-process", 1).submit(WriterProcess, nice)
        return _current


def stop() -> None:
    """Shut the writer process down and reap it (at exit, once no save is pending): closing
    the socket ends the child's loop; one that has not ended in time is killed (it holds
    no write). A child still starting is left to die with this process.

    Example:
        >>> _ = start(Settings()).result(); stop(); current() is None
        True
    """
    global _current
    with _lock:
        future, _current = _current, None
    if future is not None and future.done() and future.exception() is None:
        future.result().reap()


def current() -> WriterProcess | None:
    """The writer process, if one has been started and is usable (for tests and tools)."""
    with _lock:
        future = _current
    if future is None or _broken(future):
        return None
    return future.result()


#: pid -> CPU seconds that writer process had used when last looked at.
_child_cpu: dict[int, float] = {}


def children_cpu_seconds() -> float:
    """CPU seconds every writer process of this process has used so far (Linux; 0.0
    elsewhere): the background writer's own work, which does not make the CPU look busy.

    Example:
        >>> children_cpu_seconds() >= 0.0
        True
    """
    with _lock:
        future = _current
    if future is not None and future.done() and future.exception() is None:
        pid = future.result().pid
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            _child_cpu[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass  # gone, or not Linux: its last reading stands
    return sum(_child_cpu.values())


cpu.add_writer_source(children_cpu_seconds)


def _broken(future: Future[WriterProcess]) -> bool:
    if not future.done():
        return False
    return future.exception() is not None or not future.result().usable()


def write(
    snap: Snapshot,
    storage: Storage,
    path: str,
    options: WriteOptions,
    progress: Callable[[int], None] | None = None,
    guard: PublishGuard | None = None,
) -> int:
    """``write_snapshot``, in the writer process when ``writer_processes`` asks for it.

    Arguments and result are ``write_snapshot``'s; falls back to threads where the child
    cannot write (see the module docstring). Waits for the copy into ``snap`` to end: the
    child does not follow a pipelined copy.

    Raises:
        WriterProcessError: the writer process died during the write, or could not start.
        SnapshotFailedError: the copy into the arena failed.
        StorageError: the backend failed (the target is untouched).

    Example:
        >>> import tempfile, os, torch
        >>> from asyncckpt._api.dropin import stage, write_options
        >>> from asyncckpt._settings import Settings
        >>> from asyncckpt._storage import LocalStorage
        >>> options = write_options("none", Settings())
        >>> snap = stage({"w": torch.ones(2)}, options, in_this_process=True)
        >>> path = os.path.join(tempfile.mkdtemp(), "w.ackpt")
        >>> write(snap, LocalStorage(), path, options) == os.path.getsize(path)
        True
        >>> snap.release()
    """
    if not options.settings.writer_processes:
        return write_snapshot(snap, storage, path, options, progress, guard)
    refs = _layout(snap) if wanted(options) else None
    if refs is None or storage.process_local:
        local = f"{storage.describe('')} lives in this process's memory"
        reason = "an arena not in shared memory" if refs is None else local
        _warn_once(f"writer_processes=1: {reason}; that write runs on threads instead", options)
        return write_snapshot(snap, storage, path, options, progress, guard)
    failure = snap.copy_error()
    if failure is not None:
        raise SnapshotFailedError(f"the snapshot copy failed: {failure!r}")
    snap.wait_copied()
    job = WriteJob(
        storage,
        path,
        options,
        snap.root,
        snap.tensors,
        snap.arrays,
        refs,
        frozenset(r.ident for r in arena.shared_regions()),
        progress is not None,
        guard,
    )
    try:
        payload = pickle.dumps(("write", job), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        _warn_once(f"writer_processes=1: {storage!r} cannot be sent to a process ({exc})", options)
        return write_snapshot(snap, storage, path, options, progress, guard)
    try:
        process = start(options.settings).result()
        return process.write(payload, job, storage.describe(path), progress)
    except WriterProcessError:
        _remove_temp_files(storage, path)
        raise
    except JobUnreadable as exc:
        where = storage.describe("")
        reason = f"the writer process cannot load {where} ({exc})"
        _warn_once(f"writer_processes=1: {reason}; that write runs on threads instead", options)
        return write_snapshot(snap, storage, path, options, progress, guard)


def _remove_temp_files(storage: Storage, path: str) -> None:
    """Delete the temp files a killed child left beside ``path`` (best effort)."""
    head, _, tail = path.replace("\\", "/").rpartition("/")
    with contextlib.suppress(Exception):
        for name in storage.list_dir(head):
            if name.startswith(tail + TEMP_MARK):
                storage.delete(storage.join(head, name))


def _layout(snap: Snapshot) -> list[StagedRef] | None:
    """Where each staged storage lies in shared memory; None if one lies elsewhere."""
    refs = []
    for staged in snap.storages:
        n = staged.data.numel()
        found = arena.shared_region(staged.data) if n else None
        if n and found is None:
            return None
        ident, offset = (found[0].ident, found[1]) if found else (0, 0)
        refs.append(StagedRef(ident, offset, n, staged.itemsize, staged.is_float, staged.device))
    return refs


def _warn_once(message: str, options: WriteOptions) -> None:
    """Say once why a write stays on threads, as a warning or a debug message (see the
    module docstring)."""
    with _lock:
        if message in _warned:
            return
        _warned.add(message)
    explicit = "writer_processes" in options.settings.given
    log.log(logging.WARNING if explicit else logging.DEBUG, "%s", message)


def _forget_after_fork() -> None:
    """In a forked child (a DataLoader worker, say): the writer process is the parent's.

    Closing this copy of the socket leaves the parent's connection open. The lock is new:
    another thread of the parent may have held it at the fork.
    """
    global _current, _lock
    _lock = threading.Lock()
    future, _current = _current, None
    if future is not None and future.done() and future.exception() is None:
        future.result().close()


workers.after_fork_in_child(_forget_after_fork)
