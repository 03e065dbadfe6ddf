"""What a drop-in load of a committed file asks an object store (``s3mem://``, the S3 API in
memory): every request is a round trip a restarted job waits on before its data moves."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt._api import dropin
from asyncckpt._versions import pending
from tests.s3mem import MemoryS3FileSystem


def _url() -> str:
    return f"s3mem://load-requests/{uuid.uuid4().hex[:8]}/model.ackpt"


def _requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every request the store serves, by kind (ranged GETs as ``get_object``)."""
    seen: list[str] = []
    call_s3, ranged = MemoryS3FileSystem.call_s3, MemoryS3FileSystem.asyncckpt_ranged_get

    def counted_call(self: Any, method: str, *args: Any, **kw: Any) -> Any:
        seen.append(method)
        return call_s3(self, method, *args, **kw)

    def counted_get(self: Any, *args: Any) -> Any:
        seen.append("get_object")
        return ranged(self, *args)

    monkeypatch.setattr(MemoryS3FileSystem, "call_s3", counted_call)
    monkeypatch.setattr(MemoryS3FileSystem, "asyncckpt_ranged_get", counted_get)
    return seen


def test_a_load_names_and_opens_the_file_in_few_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a listing of the path and of its uploads to name it, a HEAD for its size, a
    # second HEAD to open it, then the header and the tail: six requests before any chunk.
    url = _url()
    asyncckpt.save({"w": torch.arange(10.0)}, url, compression="none").result()
    seen = _requests(monkeypatch)
    assert torch.equal(asyncckpt.load(url)["w"], torch.arange(10.0))
    assert not [r for r in seen if r.startswith("list")], seen
    assert seen.count("head_object") == 1, seen
    assert len(seen) <= 4, seen  # one HEAD; the header and the tail; the one chunk


def test_a_file_replaced_after_it_was_named_is_loaded_as_it_is_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The size that named the file is reused to open it; its ETag pins the reads, so a file
    # replaced in between (while the load checked for saves in flight) is read anew.
    url = _url()
    asyncckpt.save({"w": torch.zeros(1000)}, url).result()
    real = pending.wait_for_saves

    def replaced_meanwhile(*args: Any, **kwargs: Any) -> None:
        asyncckpt.save({"w": torch.ones(10)}, url).result()
        real(*args, **kwargs)

    monkeypatch.setattr(dropin.pending, "wait_for_saves", replaced_meanwhile)
    assert torch.equal(asyncckpt.load(url)["w"], torch.ones(10))


def test_a_prefix_is_still_a_root_not_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    url = _url().removesuffix("/model.ackpt")
    with asyncckpt.Checkpointer(url) as ckpt:
        ckpt.save(3, {"w": torch.ones(2)}).result()
    seen = _requests(monkeypatch)
    assert torch.equal(asyncckpt.load(url)["w"], torch.ones(2))
    assert "head_bucket" not in seen, seen  # the HEAD that finds no file asks nothing more
    assert torch.equal(asyncckpt.load(f"{url}@3")["w"], torch.ones(2))
