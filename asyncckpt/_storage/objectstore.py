"""Object storage (S3 and S3-compatible stores, through s3fs): atomic writes without renames.

A "rename" on an object store is a copy and a delete, neither atomic nor cheap, so
:class:`ObjectStorage` never renames. Every file is written at its final key:

* up to one part (``part_bytes``) of data: one ``PutObject``, which S3 applies whole or not
  at all;
* larger: a multipart upload whose parts are sent by a pool of threads while the caller
  keeps writing (at most ``part_concurrency`` parts in flight, so a writer holds at most
  ``(part_concurrency + 1) x part_bytes`` of memory). The object appears only when
  :meth:`AtomicWriter.commit` completes the upload; :meth:`AtomicWriter.abort`, or any
  failure, aborts the upload so that no parts are left behind.

:meth:`ObjectStorage.create_exclusive` is a conditional ``PutObject`` (``If-None-Match: *``):
of two writers creating one key, exactly one succeeds and the other gets
:class:`~asyncckpt.errors.ConflictError`. Whether the store honours the condition is probed
once per instance; a store that ignores it is used with a check-then-put that keeps the
guarantee only for writers that do not race (a warning says so; see ``docs/s3.md``).

Every request is retried on throttling (503 SlowDown), 5xx, 429, connection resets and
timeouts, with exponential backoff and jitter, bounded by ``retry_attempts`` and
``retry_deadline_s``; anything else (access denied, a missing bucket, a bad request) fails
at once with :class:`~asyncckpt.errors.StorageError` naming the bucket and key. Messages
and log lines never contain credentials: known secrets and credential-shaped strings are
redacted, and a backend exception that carried one is not chained.

Tunables (argument > the storage's :class:`~asyncckpt._settings.Settings`, resolved by
the entry point that built it): ``part_bytes``, ``part_concurrency``, ``retry_attempts``,
``retry_deadline_s``, ``retry_backoff_ms``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from asyncckpt._settings import Settings
from asyncckpt._storage.base import AtomicWriter, ReadHandle, Storage, temp_name
from asyncckpt._threads import pool
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    ConflictError,
    FileReplacedError,
    FormatError,
    RangeNotSatisfiable,
    StorageError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

#: fsspec protocols that :func:`asyncckpt._storage.resolve` routes to :class:`ObjectStorage`.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a"})
#: S3's limits: parts (except the last) of at least 5 MiB, at most 10,000 parts.
MIN_PART_BYTES = 5 << 20
MAX_PARTS = 10_000
#: Part size doubles every this many parts, so a file of unknown size never runs out of parts.
PARTS_PER_SIZE_STEP = 1_000
_MAX_BACKOFF_S = 10.0
_DELETE_BATCH = 1000
_MAX_TAGGED_BYTES = 1 << 20  # the records compared after a 412 (VERSION) are far smaller

# Indirection so tests can drive the retry loop with a fake clock.
_clock: Callable[[], float] = time.monotonic
_sleep: Callable[[float], None] = time.sleep

_RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ConditionalRequestConflict",
        "OperationAborted",
    }
)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_RETRY_ERRNOS = frozenset(
    {errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE}
    | ({errno.EREMOTEIO} if hasattr(errno, "EREMOTEIO") else set())
)


def is_object_store(fs: Any) -> bool:
    """Whether ``fs`` is (or wraps, like ``faulty::s3``) an S3-API object store."""
    marker = getattr(fs, "wraps_object_store", None)
    if marker is not None:
        return bool(marker)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & OBJECT_STORE_PROTOCOLS) and callable(getattr(fs, "call_s3", None))


def _single_retry_layer(fs: Any) -> None:
    """Switch off s3fs's own retry loop (``retries``) under this module's.

    Two layers of retries hide lost responses from the one that decides: a ``PutObject``
    whose response was lost and that s3fs retried returns 412 to us as if another writer
    had won. With one layer, :meth:`ObjectStorage.request` sees every try.
    """
    current, depth = fs, 0
    while current is not None and depth < 4:
        if type(getattr(type(current), "retries", None)) is int:
            current.retries = 1
        current, depth = getattr(current, "fs", None), depth + 1


def prepare_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Storage options for ``url`` with asyncckpt's defaults for S3 filled in.

    botocore's own retries are switched off (unless the caller configured them) so that
    :class:`ObjectStorage`'s policy alone decides how often and how long a request is
    retried, and the connection pool is sized for parallel parts and reads.
    """
    chain = [p.split("://", 1)[0] for p in url.split("::")]
    protocol = chain[-1] if len(chain) > 1 else chain[0]
    if protocol not in OBJECT_STORE_PROTOCOLS:
        return options
    out = dict(options)
    if len(chain) > 1:
        target = dict(out.get(protocol) or {})
        out[protocol] = target
    else:
        target = out
    kwargs = dict(target.get("config_kwargs") or {})
    kwargs.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    kwargs.setdefault("max_pool_connections", 64)
    target["config_kwargs"] = kwargs
    return out


