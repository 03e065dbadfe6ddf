"""URLs are turned into a storage backend here and nowhere else."""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import StorageError
from .base import UNSAFE_UNCONDITIONAL_WRITES, Storage
from .generic import FsspecStorage
from .local import LocalStorage
from .objectstore import ObjectStorage, is_object_store, prepare_options


def resolve(
    f: str | os.PathLike[str], storage_options: dict[str, Any] | None
) -> tuple[Storage, str]:
    """Turn a user's path, PathLike or fsspec URL into ``(storage, path)``.

    Args:
        f: a local path, ``os.PathLike``, or URL such as ``memory://ckpt/x`` or ``file:///x``.
        storage_options: keyword arguments for the fsspec filesystem (e.g. an endpoint).

    Returns:
        The storage backend and the path within it.

    Raises:
        TypeError: ``f`` is not a path or URL (file objects are not supported).
        StorageError: the URL's filesystem cannot be created (e.g. a missing extra).
    """
    if isinstance(f, os.PathLike):
        f = os.fspath(f)
    if not isinstance(f, str):
        raise TypeError(
            f"expected a path, os.PathLike or fsspec URL, got {type(f).__qualname__}; "
            "file objects are not supported because writes must be atomic"
        )
    if "://" not in f:
        return LocalStorage(), os.path.abspath(f)
    options = dict(storage_options or {})
    unsafe = bool(options.pop(UNSAFE_UNCONDITIONAL_WRITES, False))
    try:
        fs, path = fsspec.core.url_to_fs(f, **prepare_options(f, options))
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot open {f.split('://')[0]}:// storage: {exc}") from exc
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(), os.path.abspath(path)
    if is_object_store(fs):  # s3:// (and wrappers of it): no renames, see objectstore.py
        label = f[: f.rindex("://") + 3]
        return ObjectStorage(fs, label=label, allow_unconditional=unsafe), path
    return FsspecStorage(fs), path
