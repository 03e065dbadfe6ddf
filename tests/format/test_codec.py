"""Chunk codecs: raw, zstd and byte-grouped zstd, encoded and decoded directly."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt._format.codec import (
    check_compression,
    checksum,
    compress_frames,
    decode_chunk,
    encode_chunk,
    group_bytes,
    ungroup_bytes,
)
from asyncckpt._format.container import CODECS
from asyncckpt.errors import FormatError


def _roundtrip(raw: bytes, *, itemsize: int, is_float: bool, compression: str = "zstd") -> str:
    """Encode ``raw``, decode it into a fresh buffer, check the bytes; return the codec."""
    codec, stored = encode_chunk(
        memoryview(raw), itemsize=itemsize, is_float=is_float, compression=compression, level=1
    )
    assert codec in CODECS
    if codec == "raw":
        assert bytes(stored) == raw
    out = bytearray(len(raw))
    decode_chunk(bytes(stored), codec, itemsize, memoryview(out))
    assert bytes(out) == raw
    return codec


def _weights(dtype: torch.dtype, n: int = 1 << 14) -> bytes:
    """Bytes of trained-weight-like values: small, normally distributed."""
    g = torch.Generator().manual_seed(1234)
    t = (torch.randn(n, generator=g, dtype=torch.float64) * 0.02).to(dtype)
    return t.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    ("dtype", "itemsize"),
    [
        (torch.float64, 8),
        (torch.float32, 4),
        (torch.float16, 2),
        (torch.bfloat16, 2),
    ],
)
def test_float_weights_use_bytegroup_and_shrink(dtype: torch.dtype, itemsize: int) -> None:
    raw = _weights(dtype)
    codec, stored = encode_chunk(
        memoryview(raw), itemsize=itemsize, is_float=True, compression="zstd", level=1
    )
    assert codec == "zstd-bytegroup"
    assert len(stored) < len(raw)
    # The stored payload is a table of plane lengths, then each byte plane of the grouped
    # bytes as its own zstd frame, or raw when compressing it did not help.
    lengths = struct.unpack_from(f"<{itemsize}I", stored)
    assert 4 * itemsize + sum(lengths) == len(stored)
    grouped, plane, pos = group_bytes(raw, itemsize), len(raw) // itemsize, 4 * itemsize
    for j, n in enumerate(lengths):
        part = bytes(stored[pos : pos + n])
        expected = bytes(grouped[j * plane : (j + 1) * plane])
        assert (part if n == plane else zstandard.ZstdDecompressor().decompress(part)) == expected
        pos += n
    assert any(n < plane for n in lengths)  # the sign/exponent plane shrinks
    out = bytearray(len(raw))
    decode_chunk(stored, codec, itemsize, memoryview(out))
    assert bytes(out) == raw


def test_raw_planes_behind_a_frame_move_up_in_place() -> None:
    """Plane 0 compresses, planes 1 and 2 are noise: both move up behind plane 0's frame."""
    rng = np.random.default_rng(5)
    grid = rng.integers(0, 256, size=(1 << 18, 3), dtype=np.uint8)
    grid[:, 0] = 7
    raw = grid.tobytes()
    codec, stored = encode_chunk(
        memoryview(raw), itemsize=3, is_float=True, compression="zstd", level=1
    )
    plane = len(raw) // 3
    lengths = struct.unpack_from("<3I", stored)
    assert codec == "zstd-bytegroup"
    assert lengths[0] < plane // 100 and lengths[1:] == (plane, plane)
    planes = bytes(stored[12 + lengths[0] :])
    assert planes == grid[:, 1].tobytes() + grid[:, 2].tobytes()
    out = bytearray(len(raw))
    decode_chunk(stored, codec, 3, memoryview(out))
    assert bytes(out) == raw


@pytest.mark.parametrize(
    "parts",
    [[b"a" * 5000, bytes(range(256)) * 40, b"zz"], [b"only one" * 100], [b"x" * 100, b""], []],
)
def test_compress_frames_gives_the_frames_compress_gives(parts: list[bytes]) -> None:
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    frames = compress_frames(cctx, [memoryview(p) for p in parts])
    assert [bytes(f) for f in frames] == [cctx.compress(p) for p in parts]


