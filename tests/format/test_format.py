"""The container format: header, footer and manifest codecs, the layout the writer produces,
and fuzzing of every parser (only asyncckpt errors may come out, whatever the bytes)."""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import math
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncckpt
from asyncckpt._format.codec import decode_chunk
from asyncckpt._format.container import (
    FOOTER_SIZE,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_CHUNK_BYTES,
    MAX_DEPTH,
    MAX_EXPANSION,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    ArrayEntry,
    Chunk,
    Footer,
    Manifest,
    StorageEntry,
    TensorEntry,
    decode_footer,
    decode_header,
    decode_manifest,
    encode_footer,
    encode_header,
    encode_manifest,
)
from asyncckpt.errors import AsyncCkptError, ChecksumError, FormatError, TruncatedFileError

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# --------------------------------------------------------------------------- helpers


def _state() -> dict[str, Any]:
    od: collections.OrderedDict[str, Any] = collections.OrderedDict(a=torch.ones(2))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)  # compresses: zstd-bytegroup
    state: dict[str, Any] = {
        "w": w,
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "idx": torch.arange(5),
        "p": torch.nn.Parameter(torch.linspace(0, 1, 4)),
        "np": np.arange(4, dtype=np.int16),
        "sc": np.float64(2.5),
        "od": od,
        "t": (1.5, b"xy", None, True, "s", torch.Size([2]), torch.float16, torch.device("cpu")),
        7: [float("nan"), -0.0],
        "tied": w[1],
    }
    return state


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.requires_grad == b.requires_grad
            and torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b)
        )
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _layout(data: bytes) -> tuple[int, int, dict[str, Any]]:
    """(manifest offset, manifest length, manifest document) of a well-formed file."""
    offset, length, _, _, _ = struct.unpack("<QQII8s", data[-FOOTER_SIZE:])
    return offset, length, json.loads(data[offset : offset + length])


def _with_manifest(data: bytes, doc: Any = None, *, body: bytes | None = None) -> bytes:
    """``data`` with its manifest replaced and a footer that matches (length and crc)."""
    offset, _, _ = _layout(data)
    if body is None:
        body = json.dumps(doc, separators=(",", ":")).encode()
    return data[:offset] + body + encode_footer(offset, body)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("format")


@pytest.fixture(scope="module")
def sample(scratch: Path) -> tuple[bytes, dict[str, Any]]:
    """A checkpoint of :func:`_state` as bytes, and the state it holds (zstd: the codecs do
    not depend on what ``"auto"``, the default, has measured)."""
    state = _state()
    path = scratch / "sample.ackpt"
    asyncckpt.save(state, path, compression="zstd").result()
    return path.read_bytes(), state


def _load_bytes(scratch: Path, data: bytes, name: str = "fuzz.ackpt") -> Any:
    path = scratch / name
    path.write_bytes(data)
    return asyncckpt.load(path)


# --------------------------------------------------------------------------- header


def test_header_layout() -> None:
    header = encode_header()
    assert len(header) == HEADER_SIZE == 16
    assert MAGIC == b"\x89ACKPT\r\n"
    assert header == MAGIC + struct.pack("<II", FORMAT_VERSION, 0)
    assert decode_header(header, "f") == FORMAT_VERSION == 1
    assert decode_header(header + b"ignored", "f") == FORMAT_VERSION


@pytest.mark.parametrize("length", [0, 1, 8, 15])
def test_short_header_is_truncated(length: int) -> None:
    with pytest.raises(TruncatedFileError, match=r"ckpt\.bin"):
        decode_header(encode_header()[:length], "ckpt.bin")


@pytest.mark.parametrize(
    ("header", "words"),
    [
        (b"PK\x03\x04" + bytes(12), "not an asyncckpt file"),
        (b"\x80\x02}q\x00" + bytes(11), "torch.load"),  # a pickle
        (MAGIC + struct.pack("<II", 2, 0), "upgrade asyncckpt"),
        (MAGIC + struct.pack("<II", 0, 0), "format version 0"),
        (MAGIC + struct.pack("<II", 1, 1), "flags 0x1"),
        (MAGIC + struct.pack("<II", 1, 1 << 31), "flags"),
    ],
)
def test_bad_header_is_a_format_error(header: bytes, words: str) -> None:
    with pytest.raises(FormatError, match=words) as info:
        decode_header(header, "ckpt.bin")
    assert type(info.value) is FormatError
    assert "ckpt.bin" in str(info.value)


# --------------------------------------------------------------------------- footer


def test_footer_layout_and_round_trip() -> None:
    body = b'{"x":1}'
    footer = encode_footer(100, body)
    assert len(footer) == FOOTER_SIZE == 32
    assert footer == struct.pack("<QQII", 100, len(body), zlib.crc32(body), FORMAT_VERSION) + MAGIC
    assert decode_footer(footer, 100 + len(body) + 32, "f") == Footer(
        100, len(body), zlib.crc32(body)
    )


def _footer(
    offset: int, length: int, crc: int = 0, version: int = 1, magic: bytes = MAGIC
) -> bytes:
    return struct.pack("<QQII8s", offset, length, crc, version, magic)