# -- errors ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Failure:
    """What a backend exception means: its kind, S3 code and HTTP status if known."""

    kind: str  # retry | conflict | missing | no-bucket | range | fatal
    code: str | None
    status: int | None
    message: str


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 8:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _response(exc: BaseException) -> dict[str, Any] | None:
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):
            return response
    return None


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        import asyncio

        types.append(asyncio.TimeoutError)
    except ImportError:  # pragma: no cover
        pass
    try:
        from botocore import exceptions as bce

        types += [bce.HTTPClientError, bce.IncompleteReadError]
        if hasattr(bce, "ResponseStreamingError"):
            types.append(bce.ResponseStreamingError)
    except ImportError:
        pass
    try:
        import aiohttp

        types.append(aiohttp.ClientError)
    except ImportError:
        pass
    return tuple(types)


_TRANSIENT: tuple[type[BaseException], ...] | None = None


def classify(exc: BaseException) -> _Failure:
    """Decide what a backend exception means for the retry loop.

    Example:
        >>> classify(ConnectionResetError(104, "Connection reset by peer")).kind
        'retry'
        >>> classify(PermissionError("Access Denied")).kind
        'fatal'
    """
    global _TRANSIENT
    if _TRANSIENT is None:
        _TRANSIENT = _transient_types()
    response = _response(exc)
    if response is not None:
        error = response.get("Error") or {}
        code = error.get("Code") or None
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        message = str(error.get("Message") or exc)
        if code in _RETRY_CODES or status in _RETRY_STATUS:
            return _Failure("retry", code, status, message)
        if code == "PreconditionFailed" or status == 412:
            return _Failure("conflict", code, status, message)
        if code == "InvalidRange" or status == 416:
            return _Failure("range", code, status, message)
        if code == "NoSuchBucket":
            return _Failure("no-bucket", code, status, message)
        if code in ("NoSuchKey", "NoSuchUpload", "NotFound") or status == 404:
            return _Failure("missing", code, status, message)
        return _Failure("fatal", code, status, message)
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, _TRANSIENT):
        return _Failure("retry", None, None, message)
    if isinstance(exc, FileNotFoundError):
        return _Failure("missing", None, None, message)
    if isinstance(exc, FileExistsError):
        return _Failure("conflict", None, None, message)
    if isinstance(exc, OSError) and exc.errno in _RETRY_ERRNOS:
        return _Failure("retry", None, None, message)
    return _Failure("fatal", None, None, message)


def _denied(exc: BaseException) -> bool:
    """Whether a request failed with 403 Access Denied (as its chained cause says)."""
    cause = exc.__cause__
    if cause is None:
        return False
    return isinstance(cause, PermissionError) or classify(cause).status == 403


_unreadable_lock = threading.Lock()
_unreadable: set[str] = set()


def _warn_markers_unreadable(label: str, bucket: str, exc: BaseException) -> None:
    with _unreadable_lock:
        if bucket in _unreadable:
            return
        _unreadable.add(bucket)
    log.warning(
        "%s%s: save markers cannot be read (%s); loads there do not wait for other "
        "processes' saves in flight. Allow s3:ListBucket (S3 then answers 404 for a "
        "missing marker) and s3:GetObject on *.ackpending (docs/PROTOCOL.md §8)",
        label,
        bucket,
        exc,
    )


_CREDENTIAL_PATTERNS = (
    (re.compile(r"\b(AKIA|ASIA|AROA|AIDA)[A-Z0-9]{12,}\b"), r"\1****"),
    (re.compile(r"(Signature=)[0-9a-fA-F]{16,}"), r"\1****"),
    (re.compile(r"(Credential=)[^\s,/&]+"), r"\1****"),
    (re.compile(r"(X-Amz-Security-Token=)[^\s&]+", re.IGNORECASE), r"\1****"),
    (re.compile(r"(aws_secret_access_key\s*[=:]\s*)\S+", re.IGNORECASE), r"\1****"),
)
_SECRET_FIELD = re.compile(r"key|secret|token|password|credential", re.IGNORECASE)


def _collect_secrets(value: Any, out: set[str], field: str = "", depth: int = 0) -> None:
    if depth > 4:
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _collect_secrets(v, out, str(k), depth + 1)
    elif isinstance(value, str) and _SECRET_FIELD.search(field) and len(value) >= 4:
        out.add(value)


