"""Every storage backend passes asyncckpt.testing.StorageConformanceSuite.

Backends: local disk, ``memory://``, S3 (real moto and SeaweedFS servers over HTTP, each
test once per store), the in-process S3 API, and the fault injecting wrapper with no faults
around memory and around S3.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest

from asyncckpt._storage import FsspecStorage, LocalStorage, Storage, resolve
from asyncckpt._storage.s3 import S3Storage
from asyncckpt.testing import FaultyFileSystem, StorageConformanceSuite
from tests.conftest import S3_TEST_PART_BYTES


class TestLocal(StorageConformanceSuite):
    @pytest.fixture
    def storage_root(self, tmp_path: Any) -> tuple[Storage, str]:
        storage, root = resolve(str(tmp_path), None)
        assert isinstance(storage, LocalStorage)
        return storage, root


@pytest.fixture
def memory_prefix() -> Iterator[str]:
    root = f"memory://conformance-{uuid.uuid4().hex[:8]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


class TestMemory(StorageConformanceSuite):
    @pytest.fixture
    def storage_root(self, memory_prefix: str) -> tuple[Storage, str]:
        storage, root = resolve(memory_prefix, None)
        assert isinstance(storage, FsspecStorage)
        return storage, root


class TestFaultyMemory(StorageConformanceSuite):
    @pytest.fixture
    def storage_root(self, memory_prefix: str) -> tuple[Storage, str]:
        storage, root = resolve(f"faulty::{memory_prefix}", None)
        assert isinstance(storage, FsspecStorage)
        assert isinstance(storage.fs, FaultyFileSystem)
        return storage, root


class TestS3(StorageConformanceSuite):
    @pytest.fixture
    def storage_root(self, s3_root: str, s3_server: Any, s3_part_bytes: int) -> tuple[Storage, str]:
        self.large_bytes = 5 * s3_part_bytes + 12_345  # six parts, four in flight at most
        storage, root = resolve(s3_root, s3_server.storage_options)
        assert isinstance(storage, S3Storage)
        return storage, root


class TestFaultyS3(StorageConformanceSuite):
    @pytest.fixture
    def storage_root(self, s3_root: str, s3_server: Any, s3_part_bytes: int) -> tuple[Storage, str]:
        self.large_bytes = 5 * s3_part_bytes + 12_345
        storage, root = resolve(f"faulty::{s3_root}", {"s3": s3_server.storage_options})
        assert isinstance(storage, S3Storage)
        assert isinstance(storage.fs, FaultyFileSystem)
        return storage, root


class TestMemoryS3(StorageConformanceSuite):
    """The in-process S3 API used for link simulations behaves like the real server."""

    @pytest.fixture
    def storage_root(self, monkeypatch: pytest.MonkeyPatch) -> tuple[Storage, str]:
        monkeypatch.setenv("ASYNCCKPT_PART_BYTES", str(S3_TEST_PART_BYTES))
        storage, root = resolve(f"s3mem://bucket/{uuid.uuid4().hex[:8]}", None)
        assert isinstance(storage, S3Storage)
        return storage, root

    large_bytes = 5 * S3_TEST_PART_BYTES + 12_345
