"""Test helpers that ship with asyncckpt: fault injection, a local S3 server, conformance.

Three public pieces, usable from any project's tests:

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
  names that :class:`~asyncckpt.objectstore.ObjectStorage` issues (``put_object``,
  ``create_multipart_upload``, ``upload_part``, ``complete_multipart_upload``,
  ``abort_multipart_upload``, ``head_object``, ``list_objects_v2``, ``delete_objects`` ...;
  ranged reads are ``cat_file``).
* :class:`MotoServer` — a real moto S3 server in a child process on ``127.0.0.1`` with a free
  port, for tests and benchmarks that talk HTTP to "S3" (needs ``moto[server]``).
* :class:`StorageConformanceSuite` — pytest tests that every :class:`~asyncckpt.storage.Storage`
  backend must pass. Subclass it and provide a ``storage_root`` fixture returning
  ``(storage, root)``::

      class TestMyBackend(StorageConformanceSuite):
          @pytest.fixture
          def storage_root(self, tmp_path):
              return LocalStorage(), str(tmp_path)
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.chained import ChainedFileSystem

from .errors import CheckpointNotFoundError, ConflictError, FormatError
from .objectstore import is_object_store
from .storage import Storage

__all__ = [
    "FAULT_KINDS",
    "S3_OPERATIONS",
    "TRANSIENT_KINDS",
    "Fault",
    "FaultEvent",
    "FaultPlan",
    "FaultyFileSystem",
    "MemoryS3FileSystem",
    "MotoServer",
    "StorageConformanceSuite",
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

#: The S3 calls :class:`~asyncckpt.objectstore.ObjectStorage` makes, plus ranged reads.
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
        ignore_conditional: drop ``IfNoneMatch`` from S3 writes, as a store without
            conditional writes would.
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
        ignore_conditional: bool = False,
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


def _injected(kind: str, op: str, call: int, s3: bool) -> BaseException:
    """The exception a real backend would raise for ``kind``."""
    where = f"[injected {kind} at {op} call {call}]"
    s3_errors = {
        "slowdown": ("SlowDown", 503, "Please reduce your request rate."),
        "server-error": ("InternalError", 500, "We encountered an internal error."),
        "denied": ("AccessDenied", 403, "Access Denied"),
        "no-bucket": ("NoSuchBucket", 404, "The specified bucket does not exist"),
    }
    if kind in s3_errors:
        code, status, message = s3_errors[kind]
        if s3:
            return _s3_error(code, status, f"{message} {where}", op)
        plain: dict[str, BaseException] = {
            "slowdown": OSError(errno.EBUSY, f"{message} {where}"),
            "server-error": OSError(errno.EIO, f"{message} {where}"),
            "denied": PermissionError(errno.EACCES, f"{message} {where}"),
            "no-bucket": FileNotFoundError(errno.ENOENT, f"{message} {where}"),
        }
        return plain[kind]
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
            if isinstance(result, (bytes, bytearray)) and result:
                plan.transfer(len(result), up=False, request=False)
            return result
        finally:
            plan.leave(op)

    # -- S3 API (present only when the wrapped filesystem is s3fs) ----------------------

    def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.plan.ignore_conditional:
            kwargs.pop("IfNoneMatch", None)
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

    def split_path(self, path: str) -> Any:
        return self.fs.split_path(path)

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


# -- an in-process S3 API, for simulations --------------------------------------------------


def _s3_error(code: str, status: int, message: str, op: str, **extra: str) -> BaseException:
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


class MemoryS3FileSystem(fsspec.AbstractFileSystem):  # type: ignore[misc]
    """The S3 calls :class:`~asyncckpt.objectstore.ObjectStorage` makes, served from memory.

    For simulations, not for tests of S3 behaviour (use :class:`MotoServer` for those): put
    it behind a :class:`FaultyFileSystem` to model a link's latency and bandwidth without a
    server's own cost (``faulty::s3mem://bucket/x``). Objects live in the instance (fsspec
    shares one instance per set of options, as for ``memory://``); buckets are created on
    first use. Conditional creates, multipart uploads and ranged reads behave as on S3;
    ETags are random tokens rather than MD5s, so that the store itself costs no CPU (a
    multipart ETag is derived from its parts' ETags as S3 derives it from their MD5s).
    """

    protocol = "s3mem"
    wraps_object_store = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.Lock()
        self._objects: dict[tuple[str, str], bytes] = {}
        self._etags: dict[tuple[str, str], str] = {}
        self._uploads: dict[str, tuple[str, str, dict[int, tuple[bytes, str]]]] = {}

    @staticmethod
    def _etag() -> str:
        return f'"{uuid.uuid4().hex}"'

    def call_s3(self, method: str, *args: Any, **kw: Any) -> dict[str, Any]:
        bucket, key = str(kw.get("Bucket", "")), str(kw.get("Key", ""))
        with self._lock:
            if method in ("create_bucket", "head_bucket"):
                return {}
            if method == "put_object":
                if kw.get("IfNoneMatch") == "*" and (bucket, key) in self._objects:
                    raise _s3_error(
                        "PreconditionFailed",
                        412,
                        "At least one of the pre-conditions you specified did not hold",
                        method,
                        Condition="If-None-Match",
                    )
                self._objects[(bucket, key)] = bytes(kw.get("Body") or b"")
                self._etags[(bucket, key)] = self._etag()
                return {"ETag": self._etags[(bucket, key)]}
            if method == "head_object":
                if (bucket, key) not in self._objects:
                    raise _s3_error("404", 404, "Not Found", method)
                data, etag = self._objects[(bucket, key)], self._etags[(bucket, key)]
                return {"ContentLength": len(data), "ETag": etag}
            if method == "delete_object":
                self._objects.pop((bucket, key), None)
                self._etags.pop((bucket, key), None)
                return {}
            if method == "delete_objects":
                for item in kw["Delete"]["Objects"]:
                    self._objects.pop((bucket, item["Key"]), None)
                    self._etags.pop((bucket, item["Key"]), None)
                return {}
            if method == "list_objects_v2":
                return self._list(bucket, kw)
            if method == "create_multipart_upload":
                upload_id = uuid.uuid4().hex
                self._uploads[upload_id] = (bucket, key, {})
                return {"UploadId": upload_id}
            if method in ("upload_part", "complete_multipart_upload", "abort_multipart_upload"):
                upload = self._uploads.get(str(kw.get("UploadId")))
                if upload is None or upload[:2] != (bucket, key):
                    raise _s3_error("NoSuchUpload", 404, "The upload does not exist", method)
                parts = upload[2]
                if method == "upload_part":
                    etag = self._etag()
                    parts[int(kw["PartNumber"])] = (bytes(kw["Body"]), etag)
                    return {"ETag": etag}
                del self._uploads[str(kw["UploadId"])]
                if method == "complete_multipart_upload":
                    numbers = [p["PartNumber"] for p in kw["MultipartUpload"]["Parts"]]
                    self._objects[(bucket, key)] = b"".join(parts[n][0] for n in numbers)
                    tags = b"".join(bytes.fromhex(parts[n][1].strip('"')) for n in numbers)
                    etag = f'"{hashlib.md5(tags).hexdigest()}-{len(numbers)}"'
                    self._etags[(bucket, key)] = etag
                    return {"ETag": etag}
                return {}
            if method == "list_multipart_uploads":
                prefix = str(kw.get("Prefix", ""))
                return {
                    "Uploads": [
                        {"Key": k, "UploadId": u}
                        for u, (b, k, _) in self._uploads.items()
                        if b == bucket and k.startswith(prefix)
                    ]
                }
        raise NotImplementedError(f"MemoryS3FileSystem does not implement {method}")

    def _list(self, bucket: str, kw: dict[str, Any]) -> dict[str, Any]:
        prefix, delimiter = str(kw.get("Prefix", "")), kw.get("Delimiter")
        keys = sorted(k for b, k in self._objects if b == bucket and k.startswith(prefix))
        contents, prefixes = [], set()
        for key in keys:
            rest = key[len(prefix) :]
            if delimiter and delimiter in rest:
                prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
            else:
                contents.append({"Key": key, "Size": len(self._objects[(bucket, key)])})
        limit = int(kw.get("MaxKeys", 1000))
        return {
            "Contents": contents[:limit],
            "CommonPrefixes": [{"Prefix": p} for p in sorted(prefixes)][:limit],
            "IsTruncated": False,
        }

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        bucket, _, key = self._strip_protocol(path).lstrip("/").partition("/")
        with self._lock:
            data = self._objects.get((bucket, key))
        if data is None:
            raise _s3_error("NoSuchKey", 404, "The specified key does not exist.", "get_object")
        start = start or 0
        if start >= len(data) and (start or end):
            raise _s3_error("InvalidRange", 416, "The requested range is not satisfiable", "get")
        return data[start:end]


# -- a local S3 server ----------------------------------------------------------------------

FAKE_ACCESS_KEY = "asyncckpt-fake-access-key"
FAKE_SECRET_KEY = "asyncckpt-fake-secret-key"

_SERVER_CODE = r"""
import logging, sys, threading
from werkzeug.serving import make_server
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication, MotoRequestHandler, create_backend_app)
logging.getLogger("werkzeug").setLevel(logging.ERROR)
app = DomainDispatcherApplication(create_backend_app)
lock = threading.Lock()

