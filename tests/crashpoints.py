"""Numbered storage operations: fail one, or stop the process at one, deterministically.

:class:`CrashStorage` wraps any :class:`~asyncckpt._storage.Storage` and numbers every call
that passes through it (``open_atomic``, a writer's ``write``/``commit``/``abort``,
``create_exclusive``, ``replace_if``, ``delete``, ``delete_tree``, ``list_dir``, ...), as a
:class:`CrashPlan` directs:

* ``"count"``: only record the operations (:attr:`CrashPlan.trace`), to learn how many
  points a scenario has;
* ``"fail"``: operation number ``at`` raises :class:`~asyncckpt.errors.StorageError` and
  does nothing; the others run (a backend failure the library must survive). Its points
  are the operations that change storage and the first read of each kind (operation and
  path, step numbers and tokens aside), or every call with ``every_read=True``;
* ``"crash"``: operation number ``at`` and every later one raise and do nothing, as if the
  process had died just before it (fast, in-process: nothing the library does afterwards
  reaches storage);
* ``"kill"``: the process sends itself ``SIGKILL`` just before operation number ``at``
  (run the scenario in a child process).

``"crash"`` and ``"kill"`` number only the operations that change storage (a crash before a
read is the same state as a crash before the next write).
Calls on a path outside :attr:`CrashPlan.allowed` are recorded in :attr:`CrashPlan.outside`.

Unlike :class:`~asyncckpt.testing.FaultyFileSystem`, which fails fsspec calls, this sits at
the storage interface, so it covers local disk (``LocalStorage``) as the library uses it.
One backend call is one point: what a backend does inside a call (the temp file, fsync and
link of a local ``create_exclusive``) is atomic here, except a local ``delete_tree``, whose
entries are removed (and numbered) one by one, as the OS does.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from asyncckpt._storage.base import AtomicWriter, PublishGuard, ReadHandle, Storage
from asyncckpt.errors import StorageError

__all__ = ["CRASH_MODES", "MUTATING_OPS", "CrashPlan", "CrashStorage", "StorageOp"]

#: What a :class:`CrashPlan` does at its point.
CRASH_MODES = ("count", "fail", "crash", "kill")
#: Operations that change what is stored (the points of ``"crash"`` and ``"kill"``).
MUTATING_OPS = frozenset(
    {
        "open_atomic",
        "write",
        "commit",
        "abort",
        "create_exclusive",
        "replace_if",
        "write_marker",
        "delete",
        "delete_tree",
        "abort_unfinished",
    }
)


@dataclass(frozen=True)
class StorageOp:
    """One call through a :class:`CrashStorage`: its operation, path and thread."""

    op: str
    path: str
    thread: str

    @property
    def mutating(self) -> bool:
        return self.op in MUTATING_OPS

    @property
    def kind(self) -> tuple[str, str]:
        """The operation and its path with numbers and tokens left out: reads of one kind
        fail the same way, so ``"fail"`` tries the first of each."""
        return self.op, _NUMBERS.sub("#", os.path.basename(self.path))


_NUMBERS = re.compile(r"[0-9a-f]{12}|[0-9]+")


class CrashPlan:
    """Which operation a :class:`CrashStorage` fails or stops at, and what it saw.

    Args:
        mode: one of :data:`CRASH_MODES`.
        at: the point, counted from 1 over every call (``"fail"``) or over the calls that
            change storage (``"crash"``, ``"kill"``); ignored by ``"count"``.
        allowed: path prefixes the calls may touch (empty: any).
        every_read: with ``"fail"``, every read is a point, not only the first of its kind.
        on_call: called with each :class:`StorageOp` before it runs (and before the plan
            acts on it): tests use it to act at an exact moment, e.g. to play a racing
            writer's part.
    """

    trace: list[StorageOp]
    outside: list[StorageOp]
    fired: StorageOp | None
    _kinds: set[tuple[str, str]]

    def __init__(
        self,
        mode: str = "count",
        at: int = 0,
        allowed: tuple[str, ...] = (),
        *,
        every_read: bool = False,
        on_call: Callable[[StorageOp], None] | None = None,
    ) -> None:
        self.allowed, self.every_read, self.on_call = allowed, every_read, on_call
        self._lock = threading.Lock()
        self.arm(mode, at)

    def arm(self, mode: str, at: int = 0) -> None:
        """Start afresh: forget the trace, then act as ``mode`` at point ``at``."""
        if mode not in CRASH_MODES:
            raise ValueError(f"unknown mode {mode!r}; known: {CRASH_MODES}")
        with self._lock:
            self.mode, self.at = mode, at
            self.trace, self.outside, self.fired, self.dead = [], [], None, False
            self._points, self._kinds = 0, set()

    def points(self, mode: str | None = None) -> int:
        """How many points the recorded trace has for ``mode`` (default: the plan's)."""
        mode = self.mode if mode is None else mode
        seen: set[tuple[str, str]] = set()
        return sum(self._is_point(op, mode, seen) for op in self.trace)

    def _is_point(self, op: StorageOp, mode: str, seen: set[tuple[str, str]]) -> bool:
        if op.mutating:
            return mode != "count"
        if mode != "fail":
            return False
        new = op.kind not in seen
        seen.add(op.kind)
        return new or self.every_read

    def enter(self, op: str, path: str) -> None:
        """Count one call; raise or stop the process if the plan says so."""
        entry = StorageOp(op, path, threading.current_thread().name)
        if self.on_call is not None and not self.dead:
            self.on_call(entry)
        with self._lock:
            if self.dead:
                raise StorageError(f"[simulated crash: {op} {path} after the process died]")
            self.trace.append(entry)
            if self.allowed and not any(_under(path, a) for a in self.allowed):
                self.outside.append(entry)
            if not self._is_point(entry, self.mode, self._kinds):
                return
            self._points += 1
            if self._points != self.at:
                return
            self.fired = entry
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            self.dead = self.mode == "crash"
        raise StorageError(f"[injected {self.mode} at storage op {self.at}: {op} {path}]")


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


class CrashStorage(Storage):
    """``inner`` with every call numbered and acted on by ``plan`` (see the module)."""

    def __init__(self, inner: Storage, plan: CrashPlan) -> None:
        self.inner, self.plan = inner, plan
        self.label = inner.label
        self.process_local, self.local_paths = inner.process_local, inner.local_paths
        self.sized_paths_are_files = inner.sized_paths_are_files

    # Capabilities are the inner backend's (the engine asks them, never the type).
    def target(self, path: str) -> tuple[str, ...]:
        return self.inner.target(path)

    def on_local_disk(self, path: str) -> bool:
        return self.inner.on_local_disk(path)

    def file_key(self, path: str) -> tuple[str, str]:
        return self.inner.file_key(path)

    def __getattr__(self, name: str) -> Any:  # settings, and a backend's own attributes
        return getattr(self.inner, name)

    def describe(self, path: str) -> str:
        return self.inner.describe(path)

    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)

    def open_atomic(self, path: str) -> AtomicWriter:
        self.plan.enter("open_atomic", path)
        return _CountedWriter(self.plan, self.inner.open_atomic(path), path)

    def size(self, path: str) -> int:
        self.plan.enter("size", path)
        return self.inner.size(path)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        self.plan.enter("read_range", path)
        return self.inner.read_range(path, start, length)

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        self.plan.enter("read_into", path)
        return self.inner.read_into(path, start, out)

    def open_read(self, path: str) -> ReadHandle:
        self.plan.enter("open_read", path)
        return self.inner.open_read(path)

    def exists(self, path: str) -> bool:
        self.plan.enter("exists", path)
        return self.inner.exists(path)

    def delete(self, path: str) -> None:
        self.plan.enter("delete", path)
        self.inner.delete(path)

    def abort_unfinished(self, path: str, *, exact: bool = False) -> None:
        self.plan.enter("abort_unfinished", path)
        self.inner.abort_unfinished(path, exact=exact)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.plan.enter("create_exclusive", path)
        self.inner.create_exclusive(path, data)

    def list_dir(self, path: str) -> list[str]:
        self.plan.enter("list_dir", path)
        return self.inner.list_dir(path)

    def delete_tree(self, path: str) -> None:
        # A real rmtree removes entries one by one in directory order, which may put a
        # step's data before its COMMIT: each entry is a point, in reverse name order
        # (data files before COMMIT), so a crash can stop it midway as the OS can.
        local = self.inner.local_paths
        if local and os.path.isdir(path) and not os.path.islink(path):
            for name in sorted(os.listdir(path), reverse=True):
                child = os.path.join(path, name)
                if os.path.isdir(child) and not os.path.islink(child):
                    self.delete_tree(child)
                else:
                    self.plan.enter("delete_tree", child)
                    self.inner.delete(child)
        self.plan.enter("delete_tree", path)
        self.inner.delete_tree(path)

    def is_link(self, path: str) -> bool:
        self.plan.enter("is_link", path)
        return self.inner.is_link(path)

    def read_bytes(self, path: str, limit: int) -> bytes:
        self.plan.enter("read_bytes", path)
        return self.inner.read_bytes(path, limit)

    def read_marker(self, path: str, limit: int) -> bytes | None:
        self.plan.enter("read_marker", path)
        return self.inner.read_marker(path, limit)

    def write_marker(self, path: str, data: bytes, replacing: str | None = None) -> str:
        self.plan.enter("write_marker", path)
        return self.inner.write_marker(path, data, replacing)

    def marker_lock(self, path: str) -> AbstractContextManager[None]:
        self.plan.enter("marker_lock", path)
        return self.inner.marker_lock(path)

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str] | None:
        self.plan.enter("read_tagged", path)
        return self.inner.read_tagged(path, limit)

    def replace_if(self, path: str, data: bytes, tag: str | None) -> str:
        self.plan.enter("replace_if", path)
        return self.inner.replace_if(path, data, tag)


