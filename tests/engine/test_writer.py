"""The writer: chunks encoded on a pool and written in order, small ones in batches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt._engine import encode as writer


def _slice(n: int) -> tuple[memoryview, int, bool]:
    return memoryview(bytes(n)), 4, True


def test_consecutive_small_slices_are_batched_up_to_the_limit() -> None:
    sizes = [1, 1, 1, 5, 1, 1, 2, 3, 3]
    batches = list(writer._batches(iter([_slice(n) for n in sizes]), limit=3))
    assert [[len(raw) for raw, _, _ in batch] for batch in batches] == [
        [1, 1, 1],
        [5],  # over the limit: alone
        [1, 1],
        [2],
        [3],
        [3],
    ]


def test_while_the_copy_goes_on_each_slice_is_a_batch_at_once() -> None:
    """A pipelined save: a landed chunk does not wait for the next one to fill a batch."""
    landed = [False, False, True, True]  # copied() as the copy finishes after slice 2
    batches = writer._batches(iter([_slice(1) for _ in landed]), 3, lambda: landed.pop(0))
    assert [len(b) for b in batches] == [1, 1, 2]


def test_no_slices_no_batches() -> None:
    assert list(writer._batches(iter([]), limit=3)) == []


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_a_model_of_many_small_tensors_is_written_in_a_few_batches(
    tmp_path: Path, compression: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hundreds of biases and norms: one encoder hand-off and one write per batch, and the
    file reads back exactly (every chunk's offset and checksum right)."""
    monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "0")
    monkeypatch.setattr(writer, "_BATCH_BYTES", 64 << 10)
    gen = torch.Generator().manual_seed(3)
    state = {f"block{i}.bias": torch.randn(1000 + i, generator=gen) for i in range(300)}
    state["big"] = torch.randn(100_000, generator=gen)  # over the limit: a batch of its own
    batches: list[int] = []
    encode_batch = writer._encode_batch

    def counting(batch: list[tuple[memoryview, int, bool]], *args: Any) -> Any:
        batches.append(len(batch))
        return encode_batch(batch, *args)

    monkeypatch.setattr(writer, "_encode_batch", counting)
    path = os.path.join(tmp_path, "many.ackpt")
    asyncckpt.save(state, path, compression=compression).result()
    assert sum(batches) == len(state)
    assert 1 in batches and len(batches) < len(state) // 10
    loaded = asyncckpt.load(path)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
