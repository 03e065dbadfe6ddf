"""Object stores: a file opened for reading, pinned to the ETag it had when it was opened.

A 412 to ``If-Match`` (or a response with another ETag, from a store that ignores the
header) means the object was replaced: the load starts over
(:class:`~asyncckpt.errors.FileReplacedError`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fsspec.asyn import sync

from asyncckpt._storage.base import ReadHandle
from asyncckpt._storage.s3client import ObjectClient
from asyncckpt.errors import (
    CheckpointNotFoundError,
    ConflictError,
    FileReplacedError,
    RangeNotSatisfiable,
)

T = TypeVar("T")

#: :meth:`ObjectHandle.read_into` splits a span into GETs of at most this many bytes, sent
#: at once: one 16 MiB chunk becomes several streams (as s3transfer's 8 MiB ranges on 10
#: threads do), while the chunk before it is being checked and decoded.
READ_PIECE_BYTES = 4 << 20


class ObjectHandle(ReadHandle):
    """An object pinned to its ETag: ranged ``GetObject`` requests with ``If-Match``."""

    def __init__(
        self, storage: ObjectClient, path: str, head: dict[str, Any] | None = None
    ) -> None:
        """``head``: a ``HeadObject`` response of ``path`` already at hand (else one is
        made); the reads are pinned to its ETag whatever its age."""
        head = head or storage.head(path)
        if head is None:
            raise storage.not_found(path)
        super().__init__(storage.describe(path), int(head["ContentLength"]))
        self.storage, self.path = storage, path
        self.etag = str(head.get("ETag") or "") or None

    def read_range(self, start: int, length: int) -> bytes:
        if length <= 0 or start >= self.size:
            return b""
        bucket, key = self.storage.split(self.path)
        end = min(start + length, self.size)
        data, etag = self._request(
            lambda: ranged_get(self.storage.fs, bucket, key, start, end, self.etag)
        )
        self._check_etags([etag])
        return data

    def read_ranges(self, spans: list[tuple[int, int]]) -> list[bytes]:
        """Each ``(start, length)`` as :meth:`read_range` reads it; on s3fs all the GETs are
        sent at once on its event loop (one round trip), retried together."""
        fs = self.storage.fs
        if not streams_into(fs) or len(spans) < 2:
            return super().read_ranges(spans)
        bucket, key = self.storage.split(self.path)
        wanted = [(s, min(s + n, self.size)) for s, n in spans]
        todo = [(s, e) for s, e in wanted if e > s]

        async def gather() -> list[tuple[bytes, str | None]]:
            gets = (_s3fs_ranged_get(fs, bucket, key, s, e, self.etag) for s, e in todo)
            return list(await asyncio.gather(*gets))

        got = iter(self._request(lambda: sync(fs.loop, gather)))
        out = [next(got) if e > s else (b"", None) for s, e in wanted]
        self._check_etags([etag for _, etag in out])
        return [data for data, _ in out]

    def read_into(self, start: int, out: memoryview) -> int:
        """Fill ``out`` from ``start``: on s3fs with :func:`ranged_get_into`, elsewhere one
        :meth:`read_range`. A transient failure of any GET repeats them all (they are one
        request to the retry policy)."""
        fs = self.storage.fs
        if len(out) == 0 or start >= self.size or not streams_into(fs):
            return super().read_into(start, out)
        bucket, key = self.storage.split(self.path)
        view = memoryview(out).cast("B")[: min(len(out), self.size - start)]
        etags = self._request(lambda: ranged_get_into(fs, bucket, key, start, view, self.etag))
        self._check_etags(etags)
        return len(view)

    def _request(self, fn: Callable[[], T]) -> T:
        """``fn`` under the storage's retry policy, its failures as a load needs them."""
        try:
            return self.storage.request("read", self.path, fn)
        except ConflictError as exc:  # 412: If-Match failed, another object is there now
            raise self._replaced("the store refused to read it (412 Precondition Failed)") from exc
        except RangeNotSatisfiable as exc:  # 416: a shorter object is there now
            raise self._replaced("a read past the end of the new object failed (416)") from exc
        except CheckpointNotFoundError as exc:
            raise self.storage.not_found(self.path) from exc

    def _check_etags(self, etags: list[str | None]) -> None:
        """For stores that ignore ``If-Match``: every response must carry the pinned ETag."""
        for etag in etags:
            if self.etag is not None and etag is not None and etag != self.etag:
                raise self._replaced(f"a read returned ETag {etag}")

    def _replaced(self, how: str) -> FileReplacedError:
        return FileReplacedError(
            self.name,
            f"the object was replaced while it was being loaded (its ETag was {self.etag}; {how})",
        )