@pytest.mark.parametrize(
    ("footer", "size", "error"),
    [
        (_footer(16, 0), 47, TruncatedFileError),  # shorter than header + footer
        (_footer(16, 0)[:31], 48, TruncatedFileError),  # not 32 bytes
        (_footer(16, 0, magic=b"\x89ACKPT\r\x00"), 48, TruncatedFileError),
        (bytes(32), 1000, TruncatedFileError),
        (_footer(16, 0, version=2), 48, FormatError),
        (_footer(16, 0, version=0), 48, FormatError),
        (_footer(16, MAX_MANIFEST_BYTES + 1), 1 << 40, FormatError),
        (_footer(15, 1), 1000, TruncatedFileError),  # manifest inside the header
        (_footer(0, 0), 1000, TruncatedFileError),
        (_footer(16, 953), 1000, TruncatedFileError),  # manifest overlaps the footer
        (_footer(969, 0), 1000, TruncatedFileError),
        (_footer(2**64 - 1, 10), 1000, TruncatedFileError),
        (_footer(16, 2**64 - 1), 1000, FormatError),
    ],
)
def test_bad_footer(footer: bytes, size: int, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        decode_footer(footer, size, "ckpt.bin")
    assert type(info.value) is error
    assert "ckpt.bin" in str(info.value)


@pytest.mark.parametrize(("offset", "length"), [(16, 952), (968, 0), (16, 0), (500, 468)])
def test_footer_bounds_are_inclusive(offset: int, length: int) -> None:
    assert decode_footer(_footer(offset, length, 7), 1000, "f") == Footer(offset, length, 7)


def test_max_manifest_size_is_accepted() -> None:
    size = HEADER_SIZE + MAX_MANIFEST_BYTES + FOOTER_SIZE
    footer = decode_footer(_footer(16, MAX_MANIFEST_BYTES), size, "f")
    assert footer.manifest_length == MAX_MANIFEST_BYTES


# --------------------------------------------------------------------------- manifest


def _manifest() -> Manifest:
    return Manifest(
        chunks=(
            Chunk(16, 10, 40, "zstd-bytegroup", 1),
            Chunk(26, 8, 8, "raw", 2),
            Chunk(34, 0, 0, "raw", 0),
            Chunk(34, 3, 16, "zstd", 2**32 - 1),
        ),
        storages=(
            StorageEntry(40, 4, "cpu", 0, 1),
            StorageEntry(8, 8, "cuda:1", 1, 1),
            StorageEntry(16, 1, "cpu", 2, 2),
            StorageEntry(0, 2, "cpu", 4, 0),
        ),
        tensors=(
            TensorEntry(0, "float32", (2, 5), (5, 1), 0, True, True, "state['w']"),
            TensorEntry(0, "float32", (5,), (1,), 5, False, False, "state['w2']"),
            TensorEntry(1, "int64", (), (), 0, False, False, "state['step']"),
            TensorEntry(3, "float16", (0, 3), (3, 1), 0, False, False, "state['e']"),
            TensorEntry(0, "bfloat16", (4,), (0,), 19, False, False, "state['x']"),
        ),
        arrays=(
            ArrayEntry(2, "<i2", (2, 4), False, "state['a']"),
            ArrayEntry(3, "|b1", (0,), False, "state['empty']"),
        ),
        root={"dict": [["w", {"tensor": 0}], ["ü", {"ndarray": 0}], [3, [None, True]]]},
        meta={"library": "test", "note": "ünïcode"},
    )


def test_manifest_round_trip() -> None:
    manifest = _manifest()
    body = encode_manifest(manifest)
    footer = Footer(37, len(body), zlib.crc32(body))
    assert decode_manifest(body, footer, "f") == manifest


def test_manifest_encoding_is_compact_utf8_json() -> None:
    body = encode_manifest(_manifest())
    assert b" " not in body.replace("ünïcode".encode(), b"")
    assert "ünïcode".encode() in body  # not \u-escaped
    doc = json.loads(body)
    assert list(doc) == [
        "format_version",
        "checksum",
        "chunks",
        "storages",
        "tensors",
        "arrays",
        "root",
        "byteorder",
        "meta",
    ]
    assert doc["byteorder"] == "little"
    assert doc["format_version"] == 1 and doc["checksum"] == "crc32"
    assert doc["chunks"][0] == [16, 10, 40, "zstd-bytegroup", 1]
    assert doc["storages"][1] == [8, 8, "cuda:1", 1, 1]
    assert doc["tensors"][0] == [0, "float32", [2, 5], [5, 1], 0, True, True, "state['w']"]
    assert doc["arrays"][0] == [2, "<i2", [2, 4], False, "state['a']"]


def test_manifest_keys_of_storage_and_storage_of_chunk() -> None:
    m = _manifest()
    assert m.keys_of_storage(0) == ["state['w']", "state['w2']", "state['x']"]
    assert m.keys_of_storage(2) == ["state['a']"]
    assert m.keys_of_storage(3) == ["state['e']", "state['empty']"]
    assert [m.storage_of_chunk(i) for i in range(5)] == [0, 1, 2, 2, None]


def test_manifest_optional_meta_and_extra_keys() -> None:
    doc = json.loads(encode_manifest(_manifest()))
    del doc["meta"]
    doc["future_field"] = {"anything": [1, 2]}
    body = json.dumps(doc).encode()
    decoded = decode_manifest(body, Footer(37, len(body), zlib.crc32(body)), "f")
    assert decoded.meta == {}


def test_manifest_length_and_checksum_are_checked_first() -> None:
    body = encode_manifest(_manifest())
    with pytest.raises(TruncatedFileError):
        decode_manifest(body[:-1], Footer(37, len(body), zlib.crc32(body)), "f")
    with pytest.raises(FormatError, match="checksum") as info:
        decode_manifest(body, Footer(37, len(body), zlib.crc32(body) ^ 1), "ckpt.bin")
    assert type(info.value) is FormatError
    assert "ckpt.bin" in str(info.value)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xfe",
        b"[",
        b"[]",
        b"null",
        b'"x"',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"format_version": NaN}',
        b'{"format_version": Infinity}',
        b'{"format_version": 1' + b"0" * 5000 + b"}",
        b'{"format_version": 1, "checksum": "crc32", "chunks": [], "storages": [], '
        b'"tensors": [], "arrays": [], "root": {"float": NaN}}',
    ],
    ids=lambda b: repr(b[:24]),
)
def test_malformed_json_is_a_format_error(body: bytes) -> None:
    with pytest.raises(FormatError):
        decode_manifest(body, Footer(16, len(body), zlib.crc32(body)), "f")


