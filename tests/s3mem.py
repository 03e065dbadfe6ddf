"""An in-process S3 API, for simulations: :class:`MemoryS3FileSystem` (``s3mem://``).

It serves the S3 calls asyncckpt makes from this process's memory, so that a simulated link
(``faulty::s3mem://``, see :class:`~asyncckpt.testing.faults.FaultyFileSystem`) costs no
server of its own. Importing this module registers it as the ``s3mem`` protocol.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import uuid
from typing import Any

import fsspec

from asyncckpt.testing.faults import s3_error

__all__ = ["MemoryS3FileSystem"]


class MemoryS3FileSystem(fsspec.AbstractFileSystem):  # type: ignore[misc]
    """The S3 calls :class:`~asyncckpt._storage.s3.S3Storage` makes, from memory.

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
    #: Its objects live in this process: a writer process would write into its own copy.
    process_local = True

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
                self._check_condition(method, bucket, key, kw)
                self._objects[(bucket, key)] = bytes(kw.get("Body") or b"")
                self._etags[(bucket, key)] = self._etag()
                return {"ETag": self._etags[(bucket, key)]}
            if method == "head_object":
                if (bucket, key) not in self._objects:
                    raise s3_error("404", 404, "Not Found", method)
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
                    raise s3_error("NoSuchUpload", 404, "The upload does not exist", method)
                parts = upload[2]
                if method == "upload_part":
                    etag = self._etag()
                    parts[int(kw["PartNumber"])] = (bytes(kw["Body"]), etag)
                    return {"ETag": etag}
                del self._uploads[str(kw["UploadId"])]
                if method == "complete_multipart_upload":
                    self._check_condition(method, bucket, key, kw)
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

    def _check_condition(self, method: str, bucket: str, key: str, kw: dict[str, Any]) -> None:
        """Refuse a write whose ``IfNoneMatch``/``IfMatch`` does not hold, as S3 does."""
        etag = self._etags.get((bucket, key))
        if kw.get("IfNoneMatch") == "*" and etag is not None:
            failed = "If-None-Match"
        elif "IfMatch" in kw and etag is None:
            raise s3_error("NoSuchKey", 404, "The specified key does not exist.", method)
        elif "IfMatch" in kw and kw["IfMatch"] != etag:
            failed = "If-Match"
        else:
            return
        raise s3_error(
            "PreconditionFailed",
            412,
            "At least one of the pre-conditions you specified did not hold",
            method,
            Condition=failed,
        )

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

    def asyncckpt_ranged_get(
        self, bucket: str, key: str, start: int, end: int, if_match: str | None
    ) -> tuple[bytes, str | None]:
        """A ranged ``GetObject`` with ``If-Match``, as S3 answers it (412 on another ETag)."""
        with self._lock:
            data, etag = self._objects.get((bucket, key)), self._etags.get((bucket, key))
            if data is None or etag is None:
                raise s3_error("NoSuchKey", 404, "The specified key does not exist.", "get_object")
            condition = {} if if_match is None else {"IfMatch": if_match}
            self._check_condition("get_object", bucket, key, condition)
        if start >= len(data):
            raise s3_error("InvalidRange", 416, "The requested range is not satisfiable", "get")
        return data[start:end], etag

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        bucket, _, key = self._strip_protocol(path).lstrip("/").partition("/")
        with self._lock:
            data = self._objects.get((bucket, key))
        if data is None:
            raise s3_error("NoSuchKey", 404, "The specified key does not exist.", "get_object")
        start = start or 0
        if start >= len(data) and (start or end):
            raise s3_error("InvalidRange", 416, "The requested range is not satisfiable", "get")
        return data[start:end]


with contextlib.suppress(ValueError):
    fsspec.register_implementation("s3mem", MemoryS3FileSystem)