def test_compress_frames_without_the_batch_call() -> None:
    """Backends that lack ``multi_compress_to_buffer`` (cffi) compress frame by frame."""

    class NoBatch:
        def __init__(self) -> None:
            self.cctx = zstandard.ZstdCompressor(level=1)

        def compress(self, data: memoryview) -> bytes:
            return self.cctx.compress(data)

        def multi_compress_to_buffer(self, *args: object, **kwargs: object) -> None:
            raise NotImplementedError

    parts = [memoryview(b"a" * 1000), memoryview(b"b" * 2000)]
    frames = compress_frames(NoBatch(), parts)  # type: ignore[arg-type]
    assert [bytes(f) for f in frames] == [
        zstandard.ZstdCompressor(level=1).compress(p) for p in parts
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytegroup_beats_plain_zstd_on_weights(dtype: torch.dtype) -> None:
    raw = memoryview(_weights(dtype))
    size = dtype.itemsize
    _, grouped = encode_chunk(raw, itemsize=size, is_float=True, compression="zstd", level=1)
    codec, plain = encode_chunk(raw, itemsize=size, is_float=False, compression="zstd", level=1)
    assert codec == "zstd"
    assert len(grouped) < len(plain)


def test_integers_use_plain_zstd() -> None:
    raw = torch.arange(4096, dtype=torch.int64).numpy().tobytes()
    assert _roundtrip(raw, itemsize=8, is_float=False) == "zstd"


def test_one_byte_floats_are_not_grouped() -> None:
    raw = bytes(4096)
    assert _roundtrip(raw, itemsize=1, is_float=True) == "zstd"


@pytest.mark.parametrize("extra", [1, 2, 3])
def test_length_not_a_multiple_of_itemsize_falls_back_to_zstd(extra: int) -> None:
    raw = _weights(torch.float32, 1024) + bytes(range(extra))
    assert _roundtrip(raw, itemsize=4, is_float=True) == "zstd"


@pytest.mark.parametrize("compression", ["zstd", "none", "auto"])
@pytest.mark.parametrize("is_float", [True, False])
def test_empty_chunk_is_raw(compression: str, is_float: bool) -> None:
    codec, stored = encode_chunk(
        memoryview(b""), itemsize=4, is_float=is_float, compression=compression, level=1
    )
    assert (codec, bytes(stored)) == ("raw", b"")
    decode_chunk(stored, codec, 4, memoryview(bytearray()))


@pytest.mark.parametrize("is_float", [True, False])
def test_incompressible_data_is_stored_raw(is_float: bool) -> None:
    raw = np.random.default_rng(7).integers(0, 256, 1 << 15, dtype=np.uint8).tobytes()
    view = memoryview(raw)
    codec, stored = encode_chunk(view, itemsize=4, is_float=is_float, compression="zstd", level=1)
    assert codec == "raw"
    assert stored is view  # no copy for the raw codec


def test_compression_none_is_raw_even_when_compressible() -> None:
    raw = bytes(1 << 16)
    codec, stored = encode_chunk(
        memoryview(raw), itemsize=4, is_float=True, compression="none", level=1
    )
    assert codec == "raw"
    assert bytes(stored) == raw


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(max_size=2048),
    itemsize=st.sampled_from([1, 2, 4, 8, 16]),
    is_float=st.booleans(),
    compression=st.sampled_from(["zstd", "none", "auto"]),
)
def test_any_bytes_round_trip(data: bytes, itemsize: int, is_float: bool, compression: str) -> None:
    _roundtrip(data, itemsize=itemsize, is_float=is_float, compression=compression)


@pytest.mark.parametrize("level", [1, 3, 19])
def test_levels_round_trip(level: int) -> None:
    raw = _weights(torch.float32, 2048)
    codec, stored = encode_chunk(
        memoryview(raw), itemsize=4, is_float=True, compression="zstd", level=level
    )
    out = bytearray(len(raw))
    decode_chunk(stored, codec, 4, memoryview(out))
    assert bytes(out) == raw


def test_group_bytes_layout() -> None:
    raw = bytes([0x00, 0x01, 0x02, 0x03, 0x10, 0x11, 0x12, 0x13, 0x20, 0x21, 0x22, 0x23])
    grouped = group_bytes(raw, 4)
    assert grouped == bytes(
        [0x00, 0x10, 0x20, 0x01, 0x11, 0x21, 0x02, 0x12, 0x22, 0x03, 0x13, 0x23]
    )
    out = bytearray(len(raw))
    ungroup_bytes(grouped, 4, memoryview(out))
    assert bytes(out) == raw


