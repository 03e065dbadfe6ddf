"""The commit object of a DCP checkpoint: DCP's ``Metadata`` as bounded JSON, no pickle.

``torch.distributed.checkpoint`` keeps a checkpoint's ``Metadata`` (which tensors exist,
their chunks, where each chunk is stored) in a pickled ``.metadata`` file; loading one
unpickles whatever is in it. Here the same information is a JSON document, written last
as the commit point, and every field is type- and range-checked before anything is built
from it. Functions here are pure (bytes in, objects out); the storage I/O lives in
:mod:`asyncckpt.dcp.writer` and :mod:`asyncckpt._versions.dcp_reader`. The document is
specified in ``docs/sharded.md`` ("Layout on storage").
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping
from typing import Any, Final, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from asyncckpt._format.container import (
    DTYPE_ITEMSIZE,
    FOOTER_SIZE,
    HEADER_SIZE,
    MAX_EXPANSION,
    MAX_MANIFEST_BYTES,
    FieldChecker,
    parse_json,
)

# Re-exported: the file names were defined here before they moved to names.py.
from asyncckpt._format.names import METADATA_NAME as METADATA_NAME
from asyncckpt._format.names import data_file_name as data_file_name
from asyncckpt._format.names import is_data_file_name as is_data_file_name
from asyncckpt._format.tree import Path, dtype_name, torch_dtype
from asyncckpt._version import __version__
from asyncckpt.errors import FormatError, UnsupportedObjectError

SCHEMA: Final = "asyncckpt-dcp"
SCHEMA_VERSION: Final = 1
#: Largest commit object a reader accepts (bounds the one allocation made before parsing).
MAX_METADATA_BYTES: Final = MAX_MANIFEST_BYTES
_MAX_INT: Final = 1 << 62
_LAYOUTS: Final[Mapping[str, torch.layout]] = {"strided": torch.strided}
_MEMORY_FORMATS: Final[Mapping[str, torch.memory_format]] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}


class ItemLocation(NamedTuple):
    """Where one DCP write item is stored (the ``storage_data`` of its ``WriteResult``).

    Attributes:
        file: the data file's name inside the checkpoint directory.
        file_size: that file's size in bytes, as written.
        entry: index of the item's tensor in the file's tensor table.
        nbytes: the item's raw length in bytes (a tensor chunk's data, or a bytes object).

    Example:
        >>> ItemLocation(data_file_name(0, "0" * 32), 4096, 0, 64).entry
        0
    """

    file: str
    file_size: int
    entry: int
    nbytes: int


def item_key(index: MetadataIndex) -> str:
    """The key of a write item inside its data file: ``fqn``, or ``fqn@o0,o1,...``.

    Example:
        >>> item_key(MetadataIndex("w", [4, 0]))
        'w@4,0'
    """
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


# ------------------------------------------------------------------------------- encode


def encode_metadata(metadata: Metadata, attempt: str) -> bytes:
    """Serialize ``metadata`` as compact UTF-8 JSON.

    ``metadata`` is DCP's, as ``finish`` receives it, with ``storage_data`` set to
    ``{MetadataIndex: ItemLocation}`` from every rank's write results; ``attempt``, the save
    attempt's token, makes the bytes of every commit unique.

    Raises:
        UnsupportedObjectError: a field holds something the schema cannot represent (a
            non-strided layout, an unknown dtype, planner data that is not a mapping of
            key paths); nothing is written in that case.
    """
    locations: Mapping[MetadataIndex, ItemLocation] = metadata.storage_data
    files: dict[str, tuple[int, int]] = {}  # name -> (its number, its size)
    items = []
    for index, loc in locations.items():
        if not isinstance(loc, ItemLocation):
            raise UnsupportedObjectError(index.fqn, f"storage data {type(loc).__name__}")
        number, _ = files.setdefault(loc.file, (len(files), loc.file_size))
        offset = None if index.offset is None else list(index.offset)
        items.append([index.fqn, offset, index.index, number, loc.entry, loc.nbytes])
    doc = {
        "format": SCHEMA,
        "version": SCHEMA_VERSION,
        "dcp_version": metadata.version,
        "attempt": attempt,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "library": f"asyncckpt {__version__}",
        "files": [[name, size] for name, (_, size) in files.items()],
        "state_dict_metadata": [
            [fqn, _encode_storage(fqn, md)] for fqn, md in metadata.state_dict_metadata.items()
        ],
        "items": items,
        "planner_data": _encode_planner_data(metadata.planner_data),
        "storage_meta": _encode_storage_meta(metadata.storage_meta),
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _encode_storage(fqn: str, md: Any) -> dict[str, Any]:
    if isinstance(md, BytesStorageMetadata):
        return {"type": "bytes"}
    if not isinstance(md, TensorStorageMetadata):
        raise UnsupportedObjectError(fqn, f"DCP storage metadata {type(md).__name__}")
    props = md.properties
    name = dtype_name(props.dtype)
    if name not in DTYPE_ITEMSIZE:
        raise UnsupportedObjectError(fqn, f"dtype {props.dtype}")
    return {
        "type": "tensor",
        "dtype": name,
        "layout": _name_of(fqn, "layout", props.layout, _LAYOUTS),
        "requires_grad": bool(props.requires_grad),
        "memory_format": _name_of(fqn, "memory format", props.memory_format, _MEMORY_FORMATS),
        "pin_memory": bool(props.pin_memory),
        "size": list(md.size),
        "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
    }


def _name_of(fqn: str, what: str, value: Any, table: Mapping[str, Any]) -> str:
    for name, known in table.items():
        if value == known:
            return name
    raise UnsupportedObjectError(fqn, f"{what} {value} (supported: {', '.join(table)})")


def _encode_planner_data(data: Any) -> dict[str, list[str | int]] | None:
    # DefaultSavePlanner stores {flattened fqn: path in the original nested state dict}.
    if data is None:
        return None
    if not isinstance(data, Mapping) or not all(
        isinstance(key, str)
        and isinstance(path, (tuple, list))
        and all(type(p) in (str, int) for p in path)
        for key, path in data.items()
    ):
        raise UnsupportedObjectError(
            "metadata.planner_data",
            "asyncckpt.dcp stores planner data only as {str: tuple of str/int} (what "
            "DefaultSavePlanner produces)",
        )
    return {key: list(path) for key, path in data.items()}


def _encode_storage_meta(meta: StorageMeta | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    ckpt = meta.checkpoint_id
    return {
        "checkpoint_id": None if ckpt is None else str(ckpt),
        "save_id": meta.save_id,
        "modules": [str(m) for m in meta.modules],
    }


#: Coverage is checked on the grid that the chunks' edges cut the tensor into, up to this
#: many cells (one byte each); past it, chunk against chunk, up to this many chunks.
_MAX_GRID_CELLS: Final = 1 << 24
_MAX_PAIRWISE_CHUNKS: Final = 1 << 14


def overlapping_chunks(
    size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], name: str
) -> tuple[int, int] | None:
    """Two chunks that overlap, or None; ``chunks`` are ``(offsets, sizes)`` inside ``size``
    whose volumes add up to the tensor's.

    With the volumes adding up, the chunks are pairwise disjoint exactly when they cover
    every element, so the check marks, on the grid the chunks' edges cut the tensor into,
    the cells each chunk covers: a cell left unmarked means an overlap elsewhere. That
    costs one byte per cell, and a sharded save (any mesh of ``Shard`` placements) cuts the
    tensor into about as many cells as it has chunks. A grid of more than
    :data:`_MAX_GRID_CELLS` cells is checked chunk against chunk instead (numpy, one row
    per chunk), for at most :data:`_MAX_PAIRWISE_CHUNKS` chunks.

    Raises:
        FormatError: the layout is too irregular to check within these bounds.

    Example:
        >>> overlapping_chunks((4,), [((0,), (2,)), ((2,), (2,))], "m")
        >>> overlapping_chunks((4,), [((0,), (2,)), ((1,), (2,))], "m")
        (0, 1)
    """
    import numpy as np

    boxes = [(i, off, sz) for i, (off, sz) in enumerate(chunks) if math.prod(sz)]
    if len(boxes) < 2:
        return None
    # sorted(set()) rather than np.unique: np.unique imports numpy.ma, a tenth of a second
    # that the first load of every process paid.
    edges = [
        np.array(sorted({0, n, *(o[d] for _, o, _ in boxes), *(o[d] + s[d] for _, o, s in boxes)}))
        for d, n in enumerate(size)
    ]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells <= _MAX_GRID_CELLS:
        grid = np.zeros([len(e) - 1 for e in edges], dtype=np.bool_)
        for _, off, sz in boxes:
            at = tuple(
                slice(int(np.searchsorted(e, o)), int(np.searchsorted(e, o + s)))
                for e, o, s in zip(edges, off, sz)
            )
            grid[at] = True
        if grid.all():
            return None
        return _first_overlap(boxes)
    if len(boxes) > _MAX_PAIRWISE_CHUNKS:
        raise FormatError(
            f"{name}: {len(boxes)} chunks on a grid of {cells} cells: too irregular to check "
            "that they do not overlap"
        )
    return _first_overlap(boxes)


def _first_overlap(
    boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]],
) -> tuple[int, int] | None:
    """The first pair of ``(index, offsets, sizes)`` boxes that share an element."""
    import numpy as np

    lo = np.array([off for _, off, _ in boxes], dtype=np.int64).reshape(len(boxes), -1)
    hi = lo + np.array([sz for _, _, sz in boxes], dtype=np.int64).reshape(len(boxes), -1)
    for k in range(len(boxes) - 1):
        hits = np.all((lo[k + 1 :] < hi[k]) & (lo[k] < hi[k + 1 :]), axis=1)
        if hits.any():
            return boxes[k][0], boxes[k + 1 + int(np.argmax(hits))][0]
    return None


def _identity(metadata: Metadata, fqn: str) -> tuple[Any, ...]:
    """What makes value ``fqn`` the same value as another: its type, shape and where each
    of its chunks is stored."""
    md = metadata.state_dict_metadata[fqn]
    locations: Mapping[MetadataIndex, ItemLocation] = metadata.storage_data
    if not isinstance(md, TensorStorageMetadata):
        where = locations[MetadataIndex(fqn)]
        return ("bytes", where.file, where.entry, where.nbytes)
    pieces = []
    for chunk in md.chunks:
        where = locations[MetadataIndex(fqn, chunk.offsets)]
        pieces.append((tuple(chunk.offsets), tuple(chunk.sizes), where.file, where.entry))
    return ("tensor", md.properties.dtype, tuple(md.size), tuple(pieces))


def saved_path(metadata: Metadata, fqn: str) -> Path:
    """Where DCP name ``fqn`` sits in the saved state: its key path in ``planner_data``
    (a one-key path, the name itself, where the metadata has none)."""
    return tuple((metadata.planner_data or {}).get(fqn, (fqn,)))


def tied_names(metadata: Metadata) -> list[list[str]]:
    """The names of ``metadata``'s values, grouped by what is stored for them.

    Names in one group are stored alike (same dtype and size, every chunk in the same file
    entry): they are one value under several names, a tied weight as a sharded save stores
    it. Loads build each group once.

    Example:
        >>> import os, tempfile, torch, warnings
        >>> import torch.distributed.checkpoint as dcp
        >>> import asyncckpt.dcp
        >>> url = os.path.join(tempfile.mkdtemp(), "c")
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"a": torch.ones(2)}, storage_writer=asyncckpt.dcp.Writer(url))
        >>> tied_names(asyncckpt.dcp.Reader(url).read_metadata())
        [['a']]
    """
    groups: dict[tuple[Any, ...], list[str]] = {}
    for fqn in metadata.state_dict_metadata:
        groups.setdefault(_identity(metadata, fqn), []).append(fqn)
    return list(groups.values())


def value_bytes(metadata: Metadata, fqn: str) -> int:
    """The bytes value ``fqn`` takes once loaded (a tensor whole, or a bytes object)."""
    md = metadata.state_dict_metadata[fqn]
    if isinstance(md, TensorStorageMetadata):
        return math.prod(md.size) * DTYPE_ITEMSIZE[dtype_name(md.properties.dtype)]
    where: ItemLocation = metadata.storage_data[MetadataIndex(fqn)]
    return where.nbytes


# ------------------------------------------------------------------------------- decode


def decode_metadata(data: bytes, name: str) -> Metadata:
    """Parse and validate a commit object (at ``name``) into DCP's ``Metadata``, whose
    ``storage_data`` maps every ``MetadataIndex`` to an :class:`ItemLocation` whose file
    name is a plain data file name.

    Raises:
        FormatError: anything malformed, out of range, inconsistent (an item for a chunk
            that does not exist, a chunk without an item) or from a newer schema.

    Example:
        >>> decode_metadata(b"[]", "x")
        Traceback (most recent call last):
        ...
        asyncckpt.errors.FormatError: x: invalid DCP metadata: top level is not an object
    """
    if len(data) > MAX_METADATA_BYTES:
        raise FormatError(f"{name}: {len(data)} bytes of metadata exceed {MAX_METADATA_BYTES}")
    if data[:1] == b"\x80":  # the first byte of every pickle of protocol 2 and later
        raise FormatError(
            f"{name}: a pickle, i.e. a checkpoint of DCP's FileSystemWriter, not of "
            "asyncckpt.dcp.Writer; asyncckpt never unpickles: load it with "
            "torch.distributed.checkpoint.FileSystemReader if you trust it"
        )
    return _Decoder(name).metadata(parse_json(data, f"{name}: DCP metadata"))


class _Decoder(FieldChecker):
    """Builds DCP's dataclasses from a parsed document, checking every field first."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name}: invalid DCP metadata")
        self.name = name

    def str_(self, value: Any, what: str, optional: bool = False) -> Any:
        if not (isinstance(value, str) or (optional and value is None)):
            raise self.fail(f"{what} is not a string")
        return value

    def bool_(self, value: Any, what: str) -> bool:
        if type(value) is not bool:
            raise self.fail(f"{what} is not a boolean")
        return value

    def metadata(self, doc: Any) -> Metadata:
        if not isinstance(doc, dict):
            raise self.fail("top level is not an object")
        if doc.get("format") != SCHEMA:
            raise self.fail(f"format is {doc.get('format')!r}, expected {SCHEMA!r}")
        version = doc.get("version")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise self.fail(
                f"schema version {version!r} is not supported (this asyncckpt reads "
                f"{SCHEMA_VERSION}); upgrade asyncckpt"
            )
        files = [self.file(i, f) for i, f in enumerate(self.list_(doc.get("files"), "files"))]
        if len({f[0] for f in files}) != len(files):
            raise self.fail("a data file is listed twice")
        sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for i, rec in enumerate(self.list_(doc.get("state_dict_metadata"), "state")):
            fqn, md = self.list_(rec, f"state_dict_metadata[{i}]", 2)
            fqn = self.str_(fqn, f"state_dict_metadata[{i}] key")
            if fqn in sdm:
                raise self.fail(f"{fqn!r} is described twice")
            sdm[fqn] = self.storage(fqn, md)
        locations = self.items(self.list_(doc.get("items"), "items"), files, sdm)
        metadata = Metadata(
            state_dict_metadata=sdm,
            planner_data=self.planner_data(doc.get("planner_data")),
            storage_data=locations,
            storage_meta=self.storage_meta(doc.get("storage_meta")),
            version=self.str_(doc.get("dcp_version"), "dcp_version", optional=True),
        )
        self.bounded(metadata, sum(size for _, size in files))
        return metadata

    def bounded(self, metadata: Metadata, file_bytes: int) -> None:
        """Refuse metadata whose values claim more bytes than its files can decode to.

        A consolidated load allocates every tensor whole from its ``size``: each item is
        bounded by its file, but many names may point at one stored entry. Names stored
        alike (ties: one shard stored under several names, as a sharded save does) are one
        value (:func:`tied_names`), counted and built once; everything else counts in full.
        """
        claimed = sum(value_bytes(metadata, names[0]) for names in tied_names(metadata))
        limit = file_bytes * MAX_EXPANSION
        if claimed > limit:
            raise self.fail(
                f"its tensors and bytes objects claim {claimed} bytes, more than its data "
                f"files ({file_bytes} bytes) can decode to ({limit} bytes at most)"
            )

    def file(self, i: int, rec: Any) -> tuple[str, int]:
        name, size = self.list_(rec, f"files[{i}]", 2)
        if not isinstance(name, str) or not is_data_file_name(name):
            raise self.fail(f"files[{i}] name {name!r} is not a data file name")
        return name, self.int_(size, f"files[{i}] size", HEADER_SIZE + FOOTER_SIZE)

    def storage(self, fqn: str, md: Any) -> TensorStorageMetadata | BytesStorageMetadata:
        if not isinstance(md, dict) or md.get("type") not in ("tensor", "bytes"):
            raise self.fail(f"{fqn!r}: type is neither 'tensor' nor 'bytes'")
        if md["type"] == "bytes":
            return BytesStorageMetadata()
        dtype = md.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            raise self.fail(f"{fqn!r}: unknown dtype {dtype!r}")
        layout, memory_format = md.get("layout"), md.get("memory_format")
        if not isinstance(layout, str) or layout not in _LAYOUTS:
            raise self.fail(f"{fqn!r}: unsupported layout {layout!r}")
        if not isinstance(memory_format, str) or memory_format not in _MEMORY_FORMATS:
            raise self.fail(f"{fqn!r}: unknown memory format {memory_format!r}")
        try:
            torch_type = torch_dtype(dtype)
        except FormatError as exc:
            raise self.fail(f"{fqn!r}: {exc}") from None
        props = TensorProperties(
            dtype=torch_type,
            layout=_LAYOUTS[layout],
            requires_grad=self.bool_(md.get("requires_grad"), f"{fqn!r} requires_grad"),
            memory_format=_MEMORY_FORMATS[memory_format],
            pin_memory=self.bool_(md.get("pin_memory"), f"{fqn!r} pin_memory"),
        )
        size = self.dims(md.get("size"), f"{fqn!r} size")
        if math.prod(size) > _MAX_INT:
            raise self.fail(f"{fqn!r} has more than 2**62 elements")
        chunks = []
        for j, rec in enumerate(self.list_(md.get("chunks"), f"{fqn!r} chunks")):
            offsets, sizes = self.list_(rec, f"{fqn!r} chunk {j}", 2)
            off, sz = self.dims(offsets, f"{fqn!r} offsets"), self.dims(sizes, f"{fqn!r} sizes")
            if len(off) != len(size) or len(sz) != len(size):
                raise self.fail(f"{fqn!r} chunk {j} has the wrong number of dimensions")
            if any(o + s > n for o, s, n in zip(off, sz, size)):
                raise self.fail(f"{fqn!r} chunk {j} reaches past the tensor's size {size}")
            chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(sz)))
        self.tiling(fqn, size, chunks)
        return TensorStorageMetadata(props, torch.Size(size), chunks)

    def tiling(self, fqn: str, size: tuple[int, ...], chunks: list[ChunkStorageMetadata]) -> None:
        """Refuse chunks that do not tile the tensor: each element in exactly one chunk.

        A load allocates the whole tensor from ``size`` and fills it chunk by chunk: an
        element no chunk covers would be handed out as uninitialized memory (or left as it
        was in a target), and a chunk listed twice or overlapping another would hide such a
        gap from a volume count alone.
        """
        numel = math.prod(size)
        held = sum(math.prod(c.sizes) for c in chunks)
        if held != numel:
            kind = "leave a gap" if held < numel else "overlap"
            raise self.fail(
                f"{fqn!r}: its chunks do not cover it exactly: they hold {held} elements, "
                f"the tensor {numel} (size {list(size)}), so they {kind}"
            )
        clash = overlapping_chunks(
            size, [(tuple(c.offsets), tuple(c.sizes)) for c in chunks], self.name
        )
        if clash is not None:
            i, j = clash
            raise self.fail(
                f"{fqn!r}: chunks {i} and {j} overlap (offsets {list(chunks[i].offsets)} and "
                f"{list(chunks[j].offsets)}), so part of the tensor is never written"
            )

    def items(
        self,
        records: list[Any],
        files: list[tuple[str, int]],
        sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata],
    ) -> dict[MetadataIndex, ItemLocation]:
        locations: dict[MetadataIndex, ItemLocation] = {}
        for i, rec in enumerate(records):
            fqn, offset, hint, file_no, entry, nbytes = self.list_(rec, f"items[{i}]", 6)
            fqn = self.str_(fqn, f"items[{i}] key")
            md = sdm.get(fqn)
            if md is None:
                raise self.fail(f"items[{i}] stores {fqn!r}, which is not in the state")
            file_no = self.int_(file_no, f"items[{i}] file", 0, len(files) - 1)
            name, file_size = files[file_no]
            nbytes = self.int_(nbytes, f"items[{i}] length", 0, file_size * MAX_EXPANSION)
            entry = self.int_(entry, f"items[{i}] entry")
            if hint is not None:
                hint = self.int_(hint, f"items[{i}] index hint")
            if isinstance(md, TensorStorageMetadata):
                off = self.dims(offset, f"items[{i}] offsets")
                chunk = next((c for c in md.chunks if tuple(c.offsets) == off), None)
                if chunk is None:
                    raise self.fail(f"items[{i}]: {fqn!r} has no chunk at offsets {off}")
                expected = math.prod(chunk.sizes) * DTYPE_ITEMSIZE[dtype_name(md.properties.dtype)]
                if nbytes != expected:
                    raise self.fail(f"items[{i}]: {fqn!r} chunk at {off} is {expected} bytes")
                index = MetadataIndex(fqn, off, hint)
            else:
                if offset is not None:
                    raise self.fail(f"items[{i}]: bytes object {fqn!r} has offsets")
                index = MetadataIndex(fqn, None, hint)
            if index in locations:
                raise self.fail(f"items[{i}]: {item_key(index)!r} is stored twice")
            locations[index] = ItemLocation(name, file_size, entry, nbytes)
        for fqn, md in sdm.items():
            wanted = (
                [MetadataIndex(fqn, c.offsets) for c in md.chunks]
                if isinstance(md, TensorStorageMetadata)
                else [MetadataIndex(fqn)]
            )
            for index in wanted:
                if index not in locations:
                    raise self.fail(f"no stored data for {item_key(index)!r}")
        return locations

    def planner_data(self, value: Any) -> dict[str, tuple[str | int, ...]] | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail("planner_data is not an object")
        out: dict[str, tuple[str | int, ...]] = {}
        for key, path in value.items():
            items = self.list_(path, f"planner_data[{key!r}]")
            if len(items) > 1024 or not all(type(p) in (str, int) for p in items):
                raise self.fail(f"planner_data[{key!r}] is not a list of strings and integers")
            out[key] = tuple(items)
        return out

    def storage_meta(self, value: Any) -> StorageMeta:
        if value is None:
            return StorageMeta()
        if not isinstance(value, dict):
            raise self.fail("storage_meta is not an object")
        modules = self.list_(value.get("modules", []), "storage_meta modules")
        return StorageMeta(
            checkpoint_id=self.str_(value.get("checkpoint_id"), "checkpoint_id", optional=True),
            save_id=self.str_(value.get("save_id"), "save_id", optional=True),
            modules=[self.str_(m, "storage_meta module") for m in modules],
        )
