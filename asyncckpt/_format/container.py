"""The asyncckpt container: pure functions over bytes (no I/O, no torch, no devices).

Header, chunks, manifest, footer: specified in docs/FORMAT.md §2-5. Every length read from
a file is checked against the file size and the limits below before it is used, and every
structure is validated before anything is allocated from it.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from asyncckpt.errors import FormatError, TruncatedFileError

MAGIC: Final = b"\x89ACKPT\r\n"
FORMAT_VERSION: Final = 1
HEADER_SIZE: Final = 16
FOOTER_SIZE: Final = 32
_HEADER = struct.Struct("<8sII")
_FOOTER = struct.Struct("<QQII8s")

#: Largest manifest a reader accepts; bounds the one allocation made from the footer.
MAX_MANIFEST_BYTES: Final = 256 << 20
#: Largest raw chunk; bounds each decompression buffer.
MAX_CHUNK_BYTES: Final = 1 << 30
#: Deepest nesting of the object tree (and of any JSON value in the manifest).
MAX_DEPTH: Final = 128
#: Most dimensions a tensor or array may have.
MAX_NDIM: Final = 64
#: Most raw bytes a chunk may claim per stored byte (zstd's best case: a 128 KiB block
#: stored as a 3-byte header and one repeated byte); see docs/FORMAT.md §12.
MAX_EXPANSION: Final = 32_768

CHECKSUM: Final = "crc32"
#: Chunk codecs (docs/FORMAT.md §8).
CODECS: Final = frozenset({"raw", "zstd", "zstd-bytegroup"})

#: torch dtype name -> bytes per element. Names are the attribute names in ``torch``.
DTYPE_ITEMSIZE: Final[Mapping[str, int]] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}
#: numpy dtype strings accepted for arrays: byte order, kind (bool, int, uint, float,
#: complex) and item size. Anything else (objects, structs, strings) is refused. Always
#: matched in full (``fullmatch``): ``$`` would also accept a string ending in a newline.
_NUMPY_DTYPE = re.compile(r"[<>|=](b1|[iu][1248]|f(2|4|8|12|16)|c(8|16|24|32))")


@dataclass(frozen=True)
class Chunk:
    """One encoded run of a storage's bytes, located in the file."""

    offset: int
    stored_len: int
    raw_len: int
    codec: str
    crc32: int


@dataclass(frozen=True)
class StorageEntry:
    """One contiguous byte buffer (a torch storage or an array's data)."""

    nbytes: int
    itemsize: int
    device: str
    first_chunk: int
    num_chunks: int


@dataclass(frozen=True)
class TensorEntry:
    """A tensor as a typed, strided view into a storage (several may share one)."""

    storage: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool
    parameter: bool
    key: str


@dataclass(frozen=True)
class ArrayEntry:
    """A numpy array (or numpy scalar) stored C-contiguous in its own storage."""

    storage: int
    dtype: str
    shape: tuple[int, ...]
    scalar: bool
    key: str


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs besides the chunk bytes."""

    chunks: tuple[Chunk, ...]
    storages: tuple[StorageEntry, ...]
    tensors: tuple[TensorEntry, ...]
    arrays: tuple[ArrayEntry, ...]
    root: Any
    byteorder: str = "little"
    meta: dict[str, str] = field(default_factory=dict)

    def keys_of_storage(self, storage: int) -> list[str]:
        """Key paths of every tensor and array whose bytes live in ``storage``."""
        keys = [t.key for t in self.tensors if t.storage == storage]
        return keys + [a.key for a in self.arrays if a.storage == storage]

    def storage_of_chunk(self, chunk: int) -> int | None:
        """Index of the storage that owns chunk number ``chunk``, if any."""
        for i, s in enumerate(self.storages):
            if s.first_chunk <= chunk < s.first_chunk + s.num_chunks:
                return i
        return None


@dataclass(frozen=True)
class Footer:
    """The fixed-size record at the end of every file."""

    manifest_offset: int
    manifest_length: int
    manifest_crc32: int


def encode_header() -> bytes:
    """The 16 bytes every file starts with."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0)


