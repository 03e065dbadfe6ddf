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