def serialized(environ, start_response):
    # moto checks If-None-Match / If-Match and then writes, without a lock between the two;
    # S3 does both atomically. Serialising conditional requests gives moto S3's semantics.
    if "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ:
        with lock:
            return app(environ, start_response)
    return app(environ, start_response)

server = make_server("127.0.0.1", 0, serialized, threaded=True,
                     request_handler=MotoRequestHandler)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdout.write(f"{server.server_port}\n")
sys.stdout.flush()
sys.stdin.read()  # returns when the parent closes stdin, or dies
"""


def fake_aws_environment() -> dict[str, str | None]:
    """Environment variables that keep boto away from real credentials and config files.

    A value of None means "unset". Apply them before creating any S3 filesystem.
    """
    missing = os.path.join(tempfile.gettempdir(), f"asyncckpt-no-aws-{uuid.uuid4().hex}")
    return {
        "AWS_ACCESS_KEY_ID": FAKE_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET_KEY,
        "AWS_SESSION_TOKEN": None,
        "AWS_SECURITY_TOKEN": None,
        "AWS_PROFILE": None,
        "AWS_DEFAULT_PROFILE": None,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_CONFIG_FILE": missing,
        "AWS_SHARED_CREDENTIALS_FILE": missing,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL": None,
        "AWS_ENDPOINT_URL_S3": None,
    }


class MotoServer:
    """A moto S3 server in a child process, listening on ``127.0.0.1`` on a free port.

    Args:
        min_part_bytes: the smallest multipart part the server accepts (S3: 5 MiB); tests
            lower it to exercise multipart uploads with small files.
        startup_timeout: seconds to wait for the server to listen.

    The child exits when :meth:`stop` is called or when this process dies (it watches its
    stdin). Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    region = "us-east-1"

    def __init__(self, *, min_part_bytes: int | None = None, startup_timeout: float = 60) -> None:
        self.min_part_bytes = min_part_bytes
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self._fs: Any = None
        self._fs_port: int | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._log: Any = None

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        if self.port is None:
            raise RuntimeError("the moto server is not running; call start() first")
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options that reach this server with fake credentials."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": FAKE_ACCESS_KEY,
            "secret": FAKE_SECRET_KEY,
            "client_kwargs": {"region_name": self.region},
        }

    def start(self) -> MotoServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update({k: v for k, v in fake_aws_environment().items() if v is not None})
        env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(64 << 20)
        if self.min_part_bytes is not None:
            env["S3_UPLOAD_PART_MIN_SIZE"] = str(self.min_part_bytes)
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop)
            prefix="asyncckpt-moto-", suffix=".log", delete=False
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
        )
        line: list[str] = []
        reader = threading.Thread(
            target=lambda: line.append(self._proc.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        reader.join(self.startup_timeout)
        if not line or not line[0].strip().isdigit():
            with open(self._log.name, errors="replace") as f:
                tail = f.read()[-2000:]
            self.stop()
            raise RuntimeError(f"the moto server did not start: {tail or 'no output'}")
        self.port = int(line[0])
        return self

    def stop(self) -> None:
        """Stop the server (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        with contextlib.suppress(OSError):
            proc.stdout.close()  # type: ignore[union-attr]
        self.port = None
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
                os.unlink(self._log.name)
            self._log = None

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def filesystem(self) -> Any:
        """An ``s3fs.S3FileSystem`` talking to this server (one per server)."""
        if self._fs is None or self._fs_port != self.port:
            self._fs = fsspec.filesystem("s3", skip_instance_cache=True, **self.storage_options)
            self._fs_port = self.port
        return self._fs

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (no error if it exists)."""
        with contextlib.suppress(FileExistsError):
            self.filesystem().call_s3("create_bucket", Bucket=name)

    def uploads(self, bucket: str, prefix: str = "") -> list[tuple[str, str]]:
        """``(key, upload_id)`` of the multipart uploads in progress under ``prefix``."""
        fs = self.filesystem()
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        return [(u["Key"], u["UploadId"]) for u in page.get("Uploads") or []]


# -- the storage conformance suite ----------------------------------------------------------


def _payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@contextlib.contextmanager
def _raises(kind: type[BaseException] | tuple[type[BaseException], ...]) -> Iterator[None]:
    try:
        yield
    except kind:
        return
    raise AssertionError(f"expected {kind}, nothing was raised")


class StorageConformanceSuite:
    """Behaviour every :class:`~asyncckpt.storage.Storage` backend must have.

    Subclass it in a ``test_*.py`` module and define a ``storage_root`` fixture that returns
    ``(storage, root)``: a backend and an empty directory (prefix) in it, unique per test.

    Class attributes a subclass may override:
        large_bytes: size of the "large" streamed file (make it span several multipart
            parts on an object store).
        racers: threads that race to create one file exclusively.
    """

    large_bytes = 1 << 20
    racers = 8

    # -- writes and reads ---------------------------------------------------------------

    def test_write_then_read(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "a.bin")
        data = _payload(10_000)
        storage.write_bytes(path, data)
        assert storage.exists(path)
        assert storage.size(path) == len(data)
        assert storage.read_bytes(path, 1 << 20) == data
        assert storage.read_range(path, 100, 50) == data[100:150]
        out = bytearray(300)
        assert storage.read_into(path, 9_800, memoryview(out)) == 200
        assert bytes(out[:200]) == data[9_800:]

    def test_streamed_large_write(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "large.bin")
        rng = random.Random(1)
        digest, total = hashlib.sha256(), 0
        with storage.atomic_write(path) as out:
            while total < self.large_bytes:
                piece = rng.randbytes(min(rng.randint(1, 300_000), self.large_bytes - total))
                out.write(piece if rng.random() < 0.5 else memoryview(piece))
                digest.update(piece)
                total += len(piece)
        assert storage.size(path) == total
        got = hashlib.sha256(storage.read_range(path, 0, total)).hexdigest()
        assert got == digest.hexdigest()
        middle = total // 2
        chunk = storage.read_range(path, middle, 1000)
        assert len(chunk) == 1000

    def test_empty_file(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "empty")
        storage.write_bytes(path, b"")
        assert storage.exists(path)
        assert storage.size(path) == 0
        assert storage.read_bytes(path, 10) == b""
        assert storage.read_range(path, 0, 10) == b""

    def test_overwrite_replaces(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "f")
        storage.write_bytes(path, b"old" * 1000)
        storage.write_bytes(path, b"new")
        assert storage.read_bytes(path, 1 << 20) == b"new"

    def test_invisible_until_commit(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "pending.bin")
        writer = storage.open_atomic(path)
        try:
            writer.write(_payload(1000))
            assert not storage.exists(path)
            assert "pending.bin" not in storage.list_dir(root)
            with _raises(CheckpointNotFoundError):
                storage.size(path)
        except BaseException:
            writer.abort()
            raise
        writer.commit()
        assert storage.exists(path)
        assert "pending.bin" in storage.list_dir(root)

    def test_abort_leaves_nothing(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "aborted.bin")
        writer = storage.open_atomic(path)
        writer.write(_payload(self.large_bytes))
        writer.abort()
        writer.abort()  # idempotent
        assert not storage.exists(path)
        assert storage.list_dir(root) == []

    def test_failure_keeps_previous_version(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "kept.bin")
        storage.write_bytes(path, b"version 1")

        class Boom(Exception):
            pass

        with _raises(Boom), storage.atomic_write(path) as out:
            out.write(_payload(self.large_bytes))
            raise Boom
        assert storage.read_bytes(path, 100) == b"version 1"
        assert storage.list_dir(root) == ["kept.bin"]

    def test_read_range_bounds(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "r")
        storage.write_bytes(path, b"0123456789")
        assert storage.read_range(path, 0, 0) == b""
        assert storage.read_range(path, 8, 10) == b"89"
        assert storage.read_range(path, 10, 5) == b""
        assert storage.read_range(path, 50, 5) == b""

    def test_missing_file(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "missing")
        assert not storage.exists(path)
        for call in (
            lambda: storage.size(path),
            lambda: storage.read_range(path, 0, 10),
            lambda: storage.read_bytes(path, 10),
        ):
            with _raises(CheckpointNotFoundError):
                call()
        assert issubclass(CheckpointNotFoundError, FileNotFoundError)

    def test_read_bytes_limit(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "big")
        storage.write_bytes(path, b"x" * 100)
        assert storage.read_bytes(path, 100) == b"x" * 100
        with _raises(FormatError):
            storage.read_bytes(path, 99)

    def test_parallel_reads(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "p")
        data = _payload(64_000)
        storage.write_bytes(path, data)
        ranges = [(i * 1000, 1000) for i in range(64)]
        with ThreadPoolExecutor(8) as ex:
            parts = list(ex.map(lambda r: storage.read_range(path, *r), ranges))
        assert b"".join(parts) == data

    # -- exclusive create ---------------------------------------------------------------

    def test_create_exclusive(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "sub", "COMMIT")
        storage.create_exclusive(path, b"first")
        with _raises(ConflictError):
            storage.create_exclusive(path, b"second")
        assert storage.read_bytes(path, 100) == b"first"

    def test_create_exclusive_race(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "race", "COMMIT")
        storage.create_exclusive(storage.join(root, "race", "warmup"), b"")  # probes, dirs
        barrier = threading.Barrier(self.racers)

        def attempt(i: int) -> bool:
            barrier.wait(30)
            try:
                storage.create_exclusive(path, f"writer {i}".encode())
            except ConflictError:
                return False
            return True

        with ThreadPoolExecutor(self.racers) as ex:
            won = list(ex.map(attempt, range(self.racers)))
        assert won.count(True) == 1, won
        assert storage.read_bytes(path, 100) == f"writer {won.index(True)}".encode()

    # -- listing and deleting -----------------------------------------------------------

    def test_list_dir(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        assert storage.list_dir(root) == []
        assert storage.list_dir(storage.join(root, "nope")) == []
        for name in ("b", "a", "d/x", "d/y/z", "dd/w"):
            storage.write_bytes(storage.join(root, *name.split("/")), name.encode())
        assert storage.list_dir(root) == ["a", "b", "d", "dd"]
        assert storage.list_dir(storage.join(root, "d")) == ["x", "y"]
        assert storage.exists(storage.join(root, "d"))

    def test_delete(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "gone")
        storage.delete(path)  # missing: fine
        storage.write_bytes(path, b"x")
        storage.delete(path)
        assert not storage.exists(path)
        assert storage.list_dir(root) == []

    def test_delete_tree(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        for name in ("1/a", "1/sub/b", "10/c", "2/d"):
            storage.write_bytes(storage.join(root, *name.split("/")), b"x")
        storage.delete_tree(storage.join(root, "1"))
        assert storage.list_dir(root) == ["10", "2"]
        assert storage.read_bytes(storage.join(root, "10", "c"), 10) == b"x"
        storage.delete_tree(storage.join(root, "missing"))  # missing: fine
        storage.delete_tree(storage.join(root, "1"))

    def test_describe_names_the_file(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "named.bin")
        assert "named.bin" in storage.describe(path)
        with _raises(CheckpointNotFoundError):
            try:
                storage.size(path)
            except CheckpointNotFoundError as exc:
                assert "named.bin" in str(exc)
                raise
