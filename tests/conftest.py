"""Shared fixtures: a local directory, a memory filesystem, and a URL for each backend."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import fsspec
import pytest


@pytest.fixture
def memory_root() -> Iterator[str]:
    """A fresh ``memory://`` prefix, removed after the test."""
    root = f"memory://asyncckpt-test-{uuid.uuid4().hex[:8]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["local", "memory"])
def any_root(request: pytest.FixtureRequest, tmp_path: object, memory_root: str) -> str:
    """A checkpoint root on each backend the tests cover (local path, memory URL)."""
    if request.param == "local":
        return str(tmp_path)
    return memory_root


# -- S3: a real moto server over HTTP (asyncckpt.testing.MotoServer) -------------------------

S3_BUCKET = "asyncckpt-test"
#: Multipart part size in S3 tests: small, so that small states span several parts (the
#: test server accepts parts down to 64 KiB; real S3 needs 5 MiB).
S3_TEST_PART_BYTES = 256 << 10


@pytest.fixture(scope="session")
def s3_server() -> Iterator[object]:
    """A moto S3 server on 127.0.0.1 (free port) for the whole session, with one bucket.

    AWS variables are replaced by fake credentials and config files that do not exist, so
    nothing from the environment (real credentials, profiles, endpoints) is ever used.
    Use ``s3_server.storage_options`` to reach it.
    """
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from asyncckpt.testing import MotoServer, fake_aws_environment

    with pytest.MonkeyPatch.context() as mp:
        for name, value in fake_aws_environment().items():
            if value is None:
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
        with MotoServer(min_part_bytes=64 << 10) as server:
            server.create_bucket(S3_BUCKET)
            yield server


@pytest.fixture
def s3_root(s3_server: object, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh ``s3://asyncckpt-test/<id>`` prefix; small parts and fast retries for tests."""
    monkeypatch.setenv("ASYNCCKPT_PART_BYTES", str(S3_TEST_PART_BYTES))
    monkeypatch.setenv("ASYNCCKPT_PART_CONCURRENCY", "4")
    monkeypatch.setenv("ASYNCCKPT_RETRY_BACKOFF_MS", "1")
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"