# --------------------------------------------------------------------------- writer layout


def test_written_file_layout(sample: tuple[bytes, dict[str, Any]]) -> None:
    data, _ = sample
    assert data[:HEADER_SIZE] == encode_header()
    offset, length, doc = _layout(data)
    assert data[-FOOTER_SIZE:] == encode_footer(offset, data[offset : offset + length])
    assert offset + length + FOOTER_SIZE == len(data)
    # Storages take consecutive runs of chunks, in order, and chunks tile [16, manifest
    # offset) in table order: no gaps, no overlap, no padding.
    position, first = HEADER_SIZE, 0
    for nbytes, itemsize, _, storage_first, count in doc["storages"]:
        assert storage_first == first
        first += count
        total = 0
        for at, stored_len, raw_len, codec, crc in doc["chunks"][storage_first:first]:
            assert at == position
            stored = data[at : at + stored_len]
            assert zlib.crc32(stored) == crc
            decode_chunk(stored, codec, itemsize, memoryview(bytearray(raw_len)))
            position += stored_len
            total += raw_len
        assert total == nbytes
    assert first == len(doc["chunks"])
    assert position == offset
    assert set(doc["meta"]) == {"library", "torch", "created"}
    assert doc["meta"]["library"] == f"asyncckpt {asyncckpt.__version__}"


def test_written_manifest_describes_the_state(sample: tuple[bytes, dict[str, Any]]) -> None:
    data, _ = sample
    _, _, doc = _layout(data)
    tensors = {t[7]: t for t in doc["tensors"]}
    assert list(tensors) == [
        "state['w']",
        "state['b']",
        "state['idx']",
        "state['p']",
        "state['od']['a']",
        "state['tied']",
    ]
    assert tensors["state['w']"][:7] == [0, "float32", [8, 8], [8, 1], 0, False, False]
    assert tensors["state['tied']"][:7] == [0, "float32", [8], [1], 8, False, False]
    assert tensors["state['p']"][5:7] == [True, True]
    assert doc["arrays"] == [
        [5, "<i2", [4], False, "state['np']"],
        [6, "<f8", [], True, "state['sc']"],
    ]
    codecs = {doc["chunks"][s[3]][3] for s in doc["storages"] if s[4]}
    assert "zstd-bytegroup" in codecs
    w_storage = doc["storages"][0]
    assert w_storage[:3] == [256, 4, "cpu"]


@pytest.mark.parametrize(
    ("tensor", "itemsize"),
    [
        (torch.zeros(8, dtype=torch.float64), 8),
        (torch.zeros(8, dtype=torch.float32), 4),
        (torch.zeros(8, dtype=torch.bfloat16), 2),
        (torch.zeros(8, dtype=torch.complex64), 4),  # grouped by component
        (torch.zeros(8, dtype=torch.complex128), 8),
        (torch.zeros(8, dtype=torch.int64), 8),
        (torch.zeros(8, dtype=torch.bool), 1),
        (torch.zeros(8, dtype=torch.float8_e4m3fn), 1),
    ],
    ids=str,
)
def test_storage_itemsize_is_the_byte_group_width(
    scratch: Path, tensor: torch.Tensor, itemsize: int
) -> None:
    path = scratch / "itemsize.ackpt"
    asyncckpt.save({"t": tensor}, path).result()
    _, _, doc = _layout(path.read_bytes())
    assert doc["storages"][0][1] == itemsize


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_chunks_follow_chunk_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str
) -> None:
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", "1000")  # rounded down to a multiple of 16
    state = {"w": torch.randn(1000), "e": torch.zeros(0), "i": torch.arange(10)}
    asyncckpt.save(state, tmp_path / "c.ackpt", compression=compression).result()
    _, _, doc = _layout((tmp_path / "c.ackpt").read_bytes())
    raw_lens = [c[2] for c in doc["chunks"]]
    assert raw_lens == [992, 992, 992, 992, 32, 80]
    assert [s[3:] for s in doc["storages"]] == [[0, 5], [5, 0], [5, 1]]
    if compression == "none":
        assert {c[3] for c in doc["chunks"]} == {"raw"}
    assert _equal(asyncckpt.load(tmp_path / "c.ackpt"), state)


def test_writer_never_exceeds_max_chunk_bytes() -> None:
    from asyncckpt._engine.encode import _slices
    from asyncckpt._engine.snapshot import StagedStorage

    big = torch.empty(MAX_CHUNK_BYTES + 32, dtype=torch.uint8)  # never touched
    lengths = [len(v) for v, _, _ in _slices([StagedStorage(big, 4, True, "cpu")], 1 << 31)]
    assert lengths == [MAX_CHUNK_BYTES, 32]


# --------------------------------------------------------------------------- ranged reads


