"""Background threads: small daemon pools, one of them the save thread.

The threads are daemons on purpose: pending saves are awaited by an ``atexit`` hook (in
:mod:`asyncckpt._api.jobs`, which tracks them), and daemon threads keep running while
``atexit`` hooks do. The stdlib ``ThreadPoolExecutor`` refuses new work once interpreter
shutdown begins, which would break a save that is still compressing when the main thread
ends.

The threads of a background write run ``writer_nice`` below the caller's
(:func:`lower_priority`): on a CPU shared with training, training wins the cores.

A forked child (a DataLoader worker, a ``multiprocessing`` fork) inherits none of these
threads, but it does inherit the pools, the pending saves and every lock, possibly held by
a thread that does not exist there: its first ``load`` or ``save`` would wait for ever.
:func:`after_fork_in_child` is the one place that knows what a child must drop; what the
parent owned is kept, untouched, rather than freed in the child (:func:`keep_from_parent`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Final, TypeVar

from asyncckpt import _cpu as cpu

T = TypeVar("T")

#: Pools that only ever run background writes; their callers give them ``writer_nice``.
#: Readers ("read", "records") serve a caller that is waiting, and heartbeats ("beats") must
#: keep their lease alive, so they keep the caller's priority.
WRITER_POOLS: frozenset[str] = frozenset({"save", "encode"})


def lower_priority(nice: int) -> bool:
    """Run the calling thread ``nice`` steps below the main thread (Linux only; one thread).

    Elsewhere ``setpriority(PRIO_PROCESS, tid)`` would renice the whole process. The level
    is relative to the main thread (whose id is the process id), not the calling thread: a
    thread inherits its creator's niceness, and the encoders are created by the already
    lowered save thread (so are a storage's I/O threads: see ``_restore_priority``).
    Returns True if the thread now runs at that level.

    Example:
        >>> threading.Thread(target=lower_priority, args=(5,)).start()
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError:  # a sandbox may forbid it; the write still runs, at full priority
        return False
    return True


def _restore_priority() -> None:
    """Undo the niceness a pool thread inherited from the writer thread that started it.

    Raising a thread's priority needs ``CAP_SYS_NICE`` or ``RLIMIT_NICE``; without them the
    thread stays lowered.
    """
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())
        if os.getpriority(os.PRIO_PROCESS, tid) > base:
            os.setpriority(os.PRIO_PROCESS, tid, base)
    except OSError:
        pass


class DaemonPool:
    """A fixed set of daemon threads running submitted callables in FIFO order.

    ``nice`` > 0: the threads run that much below the main thread (:func:`lower_priority`);
    0: at the main thread's priority, where the OS lets a thread raise its inherited one.

    Example:
        >>> pool = DaemonPool(2, "demo")
        >>> pool.submit(sum, [1, 2]).result()
        3
    """

    def __init__(self, threads: int, name: str, nice: int = 0) -> None:
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._tasks = queue.SimpleQueue()
        self.threads = threads
        self.nice = nice
        self._unfinished = 0  # tasks queued or running, references not yet dropped
        self.cpu_s = 0.0  # CPU seconds its threads have spent in tasks
        self._idle = threading.Condition()
        for i in range(threads):
            threading.Thread(target=self._run, name=f"asyncckpt-{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; the returned future holds its result or exception."""
        future: Future[T] = Future()
        with self._idle:
            self._unfinished += 1
        self._tasks.put((future, fn, args))
        return future

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every task has finished and its thread has dropped its references:
        True if the pool is idle, False if ``timeout`` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unfinished == 0, timeout)

    def _run(self) -> None:
        if self.nice > 0:
            lower_priority(self.nice)
        else:
            _restore_priority()
        while True:
            future, fn, args = self._tasks.get()
            started = time.thread_time()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)
            # Drop the task before waiting for the next one: an idle thread must not keep
            # its last task's arguments (a whole tensor, a chunk buffer) alive; and the last
            # reference to a tensor must not be dropped here while the interpreter shuts
            # down (see wait_idle: freeing a tensor takes the GIL inside C++, and a daemon
            # thread that takes the GIL during finalization is unwound, which aborts).
            del future, fn, args
            with self._idle:
                self.cpu_s += time.thread_time() - started
                self._unfinished -= 1
                self._idle.notify_all()


