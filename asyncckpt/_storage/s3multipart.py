"""Object stores: one file written as a single ``PutObject`` or a multipart upload.

A multipart upload's parts are sent by a pool of threads while the caller keeps writing, at
most ``part_concurrency`` in flight: a writer holds at most ``(part_concurrency + 1) x
part_bytes``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from concurrent.futures import Future
from typing import Any

from asyncckpt._storage.base import AtomicWriter
from asyncckpt._storage.s3client import ObjectClient
from asyncckpt._storage.s3listing import list_uploads
from asyncckpt._storage.s3retry import Attempts
from asyncckpt._threads import pool
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    ConflictError,
    StorageError,
)

log = logging.getLogger(__name__)

#: S3's limits: parts (except the last) of at least 5 MiB, at most 10,000 parts.
MAX_PARTS = 10_000
#: Part size doubles every this many parts, so a file of unknown size never runs out of parts.
PARTS_PER_SIZE_STEP = 1_000


class ObjectWriter(AtomicWriter):
    """One object being written: a single PUT, or a multipart upload with parallel parts."""

    def __init__(self, storage: ObjectClient, path: str) -> None:
        self.storage = storage
        self.path = path
        self.part_bytes = storage.settings.part_bytes
        self.concurrency = storage.settings.part_concurrency
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

    def _raise_part_error(self) -> None:
        with self.lock:
            error = self.error
        if error is None:
            return
        if self._vanished():
            raise self._aborted_by_another() from error
        raise error

    def _vanished(self) -> bool:
        """Whether this upload is gone from the store (aborted by someone else)."""
        if self.upload_id is None:
            return False
        try:
            listed = list_uploads(self.storage, self.path, exact=True)
        except AsyncCkptError:
            return False  # cannot tell: the request's own error stands
        return all(upload_id != self.upload_id for _key, upload_id in listed)

    def _aborted_by_another(self) -> ConflictError:
        # Stores answer a part or a completion of an aborted upload differently (S3 and
        # SeaweedFS: NoSuchUpload; moto: HTTP 500); what they agree on is the listing.
        return ConflictError(
            f"{self.storage.describe(self.path)}: this save's upload was aborted by another "
            "writer of the same file (a save of it that finished first aborts the other "
            "uploads of the key) or by a bucket lifecycle rule; this save did not happen"
        )

    def write(self, data: bytes | memoryview) -> None:
        if self.finished:
            raise StorageError(f"{self.storage.describe(self.path)}: write after commit/abort")
        self._raise_part_error()
        view = memoryview(data).cast("B")
        while len(view):
            limit = self.part_bytes << ((self.next_part - 1) // PARTS_PER_SIZE_STEP)
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
            attempts = Attempts()
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
            head = self.storage.head(self.path)
            if head is None or not self._is_ours(head):
                raise StorageError(
                    f"{self.storage.describe(self.path)}: complete upload failed: the upload "
                    "no longer exists and the object at the key is not this upload (was it "
                    "aborted by a lifecycle rule or another process?)"
                ) from exc
        except AsyncCkptError as exc:
            if self._vanished():
                raise self._aborted_by_another() from exc
            raise
        self.upload_id = None

    def _is_ours(self, head: dict[str, Any]) -> bool:
        if int(head.get("ContentLength", -1)) != self.size:
            return False
        etag = str(head.get("ETag", "")).strip('"')
        expected = multipart_etag([self.etags[n] for n in sorted(self.etags)])
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
