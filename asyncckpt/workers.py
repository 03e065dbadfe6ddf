"""Background threads: a small daemon pool, and the process's queue of pending saves.

The threads are daemons on purpose: pending saves are awaited by an ``atexit`` hook (in
:mod:`asyncckpt.api`), and daemon threads keep running while ``atexit`` hooks do. The
stdlib ``ThreadPoolExecutor`` refuses new work once interpreter shutdown begins, which would
break a save that is still compressing when the main thread ends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonPool:
    """A fixed set of daemon threads running submitted callables in FIFO order.

    Example:
        >>> pool = DaemonPool(2, "demo")
        >>> pool.submit(sum, [1, 2]).result()
        3
    """

    def __init__(self, threads: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._tasks = queue.SimpleQueue()
        self.threads = threads
        for i in range(threads):
            threading.Thread(target=self._run, name=f"asyncckpt-{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; the returned future holds its result or exception."""
        future: Future[T] = Future()
        self._tasks.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)
            # Drop the task before waiting for the next one: an idle thread must not keep
            # its last task's arguments (a whole tensor, a chunk buffer) alive.
            del future, fn, args


_lock = threading.Lock()
_pools: dict[tuple[str, int], DaemonPool] = {}


def pool(name: str, threads: int) -> DaemonPool:
    """The process-wide pool called ``name`` with ``threads`` threads (created on first use)."""
    with _lock:
        key = (name, threads)
        if key not in _pools:
            _pools[key] = DaemonPool(threads, name)
        return _pools[key]


def save_queue() -> DaemonPool:
    """The single thread that runs save jobs, one at a time, in submission order."""
    return pool("save", 1)


_pending: set[Any] = set()


def track(handle: Any) -> None:
    """Remember a pending save so that :func:`pending` and the exit hook can see it."""
    with _lock:
        _pending.add(handle)


def untrack(handle: Any) -> None:
    """Forget a finished save."""
    with _lock:
        _pending.discard(handle)


def pending() -> list[Any]:
    """The saves of this process that have not finished, oldest first."""
    with _lock:
        return sorted(_pending, key=lambda h: h.sequence)