class _CountedWriter(AtomicWriter):
    """A backend's writer whose ``write``, ``commit`` and ``abort`` are numbered calls."""

    def __init__(self, plan: CrashPlan, inner: AtomicWriter, path: str) -> None:
        self.plan, self.inner, self.path = plan, inner, path

    # The caller sets these on the writer it was given: they belong to the backend's.
    @property  # type: ignore[override]
    def writeback_bytes(self) -> int:
        return self.inner.writeback_bytes

    @writeback_bytes.setter
    def writeback_bytes(self, value: int) -> None:
        self.inner.writeback_bytes = value

    @property  # type: ignore[override]
    def publish_guard(self) -> PublishGuard | None:
        return self.inner.publish_guard

    @publish_guard.setter
    def publish_guard(self, value: PublishGuard | None) -> None:
        self.inner.publish_guard = value

    def write(self, data: bytes | memoryview) -> None:
        self.plan.enter("write", self.path)
        self.inner.write(data)

    def commit(self) -> None:
        try:
            self.plan.enter("commit", self.path)
        except BaseException:
            with contextlib.suppress(StorageError):
                self.abort()  # a backend's commit aborts when it fails: so does this one
            raise
        self.inner.commit()

    def abort(self) -> None:
        try:
            self.plan.enter("abort", self.path)
        except StorageError:
            if self.plan.dead:
                # What the OS does for a dead process: its files close, and the locks on
                # them go (a local temp file's flock tells later saves its writer is dead).
                file = getattr(self.inner, "file", None)
                if file is not None:
                    file.close()
            raise
        self.inner.abort()
