"""Object stores: listing keys and multipart uploads, page by page, and directory markers."""

from __future__ import annotations

from typing import Any

from asyncckpt._storage.s3client import ObjectClient


def list_keys(
    storage: ObjectClient, path: str, *, delimiter: bool, max_keys: int | None = None
) -> list[str]:
    """Keys (and, with ``delimiter``, common prefixes) below ``path`` + ``/``."""
    _, key = storage.split(path)
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
        page = storage.call("list", path, "list_objects_v2", **kwargs)
        out += [c["Key"] for c in page.get("Contents") or []]
        out += [p["Prefix"] for p in page.get("CommonPrefixes") or []]
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token or max_keys is not None:
            return out


def list_uploads(storage: ObjectClient, path: str, *, exact: bool = False) -> list[tuple[str, str]]:
    """``(key, upload_id)`` of every multipart upload in progress below ``path`` (or,
    with ``exact``, of the object ``path`` itself)."""
    _, key = storage.split(path)
    prefix = key if exact else key.rstrip("/") + "/" if key.strip("/") else ""
    out: list[tuple[str, str]] = []
    markers: dict[str, Any] = {}
    while True:
        page = storage.call("list", path, "list_multipart_uploads", Prefix=prefix, **markers)
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


def directory_markers(top: str, keys: list[str]) -> list[str]:
    """The ``dir/`` keys of ``top`` and of every directory below it that holds ``keys``,
    deepest first.

    Example:
        >>> directory_markers("run/7", ["run/7/a/x", "run/7/b"])
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