_lock = threading.Lock()
_pools: dict[tuple[str, int], DaemonPool] = {}


def pool(name: str, threads: int, nice: int = 0) -> DaemonPool:
    """The process-wide pool called ``name`` with ``threads`` threads (created on first use).

    It keeps the ``nice`` of the call that created it (a process's first save).

    Example:
        >>> pool("demo", 1).submit(len, "abc").result()
        3
    """
    with _lock:
        if (name, threads) not in _pools:
            _pools[name, threads] = DaemonPool(threads, name, nice)
        return _pools[name, threads]


def writer_cpu_seconds() -> float:
    """CPU seconds the background writer's threads (:data:`WRITER_POOLS`) have spent so far.

    Example:
        >>> writer_cpu_seconds() >= 0.0
        True
    """
    with _lock:
        pools = [p for (name, _), p in _pools.items() if name in WRITER_POOLS]
    return sum(p.cpu_s for p in pools)


cpu.add_writer_source(writer_cpu_seconds)


def wait_idle(timeout: float) -> bool:
    """Wait until every pool of the process is idle (for the exit hook); True if it is.

    A pool thread drops its task's references only after publishing the result; freeing a
    tensor once the interpreter finalizes aborts the process (see ``DaemonPool._run``).

    Example:
        >>> wait_idle(1.0)
        True
    """
    deadline = time.monotonic() + timeout
    with _lock:
        pools = list(_pools.values())
    return all(p.wait_idle(max(0.0, deadline - time.monotonic())) for p in pools)


#: Name prefixes of torch.distributed's native worker threads (gloo's work loops, NCCL's
#: watchdog and heartbeat), which finish collectives and drop their tensors.
TORCH_WORKER_THREADS: Final = ("pt_gloo", "pt_nccl")
_QUIET_ROUNDS = 3  # consecutive polls with no such thread runnable
_QUIET_POLL_S = 0.002


def wait_torch_threads_quiet(timeout: float) -> bool:
    """Wait until no native torch.distributed worker thread is running (for the exit hook).

    Such a thread outlives ``destroy_process_group()`` while something holds the group (a
    ``fully_shard`` module's DeviceMesh in DTensor's caches). Dropping a finished
    collective's tensors takes the GIL; once the interpreter finalizes, CPython ends the
    thread with ``pthread_exit``, whose unwinding through torch's C++ destructors calls
    ``std::terminate`` (SIGABRT after the script's last line, when the thread was preempted
    right after the job's last collective). Each poll sleeps (so a thread waiting for the
    GIL gets it), then checks that none is runnable; three quiet polls end the wait. Linux
    only (elsewhere the threads cannot be seen). False if ``timeout`` passed first.

    Example:
        >>> wait_torch_threads_quiet(1.0)
        True
    """
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < _QUIET_ROUNDS:
        threads = _torch_worker_threads()
        if not threads:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_QUIET_POLL_S)  # the GIL is free meanwhile
        quiet = 0 if any(_runnable(tid) for tid in threads) else quiet + 1
    return True


