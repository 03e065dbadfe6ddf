"""The chunk-read engine: a chunk's stored bytes are fetched while the chunk before it is
decoded (network and decoding overlap), and a damaged chunk still fails the read with no
chunk left writing into the buffers afterwards."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt._engine import chunks
from asyncckpt._engine.opened import open_file
from asyncckpt._storage import resolve
from asyncckpt.errors import ChecksumError

CHUNK = 64 << 10


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = {"w": torch.randn(4 * CHUNK // 4, generator=torch.Generator().manual_seed(0))}
    path = tmp_path / "x.ackpt"
    settings = {"chunk_bytes": CHUNK}
    asyncckpt.save(state, path, compression="zstd", settings=settings).result()
    return path, state


@pytest.mark.timeout(60)
def test_the_next_chunk_is_fetched_while_one_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One thread: decoding chunk 0 waits until chunk 1's bytes are being fetched, which a
    # reader that fetches and decodes each chunk in turn never does.
    path, state = _saved(tmp_path)
    fetching = {i: threading.Event() for i in range(4)}
    overlapped: list[bool] = []
    real_decode = chunks.decode_chunk

    def decode(stored: Any, codec: str, itemsize: int, out: memoryview) -> None:
        if not overlapped:
            overlapped.append(fetching[1].wait(timeout=10))
        real_decode(stored, codec, itemsize, out)

    monkeypatch.setattr(chunks, "decode_chunk", decode)
    with open_file(*resolve(str(path), None)) as opened:
        offsets = [c.offset for c in opened.manifest.chunks]
        assert len(offsets) == 4 and all(c.codec != "raw" for c in opened.manifest.chunks)
        real_read = opened.handle.read_into

        def read_into(start: int, out: memoryview) -> int:
            fetching[offsets.index(start)].set()
            return real_read(start, out)

        monkeypatch.setattr(opened.handle, "read_into", read_into)
        got = chunks.read_runs(opened, {0: chunks.whole_run(opened, 0)}, 1)
    assert overlapped == [True]
    assert torch.equal(got[0].view(torch.float32), state["w"])


def test_a_damaged_chunk_fails_the_read_and_nothing_writes_after(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    with open_file(*resolve(str(path), None)) as opened:
        damaged = opened.manifest.chunks[1].offset + 10
    data = bytearray(path.read_bytes())
    data[damaged] ^= 0xFF
    path.write_bytes(bytes(data))
    with open_file(*resolve(str(path), None)) as opened:
        out = torch.zeros(4 * CHUNK, dtype=torch.uint8)
        with pytest.raises(ChecksumError, match="chunk 1"):
            chunks.read_runs(opened, {0: chunks.whole_run(opened, 0)}, 2, into={0: out})
        before = out.clone()
    threading.Event().wait(0.2)  # a chunk still running would write meanwhile
    assert torch.equal(out, before)
