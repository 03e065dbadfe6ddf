"""The obstore (Rust's ``object_store``) prototype of the S3 backend, kept for issue 30's benchmark.

Issue 30 asked whether the S3 backend should stay on s3fs/aiobotocore or move to a
maintained object-store client, decided by measuring both behind the storage conformance
suite on SeaweedFS (``bench_obstore.py``; the decision and the figures are in
docs/benchmarks-notes.md, "Issue 30"). This is the obstore side: not part of the package,
and obstore is not a dependency. It keeps :class:`~asyncckpt._storage.s3.S3Storage`'s
contract, with obstore doing the requests, the signing, the retries and the multipart
uploads:

* a file of up to one part is one ``PutObject``; a larger one is streamed to obstore's
  multipart ``put`` through a bounded queue, and an abort makes that stream fail, which
  aborts the upload;
* ``create_exclusive`` and ``replace_if`` are conditional ``PutObject`` requests
  (``If-None-Match: *`` / ``If-Match``), probed once per instance as ``S3Storage`` does;
* a read handle pins the ETag of its ``HeadObject`` on every ranged ``GetObject``.

What it cannot do: obstore neither lists nor aborts multipart uploads by key, so
:meth:`~asyncckpt._storage.base.Storage.abort_unfinished` is a no-op (the parts of a
writer killed mid-upload stay until a bucket lifecycle rule removes them) and
``list_dir`` does not show a directory that holds only such an upload.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from asyncckpt._settings import Settings
from asyncckpt._storage.base import MAX_TAGGED_BYTES, AtomicWriter, ReadHandle, Storage, temp_name
from asyncckpt._storage.s3 import S3Storage, _warn_markers_unreadable
from asyncckpt._storage.s3listing import directory_markers
from asyncckpt._storage.s3multipart import MAX_PARTS
from asyncckpt._storage.s3read import READ_PIECE_BYTES
from asyncckpt._storage.s3retry import Failure, request_error, secrets_of
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

if TYPE_CHECKING:
    from obstore import GetOptions
    from obstore.store import RetryConfig

T = TypeVar("T")
_READ_THREADS = 16


def classify(exc: BaseException) -> Failure | None:
    """What an obstore exception means (None: not obstore's, let it through).

    Example:
        >>> classify(ValueError("x")) is None
        True
    """
    from obstore import exceptions as oe

    if not isinstance(exc, (oe.BaseError, FileNotFoundError)):  # obstore raises a 404 as
        return None  # the builtin FileNotFoundError
    text = str(exc)
    code = text.split("<Code>", 1)[1].split("</Code>", 1)[0] if "<Code>" in text else None
    status = next((int(w[:3]) for w in text.split("status code: ")[1:2] if w[:3].isdigit()), None)
    kind = "fatal"
    if code == "NoSuchBucket":
        kind = "no-bucket"
    elif isinstance(exc, (oe.NotFoundError, FileNotFoundError)):
        kind = "missing"
    elif isinstance(exc, (oe.AlreadyExistsError, oe.PreconditionError)):
        kind, status = "conflict", status or 412
    elif status == 416:
        kind = "range"
    elif isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)):
        status = status or 403
    return Failure(kind, code, status, text.split("\n\nDebug source:", 1)[0])


def store_config(options: dict[str, Any]) -> dict[str, Any]:
    """obstore ``S3Store`` keywords from s3fs-style storage options.

    Example:
        >>> store_config({"endpoint_url": "http://127.0.0.1:9000", "key": "k"})["access_key_id"]
        'k'
    """
    region = (options.get("client_kwargs") or {}).get("region_name")
    pairs = {
        "endpoint": options.get("endpoint_url"),
        "access_key_id": options.get("key"),
        "secret_access_key": options.get("secret"),
        "session_token": options.get("token"),
        "region": region or "us-east-1",
        "skip_signature": True if options.get("anon") else None,
    }
    return {k: v for k, v in pairs.items() if v is not None}


class ObstoreS3Storage(Storage):
    """S3 (or an S3-compatible store) through obstore, with no renames.

    Args:
        options: s3fs-style storage options (``endpoint_url``, ``key``, ``secret``,
            ``token``, ``client_kwargs.region_name``); what is missing comes from the
            ``AWS_*`` environment, as obstore reads it.
        conditional_writes, allow_unconditional, label: as for ``S3Storage``.
        settings: the tunables (``part_bytes``, ``part_concurrency``, ``retry_*``).

    Example:
        >>> ObstoreS3Storage({"endpoint_url": "http://127.0.0.1:9"}).describe("b/k")
        's3://b/k'
    """

    split = staticmethod(S3Storage.split)
    target = S3Storage.target

    def __init__(
        self,
        options: dict[str, Any] | None = None,
        *,
        conditional_writes: bool | None = None,
        allow_unconditional: bool = False,
        label: str = "s3://",
        settings: Settings | None = None,
    ) -> None:
        self.options = dict(options or {})
        self.label = label
        self.settings = settings or Settings.resolve()
        self.conditional_writes = conditional_writes
        self.allow_unconditional = allow_unconditional
        self._secrets = secrets_of(types.SimpleNamespace(storage_options=self.options))
        self.__setstate__(self.__dict__)

    def __getstate__(self) -> dict[str, Any]:
        """For a writer process: the clients and the lock are rebuilt there."""
        state = dict(self.__dict__)
        del state["_stores"], state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ObstoreS3Storage({self.label!r})"

    def store(self, bucket: str) -> Any:
        """The obstore client of ``bucket`` (one per bucket, made on first use)."""
        with self._lock:
            if bucket not in self._stores:
                from obstore.store import S3Store

                s = self.settings
                retry: RetryConfig = {
                    "max_retries": s.retry_attempts - 1,
                    "retry_timeout": timedelta(seconds=s.retry_deadline_s),
                    "backoff": {"init_backoff": timedelta(milliseconds=s.retry_backoff_ms)},
                }
                http = str(self.options.get("endpoint_url", "")).startswith("http://")
                self._stores[bucket] = S3Store(
                    bucket,
                    client_options={"allow_http": http},
                    retry_config=retry,
                    **store_config(self.options),
                )
            return self._stores[bucket]

    def call(self, action: str, path: str, fn: Callable[[Any, str], T]) -> T:
        """``fn(store, key)`` for ``path``, its failure as an asyncckpt error (obstore has
        retried what can be retried)."""
        bucket, key = self.split(path)
        try:
            return fn(self.store(bucket), key)
        except Exception as exc:
            failure = classify(exc)
            if failure is None:
                raise
            error = request_error(
                self.describe(path), bucket, key, action, exc, failure, 1, self._secrets
            )
        raise error  # outside the except block: no implicit chaining of secrets

    def put(self, path: str, data: bytes | bytearray, mode: Any = None) -> str:
        """One ``PutObject`` (conditional with ``mode``); the new ETag."""
        import obstore as obs

        result = self.call(
            "write", path, lambda s, k: obs.put(s, k, data, mode=mode, use_multipart=False)
        )
        return str(result["e_tag"])

    # -- writing ----------------------------------------------------------------------------

    def open_atomic(self, path: str) -> AtomicWriter:
        bucket, key = self.split(path)
        if not bucket or not key:
            raise StorageError(f"{self.describe(path)}: expected s3://bucket/key")
        return StreamWriter(self, path)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.replace_if(path, data, None)

    def write_marker(self, path: str, data: bytes, replacing: str | None = None) -> str:
        if replacing is None:
            return self.put(path, data)
        return self._put_if(path, data, {"e_tag": replacing}, "replaced or removed")

    def replace_if(self, path: str, data: bytes, tag: str | None) -> str:
        self._require_conditional_writes(path)
        if not self.conditional_writes:  # check, then put: safe for one writer only
            head = self.head(path)
            if (None if head is None else head["e_tag"]) != tag:
                raise ConflictError(f"{self.describe(path)} was replaced by another writer")
            return self.put(path, data)
        mode = "create" if tag is None else {"e_tag": tag}
        return self._put_if(path, data, mode, "created or replaced by another writer")

    def _put_if(self, path: str, data: bytes, mode: Any, what: str) -> str:
        """A conditional ``PutObject``; a refusal is a conflict unless the object holds
        ``data`` (our own write, whose response was lost and which obstore retried)."""
        try:
            return self.put(path, data, mode)
        except (ConflictError, CheckpointNotFoundError):
            found = self.read_tagged(path, max(len(data), MAX_TAGGED_BYTES))
            if found is not None and found[0] == data:
                return found[1]
            raise ConflictError(f"{self.describe(path)} was {what}") from None

    def _require_conditional_writes(self, path: str) -> None:
        with self._lock:
            probed = self.conditional_writes
        if probed is None:
            probed = self._probe_conditional_writes(path)
            with self._lock:
                self.conditional_writes = probed
        if probed or self.allow_unconditional:
            return
        raise StorageError(
            f"{self.label}{self.split(path)[0]}: the store ignores conditional writes "
            "(If-None-Match/If-Match); pass storage_options={'unsafe_unconditional_writes': "
            "True} if only one writer can ever write to this root (docs/s3.md)"
        )

    def _probe_conditional_writes(self, path: str) -> bool:
        """Whether the store refuses a ``PutObject`` whose condition does not hold."""
        probe = temp_name(path)
        self.put(probe, b"probe")
        honoured = 0
        try:
            for mode in ("create", {"e_tag": '"' + "0" * 32 + '"'}):
                try:
                    self.put(probe, b"probe", mode)
                except ConflictError:
                    honoured += 1
                except StorageError:
                    pass  # 400/501: the store does not know the header
        finally:
            self.delete(probe)
        return honoured == 2

    # -- reading ----------------------------------------------------------------------------

    def head(self, path: str) -> dict[str, Any] | None:
        """The object's metadata (``size``, ``e_tag``); None when it does not exist."""
        import obstore as obs

        try:
            return dict(self.call("stat", path, obs.head))
        except CheckpointNotFoundError:
            return None

    def not_found(self, path: str) -> AsyncCkptError:
        """A missing key, or a missing bucket (a HEAD cannot tell them apart)."""
        try:
            self._keys(path, limit=1)
        except StorageError as exc:
            return exc
        return CheckpointNotFoundError(f"{self.describe(path)}: no such file")

    def size(self, path: str) -> int:
        head = self.head(path)
        if head is None:
            raise self.not_found(path)
        return int(head["size"])

    def get(self, path: str, start: int, end: int, etag: str | None = None) -> Any:
        """Bytes ``[start, end)`` (a buffer; none past the end) in one ranged GET."""
        import obstore as obs

        options: GetOptions = {"range": (start, end)}
        if etag:
            options["if_match"] = etag
        try:
            return self.call(
                "read",
                path,
                lambda s, k: obs.get(s, k, options=options).bytes(),
            )
        except RangeNotSatisfiable:
            return b""

    def read_range(self, path: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            return bytes(self.get(path, start, start + length))
        except CheckpointNotFoundError as exc:
            raise self.not_found(path) from exc

    def read_bytes(self, path: str, limit: int) -> bytes:
        data = self.read_range(path, 0, limit + 1)  # one request, not a HEAD and a GET
        if len(data) > limit:
            raise FormatError(f"{self.describe(path)}: larger than {limit} bytes")
        if not data and self.head(path) is None:
            raise self.not_found(path)
        return data

    def read_marker(self, path: str, limit: int) -> bytes | None:
        try:
            return self.read_bytes(path, limit)
        except CheckpointNotFoundError:
            return None
        except StorageError as exc:
            cause = None if exc.__cause__ is None else classify(exc.__cause__)
            if cause is None or cause.status != 403:  # 403: a missing key, no ListBucket
                raise
            _warn_markers_unreadable(self.label, self.split(path)[0], exc)
            return None

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str] | None:
        head = self.head(path)  # the ETag first: a replace_if with it can only fail
        if head is None:
            return None
        try:
            return self.read_bytes(path, limit), str(head["e_tag"])
        except CheckpointNotFoundError:
            return None

    def open_read(self, path: str) -> ReadHandle:
        return PinnedObject(self, path)

    def exists(self, path: str) -> bool:
        _, key = self.split(path)
        return (bool(key) and self.head(path) is not None) or bool(self._keys(path, limit=1))

    # -- listing and deleting ---------------------------------------------------------------

    def _keys(self, path: str, limit: int | None = None) -> list[str]:
        """Keys below ``path`` + ``/`` (at most ``limit``)."""
        import obstore as obs

        def listing(store: Any, key: str) -> list[str]:
            prefix = key.strip("/") or None
            out: list[str] = []
            for page in obs.list(store, prefix, chunk_size=limit or 1000):
                out += [meta["path"] for meta in page]
                if limit is not None and len(out) >= limit:
                    break
            return out

        return self.call("list", path, listing)

    def list_dir(self, path: str) -> list[str]:
        import obstore as obs

        _, key = self.split(path)
        prefix = key.strip("/")
        found = self.call("list", path, lambda s, _k: obs.list_with_delimiter(s, prefix or None))
        cut = len(prefix) + 1 if prefix else 0
        names = {p[cut:] for p in found["common_prefixes"]}
        names |= {meta["path"][cut:] for meta in found["objects"]}
        names.discard("")
        return sorted(names)

    def delete(self, path: str) -> None:
        import obstore as obs

        with contextlib.suppress(CheckpointNotFoundError):
            self.call("delete", path, obs.delete)

    def delete_tree(self, path: str) -> None:
        import obstore as obs

        _, key = self.split(path)
        keys = self._keys(path)
        if key.strip("/") and self.head(path) is not None:
            keys.append(key)
        # SeaweedFS keeps an emptied "directory" listed until its marker key is deleted.
        keys += directory_markers(key, keys) if keys else []
        if keys:
            self.call("delete", path, lambda s, _k: obs.delete(s, keys))


class PinnedObject(ReadHandle):
    """An object pinned to its ETag: ranged ``GetObject`` requests with ``If-Match``; a
    span larger than :data:`READ_PIECE_BYTES` is read in pieces on parallel threads."""

    def __init__(self, storage: ObstoreS3Storage, path: str) -> None:
        head = storage.head(path)
        if head is None:
            raise storage.not_found(path)
        super().__init__(storage.describe(path), int(head["size"]))
        self.storage, self.path, self.etag = storage, path, head.get("e_tag")

    def _get(self, start: int, end: int) -> Any:
        try:
            data = self.storage.get(self.path, start, end, self.etag)
        except ConflictError as exc:  # 412: another object is there now
            raise self._replaced("the store refused to read it (412)") from exc
        except CheckpointNotFoundError as exc:
            raise self.storage.not_found(self.path) from exc
        if len(data) != end - start:  # a shorter object: the store ignored If-Match
            raise self._replaced(f"a read of {end - start} bytes returned {len(data)}")
        return data

    def read_range(self, start: int, length: int) -> bytes:
        end = min(start + max(length, 0), self.size)
        return bytes(self._get(start, end)) if end > start else b""

    def read_into(self, start: int, out: memoryview) -> int:
        view = memoryview(out).cast("B")[: max(0, min(len(out), self.size - start))]
        spans = [
            (at, min(at + READ_PIECE_BYTES, len(view)))
            for at in range(0, len(view), READ_PIECE_BYTES)
        ]

        def fill(span: tuple[int, int]) -> None:
            view[span[0] : span[1]] = self._get(start + span[0], start + span[1])

        if len(spans) == 1:
            fill(spans[0])
        else:
            readers = pool("obstore-reads", _READ_THREADS)
            for future in [readers.submit(fill, span) for span in spans]:
                future.result()
        return len(view)

    def _replaced(self, how: str) -> FileReplacedError:
        return FileReplacedError(
            self.name, f"the object was replaced while it was being loaded ({how})"
        )


class _Aborted(Exception):
    """Raised into obstore's multipart stream: the upload is aborted, nothing appears."""


class StreamWriter(AtomicWriter):
    """One object being written: a single PUT, or obstore's multipart ``put`` of a stream.

    Up to one part of data stays in memory and becomes one ``PutObject``. Beyond it, a
    thread runs ``obstore.put`` over a stream of parts fed through a queue of
    ``part_concurrency`` parts, so a writer holds about ``2 x part_concurrency`` parts.
    """

    def __init__(self, storage: ObstoreS3Storage, path: str) -> None:
        self.storage, self.path = storage, path
        self.part_bytes = storage.settings.part_bytes
        self.concurrency = storage.settings.part_concurrency
        self.buffer = bytearray()
        self.parts = 0
        self.queue: queue.Queue[bytearray | BaseException | None] = queue.Queue(self.concurrency)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.ended = False  # the stream took its end (None) or an abort
        self.finished = False

    def write(self, data: bytes | memoryview) -> None:
        if self.finished:
            raise StorageError(f"{self.storage.describe(self.path)}: write after commit/abort")
        view = memoryview(data).cast("B")
        while len(view):
            if len(self.buffer) >= self.part_bytes:  # sent only once more data comes, so a
                self._send(self.buffer)  # file of exactly one part stays a single PUT
                self.buffer = bytearray()
            take = view[: self.part_bytes - len(self.buffer)]
            self.buffer += take
            view = view[len(take) :]

    def _send(self, part: bytearray | BaseException | None) -> None:
        if self.error is not None:
            raise self.error
        if isinstance(part, bytearray):
            self.parts += 1
            if self.parts > MAX_PARTS:
                raise StorageError(
                    f"{self.storage.describe(self.path)}: more than {MAX_PARTS} parts"
                )
        if self.thread is None:
            self.thread = threading.Thread(target=self._upload, daemon=True)
            self.thread.start()
        self.queue.put(part)

    def _stream(self) -> Iterator[bytearray]:
        while not self.ended:
            part = self.queue.get()
            self.ended = not isinstance(part, bytearray)
            if isinstance(part, BaseException):
                raise part
            if part is not None:
                yield part

    def _upload(self) -> None:
        import obstore as obs

        def put(store: Any, key: str) -> None:
            obs.put(
                store,
                key,
                self._stream(),
                use_multipart=True,
                chunk_size=self.part_bytes,
                max_concurrency=self.concurrency,
            )

        try:
            self.storage.call("write", self.path, put)
        except BaseException as exc:
            self.error = exc
            while not self.ended:  # keep taking parts until the writer commits or aborts
                self.ended = not isinstance(self.queue.get(), bytearray)

    def commit(self) -> None:
        if self.finished:
            raise StorageError(f"{self.storage.describe(self.path)}: already committed/aborted")
        try:
            if self.thread is None:
                with self.publishing():
                    self.storage.put(self.path, self.buffer)
            else:
                if self.buffer:
                    self._send(self.buffer)
                with self.publishing():
                    self._send(None)
                    self._join()
            self.finished = True
        except BaseException:
            self.abort()
            raise
        finally:
            self.buffer = bytearray()

    def _join(self) -> None:
        assert self.thread is not None
        self.thread.join()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.buffer = bytearray()
        if self.thread is not None and self.thread.is_alive():
            self.queue.put(_Aborted("aborted"))
            self.thread.join()
