"""URLs are turned into a storage backend here and nowhere else.

A URL whose path has an empty, ``.`` or ``..`` segment is refused (see
:func:`_refuse_ambiguous` and docs/s3.md); an ``http(s)://`` URL is a read-only store.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from asyncckpt._settings import Settings
from asyncckpt._storage.base import UNSAFE_UNCONDITIONAL_WRITES, Storage, is_transport_error
from asyncckpt._storage.fsspec_storage import FsspecStorage, HttpStorage, is_http
from asyncckpt._storage.local import LocalStorage
from asyncckpt._storage.s3 import S3Storage
from asyncckpt._storage.s3client import OBJECT_STORE_PROTOCOLS, is_object_store, prepare_options
from asyncckpt.errors import StorageError


def resolve(
    f: str | os.PathLike[str],
    storage_options: dict[str, Any] | None,
    settings: Settings | None = None,
) -> tuple[Storage, str]:
    """Turn a user's path, PathLike or fsspec URL (``memory://ckpt/x``, ``file:///x``) into
    ``(storage backend, path within it)``.

    Args:
        storage_options: keyword arguments for the fsspec filesystem (e.g. an endpoint).
        settings: the tunables the storage uses, resolved by the entry point (None: the
            storage's constructor resolves them, for tools and tests).

    Raises:
        TypeError: ``f`` is not a path or URL (file objects are not supported).
        StorageError: the URL's filesystem cannot be created (e.g. a missing extra), or its
            path has an empty, ``.`` or ``..`` segment (ambiguous on object stores).
    """
    if isinstance(f, os.PathLike):
        f = os.fspath(f)
    if not isinstance(f, str):
        raise TypeError(
            f"expected a path, os.PathLike or fsspec URL, got {type(f).__qualname__}; "
            "file objects are not supported because writes must be atomic"
        )
    if "://" not in f:
        return LocalStorage(settings), os.path.abspath(f)
    options = dict(storage_options or {})
    unsafe = bool(options.pop(UNSAFE_UNCONDITIONAL_WRITES, False))
    try:
        fs, path = fsspec.core.url_to_fs(f, **prepare_options(f, options))
    except Exception as exc:
        if not isinstance(exc, (ImportError, ValueError)) and not is_transport_error(exc):
            raise
        raise StorageError(
            f"cannot open {f.split('://')[0]}:// storage: {exc}{_install_hint(f, exc)}"
        ) from exc
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(settings), os.path.abspath(path)  # the OS resolves "//", "." and ".."
    if is_http(fs):
        # The path is the whole URL (fsspec keeps "http://host" in it), which names exactly
        # what the server serves: no segment rule applies, and nothing is written there.
        return HttpStorage(fs), path
    _refuse_ambiguous(f, path)
    if is_object_store(fs):  # s3:// (and wrappers of it): no renames, see s3.py
        label = f[: f.rindex("://") + 3]
        storage = S3Storage(fs, label=label, allow_unconditional=unsafe, settings=settings)
        return storage, path
    return FsspecStorage(fs), path


#: The extra that brings each protocol's filesystem (``pip install 'asyncckpt[EXTRA]'``):
#: fsspec's own message names the package, not the extra pinned to work with asyncckpt.
_EXTRAS = {protocol: "s3" for protocol in OBJECT_STORE_PROTOCOLS}


def _install_hint(url: str, exc: BaseException) -> str:
    """What to install when opening ``url`` failed with ``exc`` for want of a package.

    Example:
        >>> _install_hint("s3://b/x", ImportError("Install s3fs to access S3"))
        ". Install it with: pip install 'asyncckpt[s3]'"
        >>> _install_hint("memory://x", ValueError("bad"))
        ''
    """
    if not isinstance(exc, ImportError):
        return ""
    for link in url.split("::"):
        extra = _EXTRAS.get(link.partition("://")[0])
        if extra is not None:
            return f". Install it with: pip install 'asyncckpt[{extra}]'"
    return ""


def _refuse_ambiguous(url: str, path: str) -> None:
    """Raise if a URL's path has a segment that stores resolve differently.

    A trailing ``/`` is not ambiguous (fsspec drops it); an empty segment inside the path,
    ``.`` or ``..`` is: keys are opaque strings on S3 (``runs//`` stays in the key), while
    SeaweedFS (and other stores with a file-system view) collapse them, so the same root
    would name different keys on different stores, or be written under one prefix and
    listed under another (every version invisible).

    Example:
        >>> try:
        ...     _refuse_ambiguous("s3://b/runs//x", "b/runs//x")
        ... except StorageError as exc:
        ...     print(str(exc).split(";")[0], "->", str(exc).rsplit(" ", 1)[-1])
        s3://b/runs//x: the path has an empty segment ('//') -> s3://b/runs/x
    """
    bad = [s for s in path.strip("/").split("/") if s in ("", ".", "..")]
    if not bad or not path.strip("/"):
        return
    what = "an empty segment ('//')" if "" in bad else f"a {bad[0]!r} segment"
    scheme, _, rest = url.partition("://")
    fixed = "/".join(s for s in rest.split("/") if s not in ("", "."))
    hint = f" Write it without one: {scheme}://{fixed}" if ".." not in bad else ""
    raise StorageError(f"{url}: the path has {what}; stores disagree on what it names.{hint}")
