"""Storage: a small interface over a filesystem, with atomic writes and conditional ones.

One module per strategy, importing downward only (``base`` ← ``local``, ``fsspec_storage``,
``s3`` ← ``resolve``): :class:`LocalStorage` (local disk through the OS, temp file and
rename), :class:`FsspecStorage` (any other fsspec filesystem), :class:`S3Storage` (object
stores: no renames). :func:`resolve` turns a user's path or URL into ``(storage, path)``.
Every backend error surfaces as :class:`~asyncckpt.errors.StorageError` (or
:class:`~asyncckpt.errors.CheckpointNotFoundError`) chained with ``from``.
"""

from __future__ import annotations

from asyncckpt._storage.base import (
    TEMP_MARK,
    UNSAFE_UNCONDITIONAL_WRITES,
    AtomicWriter,
    ReadHandle,
    Storage,
    content_tag,
    is_temp_name,
    temp_name,
)
from asyncckpt._storage.fsspec_storage import FsspecStorage
from asyncckpt._storage.local import LocalStorage, fsync_dir
from asyncckpt._storage.resolve import resolve
from asyncckpt._storage.s3 import S3Storage

__all__ = [
    "TEMP_MARK",
    "UNSAFE_UNCONDITIONAL_WRITES",
    "AtomicWriter",
    "FsspecStorage",
    "LocalStorage",
    "ReadHandle",
    "S3Storage",
    "Storage",
    "content_tag",
    "fsync_dir",
    "is_temp_name",
    "resolve",
    "temp_name",
]