def secrets_of(fs: Any) -> tuple[str, ...]:
    """Credential strings that ``fs`` (or a filesystem it wraps) or the environment holds."""
    found: set[str] = set()
    current, depth = fs, 0
    while current is not None and depth < 4:
        for attr in ("key", "secret", "token"):
            value = getattr(current, attr, None)
            if isinstance(value, str) and len(value) >= 4:
                found.add(value)
        _collect_secrets(getattr(current, "storage_options", None), found)
        current, depth = getattr(current, "fs", None), depth + 1
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        value = os.environ.get(name, "")
        if len(value) >= 4:
            found.add(value)
    return tuple(sorted(found, key=len, reverse=True))


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with every secret and credential-shaped substring replaced by ``****``.

    Example:
        >>> redact("key AKIAABCDEFGHIJKLMNOP and hunter22", ("hunter22",))
        'key AKIA**** and ****'
    """
    for secret in secrets:
        text = text.replace(secret, "****")
    for pattern, replacement in _CREDENTIAL_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def _leaks(exc: BaseException, secrets: tuple[str, ...]) -> bool:
    for e in _chain(exc):
        texts = [str(e), repr(getattr(e, "response", ""))]
        if any(redact(t, secrets) != t for t in texts):
            return True
    return False


# -- the storage ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How a request is retried: at most ``attempts`` tries within ``deadline_s`` seconds.

    The delay before retry ``n`` (1-based) is drawn uniformly from ``[d/2, d]`` with
    ``d = min(10 s, backoff_s * 2**(n-1))`` ("equal jitter").
    """

    attempts: int
    deadline_s: float
    backoff_s: float

    def delay(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        cap = min(_MAX_BACKOFF_S, self.backoff_s * 2.0 ** (retry - 1))
        return cap / 2 + rng.uniform(0, cap / 2)


class _Attempts:
    """Counts the tries of one logical request (to recognise an ambiguous retry)."""

    def __init__(self) -> None:
        self.count = 0
        self.failed_transiently = False


class ObjectStorage(Storage):
    """S3 (or an S3-compatible store) through an s3fs filesystem, with no renames.

    Args:
        fs: an ``s3fs.S3FileSystem`` (or a wrapper exposing its ``call_s3`` and
            ``cat_file``, such as :class:`asyncckpt.testing.FaultyFileSystem`).
        part_bytes: multipart part size (default: the ``part_bytes`` tunable).
        part_concurrency: parts uploaded in parallel per file (``part_concurrency``).
        retry_attempts: tries per request on transient errors (``retry_attempts``).
        retry_deadline_s: seconds after which a request is no longer retried.
        retry_backoff_ms: delay before the first retry, doubled per retry.
        conditional_writes: whether the store honours ``If-None-Match: *`` and
            ``If-Match``; None probes it once, on the first conditional write.
        allow_unconditional: use a store that does not honour them anyway (unsafe with two
            writers on one root; the ``unsafe_unconditional_writes`` storage option).
        label: the URL prefix used in messages (default ``s3://``).
        settings: the tunables the arguments above do not set (None: resolved now).

    Paths are ``bucket/key`` (no scheme), as :func:`asyncckpt._storage.resolve` returns.
    """

    def __init__(
        self,
        fs: Any,
        *,
        part_bytes: int | None = None,
        part_concurrency: int | None = None,
        retry_attempts: int | None = None,
        retry_deadline_s: int | None = None,
        retry_backoff_ms: int | None = None,
        conditional_writes: bool | None = None,
        allow_unconditional: bool = False,
        label: str = "s3://",
        settings: Settings | None = None,
    ) -> None:
        if not callable(getattr(fs, "call_s3", None)):
            raise TypeError(
                f"ObjectStorage needs an S3-API filesystem (s3fs), got {type(fs).__qualname__}"
            )
        self.fs = fs
        self.label = label
        # An in-memory store (the test suite's s3mem://) cannot be written by another process.
        self.process_local = bool(getattr(fs, "process_local", False))
        base = Settings.resolve() if settings is None else settings
        self.settings = base.replace(  # validated now
            part_bytes=part_bytes,
            part_concurrency=part_concurrency,
            retry_attempts=retry_attempts,
            retry_deadline_s=retry_deadline_s,
            retry_backoff_ms=retry_backoff_ms,
        )
        self.conditional_writes = conditional_writes
        self.allow_unconditional = allow_unconditional
        self._probe_lock = threading.Lock()
        _single_retry_layer(fs)
        self._secrets = secrets_of(fs)
        self._rng = random.Random()

    def __repr__(self) -> str:
        return f"ObjectStorage({self.label!r})"

    def __getstate__(self) -> dict[str, Any]:
        """For a writer process: the lock and the random source are rebuilt there."""
        state = dict(self.__dict__)
        del state["_probe_lock"], state["_rng"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._probe_lock = threading.Lock()
        self._rng = random.Random()
        _single_retry_layer(self.fs)  # a filesystem rebuilt by unpickling has its defaults

    # -- settings and plumbing --------------------------------------------------------------

    def setting(self, name: str) -> int:
        """A tunable as this storage uses it (argument > its settings)."""
        value: int = getattr(self.settings, name)
        return value

    def policy(self) -> RetryPolicy:
        """The retry policy for the next request."""
        return RetryPolicy(
            attempts=self.setting("retry_attempts"),
            deadline_s=float(self.setting("retry_deadline_s")),
            backoff_s=self.setting("retry_backoff_ms") / 1000.0,
        )

    @staticmethod
    def split(path: str) -> tuple[str, str]:
        """``(bucket, key)`` of a ``bucket/key`` path."""
        bucket, _, key = path.lstrip("/").partition("/")
        return bucket, key

    def _redact(self, text: str) -> str:
        return redact(text, self._secrets)

    def _error(
        self, path: str, action: str, exc: BaseException, failure: _Failure, tries: int
    ) -> AsyncCkptError:
        """The asyncckpt error for a failed request (naming bucket and key, no secrets)."""
        bucket, key = self.split(path)
        where = self.describe(path)
        what = failure.code or ""
        if failure.status:
            what = f"{what} (HTTP {failure.status})".strip()
        detail = f"{what}: {failure.message}" if what else failure.message
        after = f" after {tries} attempts" if tries > 1 else ""
        err: AsyncCkptError
        if failure.kind == "no-bucket":
            err = StorageError(
                f"{where}: {action} failed: bucket {bucket!r} does not exist ({detail})"
            )
        elif failure.kind == "missing":
            err = CheckpointNotFoundError(f"{where}: no such object ({detail})")
        elif failure.kind == "conflict":
            err = ConflictError(f"{where} already exists ({detail})")
        elif failure.kind == "range":
            err = RangeNotSatisfiable(f"{where}: {action}: {detail}")
        else:
            hint = ""
            if failure.status == 403 or isinstance(exc, PermissionError):
                hint = (
                    f"; check the credentials and that they may {action.split()[0]} "
                    f"key {key!r} in bucket {bucket!r}"
                )
            elif failure.kind == "retry":
                hint = " (transient errors persisted; see the retry_* tunables)"
            err = StorageError(f"{where}: {action} failed{after}: {detail}{hint}")
        message = self._redact(str(err))
        if message != str(err):
            err.args = (message,)
        if _leaks(exc, self._secrets):
            err.__cause__ = None
            err.__suppress_context__ = True
        else:
            err.__cause__ = exc
        return err

    def request(
        self,
        action: str,
        path: str,
        fn: Callable[[], T],
        attempts: _Attempts | None = None,
    ) -> T:
        """Run one backend request with the retry policy; raise asyncckpt errors only."""
        policy = self.policy()
        deadline = _clock() + policy.deadline_s
        tries = attempts or _Attempts()
        retry = 0
        while True:
            tries.count += 1
            error: AsyncCkptError | None = None
            try:
                return fn()
            except Exception as exc:
                failure = classify(exc)
                if failure.kind == "retry":
                    tries.failed_transiently = True
                    retry += 1
                    pause = policy.delay(retry, self._rng)
                    if retry >= policy.attempts or _clock() + pause > deadline:
                        error = self._error(path, action, exc, failure, tries.count)
                else:
                    error = self._error(path, action, exc, failure, tries.count)
            if error is not None:
                raise error  # outside the except block: no implicit chaining of secrets
            log.info(
                "%s of %s failed (%s); retry %d of %d in %.2f s",
                action,
                self.describe(path),
                self._redact(failure.message),
                retry,
                policy.attempts - 1,
                pause,
            )
            _sleep(pause)

    def call(
        self,
        action: str,
        path: str,
        method: str,
        attempts: _Attempts | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """One S3 API call (``method``, e.g. ``"put_object"``) on ``path``'s bucket, retried."""
        bucket, key = self.split(path)
        if "Key" in kwargs and kwargs["Key"] is None:
            kwargs["Key"] = key
        result: dict[str, Any] = self.request(
            action, path, lambda: self.fs.call_s3(method, Bucket=bucket, **kwargs), attempts
        )
        return result

    # -- writing ----------------------------------------------------------------------------

    def open_atomic(self, path: str) -> AtomicWriter:
        bucket, key = self.split(path)
        if not bucket or not key:
            raise StorageError(f"{self.describe(path)}: expected s3://bucket/key")
        return _ObjectWriter(self, path)

    def put(
        self,
        path: str,
        data: bytes | bytearray,
        attempts: _Attempts | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """One ``PutObject`` of ``data`` at ``path`` (retried)."""
        return self.call("write", path, "put_object", attempts, Key=None, Body=data, **kwargs)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self._require_conditional_writes(path)
        if not self.conditional_writes:
            self._create_best_effort(path, data)
            return
        try:
            self.put(path, data, IfNoneMatch="*")
        except ConflictError:
            # A retried request (ours, or one inside the client library) may find the
            # object that its own first try created before the response was lost: the bytes
            # of every record are unique (a token and a time stamp), so equal bytes are ours.
            if self._holds(path, data):
                return
            raise ConflictError(f"{self.describe(path)} already exists") from None

    def read_marker(self, path: str, limit: int) -> bytes | None:
        bucket, key = self.split(path)
        try:
            data: bytes = self.request(
                "read",
                path,
                lambda: self.fs.cat_file(f"{bucket}/{key}", start=0, end=limit + 1),
            )
        except CheckpointNotFoundError:  # the common case: one GET, no HEAD of the bucket
            return None
        except RangeNotSatisfiable:  # an empty object
            return b""
        except StorageError as exc:
            # Without s3:ListBucket, S3 answers a GET of a missing key with 403, not 404:
            # a reader allowed to read the data must not fail on a marker it cannot see.
            if not _denied(exc):
                raise
            _warn_markers_unreadable(self.label, bucket, exc)
            return None
        if len(data) > limit:
            raise FormatError(f"{self.describe(path)}: larger than {limit} bytes")
        return data

    def write_marker(self, path: str, data: bytes, replacing: str | None = None) -> str:
        # One PUT (whole or nothing); with ``replacing``, conditional on the ETag (If-Match),
        # so a heartbeat can never bring back a marker that was deleted or replaced.
        condition: dict[str, Any] = {} if replacing is None else {"IfMatch": replacing}
        try:
            return str(self.put(path, data, None, **condition)["ETag"])
        except (ConflictError, CheckpointNotFoundError):
            if replacing is None:
                raise
            found = self.read_tagged(path, max(len(data), _MAX_TAGGED_BYTES))
            if found is not None and found[0] == data:  # our own write, response lost
                return found[1]
            raise ConflictError(
                f"{self.describe(path)} was replaced or removed by another writer"
            ) from None

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str] | None:
        head = self._head(path)
        if head is None:
            return None
        # The ETag comes first: if the object changes between the two requests, the tag is
        # the older one, so a replace_if with it fails instead of overwriting unseen data.
        try:
            data = self.read_bytes(path, limit)
        except CheckpointNotFoundError:
            return None
        return data, str(head["ETag"])

    def replace_if(self, path: str, data: bytes, tag: str | None) -> str:
        self._require_conditional_writes(path)
        if not self.conditional_writes:
            return self._replace_best_effort(path, data, tag)
        condition: dict[str, Any] = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        try:
            return str(self.put(path, data, None, **condition)["ETag"])
        except (ConflictError, CheckpointNotFoundError):
            found = self.read_tagged(path, max(len(data), _MAX_TAGGED_BYTES))
            if found is not None and found[0] == data:  # our own write, response lost
                return found[1]
            raise ConflictError(
                f"{self.describe(path)} was replaced by another writer since this one read it"
            ) from None

    def _replace_best_effort(self, path: str, data: bytes, tag: str | None) -> str:
        head = self._head(path)
        current = None if head is None else str(head["ETag"])
        if current != tag:
            raise ConflictError(f"{self.describe(path)} was replaced by another writer")
        return str(self.put(path, data)["ETag"])

    def _holds(self, path: str, data: bytes) -> bool:
        try:
            return self.read_range(path, 0, len(data) + 1) == data
        except CheckpointNotFoundError:
            return False

    def _create_best_effort(self, path: str, data: bytes) -> None:
        # Without conditional writes: refuse if it exists, write, then check what won.
        if self._object_exists(path):
            raise ConflictError(f"{self.describe(path)} already exists")
        self.put(path, data)
        if not self._holds(path, data):
            raise ConflictError(f"{self.describe(path)} was created concurrently by another writer")

    def _require_conditional_writes(self, path: str) -> None:
        """Probe (once) whether the store honours ``If-None-Match``/``If-Match``.

        Raises:
            StorageError: it does not, and the user did not opt in to unconditional writes.
        """
        with self._probe_lock:
            if self.conditional_writes is None:
                self.conditional_writes = self._probe_conditional_writes(path)
        if self.conditional_writes or self.allow_unconditional:
            return
        raise StorageError(
            f"{self.label}{self.split(path)[0]}: the store ignores conditional writes "
            "(If-None-Match/If-Match), so two writers could both commit or move the version "
            "file backwards. Use a store that honours them (AWS S3, SeaweedFS, MinIO), or "
            "pass storage_options={'unsafe_unconditional_writes': True} if only one writer "
            "can ever write to this root (docs/s3.md)"
        )

    def _probe_conditional_writes(self, path: str) -> bool:
        """Whether the store refuses a ``PutObject`` whose condition does not hold.

        Puts a probe object, then puts it again with ``If-None-Match: *`` and with
        ``If-Match`` on an ETag it cannot have: a store that honours both refuses both. An
        answer that is neither a refusal nor an acceptance (a timeout, a 5xx) proves
        nothing, so the probe is repeated, never taken as "unsupported".
        """
        probe = temp_name(path)
        bucket, key = self.split(probe)
        wrong_etag = '"' + "0" * 32 + '"'

        def outcome(**condition: str) -> str:
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"probe", **condition)
            except Exception as exc:
                failure = classify(exc)
                if failure.kind == "conflict":
                    return "honoured"
                if failure.kind == "fatal" and failure.status in (400, 501):
                    return f"rejected ({failure.code or failure.status})"
                raise
            return "ignored"

        self.put(probe, b"probe")
        try:
            results = {
                "If-None-Match": self.request(
                    "probe conditional writes", probe, lambda: outcome(IfNoneMatch="*")
                ),
                "If-Match": self.request(
                    "probe conditional writes", probe, lambda: outcome(IfMatch=wrong_etag)
                ),
            }
        finally:
            self.delete(probe)
        if all(r == "honoured" for r in results.values()):
            return True
        log.warning(
            "%s%s: the store does not honour conditional writes (%s)",
            self.label,
            bucket,
            ", ".join(f"{k}: {v}" for k, v in results.items()),
        )
        return False

    # -- reading ----------------------------------------------------------------------------

    def size(self, path: str) -> int:
        head = self._head(path)
        if head is None:
            raise self._not_found(path)
        return int(head["ContentLength"])

    def _head(self, path: str) -> dict[str, Any] | None:
        try:
            return self.call("stat", path, "head_object", Key=None)
        except CheckpointNotFoundError:
            return None

    def _not_found(self, path: str) -> AsyncCkptError:
        bucket, _ = self.split(path)
        try:
            self.call("stat", bucket, "head_bucket")
        except CheckpointNotFoundError:
            return StorageError(f"{self.describe(path)}: bucket {bucket!r} does not exist")
        except StorageError as exc:
            return exc
        return CheckpointNotFoundError(f"{self.describe(path)}: no such file")

    def read_range(self, path: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        bucket, key = self.split(path)
        try:
            data: bytes = self.request(
                "read",
                path,
                lambda: self.fs.cat_file(f"{bucket}/{key}", start=start, end=start + length),
            )
        except RangeNotSatisfiable:
            return b""
        except CheckpointNotFoundError as exc:
            raise self._not_found(path) from exc
        return data

    def open_read(self, path: str) -> ReadHandle:
        """The object as it is now: its size and ETag from one ``HeadObject``, and every
        ranged read sent with ``If-Match`` on that ETag (and the ETag of each response
        compared with it, for stores that ignore the header). A read of an object replaced
        since raises :class:`~asyncckpt.errors.FileReplacedError`; the load starts over.
        """
        return _ObjectHandle(self, path)

    def read_bytes(self, path: str, limit: int) -> bytes:
        data = self.read_range(path, 0, limit + 1)  # one request, not a HEAD and a GET
        if len(data) > limit:
            raise FormatError(f"{self.describe(path)}: larger than {limit} bytes")
        if not data and not self._object_exists(path):
            raise self._not_found(path)
        return data

    def exists(self, path: str) -> bool:
        if self._object_exists(path):
            return True
        return bool(self._list(path, delimiter=True, max_keys=1))

    def _object_exists(self, path: str) -> bool:
        _, key = self.split(path)
        return bool(key) and self._head(path) is not None

    # -- listing and deleting ---------------------------------------------------------------

    def _list(self, path: str, *, delimiter: bool, max_keys: int | None = None) -> list[str]:
        """Keys (and, with ``delimiter``, common prefixes) below ``path`` + ``/``."""
        _, key = self.split(path)
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        out: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = "/"
            if max_keys is not None:
                kwargs["MaxKeys"] = max_keys
            if token:
                kwargs["ContinuationToken"] = token
            page = self.call("list", path, "list_objects_v2", **kwargs)
            out += [c["Key"] for c in page.get("Contents") or []]
            out += [p["Prefix"] for p in page.get("CommonPrefixes") or []]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token or max_keys is not None:
                return out

    def list_dir(self, path: str) -> list[str]:
        _, key = self.split(path)
        cut = len(key.rstrip("/") + "/") if key.strip("/") else 0
        names = {k[cut:].rstrip("/") for k in self._list(path, delimiter=True)}
        # A directory exists while a file in it is being written, as on a local disk (where
        # the temp file shows): so recovery and retention find, and delete_tree aborts, the
        # uploads that a killed writer left in a step directory with no object yet.
        names |= {k[cut:].split("/", 1)[0] for k, _ in self.uploads(path) if "/" in k[cut:]}
        names.discard("")
        return sorted(names)

    def delete(self, path: str) -> None:
        with contextlib.suppress(CheckpointNotFoundError):
            self.call("delete", path, "delete_object", Key=None)

    def abort_unfinished(self, path: str, *, exact: bool = False) -> None:
        self.abort_uploads(path, exact=exact)

    def delete_tree(self, path: str) -> None:
        bucket, key = self.split(path)
        keys = self._list(path, delimiter=False)
        if key.strip("/") and self._object_exists(path):
            keys.append(key)
        # Stores with a real namespace (SeaweedFS's filer) keep a "directory" listed as a
        # common prefix after its last object is gone; deleting its marker key removes it.
        # On S3 the markers do not exist and deleting them is a no-op.
        keys += _directory_markers(key, keys) if keys else []
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i : i + _DELETE_BATCH]
            result = self.call(
                "delete",
                path,
                "delete_objects",
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            errors = result.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    f"{self.label}{bucket}/{first.get('Key')}: delete failed: "
                    f"{first.get('Code')}: {self._redact(str(first.get('Message')))}"
                )
        self.abort_uploads(path)

    def uploads(self, path: str, *, exact: bool = False) -> list[tuple[str, str]]:
        """``(key, upload_id)`` of every multipart upload in progress below ``path`` (or,
        with ``exact``, of the object ``path`` itself)."""
        _, key = self.split(path)
        prefix = key if exact else key.rstrip("/") + "/" if key.strip("/") else ""
        out: list[tuple[str, str]] = []
        markers: dict[str, Any] = {}
        while True:
            page = self.call("list", path, "list_multipart_uploads", Prefix=prefix, **markers)
            out += [
                (u["Key"], u["UploadId"])
                for u in page.get("Uploads") or []
                if not exact or u["Key"] == key
            ]
            if not page.get("IsTruncated"):
                return out
            markers = {
                "KeyMarker": page.get("NextKeyMarker") or "",
                "UploadIdMarker": page.get("NextUploadIdMarker") or "",
            }

    def abort_uploads(self, path: str, *, exact: bool = False, keep: str | None = None) -> int:
        """Abort the multipart uploads in progress below ``path`` (or, with ``exact``, of
        the object ``path``), except upload ``keep``; returns how many were aborted.

        Parts of an upload that is never completed or aborted are stored (and billed) for
        ever, so ``delete_tree`` calls this, which makes ``Checkpointer`` recovery and
        retention clean up after writers that were killed mid-upload. A bucket lifecycle
        rule (``AbortIncompleteMultipartUpload``) is the backstop for drop-in saves.
        """
        bucket, _ = self.split(path)
        found = [(k, u) for k, u in self.uploads(path, exact=exact) if u != keep]
        for key, upload_id in found:
            with contextlib.suppress(CheckpointNotFoundError):
                self.call(
                    "abort upload",
                    f"{bucket}/{key}",
                    "abort_multipart_upload",
                    Key=key,
                    UploadId=upload_id,
                )
        return len(found)


class _ObjectHandle(ReadHandle):
    """An object pinned to its ETag: ranged ``GetObject`` requests with ``If-Match``."""

    def __init__(self, storage: ObjectStorage, path: str) -> None:
        head = storage._head(path)
        if head is None:
            raise storage._not_found(path)
        super().__init__(storage.describe(path), int(head["ContentLength"]))
        self.storage, self.path = storage, path
        self.etag = str(head.get("ETag") or "") or None

    def read_range(self, start: int, length: int) -> bytes:
        if length <= 0 or start >= self.size:
            return b""
        bucket, key = self.storage.split(self.path)
        end = min(start + length, self.size)
        try:
            data, etag = self.storage.request(
                "read",
                self.path,
                lambda: ranged_get(self.storage.fs, bucket, key, start, end, self.etag),
            )
        except ConflictError as exc:  # 412: If-Match failed, another object is there now
            raise self._replaced("the store refused to read it (412 Precondition Failed)") from exc
        except RangeNotSatisfiable as exc:  # 416: a shorter object is there now
            raise self._replaced("a read past the end of the new object failed (416)") from exc
        except CheckpointNotFoundError as exc:
            raise self.storage._not_found(self.path) from exc
        if self.etag is not None and etag is not None and etag != self.etag:
            raise self._replaced(f"a read returned ETag {etag}")
        return data

    def _replaced(self, how: str) -> FileReplacedError:
        return FileReplacedError(
            self.name,
            f"the object was replaced while it was being loaded (its ETag was {self.etag}; {how})",
        )


def ranged_get(
    fs: Any, bucket: str, key: str, start: int, end: int, if_match: str | None
) -> tuple[bytes, str | None]:
    """Bytes ``[start, end)`` of object ``bucket/key``, only while its ETag is ``if_match``.

    One ``GetObject`` with ``Range`` and ``If-Match`` (when ``if_match`` is given): a store
    that honours it answers 412 for an object replaced since. A filesystem that defines
    ``asyncckpt_ranged_get(bucket, key, start, end, if_match)`` (the fault wrapper, the
    in-memory S3) serves it; s3fs is called directly (its ``cat_file`` takes no request
    headers); anything else gets a plain ranged ``cat_file``, unpinned.

    Returns:
        The bytes, and the response's ETag (None where the filesystem does not say).
    """
    own = getattr(fs, "asyncckpt_ranged_get", None)
    if own is not None:
        result: tuple[bytes, str | None] = own(bucket, key, start, end, if_match)
        return result
    if callable(getattr(fs, "_call_s3", None)) and getattr(fs, "loop", None) is not None:
        from fsspec.asyn import sync

        result = sync(fs.loop, _s3fs_ranged_get, fs, bucket, key, start, end, if_match)
        return result
    data: bytes = fs.cat_file(f"{bucket}/{key}", start=start, end=end)
    return data, None


async def _s3fs_ranged_get(
    fs: Any, bucket: str, key: str, start: int, end: int, if_match: str | None
) -> tuple[bytes, str | None]:
    condition = {"IfMatch": if_match} if if_match else {}
    response = await fs._call_s3(
        "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **condition
    )
    try:
        data: bytes = await response["Body"].read()
    finally:
        response["Body"].close()
    etag = response.get("ETag")
    return data, None if etag is None else str(etag)


class _ObjectWriter(AtomicWriter):
    """One object being written: a single PUT, or a multipart upload with parallel parts."""

    def __init__(self, storage: ObjectStorage, path: str) -> None:
        self.storage = storage
        self.path = path
        self.part_bytes = storage.setting("part_bytes")
        self.concurrency = storage.setting("part_concurrency")
        self.buffer = bytearray()
        self.size = 0
        self.upload_id: str | None = None
        self.next_part = 1
        self.etags: dict[int, str] = {}
        self.futures: list[Future[None]] = []
        self.slots = threading.BoundedSemaphore(self.concurrency)
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.finished = False

    def _part_limit(self) -> int:
        return self.part_bytes << ((self.next_part - 1) // PARTS_PER_SIZE_STEP)

    def _raise_part_error(self) -> None:
        with self.lock:
            error = self.error
        if error is not None:
            raise error

    def write(self, data: bytes | memoryview) -> None:
        if self.finished:
            raise StorageError(f"{self.storage.describe(self.path)}: write after commit/abort")
        self._raise_part_error()
        view = memoryview(data).cast("B")
        while len(view):
            limit = self._part_limit()
            if len(self.buffer) >= limit:  # a full part is sent only once more data comes,
                self._send_part()  # so a file of exactly one part stays a single PUT
                continue
            take = view[: limit - len(self.buffer)]
            self.buffer += take
            self.size += len(take)
            view = view[len(take) :]

    def _send_part(self) -> None:
        if self.next_part > MAX_PARTS:
            raise StorageError(
                f"{self.storage.describe(self.path)}: more than {MAX_PARTS} parts; "
                "raise the part_bytes tunable"
            )
        if self.upload_id is None:
            attempts = _Attempts()
            try:
                started = self.storage.call(
                    "start upload", self.path, "create_multipart_upload", attempts, Key=None
                )
            except AsyncCkptError:
                if attempts.failed_transiently:  # a try whose response was lost may have
                    self._abort_strays(None)  # started an upload that nobody knows of
                raise
            self.upload_id = str(started["UploadId"])
            if attempts.failed_transiently:
                self._abort_strays(self.upload_id)
        self.slots.acquire()  # at most `concurrency` parts in flight: bounded memory
        try:
            self._raise_part_error()
        except BaseException:
            self.slots.release()
            raise
        body, self.buffer = self.buffer, bytearray()
        number = self.next_part
        self.next_part += 1
        workers = pool("object-parts", self.concurrency)
        self.futures.append(workers.submit(self._upload_part, number, body))

    def _abort_strays(self, keep: str | None) -> None:
        """Abort uploads of this key other than ``keep`` (never raises)."""
        try:
            self.storage.abort_uploads(self.path, exact=True, keep=keep)
        except AsyncCkptError as exc:
            log.warning(
                "could not look for stray uploads of %s: %s", self.storage.describe(self.path), exc
            )

    def _upload_part(self, number: int, body: bytearray) -> None:
        try:
            result = self.storage.call(
                f"upload part {number}",
                self.path,
                "upload_part",
                Key=None,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=body,
            )
            with self.lock:
                self.etags[number] = str(result["ETag"])
        except BaseException as exc:
            with self.lock:
                if self.error is None:
                    self.error = exc
            raise
        finally:
            self.slots.release()

    def _wait_parts(self) -> None:
        for future in self.futures:
            future.exception()

    def commit(self) -> None:
        if self.finished:
            raise StorageError(f"{self.storage.describe(self.path)}: already committed/aborted")
        try:
            if self.upload_id is None:
                with self.publishing():
                    self.storage.put(self.path, self.buffer)
            else:
                if self.buffer:
                    self._send_part()
                self._wait_parts()
                self._raise_part_error()
                with self.publishing():
                    self._complete()
            self.finished = True
            self.buffer = bytearray()
        except BaseException:
            self.abort()
            raise

    def _complete(self) -> None:
        parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(self.etags.items())]
        try:
            self.storage.call(
                "complete upload",
                self.path,
                "complete_multipart_upload",
                Key=None,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
            )
        except CheckpointNotFoundError as exc:
            # NoSuchUpload: a retry after a completion whose response was lost. The object
            # is ours if it has our size and the multipart ETag of our parts.
            head = self.storage._head(self.path)
            if head is None or not self._is_ours(head):
                raise StorageError(
                    f"{self.storage.describe(self.path)}: complete upload failed: the upload "
                    "no longer exists and the object at the key is not this upload (was it "
                    "aborted by a lifecycle rule or another process?)"
                ) from exc
        self.upload_id = None

    def _is_ours(self, head: dict[str, Any]) -> bool:
        if int(head.get("ContentLength", -1)) != self.size:
            return False
        etag = str(head.get("ETag", "")).strip('"')
        expected = multipart_etag(list(self.etags[n] for n in sorted(self.etags)))
        return expected is None or etag == expected

    def abort(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.buffer = bytearray()
        for future in self.futures:
            if not future.cancel():
                future.exception()  # parts in flight finish (or fail) before the abort
            else:
                self.slots.release()
        if self.upload_id is None:
            return
        upload_id, self.upload_id = self.upload_id, None
        try:
            self.storage.call(
                "abort upload",
                self.path,
                "abort_multipart_upload",
                Key=None,
                UploadId=upload_id,
            )
        except CheckpointNotFoundError:
            pass
        except Exception as exc:  # abort() never raises; say what is left behind
            log.warning(
                "could not abort multipart upload %s of %s (%s); its parts stay until "
                "Checkpointer clean-up or a bucket lifecycle rule removes them",
                upload_id,
                self.storage.describe(self.path),
                exc,
            )


def _directory_markers(top: str, keys: list[str]) -> list[str]:
    """The ``dir/`` keys of ``top`` and of every directory below it that holds ``keys``,
    deepest first.

    Example:
        >>> _directory_markers("run/7", ["run/7/a/x", "run/7/b"])
        ['run/7/a/', 'run/7/']
    """
    root = top.strip("/")
    if not root:
        return []
    found = {root}
    for k in keys:
        parts = k.split("/")[:-1]
        for n in range(len(root.split("/")), len(parts) + 1):
            found.add("/".join(parts[:n]))
    return [f"{d}/" for d in sorted(found, key=lambda d: (-d.count("/"), d))]


def multipart_etag(part_etags: list[str]) -> str | None:
    """The ETag S3 gives a multipart object with these part ETags (None if not MD5s).

    Example:
        >>> multipart_etag(['"' + "0" * 32 + '"'])
        '4ae71336e44bf9bf79d2752e234818a5-1'
    """
    digests = []
    for etag in part_etags:
        clean = etag.strip('"')
        if not re.fullmatch(r"[0-9a-fA-F]{32}", clean):
            return None
        digests.append(bytes.fromhex(clean))
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"