def decode_header(data: bytes, name: str) -> int:
    """Check a file's first 16 bytes and return its format version (``name``: for errors).

    Raises:
        TruncatedFileError: fewer than 16 bytes.
        FormatError: wrong magic, unknown version or flags.
    """
    if len(data) < HEADER_SIZE:
        raise TruncatedFileError(f"{name}: {len(data)} bytes is too short for an asyncckpt file")
    magic, version, flags = _HEADER.unpack_from(data)
    _check_magic_version(magic, version, name)
    if flags != 0:
        raise FormatError(f"{name}: header flags {flags:#x} are not understood by this reader")
    return int(version)


def encode_footer(manifest_offset: int, manifest: bytes) -> bytes:
    """The 32 bytes that end every file, locating and checksumming ``manifest``."""
    return _FOOTER.pack(manifest_offset, len(manifest), zlib.crc32(manifest), FORMAT_VERSION, MAGIC)


def decode_footer(data: bytes, file_size: int, name: str) -> Footer:
    """Parse and bound-check a file's last 32 bytes: the manifest they locate is sure to lie
    between header and footer of the ``file_size``-byte file.

    Raises:
        TruncatedFileError: the file is too short or the footer points past its end.
        FormatError: wrong magic or version, or a manifest over :data:`MAX_MANIFEST_BYTES`.
    """
    if file_size < HEADER_SIZE + FOOTER_SIZE or len(data) != FOOTER_SIZE:
        raise TruncatedFileError(
            f"{name}: {file_size} bytes is too short for an asyncckpt file "
            f"(at least {HEADER_SIZE + FOOTER_SIZE}); it was probably cut off while copying"
        )
    offset, length, crc, version, magic = _FOOTER.unpack(data)
    if magic != MAGIC:
        raise TruncatedFileError(
            f"{name}: no asyncckpt footer at the end of the file; it is truncated, "
            "still being written by a tool that is not atomic, or not an asyncckpt file"
        )
    _check_magic_version(magic, version, name)
    if length > MAX_MANIFEST_BYTES:
        raise FormatError(f"{name}: manifest of {length} bytes exceeds {MAX_MANIFEST_BYTES}")
    if offset < HEADER_SIZE or offset + length > file_size - FOOTER_SIZE:
        raise TruncatedFileError(
            f"{name}: footer places the manifest at {offset}+{length}, outside the "
            f"{file_size}-byte file"
        )
    return Footer(offset, length, crc)


def _check_magic_version(magic: bytes, version: int, name: str) -> None:
    if magic != MAGIC:
        raise FormatError(
            f"{name}: not an asyncckpt file (magic {magic!r}); if it came from torch.save, "
            "load it with torch.load or convert it first"
        )
    if version != FORMAT_VERSION:
        raise FormatError(
            f"{name}: format version {version} is not supported by this asyncckpt "
            f"(it reads version {FORMAT_VERSION}); upgrade asyncckpt"
        )


