"""The obstore prototype of the S3 backend (``benchmarks/obstore_backend.py``, issue 30's
benchmark) passes the storage conformance suite, so that what the benchmark measures is a
correct backend.

Skipped where obstore is not installed (it is not a dependency).
"""

from __future__ import annotations

import importlib
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt.errors import StorageError
from asyncckpt.testing import StorageConformanceSuite

pytest.importorskip("obstore")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
try:
    ObstoreS3Storage = importlib.import_module("obstore_backend").ObstoreS3Storage
finally:
    sys.path.pop(0)


@pytest.fixture
def obstore_root(s3_root: str, s3_server: Any) -> tuple[Any, str]:
    storage = ObstoreS3Storage(s3_server.storage_options, settings=Settings.resolve())
    return storage, s3_root.removeprefix("s3://")


class TestObstoreS3(StorageConformanceSuite):
    @pytest.fixture
    def storage_root(
        self, obstore_root: tuple[Any, str], s3_part_bytes: int
    ) -> tuple[Storage, str]:
        self.large_bytes = 5 * s3_part_bytes + 12_345  # six parts, four in flight at most
        return obstore_root


def test_an_aborted_large_write_leaves_no_upload(
    obstore_root: tuple[Any, str], s3_server: Any, s3_part_bytes: int
) -> None:
    storage, root = obstore_root
    path = storage.join(root, "aborted.bin")
    writer = storage.open_atomic(path)
    writer.write(b"x" * (3 * s3_part_bytes + 1))  # two parts sent, a third buffered
    writer.abort()
    bucket, key = storage.split(path)
    assert s3_server.uploads(bucket, key) == []
    assert not storage.exists(path)


def test_a_copy_for_a_writer_process_writes_and_reads(
    obstore_root: tuple[Any, str],
) -> None:
    storage, root = obstore_root
    copy = pickle.loads(pickle.dumps(storage))
    path = storage.join(root, "copied.bin")
    copy.write_bytes(path, b"from the copy")
    assert storage.read_bytes(path, 100) == b"from the copy"


def test_a_missing_bucket_is_a_storage_error(
    obstore_root: tuple[Any, str],
) -> None:
    storage, _ = obstore_root
    with pytest.raises(StorageError, match="does not exist"):
        storage.size("no-such-bucket-x/key")
    with pytest.raises(StorageError, match="does not exist"):
        storage.write_bytes("no-such-bucket-x/key", b"data")