@settings(max_examples=60, deadline=None)
@given(itemsize=st.integers(1, 16), elements=st.integers(0, 64), seed=st.integers(0, 2**32 - 1))
def test_group_ungroup_round_trip(itemsize: int, elements: int, seed: int) -> None:
    raw = np.random.default_rng(seed).integers(0, 256, itemsize * elements, dtype=np.uint8)
    grouped = group_bytes(raw.tobytes(), itemsize)
    assert len(grouped) == len(raw)
    # Byte j of element i lands at j * elements + i.
    for i in range(min(elements, 3)):
        for j in range(itemsize):
            assert grouped[j * elements + i] == raw[i * itemsize + j]
    out = bytearray(len(raw))
    ungroup_bytes(grouped, itemsize, memoryview(out))
    assert bytes(out) == raw.tobytes()


def test_raw_decode_of_wrong_length_raises() -> None:
    with pytest.raises(FormatError, match="raw chunk holds 3 bytes, expected 4"):
        decode_chunk(b"abc", "raw", 1, memoryview(bytearray(4)))
    with pytest.raises(FormatError):
        decode_chunk(b"abcde", "raw", 1, memoryview(bytearray(4)))


@pytest.mark.parametrize("codec", ["zstd", "zstd-bytegroup"])
@pytest.mark.parametrize("out_len", [0, 96, 104, 200])
def test_zstd_decode_of_wrong_length_raises(codec: str, out_len: int) -> None:
    stored = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(100))
    with pytest.raises(FormatError):
        decode_chunk(stored, codec, 4, memoryview(bytearray(out_len)))


def test_frame_without_content_size_is_bounded_by_raw_length() -> None:
    stored = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(400))
    out = bytearray(400)
    decode_chunk(stored, "zstd", 4, memoryview(out))
    assert bytes(out) == bytes(400)
    with pytest.raises(FormatError):
        decode_chunk(stored, "zstd", 4, memoryview(bytearray(200)))


def _planes(frames: list[bytes]) -> bytes:
    return struct.pack(f"<{len(frames)}I", *map(len, frames)) + b"".join(frames)


def test_bytegroup_planes_without_content_size_are_bounded() -> None:
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(100))
    out = bytearray(400)
    decode_chunk(_planes([frame] * 4), "zstd-bytegroup", 4, memoryview(out))
    assert bytes(out) == bytes(400)
    with pytest.raises(FormatError):  # each plane would decode to 100, not 50 bytes
        decode_chunk(_planes([frame] * 4), "zstd-bytegroup", 4, memoryview(bytearray(200)))


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # no plane table
        struct.pack("<4I", 1, 1, 1, 1),  # lengths promise bytes that are not there
        struct.pack("<4I", 200, 0, 0, 0) + bytes(200),  # a plane longer than n / itemsize
        struct.pack("<4I", 100, 100, 100, 100) + bytes(400) + b"x",  # trailing bytes
    ],
)
def test_bytegroup_plane_table_is_checked(payload: bytes) -> None:
    with pytest.raises(FormatError):
        decode_chunk(payload, "zstd-bytegroup", 4, memoryview(bytearray(400)))


def test_bytegroup_raw_planes_round_trip() -> None:
    raw = bytes(range(256)) * 4
    out = bytearray(len(raw))
    grouped = bytes(group_bytes(raw, 4))
    planes = [grouped[j * 256 : (j + 1) * 256] for j in range(4)]
    decode_chunk(_planes(planes), "zstd-bytegroup", 4, memoryview(out))
    assert bytes(out) == raw


@pytest.mark.parametrize("claim", [1000, 1 << 30, 1 << 40, (1 << 64) - 2])
def test_frame_declaring_a_huge_size_is_refused_before_allocating(claim: int) -> None:
    # A single-segment frame with an 8-byte content size field; zstandard would allocate the
    # declared size (a MemoryError for 1 TiB) unless the decoder checks it first.
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(100))
    assert frame[4] == 0x20  # single segment, 1-byte content size
    forged = frame[:4] + bytes([0xE0]) + struct.pack("<Q", claim) + frame[6:]
    with pytest.raises(FormatError):
        decode_chunk(forged, "zstd", 1, memoryview(bytearray(100)))