def _torch_worker_threads() -> list[str]:
    """Thread ids of this process's native torch.distributed workers (Linux /proc)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    return [t for t in tids if _task_file(t, "comm").strip().startswith(TORCH_WORKER_THREADS)]


def _runnable(tid: str) -> bool:
    _, paren, fields = _task_file(tid, "stat").rpartition(")")  # comm may hold ")"
    return bool(paren) and fields.split()[:1] == ["R"]


def _task_file(tid: str, name: str) -> str:
    """``/proc/self/task/<tid>/<name>``; empty if the thread has just exited."""
    try:
        with open(f"/proc/self/task/{tid}/{name}") as f:
            return f.read()
    except OSError:
        return ""


def save_queue(nice: int) -> DaemonPool:
    """The single thread that runs save jobs, one at a time, in submission order; it takes
    ``nice`` (the save's ``writer_nice``) when it starts (the process's first save)."""
    return pool("save", 1, nice)


#: What a forked child runs, in order, after forgetting this module's own state.
_after_fork: list[Callable[[], None]] = []
#: The parent's pools, saves and arenas, never freed in a child (see keep_from_parent).
_inherited: list[Any] = []


def after_fork_in_child(reset: Callable[[], None]) -> Callable[[], None]:
    """Run ``reset`` in every child forked from this process (a decorator).

    ``reset`` drops what belongs to the parent (threads that the child does not have, and
    locks they may have held at the fork): a new lock for each module lock, empty caches.

    Example:
        >>> @after_fork_in_child
        ... def _forget() -> None:
        ...     pass
    """
    _after_fork.append(reset)
    return reset


def keep_from_parent(*objects: Any) -> None:
    """Keep the parent's ``objects`` alive, unused, for the life of a forked child.

    Freeing them in the child would run their destructors there: a pinned buffer or a CUDA
    tensor freed in a child that cannot use the parent's CUDA context, a queued task's
    tensors. The memory is the parent's, shared copy-on-write, and costs the child nothing
    while it is not written.
    """
    _inherited.extend(objects)


#: Descriptors this process holds file locks on (``flock``), by the code that opened them.
#: A lock belongs to the open file description, which a fork shares with the child: a child
#: keeping the descriptor (a DataLoader worker forked while a save commits) would hold the
#: parent's lock for its whole life. Open and close under :data:`_fd_gate`, which a fork
#: waits for, so that no descriptor is ever unregistered at the moment of a fork.
_lock_fds: set[int] = set()
_fd_gate = threading.Lock()


@contextlib.contextmanager
def lock_descriptor(open_fd: Callable[[], int]) -> Iterator[int]:
    """The descriptor ``open_fd()`` opens, for a file lock, closed on exit; a child forked
    meanwhile never shares it (see :data:`_lock_fds`).

    Example:
        >>> with lock_descriptor(lambda: os.open(os.devnull, os.O_RDONLY)) as fd:
        ...     fd in _lock_fds
        True
    """
    with _fd_gate:
        fd = open_fd()
        _lock_fds.add(fd)
    try:
        yield fd
    finally:
        with _fd_gate:  # closed and forgotten at once: a fork never sees one without the other
            _lock_fds.discard(fd)
            _unlock(fd)
            os.close(fd)


def _unlock(fd: int) -> None:
    """Unlock ``fd``'s open file description before closing it: a close alone releases the
    lock only once every copy is closed, and a child forked a moment ago keeps its copy
    until its fork hook runs, which a loaded machine may put off past ``lock_timeout_ms``."""
    import fcntl

    with contextlib.suppress(OSError):  # never locked (a directory NFS cannot flock)
        fcntl.flock(fd, fcntl.LOCK_UN)


def _drop_lock_descriptors() -> None:
    """In a forked child: let go of the parent's lock descriptors. Each is replaced by
    ``/dev/null`` rather than closed, so that the number stays taken: were the parent's
    code to close it in the child too, it would close nothing of the child's."""
    global _fd_gate
    _fd_gate = threading.Lock()
    if _lock_fds:
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for fd in _lock_fds:
                os.dup2(null, fd)
        finally:
            os.close(null)
    _lock_fds.clear()


def _forget_parent() -> None:
    """In a forked child: no pool, fresh locks; then every registered hook."""
    global _lock
    _lock = threading.Lock()
    _drop_lock_descriptors()
    keep_from_parent(list(_pools.values()))
    _pools.clear()
    for reset in _after_fork:
        reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=lambda: _fd_gate.acquire(),
        after_in_parent=lambda: _fd_gate.release(),
        after_in_child=_forget_parent,
    )