def test_remote_reader_fetches_only_what_it_needs(sample: tuple[bytes, dict[str, Any]]) -> None:
    """The procedure of docs/FORMAT.md: size, footer, manifest, then one storage's chunks."""
    data, state = sample
    reads: list[tuple[int, int]] = []

    def read(start: int, length: int) -> bytes:
        reads.append((start, length))
        return data[start : start + length]

    size = len(data)
    footer = decode_footer(read(size - FOOTER_SIZE, FOOTER_SIZE), size, "remote")
    manifest = decode_manifest(
        read(footer.manifest_offset, footer.manifest_length), footer, "remote"
    )
    entry = next(t for t in manifest.tensors if t.key == "state['idx']")
    storage = manifest.storages[entry.storage]
    out = bytearray(storage.nbytes)
    position = 0
    for chunk in manifest.chunks[storage.first_chunk : storage.first_chunk + storage.num_chunks]:
        stored = read(chunk.offset, chunk.stored_len)
        assert zlib.crc32(stored) == chunk.crc32
        view = memoryview(out)[position : position + chunk.raw_len]
        decode_chunk(stored, chunk.codec, storage.itemsize, view)
        position += chunk.raw_len
    values = torch.frombuffer(out, dtype=torch.int64).as_strided(
        entry.shape, entry.stride, entry.offset
    )
    assert torch.equal(values, state["idx"])
    assert len(reads) == 2 + storage.num_chunks
    # Nothing of any other storage's chunks was fetched.
    others = [
        chunk
        for sid, other in enumerate(manifest.storages)
        if sid != entry.storage
        for chunk in manifest.chunks[other.first_chunk : other.first_chunk + other.num_chunks]
    ]
    assert others
    for chunk in others:
        for start, length in reads:
            assert start + length <= chunk.offset or chunk.offset + chunk.stored_len <= start


# --------------------------------------------------------------------------- fuzzing: parsers


@FUZZ
@given(st.one_of(st.binary(max_size=64), st.binary(max_size=16).map(lambda b: MAGIC + b)))
def test_fuzz_decode_header(data: bytes) -> None:
    try:
        assert decode_header(data, "f") == FORMAT_VERSION
    except AsyncCkptError:
        return
    assert data[:16] == encode_header()


_u64 = st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 4096), st.sampled_from([16, 2**63]))


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=40),
        st.builds(
            lambda o, n, c, v: struct.pack("<QQII", o, n, c, v) + MAGIC,
            _u64,
            _u64,
            st.integers(0, 2**32 - 1),
            st.sampled_from([0, 1, 2, 2**32 - 1]),
        ),
    ),
    size=st.one_of(st.integers(0, 2**64), st.integers(0, 5000)),
)
def test_fuzz_decode_footer(data: bytes, size: int) -> None:
    try:
        footer = decode_footer(data, size, "f")
    except AsyncCkptError:
        return
    assert footer.manifest_offset >= HEADER_SIZE
    assert footer.manifest_length <= MAX_MANIFEST_BYTES
    assert footer.manifest_offset + footer.manifest_length <= size - FOOTER_SIZE


def _decode_body(body: bytes) -> Manifest | None:
    try:
        return decode_manifest(body, Footer(1 << 20, len(body), zlib.crc32(body)), "f")
    except AsyncCkptError:
        return None


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_decode_manifest_bytes(body: bytes) -> None:
    _decode_body(body)


_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 70),
    st.integers(),
    st.sampled_from([2**32, 2**62, 2**63, 2**64, MAX_CHUNK_BYTES + 1, -(2**63)]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["raw", "zstd", "zstd-bytegroup", "cpu", "cuda:0", "float32", "<f4", "|b1"]),
    st.text(max_size=8),
)
_json = st.recursive(
    _json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=8), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=40,
)
_manifest_docs = st.fixed_dictionaries(
    {
        "format_version": st.one_of(st.just(1), _json_leaf),
        "checksum": st.one_of(st.just("crc32"), _json_leaf),
        "chunks": st.one_of(st.lists(st.lists(_json_leaf, max_size=6), max_size=4), _json),
        "storages": st.one_of(st.lists(st.lists(_json_leaf, max_size=6), max_size=4), _json),
        "tensors": st.one_of(st.lists(st.lists(_json, max_size=9), max_size=3), _json),
        "arrays": st.one_of(st.lists(st.lists(_json, max_size=6), max_size=3), _json),
        "root": _json,
        "meta": st.one_of(st.dictionaries(st.text(max_size=4), st.text(max_size=4)), _json),
    }
)


@FUZZ
@given(st.one_of(_json, _manifest_docs))
def test_fuzz_decode_manifest_json(doc: Any) -> None:
    manifest = _decode_body(json.dumps(doc).encode())
    if manifest is not None:  # whatever passed validation is internally consistent
        owned = []
        for s in manifest.storages:
            span = manifest.chunks[s.first_chunk : s.first_chunk + s.num_chunks]
            assert sum(c.raw_len for c in span) == s.nbytes
            owned += range(s.first_chunk, s.first_chunk + s.num_chunks)
        assert owned == list(range(len(manifest.chunks)))  # each chunk once, in order
        # so the decoded size is bounded by the chunks' stored bytes
        stored = sum(c.stored_len for c in manifest.chunks)
        assert sum(s.nbytes for s in manifest.storages) <= stored * MAX_EXPANSION