def ranged_get(
    fs: Any, bucket: str, key: str, start: int, end: int, if_match: str | None
) -> tuple[bytes, str | None]:
    """Bytes ``[start, end)`` of object ``bucket/key``, only while its ETag is ``if_match``,
    and the response's ETag (None where the filesystem does not say).

    A filesystem that defines ``asyncckpt_ranged_get(bucket, key, start, end, if_match)``
    (the fault wrapper, the in-memory S3) serves it; s3fs is called directly (its
    ``cat_file`` takes no request headers); anything else gets a ranged ``cat_file``, unpinned.
    """
    own = getattr(fs, "asyncckpt_ranged_get", None)
    if own is not None:
        result: tuple[bytes, str | None] = own(bucket, key, start, end, if_match)
        return result
    if streams_into(fs):
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


def streams_into(fs: Any) -> bool:
    """Whether ``fs`` is s3fs itself (its coroutines and event loop), so that
    :func:`ranged_get_into` can stream responses; wrappers that serve
    ``asyncckpt_ranged_get`` (the fault wrapper, the in-memory S3) read whole ranges."""
    return (
        getattr(fs, "asyncckpt_ranged_get", None) is None
        and callable(getattr(fs, "_call_s3", None))
        and getattr(fs, "loop", None) is not None
    )


def ranged_get_into(
    fs: Any, bucket: str, key: str, start: int, out: memoryview, if_match: str | None
) -> list[str | None]:
    """Fill ``out`` with bytes ``[start, start + len(out))`` of ``bucket/key`` (s3fs only);
    return the ETag of each response (None where it gave none).

    GETs of at most :data:`READ_PIECE_BYTES`, pinned like :func:`ranged_get`, sent as one
    ``gather`` on s3fs's event loop (one hop to the loop, not one per GET), each streamed
    into its slice of ``out`` (no intermediate ``bytes``).

    Raises:
        ConnectionError: a response held fewer or more bytes than its range (transient).
        Exception: the first GET's failure, as s3fs raised it.
    """

    async def gather() -> list[str | None]:
        step = READ_PIECE_BYTES
        pieces = [(at, out[at : at + step]) for at in range(0, len(out), step)]
        results = await asyncio.gather(
            *(_get_into(fs, bucket, key, start + at, part, if_match) for at, part in pieces),
            return_exceptions=True,  # wait for all: none may write into `out` after we return
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [r for r in results if not isinstance(r, BaseException)]

    result: list[str | None] = sync(fs.loop, gather)
    return result


async def _get_into(
    fs: Any, bucket: str, key: str, start: int, out: memoryview, if_match: str | None
) -> str | None:
    condition = {"IfMatch": if_match} if if_match else {}
    end = start + len(out) - 1
    response = await fs._call_s3(
        "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end}", **condition
    )
    body = response["Body"]
    try:
        got = await _stream_into(body, out)
    finally:
        body.close()
    if got != len(out):
        raise ConnectionError(
            f"{bucket}/{key}: bytes {start}-{end}: the response held {got} of {len(out)} bytes"
        )
    etag = response.get("ETag")
    return None if etag is None else str(etag)


async def _stream_into(body: Any, out: memoryview) -> int:
    """Copy a response body into ``out`` block by block as it arrives; returns its length
    (more than ``len(out)`` if it held more, though only ``len(out)`` are written)."""
    content = getattr(getattr(body, "raw_stream", None), "content", None)
    if content is None or not callable(getattr(content, "readany", None)):
        data = await body.read()  # another HTTP backend of aiobotocore: whole, then copied
        out[: min(len(data), len(out))] = data[: len(out)]
        return len(data)
    pos = 0
    while True:
        block = await content.readany()
        if not block:
            return pos
        take = min(len(block), len(out) - pos)
        out[pos : pos + take] = block[:take]
        pos += len(block)
