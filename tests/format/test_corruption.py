"""Damaged checkpoints: every flipped bit, cut or appended byte is a specific, named error.

Each test saves a real checkpoint with ``asyncckpt.save``, damages one region of the file
(header, a chunk, the manifest, the footer) and checks what ``asyncckpt.load`` raises. A load
of a damaged file never returns data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

import asyncckpt
from asyncckpt._format.container import (
    FOOTER_SIZE,
    HEADER_SIZE,
    Manifest,
    decode_footer,
    decode_manifest,
)
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    ChecksumError,
    FormatError,
    TruncatedFileError,
)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 40, generator=g)
    return {
        "model": {
            "w": w,
            "b": torch.zeros(40),
            "emb": torch.arange(600, dtype=torch.int64).reshape(60, 10),
        },
        "opt": {"step": 3, "m": torch.full((40, 40), 0.5, dtype=torch.bfloat16)},
        "mask": torch.arange(100) % 3 == 0,
        "rng": np.arange(50, dtype=np.uint32),
        "tied": w.T,
        "note": "ünïcode",
    }


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


@dataclass
class Saved:
    """A checkpoint written by asyncckpt, its bytes, and where each region lies."""

    path: str
    data: bytes
    manifest: Manifest
    manifest_offset: int
    state: Any

    @property
    def manifest_end(self) -> int:
        return len(self.data) - FOOTER_SIZE

    def write(self, data: bytes) -> None:
        with fsspec.open(self.path, "wb") as f:
            f.write(data)

    def load_damaged(self, data: bytes) -> AsyncCkptError:
        """Write ``data`` over the file, load it, and return the error load must raise."""
        self.write(data)
        with pytest.raises(AsyncCkptError) as info:
            asyncckpt.load(self.path)
        return info.value

    def region(self, position: int) -> str | int:
        """'header', 'manifest', 'footer', or the index of the chunk holding ``position``."""
        if position < HEADER_SIZE:
            return "header"
        if position >= self.manifest_end:
            return "footer"
        if position >= self.manifest_offset:
            return "manifest"
        for index, chunk in enumerate(self.manifest.chunks):
            if chunk.offset <= position < chunk.offset + chunk.stored_len:
                return index
        raise AssertionError(f"byte {position} belongs to no region")


def _save(
    root: str, state: Any, compression: str, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> Saved:
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", str(chunk_bytes))
    path = f"{root}/ckpt.ackpt"
    asyncckpt.save(state, path, compression=compression).result()
    with fsspec.open(path, "rb") as f:
        data = f.read()
    footer = decode_footer(data[-FOOTER_SIZE:], len(data), path)
    body = data[footer.manifest_offset : footer.manifest_offset + footer.manifest_length]
    manifest = decode_manifest(body, footer, path)
    assert _equal(asyncckpt.load(path), state)  # the control: undamaged, it loads
    return Saved(path, data, manifest, footer.manifest_offset, state)


@pytest.fixture(params=["zstd", "none"])
def saved(request: pytest.FixtureRequest, any_root: str, monkeypatch: pytest.MonkeyPatch) -> Saved:
    """The state above on each backend, with and without compression, in 2 KiB chunks."""
    return _save(any_root, _state(), request.param, monkeypatch, 2048)


@pytest.fixture(params=["zstd", "none"])
def small(request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Saved:
    """A few hundred bytes: small enough to damage at every position."""
    state = {
        "w": torch.linspace(-1, 1, 24),
        "i": torch.tensor([7, 8, 9], dtype=torch.int32),
        "a": np.array([True, False]),
        "step": 12,
    }
    return _save(str(tmp_path), state, request.param, monkeypatch, 64)


def _flip(data: bytes, position: int, mask: int = 0x01) -> bytes:
    return data[:position] + bytes([data[position] ^ mask]) + data[position + 1 :]


# --------------------------------------------------------------------------- setup sanity


def test_checkpoint_has_the_regions_these_tests_damage(saved: Saved) -> None:
    m = saved.manifest
    assert len(m.chunks) > len(m.storages)  # some storages span several chunks
    assert any(s.num_chunks >= 3 for s in m.storages)
    codecs = {c.codec for c in m.chunks}
    assert codecs == {"raw"} or "zstd-bytegroup" in codecs
    # The regions tile the file: there is no byte that nothing checks.
    assert [saved.region(p) for p in (0, 15, 16, len(saved.data) - 1)] == [
        "header",
        "header",
        0,
        "footer",
    ]
    covered = sum(c.stored_len for c in m.chunks)
    assert HEADER_SIZE + covered == saved.manifest_offset


# --------------------------------------------------------------------------- chunks


def test_flipped_bit_in_each_chunk_names_the_chunk_and_keys(saved: Saved) -> None:
    for index, chunk in enumerate(saved.manifest.chunks):
        storage = saved.manifest.storage_of_chunk(index)
        assert storage is not None
        expected_keys = saved.manifest.keys_of_storage(storage)
        assert expected_keys
        first, last = chunk.offset, chunk.offset + chunk.stored_len - 1
        for position, mask in [(first, 0x01), ((first + last) // 2, 0x10), (last, 0x80)]:
            err = saved.load_damaged(_flip(saved.data, position, mask))
            assert isinstance(err, ChecksumError), (index, position, err)
            assert err.chunk == index
            assert err.keys == expected_keys
            assert err.path == saved.path
            assert saved.path in str(err)
            assert f"chunk {index} " in str(err)
            assert expected_keys[0] in str(err)


def test_chunk_error_names_tied_and_array_keys(saved: Saved) -> None:
    m = saved.manifest
    w = next(t for t in m.tensors if t.key == "state['model']['w']")
    w_chunk = m.storages[w.storage].first_chunk + 1  # a chunk in the middle of w
    err = saved.load_damaged(_flip(saved.data, m.chunks[w_chunk].offset + 3))
    assert isinstance(err, ChecksumError)
    assert err.chunk == w_chunk
    assert err.keys == ["state['model']['w']", "state['tied']"]

    rng = next(a for a in m.arrays if a.key == "state['rng']")
    rng_chunk = m.storages[rng.storage].first_chunk
    err = saved.load_damaged(_flip(saved.data, m.chunks[rng_chunk].offset))
    assert isinstance(err, ChecksumError)
    assert (err.chunk, err.keys) == (rng_chunk, ["state['rng']"])


def test_zeroed_chunk_is_a_checksum_error(saved: Saved) -> None:
    """What a crash can leave on some filesystems: a run of zero bytes (a hole)."""
    m = saved.manifest
    index = len(m.chunks) // 2
    chunk = m.chunks[index]
    data = bytearray(saved.data)
    data[chunk.offset : chunk.offset + chunk.stored_len] = bytes(chunk.stored_len)
    assert bytes(data) != saved.data
    err = saved.load_damaged(bytes(data))
    assert isinstance(err, ChecksumError)
    assert err.chunk == index


def test_first_damaged_chunk_is_reported(saved: Saved) -> None:
    chunks = saved.manifest.chunks
    data = saved.data
    for index in (len(chunks) - 1, 2, 5):
        data = _flip(data, chunks[index].offset)
    err = saved.load_damaged(data)
    assert isinstance(err, ChecksumError)
    assert err.chunk == 2


def test_swapped_chunks_of_equal_length_are_detected(saved: Saved) -> None:
    chunks = saved.manifest.chunks
    pairs = [
        (i, j)
        for i in range(len(chunks))
        for j in range(i + 1, len(chunks))
        if chunks[i].stored_len == chunks[j].stored_len and chunks[i].crc32 != chunks[j].crc32
    ]
    assert pairs
    i, j = pairs[0]
    a, b = chunks[i], chunks[j]
    data = bytearray(saved.data)
    data[a.offset : a.offset + a.stored_len] = saved.data[b.offset : b.offset + b.stored_len]
    data[b.offset : b.offset + b.stored_len] = saved.data[a.offset : a.offset + a.stored_len]
    err = saved.load_damaged(bytes(data))
    assert isinstance(err, ChecksumError)
    assert err.chunk == i


# --------------------------------------------------------------------------- other regions


def test_damaged_header_is_a_format_error(saved: Saved) -> None:
    for position in range(HEADER_SIZE):
        err = saved.load_damaged(_flip(saved.data, position, 1 << (position % 8)))
        assert type(err) is FormatError, (position, err)
        assert saved.path in str(err)


def test_damaged_manifest_is_a_format_error(saved: Saved) -> None:
    start, end = saved.manifest_offset, saved.manifest_end
    for position in [start, start + 1, (start + end) // 2, end - 2, end - 1]:
        err = saved.load_damaged(_flip(saved.data, position, 0x04))
        assert type(err) is FormatError, (position, err)
        assert "checksum" in str(err)
        assert saved.path in str(err)


def test_damaged_footer_is_a_format_error(saved: Saved) -> None:
    for position in range(saved.manifest_end, len(saved.data)):
        for mask in (0x01, 0x80):
            err = saved.load_damaged(_flip(saved.data, position, mask))
            assert isinstance(err, FormatError), (position, err)
            assert not isinstance(err, ChecksumError)
            assert saved.path in str(err)


def test_damaged_footer_magic_says_truncated(saved: Saved) -> None:
    err = saved.load_damaged(_flip(saved.data, len(saved.data) - 1))
    assert isinstance(err, TruncatedFileError)
    assert "no asyncckpt footer" in str(err)


# --------------------------------------------------------------------------- length changes


def test_truncation_at_region_boundaries(saved: Saved) -> None:
    cuts = {0, 1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + FOOTER_SIZE - 1}
    for chunk in saved.manifest.chunks:
        cuts |= {chunk.offset + 1, chunk.offset + chunk.stored_len // 2}
    cuts |= {saved.manifest_offset, saved.manifest_offset + 1, saved.manifest_end - 1}
    cuts |= {saved.manifest_end, saved.manifest_end + 1, len(saved.data) - 1}
    for cut in sorted(cuts):
        err = saved.load_damaged(saved.data[:cut])
        assert isinstance(err, TruncatedFileError), (cut, err)
        assert saved.path in str(err)


@pytest.mark.parametrize(
    "garbage",
    [b"\x00", b"x" * 31, bytes(32), bytes(range(256)) * 4, b"\x89ACKPT\r"],
    ids=["1", "31", "32-zeros", "1024", "partial-magic"],
)
def test_appended_garbage_is_truncation(saved: Saved, garbage: bytes) -> None:
    err = saved.load_damaged(saved.data + garbage)
    assert isinstance(err, TruncatedFileError)
    assert saved.path in str(err)


def test_prepended_garbage_is_a_format_error(saved: Saved) -> None:
    err = saved.load_damaged(b"\x00" + saved.data)
    assert type(err) is FormatError
    assert "not an asyncckpt file" in str(err)


def test_empty_and_missing_files(saved: Saved) -> None:
    err = saved.load_damaged(b"")
    assert isinstance(err, TruncatedFileError)
    missing = saved.path.replace("ckpt.ackpt", "missing.ackpt")
    with pytest.raises(CheckpointNotFoundError) as info:
        asyncckpt.load(missing)
    assert isinstance(info.value, FileNotFoundError)
    assert "missing.ackpt" in str(info.value)


def test_torch_save_file_is_refused_with_advice(tmp_path: Any) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(100)}, path)
    with pytest.raises(FormatError, match=r"torch\.load"):
        asyncckpt.load(path)


# --------------------------------------------------------------------------- exhaustive


@pytest.mark.parametrize("mask", [0x01, 0xFF], ids=["one-bit", "whole-byte"])
def test_every_byte_position_is_checked(small: Saved, mask: int) -> None:
    """No damaged byte anywhere in the file loads: never silent wrong data."""
    assert len(small.manifest.chunks) >= 3
    seen: set[str | int] = set()
    for position in range(len(small.data)):
        bit = 1 << (position % 8) if mask == 0x01 else mask
        damaged = _flip(small.data, position, bit)
        region = small.region(position)
        seen.add(region)
        small.write(damaged)
        try:
            loaded = asyncckpt.load(small.path)
        except ChecksumError as err:
            assert region == err.chunk, (position, region, err)
        except FormatError as err:
            assert isinstance(region, str), (position, region, err)
        else:
            raise AssertionError(
                f"byte {position} ({region}) flipped with {bit:#x} loaded without error: "
                f"{'equal' if _equal(loaded, small.state) else 'WRONG'} data"
            )
    assert seen == {"header", "manifest", "footer", *range(len(small.manifest.chunks))}


def test_every_truncation_is_detected(small: Saved) -> None:
    for cut in range(len(small.data)):
        err = small.load_damaged(small.data[:cut])
        assert isinstance(err, TruncatedFileError), (cut, err)
