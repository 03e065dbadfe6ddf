"""Object storage (S3 and S3-compatible stores, through s3fs): atomic writes without renames.

A "rename" on an object store is a copy and a delete, neither atomic nor cheap, so
:class:`S3Storage` writes every file at its final key: one ``PutObject`` (whole or nothing)
up to one part, else a multipart upload (:mod:`.s3multipart`) that appears only when
completed and is aborted on any failure, so that no parts are left behind.

:meth:`S3Storage.create_exclusive` is a conditional ``PutObject`` (``If-None-Match: *``):
of two writers creating one key, exactly one succeeds. Whether the store honours the
condition is probed once per instance; a store that ignores it is refused unless the user
opts in to a check-then-put, safe only for writers that do not race (``docs/s3.md``).

Every request is retried on transient failures (:mod:`.s3retry`) within ``retry_attempts``
and ``retry_deadline_s``; anything else fails at once with
:class:`~asyncckpt.errors.StorageError` naming the bucket and key. Messages and log lines
never contain credentials, and a backend exception that carried one is not chained.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from asyncckpt._settings import Settings
from asyncckpt._storage.base import (
    MAX_TAGGED_BYTES,
    AtomicWriter,
    ReadHandle,
    Storage,
    first_time,
    temp_name,
)
from asyncckpt._storage.s3client import single_retry_layer
from asyncckpt._storage.s3listing import directory_markers, list_keys, list_uploads
from asyncckpt._storage.s3multipart import ObjectWriter
from asyncckpt._storage.s3read import ObjectHandle
from asyncckpt._storage.s3retry import (
    Attempts,
    RetryPolicy,
    classify,
    is_denied,
    redact,
    request_error,
    secrets_of,
)
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    ConflictError,
    FormatError,
    RangeNotSatisfiable,
    StorageError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_DELETE_BATCH = 1000
#: Seconds for which the ``HeadObject`` of :meth:`S3Storage.size` opens the same object
#: (:meth:`S3Storage.open_read`) without a second one: a load names its file by its size,
#: then opens it. Safe at any age: the handle pins the reads to that HEAD's ETag, so an
#: object replaced since fails them and the load starts over on the new one.
REUSED_HEAD_S = 5.0
#: Probes that must all find a condition ignored before a store is taken to lack
#: conditional writes (see :meth:`S3Storage._probe_conditional_writes`).
PROBE_ROUNDS = 3

# Indirection so tests can drive the retry loop with a fake clock.
_clock: Callable[[], float] = time.monotonic
_sleep: Callable[[float], None] = time.sleep


_unreadable: set[str] = set()


def _warn_markers_unreadable(label: str, bucket: str, exc: BaseException) -> None:
    if first_time(_unreadable, bucket):
        log.warning(
            "%s%s: save markers cannot be read (%s); loads there do not wait for other "
            "processes' saves in flight. Allow s3:ListBucket (S3 then answers 404 for a "
            "missing marker) and s3:GetObject on *.ackpending (docs/PROTOCOL.md §8)",
            label,
            bucket,
            exc,
        )


class S3Storage(Storage):
    """S3 (or an S3-compatible store) through an s3fs filesystem, with no renames.

    A key with bytes is an object, never a folder (``sized_paths_are_files``).

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
        settings: the tunables (``part_bytes``, ``part_concurrency``, ``retry_*``); None:
            ``Settings.resolve()`` (the environment), for tools and tests. The arguments
            above win over it.

    Raises:
        TypeError: ``fs`` is not an S3-API filesystem.
        ValueError: a tunable is out of range.

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
                f"S3Storage needs an S3-API filesystem (s3fs), got {type(fs).__qualname__}"
            )
        self.fs = fs
        self.label = label
        # An in-memory store (the test suite's s3mem://) cannot be written by another process.
        self.process_local = bool(getattr(fs, "process_local", False))
        self.settings = (Settings.resolve() if settings is None else settings).replace(
            part_bytes=part_bytes,
            part_concurrency=part_concurrency,
            retry_attempts=retry_attempts,
            retry_deadline_s=retry_deadline_s,
            retry_backoff_ms=retry_backoff_ms,
        )
        self.conditional_writes = conditional_writes
        self.allow_unconditional = allow_unconditional
        self._probe_lock = threading.Lock()
        self._probe_seen = "said by the caller"  # what the last probe saw, for the refusal
        single_retry_layer(fs)
        self._secrets = secrets_of(fs)
        self._rng = random.Random()
        self._last_head: tuple[str, float, dict[str, Any]] | None = None

    sized_paths_are_files = True

    def target(self, path: str) -> tuple[str, ...]:
        return (type(self).__name__, self.describe(path.lstrip("/").split("/", 1)[0]))

    def __repr__(self) -> str:
        return f"S3Storage({self.label!r})"

    def __getstate__(self) -> dict[str, Any]:
        """For a writer process: the lock and the random source are rebuilt there."""
        state = dict(self.__dict__)
        del state["_probe_lock"], state["_rng"]
        state["_last_head"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._probe_lock = threading.Lock()
        self._rng = random.Random()
        single_retry_layer(self.fs)  # a filesystem rebuilt by unpickling has its defaults

    # -- settings and plumbing --------------------------------------------------------------

    def policy(self) -> RetryPolicy:
        return RetryPolicy(
            attempts=self.settings.retry_attempts,
            deadline_s=float(self.settings.retry_deadline_s),
            backoff_s=self.settings.retry_backoff_ms / 1000.0,
        )

    @staticmethod
    def split(path: str) -> tuple[str, str]:
        bucket, _, key = path.lstrip("/").partition("/")
        return bucket, key

    def request(
        self,
        action: str,
        path: str,
        fn: Callable[[], T],
        attempts: Attempts | None = None,
    ) -> T:
        """Run one backend request with the retry policy; raise asyncckpt errors only."""
        policy = self.policy()
        deadline = _clock() + policy.deadline_s
        tries = attempts or Attempts()
        retry = 0
        while True:
            tries.count += 1
            error: AsyncCkptError | None = None
            try:
                return fn()
            except Exception as exc:
                failure = classify(exc)
                transient = failure.kind == "retry"
                if transient:
                    tries.failed_transiently = True
                    retry += 1
                    pause = policy.delay(retry, self._rng)
                if not transient or retry >= policy.attempts or _clock() + pause > deadline:
                    bucket, key = self.split(path)
                    where = self.describe(path)
                    error = request_error(
                        where, bucket, key, action, exc, failure, tries.count, self._secrets
                    )
            if error is not None:
                raise error  # outside the except block: no implicit chaining of secrets
            log.info(
                "%s of %s failed (%s); retry %d of %d in %.2f s",
                action,
                self.describe(path),
                redact(failure.message, self._secrets),
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
        attempts: Attempts | None = None,
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
        return ObjectWriter(self, path)

    def put(
        self,
        path: str,
        data: bytes | bytearray,
        attempts: Attempts | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """One ``PutObject`` of ``data`` at ``path`` (retried)."""
        return self.call("write", path, "put_object", attempts, Key=None, Body=data, **kwargs)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self._require_conditional_writes(path)
        if not self.conditional_writes:  # refuse if it exists, write, then check what won
            if self._object_exists(path):
                raise ConflictError(f"{self.describe(path)} already exists")
            self.put(path, data)
            if not self._holds(path, data):
                raise ConflictError(
                    f"{self.describe(path)} was created concurrently by another writer"
                )
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
        try:
            data = self._get(path, 0, limit + 1)
        except CheckpointNotFoundError:  # the common case: one GET, no HEAD of the bucket
            return None
        except StorageError as exc:
            # Without s3:ListBucket, S3 answers a GET of a missing key with 403, not 404:
            # a reader allowed to read the data must not fail on a marker it cannot see.
            if not is_denied(exc):
                raise
            _warn_markers_unreadable(self.label, self.split(path)[0], exc)
            return None
        if len(data) > limit:
            raise FormatError(f"{self.describe(path)}: larger than {limit} bytes")
        return data

    def write_marker(self, path: str, data: bytes, replacing: str | None = None) -> str:
        # One PUT (whole or nothing); with ``replacing``, conditional on the ETag (If-Match),
        # so a heartbeat can never bring back a marker that was deleted or replaced.
        if replacing is None:
            return str(self.put(path, data)["ETag"])
        return self._put_if(
            path, data, {"IfMatch": replacing}, "replaced or removed by another writer"
        )

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str] | None:
        head = self.head(path)
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
            head = self.head(path)
            if (None if head is None else str(head["ETag"])) != tag:
                raise ConflictError(f"{self.describe(path)} was replaced by another writer")
            return str(self.put(path, data)["ETag"])
        condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        return self._put_if(
            path, data, condition, "replaced by another writer since this one read it"
        )

    def _put_if(self, path: str, data: bytes, condition: dict[str, str], what: str) -> str:
        """A conditional ``PutObject``; its new ETag. A refusal is a conflict unless the
        object holds ``data``: then it was our own write, whose response was lost."""
        try:
            return str(self.put(path, data, None, **condition)["ETag"])
        except (ConflictError, CheckpointNotFoundError):
            found = self.read_tagged(path, max(len(data), MAX_TAGGED_BYTES))
            if found is not None and found[0] == data:
                return found[1]
            raise ConflictError(f"{self.describe(path)} was {what}") from None

    def _holds(self, path: str, data: bytes) -> bool:
        try:
            return self.read_range(path, 0, len(data) + 1) == data
        except CheckpointNotFoundError:
            return False

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
            f"({self._probe_seen}), so two writers could both commit or move the version "
            "file backwards. Use a store that honours them (AWS S3, SeaweedFS, MinIO), or "
            "pass storage_options={'unsafe_unconditional_writes': True} if only one writer "
            "can ever write to this root (docs/s3.md)"
        )

    def _probe_conditional_writes(self, path: str) -> bool:
        """Whether the store refuses a ``PutObject`` whose condition does not hold.

        An answer that is neither a refusal nor an acceptance (a timeout, a 5xx) proves
        nothing, so the probe is repeated. Neither does one acceptance: the answer stands
        for the life of the storage, and one probe of six writers racing on SeaweedFS, on
        two busy cores, once found a condition ignored. So only :data:`PROBE_ROUNDS` probes
        that all fail say "unsupported"; a store without the conditions fails every one.
        """
        seen: dict[str, str] = {}
        for _ in range(PROBE_ROUNDS):
            seen = self._probe_once(path)
            if all(r == "honoured" for r in seen.values()):
                return True
            if any(r.startswith("rejected") for r in seen.values()):
                break  # the store refuses the header itself: asking again cannot change it
        self._probe_seen = ", ".join(f"{k}: {v}" for k, v in seen.items())
        log.warning(
            "%s%s: the store does not honour conditional writes (%s)",
            self.label,
            self.split(path)[0],
            self._probe_seen,
        )
        return False

    def _probe_once(self, path: str) -> dict[str, str]:
        """What the store did with ``If-None-Match: *`` and ``If-Match`` on an ETag the
        probe object cannot have."""
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
            return {
                "If-None-Match": self.request(
                    "probe conditional writes", probe, lambda: outcome(IfNoneMatch="*")
                ),
                "If-Match": self.request(
                    "probe conditional writes", probe, lambda: outcome(IfMatch=wrong_etag)
                ),
            }
        finally:
            self.delete(probe)

    # -- reading ----------------------------------------------------------------------------

    def size(self, path: str) -> int:
        size = self.size_or_none(path)
        if size is None:
            raise self.not_found(path)
        return size

    def size_or_none(self, path: str) -> int | None:
        # One HEAD: no HeadBucket to name a missing bucket (a listing after it fails there).
        head = self.head(path)
        if head is None:
            return None
        self._last_head = (path, _clock(), head)  # for the open that follows (a load's)
        return int(head["ContentLength"])

    def _reused_head(self, path: str) -> dict[str, Any] | None:
        """The ``HeadObject`` of the last :meth:`size`, if it was of ``path`` and recent,
        taken once (an open that starts over after a replaced file asks anew)."""
        last, self._last_head = self._last_head, None
        if last is None or last[0] != path or _clock() - last[1] > REUSED_HEAD_S:
            return None
        return last[2]

    def head(self, path: str) -> dict[str, Any] | None:
        try:
            return self.call("stat", path, "head_object", Key=None)
        except CheckpointNotFoundError:
            return None

    def not_found(self, path: str) -> AsyncCkptError:
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
        try:
            return self._get(path, start, start + length)
        except CheckpointNotFoundError as exc:
            raise self.not_found(path) from exc

    def _get(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path`` in one ranged GET (retried); none past the end
        (416: an empty object, or ``start`` beyond its end)."""
        bucket, key = self.split(path)
        try:
            data: bytes = self.request(
                "read", path, lambda: self.fs.cat_file(f"{bucket}/{key}", start=start, end=end)
            )
        except RangeNotSatisfiable:
            return b""
        return data

    def open_read(self, path: str) -> ReadHandle:
        """Pinned to the ETag of one ``HeadObject`` (see :mod:`.s3read`): that of a
        :meth:`size` of ``path`` just before, if any (:data:`REUSED_HEAD_S`)."""
        return ObjectHandle(self, path, self._reused_head(path))

    def read_bytes(self, path: str, limit: int) -> bytes:
        data = self.read_range(path, 0, limit + 1)  # one request, not a HEAD and a GET
        if len(data) > limit:
            raise FormatError(f"{self.describe(path)}: larger than {limit} bytes")
        if not data and not self._object_exists(path):
            raise self.not_found(path)
        return data

    def exists(self, path: str) -> bool:
        return self._object_exists(path) or bool(list_keys(self, path, delimiter=True, max_keys=1))

    def _object_exists(self, path: str) -> bool:
        return bool(self.split(path)[1]) and self.head(path) is not None

    # -- listing and deleting ---------------------------------------------------------------

    def list_dir(self, path: str) -> list[str]:
        _, key = self.split(path)
        cut = len(key.rstrip("/") + "/") if key.strip("/") else 0
        names = {k[cut:].rstrip("/") for k in list_keys(self, path, delimiter=True)}
        # A directory exists while a file in it is being written, as on a local disk (where
        # the temp file shows): so recovery and retention find, and delete_tree aborts, the
        # uploads that a killed writer left in a step directory with no object yet.
        names |= {k[cut:].split("/", 1)[0] for k, _ in list_uploads(self, path) if "/" in k[cut:]}
        names.discard("")
        return sorted(names)

    def delete(self, path: str) -> None:
        with contextlib.suppress(CheckpointNotFoundError):
            self.call("delete", path, "delete_object", Key=None)

    def abort_unfinished(self, path: str, *, exact: bool = False) -> None:
        self.abort_uploads(path, exact=exact)

    def delete_tree(self, path: str) -> None:
        bucket, key = self.split(path)
        keys = list_keys(self, path, delimiter=False)
        if key.strip("/") and self._object_exists(path):
            keys.append(key)
        # Stores with a real namespace (SeaweedFS's filer) keep a "directory" listed as a
        # common prefix after its last object is gone; deleting its marker key removes it.
        # On S3 the markers do not exist and deleting them is a no-op.
        keys += directory_markers(key, keys) if keys else []
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
                    f"{first.get('Code')}: {redact(str(first.get('Message')), self._secrets)}"
                )
        self.abort_uploads(path)

    def abort_uploads(self, path: str, *, exact: bool = False, keep: str | None = None) -> int:
        """Abort the multipart uploads in progress below ``path`` (or, with ``exact``, of
        the object ``path``), except upload ``keep``; returns how many were aborted.

        Parts of an upload that is never completed or aborted are stored (and billed) for
        ever, so ``delete_tree`` calls this, which makes ``Checkpointer`` recovery and
        retention clean up after writers that were killed mid-upload. A bucket lifecycle
        rule (``AbortIncompleteMultipartUpload``) is the backstop for drop-in saves.
        """
        bucket, _ = self.split(path)
        found = [(k, u) for k, u in list_uploads(self, path, exact=exact) if u != keep]
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
