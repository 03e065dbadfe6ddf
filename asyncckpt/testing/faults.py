"""Fault injection for any fsspec filesystem.

* :class:`FaultyFileSystem` — an fsspec filesystem that wraps another one (local, memory,
  S3 ...) and, following a :class:`FaultPlan`, fails chosen calls (the Nth call of an
  operation, for a number of calls), adds latency to every request, limits bandwidth (per
  request, and optionally for a shared link), truncates writes, loses responses after the
  request took effect, or hangs. It is registered as the ``faulty`` protocol, so it composes
  with any URL::

      plan = FaultPlan([Fault("upload_part", nth=2, kind="slowdown")], latency_s=0.02)
      asyncckpt.save(state, "faulty::s3://bucket/x.ackpt",
                     storage_options={"faulty": {"plan": plan}, "s3": s3_options})

  Operation names are the wrapped filesystem's method names (``open``, ``write``,
  ``close``, ``cat_file``, ``pipe_file``, ``mv``, ``ls`` ...) and, for S3, the S3 API call
  names that :class:`~asyncckpt._storage.s3.S3Storage` issues (:data:`S3_OPERATIONS`;
  ranged reads are ``cat_file``).

These fail requests *inside* the client process, at the fsspec call (asyncckpt's own tests
also fail them on the wire, with the HTTP fault proxy in ``tests/proxy.py``).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.chained import ChainedFileSystem

from asyncckpt._storage.s3client import is_object_store
from asyncckpt._storage.s3read import ranged_get

__all__ = [
    "FAULT_KINDS",
    "S3_OPERATIONS",
    "TRANSIENT_KINDS",
    "Fault",
    "FaultEvent",
    "FaultPlan",
    "FaultyFileSystem",
    "random_faults",
]

#: Every kind of :class:`Fault`.
FAULT_KINDS = (
    "slowdown",  # S3 503 SlowDown (throttling)
    "server-error",  # S3 500 InternalError
    "reset",  # connection reset by peer
    "timeout",  # read timeout
    "truncate",  # part of the payload arrives, then the connection resets
    "lost-response",  # the request takes effect, then the connection resets
    "denied",  # S3 403 AccessDenied
    "no-bucket",  # S3 404 NoSuchBucket
    "hang",  # block until FaultPlan.release() (to kill a process mid-request)
)
#: Kinds a well-behaved client retries.
TRANSIENT_KINDS = ("slowdown", "server-error", "reset", "timeout", "truncate", "lost-response")

#: The S3 calls :class:`~asyncckpt._storage.s3.S3Storage` makes, plus ranged reads.
S3_OPERATIONS = (
    "put_object",
    "create_multipart_upload",
    "upload_part",
    "complete_multipart_upload",
    "abort_multipart_upload",
    "head_object",
    "list_objects_v2",
    "delete_objects",
    "delete_object",
    "list_multipart_uploads",
    "cat_file",
)


def s3_error(code: str, status: int, message: str, op: str, **extra: str) -> BaseException:
    """The exception s3fs raises for an S3 error response (a ClientError, translated)."""
    try:
        from botocore.exceptions import ClientError
    except ImportError:  # pragma: no cover - s3fs needs botocore
        return OSError(errno.EIO, f"{code}: {message}")
    error = ClientError(
        {
            "Error": {"Code": code, "Message": message, **extra},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        op,
    )
    try:
        from s3fs.errors import translate_boto_error

        translated: BaseException = translate_boto_error(error)
        return translated
    except ImportError:  # pragma: no cover
        fallback: BaseException = error
        return fallback


@dataclass(frozen=True)
class Fault:
    """Fail calls ``nth`` .. ``nth + times - 1`` of operation ``op`` (``"*"``: any operation).

    Calls are counted per operation from when the plan was armed, starting at 1.
    ``error``, if given, is raised instead of the error of ``kind``.
    """

    op: str
    nth: int = 1
    kind: str = "reset"
    times: int = 1
    error: BaseException | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {FAULT_KINDS}")
        if self.nth < 1 or self.times < 1:
            raise ValueError(f"nth and times must be positive, got {self.nth}, {self.times}")

    def matches(self, op: str, call: int) -> bool:
        """Whether call number ``call`` of ``op`` fails."""
        return self.op in (op, "*") and self.nth <= call < self.nth + self.times


@dataclass(frozen=True)
class FaultEvent:
    """A fault that fired: which operation, which call of it, what kind, on which path."""

    op: str
    call: int
    kind: str
    path: str


def random_faults(
    seed: int,
    *,
    count: int = 3,
    ops: Sequence[str] = S3_OPERATIONS,
    kinds: Sequence[str] = TRANSIENT_KINDS,
    max_nth: int = 12,
    max_times: int = 2,
) -> list[Fault]:
    """A reproducible random fault schedule of 1..``count`` faults.

    Example:
        >>> random_faults(7, count=2, ops=["upload_part"], kinds=["reset"]) == random_faults(
        ...     7, count=2, ops=["upload_part"], kinds=["reset"])
        True
    """
    rng = random.Random(seed)
    return [
        Fault(
            op=rng.choice(list(ops)),
            nth=rng.randint(1, max_nth),
            kind=rng.choice(list(kinds)),
            times=rng.randint(1, max_times),
        )
        for _ in range(rng.randint(1, count))
    ]


class FaultPlan:
    """What a :class:`FaultyFileSystem` does to the calls passing through it.

    Args:
        faults: the :class:`Fault` schedule (dicts with the same fields are accepted).
        latency_s: seconds added to every request (a round trip).
        bandwidth: bytes per second of each request's payload, up and down (None: no limit).
            Concurrent requests each get this much, as connections to S3 do.
        link_bandwidth: bytes per second shared by all requests (None: no shared limit).
        on_call: called as ``on_call(op, path, call)`` before every call (tests use it to
            observe or to synchronise with a request in flight).
        ignore_conditional: drop ``IfNoneMatch`` and ``IfMatch`` from S3 writes, as a store
            without conditional writes would; a number: from that many (the first) only, as
            a store that fails open now and then.
        sleep, clock: how to wait and what time it is (tests may fake both).

    Attributes:
        counts: calls so far per operation (since :meth:`arm`).
        events: the faults that fired, in order.
        max_active: the most calls of each operation that were in flight at once.
        bytes_up, bytes_down: payload bytes sent and received.
    """

    def __init__(
        self,
        faults: Iterable[Fault | dict[str, Any]] = (),
        *,
        latency_s: float = 0.0,
        bandwidth: float | None = None,
        link_bandwidth: float | None = None,
        on_call: Callable[[str, str, int], None] | None = None,
        ignore_conditional: bool | int = False,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.faults = [f if isinstance(f, Fault) else Fault(**f) for f in faults]
        self.latency_s = latency_s
        self.bandwidth = bandwidth
        self.link_bandwidth = link_bandwidth
        self.on_call = on_call
        self.ignore_conditional = ignore_conditional
        self.sleep = sleep
        self.clock = clock
        self.armed = True
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._link_free_at = 0.0
        self.counts: collections.Counter[str] = collections.Counter()
        self.active: collections.Counter[str] = collections.Counter()
        self.max_active: collections.Counter[str] = collections.Counter()
        self.events: list[FaultEvent] = []
        self.bytes_up = 0
        self.bytes_down = 0

    def __repr__(self) -> str:
        return f"FaultPlan({len(self.faults)} faults, latency_s={self.latency_s})"

    def arm(self) -> None:
        """Start counting calls afresh and inject faults from now on."""
        with self._lock:
            self.counts.clear()
            self.events.clear()
            self.armed = True

    def disarm(self) -> None:
        """Stop injecting faults (latency and bandwidth limits stay)."""
        with self._lock:
            self.armed = False

    def release(self) -> None:
        """Let calls blocked by a ``hang`` fault go on (they then fail with a reset)."""
        self._released.set()

    def fired(self, kind: str | None = None, op: str | None = None) -> list[FaultEvent]:
        """The faults that fired, optionally only of one kind and/or operation."""
        with self._lock:
            return [
                e
                for e in self.events
                if (kind is None or e.kind == kind) and (op is None or e.op == op)
            ]

    # -- used by FaultyFileSystem -------------------------------------------------------

    def enter(self, op: str, path: str) -> tuple[int, Fault | None]:
        with self._lock:
            self.counts[op] += 1
            call = self.counts[op]
            self.active[op] += 1
            self.max_active[op] = max(self.max_active[op], self.active[op])
            fault = None
            if self.armed:
                fault = next((f for f in self.faults if f.matches(op, call)), None)
                if fault is not None:
                    self.events.append(FaultEvent(op, call, fault.kind, path))
        if self.on_call is not None:
            self.on_call(op, path, call)
        return call, fault

    def leave(self, op: str) -> None:
        with self._lock:
            self.active[op] -= 1

    def transfer(self, nbytes: int, *, up: bool, request: bool) -> None:
        """Wait for one request's latency (if ``request``) and its payload's transfer."""
        with self._lock:
            if up:
                self.bytes_up += nbytes
            else:
                self.bytes_down += nbytes
            wait = self.latency_s if request else 0.0
            own = nbytes / self.bandwidth if self.bandwidth and nbytes else 0.0
            shared = 0.0
            if self.link_bandwidth and nbytes:
                now = self.clock()
                self._link_free_at = max(now, self._link_free_at) + nbytes / self.link_bandwidth
                shared = self._link_free_at - now
            wait += max(own, shared)
        if wait > 0:
            self.sleep(wait)

    def hang(self) -> None:
        self._released.wait()


#: kind -> the S3 error (code, HTTP status, message) and the errno a filesystem raises.
_ERRORS = {
    "slowdown": ("SlowDown", 503, "Please reduce your request rate.", errno.EBUSY),
    "server-error": ("InternalError", 500, "We encountered an internal error.", errno.EIO),
    "denied": ("AccessDenied", 403, "Access Denied", errno.EACCES),
    "no-bucket": ("NoSuchBucket", 404, "The specified bucket does not exist", errno.ENOENT),
}


def _injected(kind: str, op: str, call: int, s3: bool) -> BaseException:
    """The exception a real backend would raise for ``kind``."""
    where = f"[injected {kind} at {op} call {call}]"
    if kind in _ERRORS:
        code, status, message, number = _ERRORS[kind]
        text = f"{message} {where}"
        # OSError(errno, ...) is that errno's subclass: PermissionError, FileNotFoundError.
        return s3_error(code, status, text, op) if s3 else OSError(number, text)
    if kind == "timeout":
        return TimeoutError(f"Read timed out {where}")
    return ConnectionResetError(errno.ECONNRESET, f"Connection reset by peer {where}")


class FaultyFileSystem(ChainedFileSystem):  # type: ignore[misc]
    """An fsspec filesystem that passes calls to ``fs`` and injects what ``plan`` says.

    Args:
        fs: the filesystem to wrap (or give ``target_protocol``/``target_options``, as
            fsspec does for a chained URL ``faulty::s3://bucket/x``).
        plan: the :class:`FaultPlan`; without one, ``plan_options`` build it (so
            ``storage_options={"faulty": {"latency_s": 0.02}}`` works from a URL).

    With no faults, latency or bandwidth limit the wrapper is transparent: it passes the
    storage conformance suite on every backend it wraps.
    """

    protocol = "faulty"
    cachable = False

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem | None = None,
        plan: FaultPlan | None = None,
        *,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fo: str | None = None,
        **plan_options: Any,
    ) -> None:
        super().__init__()
        del fo
        if fs is None:
            if target_protocol is None:
                raise ValueError("FaultyFileSystem needs fs= or target_protocol=")
            fs = fsspec.filesystem(target_protocol, **(target_options or {}))
        self.fs = fs
        self.plan = plan if plan is not None else FaultPlan(**plan_options)
        self.wraps_object_store = is_object_store(fs)
        #: A wrapped store whose objects live in this process's memory stays in it.
        self.process_local = bool(getattr(fs, "process_local", False))
        self._s3 = callable(getattr(fs, "call_s3", None))
        if self._s3:
            self.call_s3 = self._call_s3

    def __repr__(self) -> str:
        return f"FaultyFileSystem({type(self.fs).__name__}, {self.plan!r})"

    def _do(
        self,
        op: str,
        path: str,
        fn: Callable[[], Any],
        *,
        up: int = 0,
        truncated: Callable[[], Any] | None = None,
    ) -> Any:
        plan = self.plan
        call, fault = plan.enter(op, path)
        try:
            plan.transfer(up, up=True, request=True)
            if fault is None:
                result = fn()
            elif fault.error is not None:
                raise fault.error
            elif fault.kind == "hang":
                plan.hang()
                raise _injected("hang", op, call, self._s3)  # a reset, once released
            elif fault.kind == "lost-response":
                fn()
                raise _injected("reset", op, call, self._s3)
            elif fault.kind == "truncate":
                if truncated is not None:
                    truncated()
                raise _injected("reset", op, call, self._s3)
            else:
                raise _injected(fault.kind, op, call, self._s3)
            payload = result[0] if isinstance(result, tuple) and result else result
            if isinstance(payload, (bytes, bytearray)) and payload:
                plan.transfer(len(payload), up=False, request=False)
            return result
        finally:
            plan.leave(op)

    # -- S3 API (present only when the wrapped filesystem is s3fs) ----------------------

    def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if ("IfNoneMatch" in kwargs or "IfMatch" in kwargs) and self._ignores_condition():
            kwargs.pop("IfNoneMatch", None)
            kwargs.pop("IfMatch", None)
        path = f"{kwargs.get('Bucket', '')}/{kwargs.get('Key', '')}"
        body = kwargs.get("Body")
        payload = body if isinstance(body, (bytes, bytearray, memoryview)) else b""
        size = len(payload)
        truncated = None
        if method == "upload_part" and size:  # a short part is stored; PUTs are all-or-nothing

            def truncated() -> Any:
                return self.fs.call_s3(method, *args, **{**kwargs, "Body": payload[: size // 2]})

        return self._do(
            method,
            path,
            lambda: self.fs.call_s3(method, *args, **kwargs),
            up=size,
            truncated=truncated,
        )

    def _ignores_condition(self) -> bool:
        plan = self.plan
        with plan._lock:
            if isinstance(plan.ignore_conditional, bool):
                return plan.ignore_conditional
            if plan.ignore_conditional <= 0:
                return False
            plan.ignore_conditional -= 1
            return True

    def split_path(self, path: str) -> Any:
        return self.fs.split_path(path)

    def asyncckpt_ranged_get(
        self, bucket: str, key: str, start: int, end: int, if_match: str | None
    ) -> tuple[bytes, str | None]:
        """A pinned ranged read (``S3Storage``'s), counted as a ``cat_file`` call."""
        if self.plan.ignore_conditional is True:  # a count is of conditional writes
            if_match = None
        return self._do(  # type: ignore[no-any-return]
            "cat_file",
            f"{bucket}/{key}",
            lambda: ranged_get(self.fs, bucket, key, start, end, if_match),
        )

    # -- fsspec methods -----------------------------------------------------------------

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        inner = self._do("open", path, lambda: self.fs.open(path, mode, **kwargs))
        return _FaultyFile(self, inner, path)

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        return self._do(
            "cat_file", path, lambda: self.fs.cat_file(path, start=start, end=end, **kw)
        )

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kw: Any) -> Any:
        return self._do(
            "pipe_file",
            path,
            lambda: self.fs.pipe_file(path, value, mode=mode, **kw),
            up=len(value),
            truncated=lambda: self.fs.pipe_file(path, value[: len(value) // 2], mode=mode, **kw),
        )

    def info(self, path: str, **kw: Any) -> Any:
        return self._do("info", path, lambda: self.fs.info(path, **kw))

    def ls(self, path: str, detail: bool = True, **kw: Any) -> Any:
        return self._do("ls", path, lambda: self.fs.ls(path, detail=detail, **kw))

    def exists(self, path: str, **kw: Any) -> Any:
        return self._do("exists", path, lambda: self.fs.exists(path, **kw))

    def isdir(self, path: str) -> Any:
        return self._do("info", path, lambda: self.fs.isdir(path))

    def isfile(self, path: str) -> Any:
        return self._do("info", path, lambda: self.fs.isfile(path))

    def size(self, path: str) -> Any:
        return self._do("size", path, lambda: self.fs.size(path))

    def rm_file(self, path: str) -> Any:
        return self._do("rm_file", path, lambda: self.fs.rm_file(path))

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> Any:
        return self._do(
            "rm", str(path), lambda: self.fs.rm(path, recursive=recursive, maxdepth=maxdepth)
        )

    def mv(self, path1: str, path2: str, **kw: Any) -> Any:
        return self._do("mv", path2, lambda: self.fs.mv(path1, path2, **kw))

    def copy(self, path1: str, path2: str, **kw: Any) -> Any:
        return self._do("copy", path2, lambda: self.fs.copy(path1, path2, **kw))

    def makedirs(self, path: str, exist_ok: bool = False) -> Any:
        return self._do("makedirs", path, lambda: self.fs.makedirs(path, exist_ok=exist_ok))

    def mkdir(self, path: str, create_parents: bool = True, **kw: Any) -> Any:
        return self._do(
            "mkdir", path, lambda: self.fs.mkdir(path, create_parents=create_parents, **kw)
        )

    def rmdir(self, path: str) -> Any:
        return self._do("rmdir", path, lambda: self.fs.rmdir(path))


class _FaultyFile:
    """A file of a :class:`FaultyFileSystem`: ``write``, ``read`` and ``close`` are calls."""

    def __init__(self, owner: FaultyFileSystem, inner: Any, path: str) -> None:
        self._owner = owner
        self._inner = inner
        self._path = path
        self.closed = False

    def write(self, data: Any) -> Any:
        view = memoryview(data).cast("B")
        return self._owner._do(
            "write",
            self._path,
            lambda: self._inner.write(view),
            up=len(view),
            truncated=lambda: self._inner.write(view[: len(view) // 2]),
        )

    def read(self, length: int = -1) -> Any:
        return self._owner._do("read", self._path, lambda: self._inner.read(length))

    def close(self) -> None:
        if self.closed:
            return
        self._owner._do("close", self._path, self._inner.close)
        self.closed = True

    def discard(self) -> None:
        self.closed = True
        with contextlib.suppress(Exception):
            discard = getattr(self._inner, "discard", None)
            if discard is not None:
                discard()

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