def encode_manifest(manifest: Manifest) -> bytes:
    """Serialize a manifest to canonical UTF-8 JSON (tuples are JSON arrays, as lists are)."""
    doc = {
        "format_version": FORMAT_VERSION,
        "checksum": CHECKSUM,
        "chunks": [(c.offset, c.stored_len, c.raw_len, c.codec, c.crc32) for c in manifest.chunks],
        "storages": [
            (s.nbytes, s.itemsize, s.device, s.first_chunk, s.num_chunks) for s in manifest.storages
        ],
        "tensors": [
            (t.storage, t.dtype, t.shape, t.stride, t.offset, t.requires_grad, t.parameter, t.key)
            for t in manifest.tensors
        ],
        "arrays": [(a.storage, a.dtype, a.shape, a.scalar, a.key) for a in manifest.arrays],
        "root": manifest.root,
        "byteorder": manifest.byteorder,
        "meta": manifest.meta,
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def decode_manifest(data: bytes, footer: Footer, name: str) -> Manifest:
    """Verify, parse and validate the manifest bytes ``footer`` locates: every index and
    length of the result is consistent and inside the file.

    Raises:
        TruncatedFileError: ``data`` is not as long as the footer says.
        FormatError: the manifest does not match its checksum, or anything malformed.
    """
    if len(data) != footer.manifest_length:
        raise TruncatedFileError(
            f"{name}: manifest is {len(data)} bytes, expected {footer.manifest_length}"
        )
    if zlib.crc32(data) != footer.manifest_crc32:
        raise FormatError(f"{name}: the manifest does not match its checksum; the file is corrupt")
    doc = parse_json(data, f"{name}: manifest")
    return _Validator(f"{name}: invalid manifest", footer.manifest_offset).manifest(doc)


def parse_json(data: bytes, what: str) -> Any:
    """``data`` as strict JSON (no NaN or Infinity); a FormatError names ``what``."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{what} is not valid JSON: {exc}") from exc


def _reject_constant(token: str) -> None:
    raise ValueError(f"non-standard JSON constant {token}")


class FieldChecker:
    """Checks of parsed JSON fields; each failure is a FormatError led by ``prefix``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def fail(self, what: str) -> FormatError:
        return FormatError(f"{self.prefix}: {what}")

    def int_(self, value: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
        if type(value) is not int or not lo <= value <= hi:
            raise self.fail(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
        return value

    def list_(self, value: Any, what: str, length: int | None = None) -> list[Any]:
        if not isinstance(value, list) or (length is not None and len(value) != length):
            raise self.fail(f"{what} is not a list" + (f" of {length}" if length else ""))
        return value

    def dims(self, value: Any, what: str) -> tuple[int, ...]:
        if not isinstance(value, list) or len(value) > MAX_NDIM:
            raise self.fail(f"{what} is not a list of at most {MAX_NDIM} integers")
        return tuple(self.int_(v, what) for v in value)


class _Validator(FieldChecker):
    """Turns a parsed manifest document into dataclasses, checking every field."""

    def __init__(self, prefix: str, data_end: int) -> None:
        super().__init__(prefix)
        self.data_end = data_end

    def manifest(self, doc: Any) -> Manifest:
        if not isinstance(doc, dict):
            raise self.fail("top level is not an object")
        version = doc.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION or doc.get("checksum") != CHECKSUM:
            raise self.fail("format_version or checksum algorithm not understood")
        chunks = tuple(self.chunk(i, c) for i, c in enumerate(self.items(doc, "chunks")))
        self.disjoint(chunks)
        storages = tuple(
            self.storage(i, s, chunks) for i, s in enumerate(self.items(doc, "storages"))
        )
        self.partition(storages, len(chunks))
        tensors = tuple(
            self.tensor(i, t, storages) for i, t in enumerate(self.items(doc, "tensors"))
        )
        arrays = tuple(self.array(i, a, storages) for i, a in enumerate(self.items(doc, "arrays")))
        meta = doc.get("meta", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self.fail("meta is not an object of strings")
        if "root" not in doc:
            raise self.fail("no root object")
        byteorder = doc.get("byteorder", "little")
        if byteorder not in ("little", "big"):
            raise self.fail(f"byteorder {byteorder!r} is neither 'little' nor 'big'")
        return Manifest(chunks, storages, tensors, arrays, doc["root"], byteorder, meta)

    def items(self, doc: dict[str, Any], key: str) -> list[Any]:
        return self.list_(doc.get(key), key)

    def record(self, value: Any, n: int, what: str) -> list[Any]:
        if not isinstance(value, list) or len(value) != n:
            raise self.fail(f"{what} is not a list of {n} fields")
        return value

    def chunk(self, i: int, rec: Any) -> Chunk:
        offset, stored, raw, codec, crc = self.record(rec, 5, f"chunk {i}")
        offset = self.int_(offset, f"chunk {i} offset", HEADER_SIZE, self.data_end)
        stored = self.int_(stored, f"chunk {i} stored length", 0, self.data_end - offset)
        raw = self.int_(raw, f"chunk {i} raw length", 0, MAX_CHUNK_BYTES)
        if not isinstance(codec, str) or codec not in CODECS:
            raise self.fail(f"chunk {i} has unknown codec {codec!r}")
        if codec == "raw" and stored != raw:
            raise self.fail(f"raw chunk {i} stores {stored} bytes for {raw}")
        if raw > stored * MAX_EXPANSION:
            raise self.fail(
                f"chunk {i} claims {raw} bytes from {stored} stored bytes, more than any "
                "chunk can decode to"
            )
        return Chunk(offset, stored, raw, codec, self.int_(crc, f"chunk {i} crc32", 0, 2**32 - 1))

    def disjoint(self, chunks: tuple[Chunk, ...]) -> None:
        """Refuse chunks that share bytes of the file (each stored byte decodes once)."""
        end = 0
        for chunk in sorted(chunks, key=lambda c: c.offset):
            if chunk.stored_len and chunk.offset < end:
                raise self.fail(f"chunks overlap at byte {chunk.offset} of the file")
            end = max(end, chunk.offset + chunk.stored_len)

    def partition(self, storages: tuple[StorageEntry, ...], count: int) -> None:
        """Refuse storages that do not own the chunk table in order, each chunk once.

        Several storages naming one chunk would decode it once each: with that, a file of
        a few KiB could make a reader allocate terabytes. Storages without chunks own none.
        """
        expected = 0
        for i, entry in enumerate(storages):
            if not entry.num_chunks:
                continue
            if entry.first_chunk != expected:
                raise self.fail(
                    f"storage {i} starts at chunk {entry.first_chunk}, expected {expected}: "
                    "storages own consecutive runs of the chunk table, in order, each chunk "
                    "exactly once"
                )
            expected += entry.num_chunks
        if expected != count:
            raise self.fail(f"chunks {expected} to {count - 1} belong to no storage")

    def storage(self, i: int, rec: Any, chunks: tuple[Chunk, ...]) -> StorageEntry:
        nbytes, itemsize, device, first, count = self.record(rec, 5, f"storage {i}")
        itemsize = self.int_(itemsize, f"storage {i} itemsize", 1, 16)
        first = self.int_(first, f"storage {i} first chunk", 0, len(chunks))
        count = self.int_(count, f"storage {i} chunk count", 0, len(chunks) - first)
        nbytes = self.int_(nbytes, f"storage {i} size")
        span = chunks[first : first + count]
        if sum(c.raw_len for c in span) != nbytes:
            raise self.fail(f"storage {i} size {nbytes} differs from its chunks' total")
        for c in span:
            if c.codec == "zstd-bytegroup" and c.raw_len % itemsize:
                raise self.fail(
                    f"storage {i} has a byte-grouped chunk not a multiple of {itemsize} bytes"
                )
        if not isinstance(device, str) or not re.fullmatch(r"[a-z_]{1,16}(:[0-9]{1,5})?", device):
            raise self.fail(f"storage {i} device {device!r} is not a device string")
        return StorageEntry(nbytes, itemsize, device, first, count)

    def tensor(self, i: int, rec: Any, storages: tuple[StorageEntry, ...]) -> TensorEntry:
        sid, dtype, shape, stride, offset, grad, param, key = self.record(rec, 8, f"tensor {i}")
        sid = self.int_(sid, f"tensor {i} storage", 0, len(storages) - 1)
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            raise self.fail(f"tensor {i} has unknown dtype {dtype!r}")
        shape_t, stride_t = self.dims(shape, f"tensor {i} shape"), self.dims(stride, "stride")
        if len(shape_t) != len(stride_t):
            raise self.fail(f"tensor {i} shape and stride differ in length")
        offset = self.int_(offset, f"tensor {i} storage offset")
        elements = storages[sid].nbytes // DTYPE_ITEMSIZE[dtype]
        if math.prod(n for n in shape_t if n) > 1 << 62:
            raise self.fail(f"tensor {i} ({key!r}) has more than 2**62 elements")
        if 0 not in shape_t:
            extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape_t, stride_t))
            if extent > elements:
                raise self.fail(f"tensor {i} ({key!r}) reaches past the end of storage {sid}")
        if type(grad) is not bool or type(param) is not bool or not isinstance(key, str):
            raise self.fail(f"tensor {i} flags or key have the wrong type")
        if grad and not dtype.startswith(("float", "bfloat", "complex")):
            raise self.fail(f"tensor {i} ({key!r}) of dtype {dtype} cannot require grad")
        return TensorEntry(sid, dtype, shape_t, stride_t, offset, grad, param, key)

    def array(self, i: int, rec: Any, storages: tuple[StorageEntry, ...]) -> ArrayEntry:
        sid, dtype, shape, scalar, key = self.record(rec, 5, f"array {i}")
        sid = self.int_(sid, f"array {i} storage", 0, len(storages) - 1)
        if not isinstance(dtype, str) or not _NUMPY_DTYPE.fullmatch(dtype):
            raise self.fail(f"array {i} has unsupported numpy dtype {dtype!r}")
        shape_t = self.dims(shape, f"array {i} shape")
        if math.prod(shape_t) * int(dtype[2:]) != storages[sid].nbytes:
            raise self.fail(f"array {i} ({key!r}) does not match the size of storage {sid}")
        if type(scalar) is not bool or not isinstance(key, str):
            raise self.fail(f"array {i} flags or key have the wrong type")
        return ArrayEntry(sid, dtype, shape_t, scalar, key)