@FUZZ
@given(
    sizes=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    shares=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=3),
)
def test_fuzz_storages_that_do_not_partition_the_chunks(
    sizes: list[int], shares: list[tuple[int, int]]
) -> None:
    """Storages of ``sizes`` chunks each, then some storages pointed at another's run: the
    parser accepts exactly the tables where every chunk belongs to one storage, in order."""
    chunks = [Chunk(16 + i, 1, 1, "raw", 0) for i in range(sum(sizes))]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    runs = [(starts[i], sizes[i]) for i in range(len(sizes))]
    for a, b in shares:
        if a < len(runs) and b < len(runs) and runs[b][1] == runs[a][1]:
            runs[a] = runs[b]  # same length, so the size equation still holds
    storages = tuple(StorageEntry(n, 1, "cpu", first, n) for first, n in runs)
    body = encode_manifest(Manifest(tuple(chunks), storages, (), (), None))
    nonempty = [(f, n) for f, n in runs if n]
    partition = [f for f, _ in nonempty] == [
        sum(n for _, n in nonempty[:i]) for i in range(len(nonempty))
    ]
    partition = partition and sum(n for _, n in nonempty) == len(chunks)
    if partition:
        assert _decode_body(body) is not None
    else:
        with pytest.raises(FormatError, match=r"storage|belong to no storage"):
            decode_manifest(body, Footer(1 << 20, len(body), zlib.crc32(body)), "f")


# --------------------------------------------------------------------------- fuzzing: load


@FUZZ
@given(st.one_of(st.binary(max_size=300), st.binary(max_size=300).map(lambda b: MAGIC + b)))
def test_fuzz_load_arbitrary_bytes(scratch: Path, data: bytes) -> None:
    with pytest.raises(AsyncCkptError):
        _load_bytes(scratch, data)


@FUZZ
@given(body=st.binary(max_size=200), manifest=st.binary(max_size=200))
def test_fuzz_load_arbitrary_body_in_a_valid_frame(
    scratch: Path, body: bytes, manifest: bytes
) -> None:
    data = encode_header() + body + manifest + encode_footer(16 + len(body), manifest)
    with pytest.raises(AsyncCkptError):
        _load_bytes(scratch, data)


@FUZZ
@given(data=st.data(), chunk=st.binary(min_size=1, max_size=24))
def test_fuzz_load_overwritten(
    scratch: Path, sample: tuple[bytes, dict[str, Any]], data: st.DataObject, chunk: bytes
) -> None:
    original, state = sample
    at = data.draw(st.integers(0, len(original) - 1))
    damaged = (original[:at] + chunk + original[at + len(chunk) :])[: len(original)]
    if damaged == original:
        assert _equal(_load_bytes(scratch, damaged), state)
    else:
        with pytest.raises(AsyncCkptError):
            _load_bytes(scratch, damaged)