@pytest.mark.parametrize(
    "stored",
    [b"", b"\x00", b"not zstd at all", b"\x28\xb5\x2f\xfd", b"\x28\xb5\x2f\xfd\x20\x64\x00"],
)
@pytest.mark.parametrize("codec", ["zstd", "zstd-bytegroup"])
def test_garbage_zstd_payload_raises(stored: bytes, codec: str) -> None:
    with pytest.raises(FormatError):
        decode_chunk(stored, codec, 4, memoryview(bytearray(100)))


def test_truncated_zstd_frame_raises() -> None:
    raw = _weights(torch.float32, 1024)
    codec, stored = encode_chunk(
        memoryview(raw), itemsize=4, is_float=True, compression="zstd", level=1
    )
    assert codec == "zstd-bytegroup"
    with pytest.raises(FormatError):
        decode_chunk(bytes(stored)[:-5], codec, 4, memoryview(bytearray(len(raw))))


def test_checksum_is_zlib_crc32() -> None:
    assert checksum(b"123456789") == 0xCBF43926  # the CRC-32/ISO-HDLC check value
    data = bytes(range(256)) * 10
    assert checksum(data) == zlib.crc32(data)
    assert checksum(memoryview(data)) == zlib.crc32(data)
    assert checksum(b"") == 0


def test_check_compression() -> None:
    assert check_compression("zstd") == "zstd"
    assert check_compression("none") == "none"
    assert check_compression("auto") == "auto"
    with pytest.raises(ValueError, match="compression must be one of"):
        check_compression("gzip")


def test_noisy_planes_are_stored_raw_without_compressing_them_whole() -> None:
    from asyncckpt._format import codec

    def looks_incompressible(data: memoryview) -> bool:  # the probe's samples shrink < 2 %
        ratio = codec._probe_ratio(data, 1)
        return ratio is not None and ratio > codec.INCOMPRESSIBLE

    rng = np.random.default_rng(0)
    noise = memoryview(rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    assert looks_incompressible(noise)
    repetitive = memoryview(bytes(range(64)) * (1 << 14))
    assert not looks_incompressible(repetitive)
    small_noise = noise[: 64 << 10]  # too short to probe: compressed and judged whole
    assert not looks_incompressible(small_noise)
    # A float chunk whose low mantissa planes are noise: those planes go in raw.
    raw = rng.standard_normal(1 << 20).astype(np.float32).tobytes()
    codec_name, stored = encode_chunk(
        memoryview(raw), itemsize=4, is_float=True, compression="zstd", level=1
    )
    lengths = struct.unpack_from("<4I", stored)
    assert codec_name == "zstd-bytegroup"
    assert lengths[0] == lengths[1] == 1 << 20  # raw planes
    assert lengths[3] < 1 << 20  # the sign/exponent plane is compressed
    out = bytearray(len(raw))
    decode_chunk(stored, codec_name, 4, memoryview(out))
    assert bytes(out) == raw


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [(np.float32, 1.0), (np.float32, 0.02), (np.float64, 1.0), (np.float16, 1.0)],
)
def test_planes_are_probed_without_regrouping_the_whole_chunk(dtype: type, scale: float) -> None:
    """The probe samples element ranges and regroups only those, yet finds what probing
    each regrouped plane finds."""
    from asyncckpt._format import codec

    rng = np.random.default_rng(5)
    raw = memoryview((rng.standard_normal(1 << 20) * scale).astype(dtype).tobytes())
    size = np.dtype(dtype).itemsize
    grouped, plane = group_bytes(raw, size), len(raw) // size
    whole = [codec._probe_ratio(grouped[j * plane : (j + 1) * plane], 1) for j in range(size)]
    assert list(codec._probe_planes(raw, size, 1)) == whole
    assert codec._probe_planes(raw[: 16 * size], size, 1) == (None,) * size  # too short


def test_incompressible_chunk_is_not_regrouped() -> None:
    from asyncckpt._format.codec import EncodeReport

    raw = memoryview(np.random.default_rng(9).integers(0, 256, 1 << 22, dtype=np.uint8).tobytes())
    report = EncodeReport()
    codec, stored = encode_chunk(
        raw, itemsize=4, is_float=True, compression="zstd", level=1, report=report
    )
    assert (codec, stored) == ("raw", raw)
    assert report.grouped_bytes == report.compressed_bytes == 0