@FUZZ
@given(data=st.data(), garbage=st.binary(max_size=64))
def test_fuzz_load_truncated_or_extended(
    scratch: Path, sample: tuple[bytes, dict[str, Any]], data: st.DataObject, garbage: bytes
) -> None:
    original, _ = sample
    cut = data.draw(st.integers(0, len(original) - 1))
    with pytest.raises(TruncatedFileError):
        _load_bytes(scratch, original[:cut])
    if garbage and not garbage.endswith(MAGIC):
        with pytest.raises(TruncatedFileError):
            _load_bytes(scratch, original + garbage)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in a JSON document (the root excluded)."""
    out: list[tuple[Any, ...]] = []
    items = (
        enumerate(node)
        if isinstance(node, list)
        else node.items()
        if isinstance(node, dict)
        else ()
    )
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_paths(value, (*prefix, key)))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


@FUZZ
@given(data=st.data(), value=_json)
def test_fuzz_load_one_manifest_field_mutated(
    scratch: Path, sample: tuple[bytes, dict[str, Any]], data: st.DataObject, value: Any
) -> None:
    original, _ = sample
    _, _, doc = _layout(original)
    path = data.draw(st.sampled_from(_paths(doc)))
    _set(doc, path, value)
    with contextlib.suppress(AsyncCkptError):
        _load_bytes(scratch, _with_manifest(original, doc))


# --------------------------------------------------------------------------- structured fuzz

_Mutation = Callable[[dict[str, Any]], None]


def _put(*path: Any, value: Any) -> _Mutation:
    return lambda doc: _set(doc, path, value)


def _drop(key: str) -> _Mutation:
    return lambda doc: doc.pop(key)


def _deep(levels: int) -> Any:
    node: Any = 1
    for _ in range(levels):
        node = {"list": [node]}
    return node


def _bytegroup_itemsize(value: int) -> _Mutation:
    def mutate(doc: dict[str, Any]) -> None:
        sid = next(
            i
            for i, s in enumerate(doc["storages"])
            if s[4] and doc["chunks"][s[3]][3] == "zstd-bytegroup"
        )
        doc["storages"][sid][1] = value

    return mutate


def _raw_chunk_field(field: int, change: Callable[[Any], Any]) -> _Mutation:
    def mutate(doc: dict[str, Any]) -> None:
        index = next(i for i, c in enumerate(doc["chunks"]) if c[3] == "raw" and c[1] > 1)
        doc["chunks"][index][field] = change(doc["chunks"][index][field])

    return mutate


def _fields(table: str, index: int, **fields: Any) -> _Mutation:
    """Set several fields of one record; ``f2=...`` is field 2."""

    def mutate(doc: dict[str, Any]) -> None:
        for name, value in fields.items():
            doc[table][index][int(name[1:])] = value

    return mutate


#: Mutations the pure parser cannot see: they fail when the chunk is read, or in the tree.
LOAD_ONLY = {"raw chunk labelled zstd", "raw chunk crc off by one"}

MUTATIONS: dict[str, _Mutation] = {
    # top level
    "format_version=2": _put("format_version", value=2),
    "format_version=0": _put("format_version", value=0),
    "format_version='1'": _put("format_version", value="1"),
    "format_version=1.0": _put("format_version", value=1.0),
    "format_version=true": _put("format_version", value=True),
    "format_version missing": _drop("format_version"),
    "checksum=sha256": _put("checksum", value="sha256"),
    "checksum missing": _drop("checksum"),
    "chunks missing": _drop("chunks"),
    "chunks is an object": _put("chunks", value={}),
    "storages null": _put("storages", value=None),
    "tensors is a string": _put("tensors", value="x"),
    "arrays is a number": _put("arrays", value=0),
    "root missing": _drop("root"),
    "meta is a list": _put("meta", value=[]),
    "meta value not a string": _put("meta", value={"a": 1}),
    # chunks
    "chunk not a list": _put("chunks", 0, value={"offset": 16}),
    "chunk with 4 fields": _put("chunks", 0, value=[16, 1, 1, "raw"]),
    "chunk with 6 fields": lambda d: d["chunks"][0].append(0),
    "chunk offset -1": _put("chunks", 0, 0, value=-1),
    "chunk offset 0": _put("chunks", 0, 0, value=0),
    "chunk offset 15": _put("chunks", 0, 0, value=15),
    "chunk offset past the manifest": _put("chunks", 0, 0, value=2**40),
    "chunk offset string": _put("chunks", 0, 0, value="16"),
    "chunk offset float": _put("chunks", 0, 0, value=16.0),
    "chunk offset bool": _put("chunks", 0, 0, value=True),
    "chunk stored length -1": _put("chunks", 0, 1, value=-1),
    "chunk stored length huge": _put("chunks", 0, 1, value=2**40),
    "chunk raw length -1": _put("chunks", 0, 2, value=-1),
    "chunk raw length over max": _put("chunks", 0, 2, value=MAX_CHUNK_BYTES + 1),
    "chunk codec lz4": _put("chunks", 0, 3, value="lz4"),
    "chunk codec RAW": _put("chunks", 0, 3, value="RAW"),
    "chunk codec null": _put("chunks", 0, 3, value=None),
    "chunk codec number": _put("chunks", 0, 3, value=1),
    "chunk codec list": _put("chunks", 0, 3, value=["zstd"]),
    "chunk codec object": _put("chunks", 0, 3, value={"zstd": 1}),
    "chunk crc -1": _put("chunks", 0, 4, value=-1),
    "chunk crc 2**32": _put("chunks", 0, 4, value=2**32),
    "chunk crc string": _put("chunks", 0, 4, value="0"),
    "raw chunk stored != raw": _raw_chunk_field(1, lambda n: n - 1),
    "raw chunk raw != stored": _raw_chunk_field(2, lambda n: n - 1),
    "raw chunk labelled zstd": _raw_chunk_field(3, lambda _: "zstd"),
    "raw chunk crc off by one": _raw_chunk_field(4, lambda crc: crc ^ 1),
    # storages
    "storage with 4 fields": lambda d: d["storages"][0].pop(),
    "storage nbytes +1": lambda d: _set(d, ("storages", 0, 0), d["storages"][0][0] + 1),
    "storage nbytes -1": _put("storages", 0, 0, value=-1),
    "storage nbytes 2**70": _put("storages", 0, 0, value=2**70),
    "storage itemsize 0": _put("storages", 0, 1, value=0),
    "storage itemsize 17": _put("storages", 0, 1, value=17),
    "storage itemsize string": _put("storages", 0, 1, value="4"),
    "bytegroup itemsize 7": _bytegroup_itemsize(7),
    "bytegroup itemsize 3": _bytegroup_itemsize(3),
    "storage device empty": _put("storages", 0, 2, value=""),
    "storage device CUDA": _put("storages", 0, 2, value="CUDA"),
    "storage device cpu:": _put("storages", 0, 2, value="cpu:"),
    "storage device index too long": _put("storages", 0, 2, value="cuda:123456"),
    "storage device name too long": _put("storages", 0, 2, value="a" * 17),
    "storage device cpu:0:1": _put("storages", 0, 2, value="cpu:0:1"),
    "storage device path": _put("storages", 0, 2, value="../etc"),
    "storage device number": _put("storages", 0, 2, value=0),
    "storage device null": _put("storages", 0, 2, value=None),
    "storage first chunk -1": _put("storages", 0, 3, value=-1),
    "storage first chunk past the table": lambda d: _set(
        d, ("storages", 0, 3), len(d["chunks"]) + 1
    ),
    "storage first chunk string": _put("storages", 0, 3, value="0"),
    "storage chunk count -1": _put("storages", 0, 4, value=-1),
    "storage chunk count past the table": lambda d: _set(
        d, ("storages", 0, 4), len(d["chunks"]) + 1
    ),
    # every chunk in exactly one storage, storages in chunk order (sharing one chunk
    # between storages made a 1 KiB file decode to 64 MiB)
    "storages share a chunk": lambda d: _set(d, ("storages", 1, 3), d["storages"][0][3]),
    "storages out of chunk order": lambda d: _set(d, ("storages", 0, 3), d["storages"][0][3] + 1),
    "a chunk of no storage": lambda d: d["chunks"].append([16, 0, 0, "raw", 0]),
    "chunks share file bytes": lambda d: _set(d, ("chunks", 1, 0), d["chunks"][0][0]),
    "empty chunk claims bytes": _fields("chunks", 0, f1=0, f2=1),
    # tensors (tensor 0 is state['w']: float32 [8, 8] over a 256-byte storage)
    "tensor with 7 fields": lambda d: d["tensors"][0].pop(),
    "tensor is an object": _put("tensors", 0, value={}),
    "tensor storage -1": _put("tensors", 0, 0, value=-1),
    "tensor storage past the table": lambda d: _set(d, ("tensors", 0, 0), len(d["storages"])),
    "tensor storage string": _put("tensors", 0, 0, value="0"),
    "tensor dtype float128": _put("tensors", 0, 1, value="float128"),
    "tensor dtype qint8": _put("tensors", 0, 1, value="qint8"),
    "tensor dtype Tensor": _put("tensors", 0, 1, value="Tensor"),
    "tensor dtype number": _put("tensors", 0, 1, value=4),
    "tensor dtype null": _put("tensors", 0, 1, value=None),
    "tensor dtype list": _put("tensors", 0, 1, value=["float32"]),
    "tensor dtype too wide for storage": _put("tensors", 0, 1, value="complex128"),
    "tensor shape string": _put("tensors", 0, 2, value="8,8"),
    "tensor shape negative": _put("tensors", 0, 2, value=[-1, 8]),
    "tensor shape float": _put("tensors", 0, 2, value=[8.0, 8]),
    "tensor shape bool": _put("tensors", 0, 2, value=[True, 8]),
    "tensor shape too big": _put("tensors", 0, 2, value=[9, 8]),
    "tensor shape 2**63": _put("tensors", 0, 2, value=[2**63, 1]),
    "tensor ndim 65": _fields("tensors", 0, f2=[1] * (MAX_NDIM + 1), f3=[1] * (MAX_NDIM + 1)),
    "tensor stride length differs": _put("tensors", 0, 3, value=[8]),
    "tensor stride negative": _put("tensors", 0, 3, value=[8, -1]),
    "tensor stride too big": _put("tensors", 0, 3, value=[9, 1]),
    "tensor offset -1": _put("tensors", 0, 4, value=-1),
    "tensor offset 1": _put("tensors", 0, 4, value=1),
    "tensor offset 2**62": _put("tensors", 0, 4, value=2**62),
    "tensor elements overflow": _fields("tensors", 0, f2=[2**62, 2**62, 1], f3=[0, 0, 0]),
    "tensor elements overflow before a zero": _fields(
        "tensors", 0, f2=[2**62, 2**62, 0], f3=[0, 0, 0]
    ),
    "tensor requires_grad string": _put("tensors", 0, 5, value="yes"),
    "tensor requires_grad 1": _put("tensors", 0, 5, value=1),
    "tensor parameter 0": _put("tensors", 0, 6, value=0),
    "tensor key number": _put("tensors", 0, 7, value=5),
    "tensor key null": _put("tensors", 0, 7, value=None),
    "int64 tensor requires grad": _put("tensors", 2, 5, value=True),
    "int64 parameter requires grad": _fields("tensors", 2, f5=True, f6=True),
    # arrays (array 0 is state['np']: <i2 [4])
    "array with 4 fields": lambda d: d["arrays"][0].pop(),
    "array storage -1": _put("arrays", 0, 0, value=-1),
    "array storage past the table": _put("arrays", 0, 0, value=99),
    "array dtype object": _put("arrays", 0, 1, value="|O8"),
    "array dtype O": _put("arrays", 0, 1, value="O"),
    "array dtype unicode": _put("arrays", 0, 1, value="<U4"),
    "array dtype void": _put("arrays", 0, 1, value="|V8"),
    "array dtype datetime": _put("arrays", 0, 1, value="<M8"),
    "array dtype without byte order": _put("arrays", 0, 1, value="i2"),
    # dtype strings of the right shape whose size matches the 8-byte storage, but that numpy
    # does not know
    "array dtype <b2": _fields("arrays", 0, f1="<b2", f2=[4]),
    "array dtype <f1": _fields("arrays", 0, f1="<f1", f2=[8]),
    "array dtype <c4": _fields("arrays", 0, f1="<c4", f2=[2]),
    "array dtype <i3": _put("arrays", 0, 1, value="<i3"),
    "array dtype <u0": _fields("arrays", 0, f1="<u0", f2=[0]),
    "array dtype number": _put("arrays", 0, 1, value=2),
    # a `$`-anchored pattern matched before a final newline: every dtype string is matched
    # in full
    "array dtype with a newline": _put("arrays", 0, 1, value="<i2\n"),
    "array dtype with a leading space": _put("arrays", 0, 1, value=" <i2"),
    "array shape mismatch": _put("arrays", 0, 2, value=[5]),
    "array shape negative": _put("arrays", 0, 2, value=[-4]),
    "array shape string": _put("arrays", 0, 2, value="4"),
    "array scalar string": _put("arrays", 0, 3, value="no"),
    "array key null": _put("arrays", 0, 4, value=None),
    # the object tree
    "root tensor out of range": _put("root", value={"tensor": 99}),
    "root ndarray -1": _put("root", value={"ndarray": -1}),
    "root float overflow": _put("root", value={"float": "0x1p99999"}),
    "root float bad": _put("root", value={"float": "zz"}),
    "root bytes bad": _put("root", value={"bytes": "!"}),
    "root unhashable tuple key": _put("root", value={"dict": [[{"tuple": [{"list": []}]}, 1]]}),
    "root device overflow": _put("root", value={"device": 2**70}),
    "root size 2**70": _put("root", value={"size": [2, 2**70]}),
    "root size 2**63": _put("root", value={"size": [2**63]}),
    "root size -2**63-1": _put("root", value={"size": [-(2**63) - 1]}),
    "root device unknown": _put("root", value={"device": "gpu"}),
    "root dtype unknown": _put("root", value={"dtype": "float128"}),
    "root JSON float": _put("root", value=1.5),
    "root JSON list": _put("root", value=[1, 2]),
    "root unknown tag": _put("root", value={"pickle": "gASV"}),
    "root two tags": _put("root", value={"list": [], "tuple": []}),
    "root too deep": _put("root", value=_deep(MAX_DEPTH + 1)),
    "root far too deep": _put("root", value=_deep(400)),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_invalid_manifest_field_is_rejected(
    tmp_path: Path, sample: tuple[bytes, dict[str, Any]], name: str
) -> None:
    original, _ = sample
    _, _, doc = _layout(original)
    mutated = copy.deepcopy(doc)
    MUTATIONS[name](mutated)
    assert json.dumps(mutated) != json.dumps(doc)  # 1.0 == True == 1 in Python
    damaged = _with_manifest(original, mutated)
    path = tmp_path / "mutated.ackpt"
    path.write_bytes(damaged)
    with pytest.raises(FormatError) as info:
        asyncckpt.load(path)
    assert str(path) in str(info.value)
    if not name.startswith("root") and name not in LOAD_ONLY:  # fails in the pure parser
        offset, length, _ = _layout(damaged)
        footer = decode_footer(damaged[-FOOTER_SIZE:], len(damaged), "f")
        with pytest.raises(FormatError):
            decode_manifest(damaged[offset : offset + length], footer, "f")


def test_unmutated_manifest_round_trips(
    tmp_path: Path, sample: tuple[bytes, dict[str, Any]]
) -> None:
    """The control for the mutation tests: re-encoding alone changes nothing."""
    original, state = sample
    _, _, doc = _layout(original)
    path = tmp_path / "same.ackpt"
    path.write_bytes(_with_manifest(original, doc))
    assert _equal(asyncckpt.load(path), state)


@pytest.mark.parametrize("device", ["distributed", "classes", "ops", "nn", "quantum", "_dynamo:0"])
def test_unknown_device_types_are_refused(
    tmp_path: Path, sample: tuple[bytes, dict[str, Any]], device: str
) -> None:
    """A device type from a file never reaches getattr(torch, ...) unless allow-listed."""
    original, _ = sample
    _, _, doc = _layout(original)
    doc["storages"][0][2] = device
    path = tmp_path / "device.ackpt"
    path.write_bytes(_with_manifest(original, doc))
    with pytest.raises(FormatError, match=r"device\.ackpt.*is not a known device type"):
        asyncckpt.load(path)


@pytest.mark.parametrize("device", ["cuda:7", "mps", "xpu:0", "hpu", "privateuseone:0"])
def test_unavailable_device_types_load_on_cpu(
    tmp_path: Path, sample: tuple[bytes, dict[str, Any]], device: str
) -> None:
    original, state = sample
    _, _, doc = _layout(original)
    doc["storages"][0][2] = device
    path = tmp_path / "device.ackpt"
    path.write_bytes(_with_manifest(original, doc))
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("CUDA is available: the tensor would go to the current device")
    with pytest.warns(UserWarning, match="loaded on the CPU"):
        loaded = asyncckpt.load(path)
    assert _equal(loaded, state)


def test_crafted_zstd_chunk_cannot_force_a_huge_allocation(
    tmp_path: Path, sample: tuple[bytes, dict[str, Any]]
) -> None:
    """A chunk whose checksum matches but whose zstd frame declares 1 TiB."""
    original, _ = sample
    offset, _, doc = _layout(original)
    index = next(i for i, c in enumerate(doc["chunks"]) if c[3] == "zstd-bytegroup")
    at, stored_len, _, _, _ = doc["chunks"][index]
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(100))
    assert frame[4] == 0x20  # single segment, 1-byte content size
    forged = frame[:4] + bytes([0xE0]) + struct.pack("<Q", 1 << 40) + frame[6:]
    assert len(forged) <= stored_len
    forged = forged[:stored_len].ljust(stored_len, b"\0")
    data = original[:at] + forged + original[at + stored_len : offset]
    doc["chunks"][index][4] = zlib.crc32(forged)
    body = json.dumps(doc).encode()
    path = tmp_path / "bomb.ackpt"
    path.write_bytes(data + body + encode_footer(offset, body))
    with pytest.raises(ChecksumError) as info:
        asyncckpt.load(path)
    assert info.value.chunk == index


def test_manifest_nesting_limit_via_load(
    tmp_path: Path, sample: tuple[bytes, dict[str, Any]]
) -> None:
    original, _ = sample
    _, _, doc = _layout(original)
    doc["root"] = _deep(MAX_DEPTH)
    path = tmp_path / "deep.ackpt"
    path.write_bytes(_with_manifest(original, doc))
    loaded = asyncckpt.load(path)
    for _ in range(MAX_DEPTH):
        loaded = loaded[0]
    assert loaded == 1


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 50_000,
        b'{"format_version":1,"chunks":NaN}',
        b"\xff" * 10,
        b'{"a":' + b"9" * 5000 + b"}",
    ],
    ids=["deep", "nan", "not-utf8", "long-int"],
)
def test_unparsable_manifest_via_load(
    tmp_path: Path, sample: tuple[bytes, dict[str, Any]], body: bytes
) -> None:
    original, _ = sample
    path = tmp_path / "bad.ackpt"
    path.write_bytes(_with_manifest(original, body=body))
    with pytest.raises(FormatError, match="not valid JSON"):
        asyncckpt.load(path)
