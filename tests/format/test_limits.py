"""What a crafted file can make a reader do: names, sizes and memory, bounded before use.

Files are built with the pure functions of ``asyncckpt._format.container`` (and DCP metadata
by hand), so each test says exactly what is crafted.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from torch.distributed.checkpoint.api import CheckpointException

import asyncckpt
from asyncckpt import Checkpointer, cli
from asyncckpt._convert import consolidate
from asyncckpt._convert.consolidate import ShardedSource
from asyncckpt._engine import decode as reader_module
from asyncckpt._format import index as schema
from asyncckpt._format.container import (
    FOOTER_SIZE,
    MAX_EXPANSION,
    Chunk,
    Footer,
    Manifest,
    StorageEntry,
    decode_footer,
    decode_manifest,
    encode_footer,
    encode_header,
    encode_manifest,
)
from asyncckpt._format.index import METADATA_NAME, decode_metadata
from asyncckpt._format.names import rank_of_data_file
from asyncckpt._settings import Settings
from asyncckpt._storage import resolve
from asyncckpt._versions import dcp_reader, sharded_reading
from asyncckpt.dcp import Reader, Writer
from asyncckpt.errors import FormatError, MemoryBudgetError
from tests import ranks


def test_rank_file_names_take_ascii_digits_only() -> None:
    """``\\d`` would accept other scripts' digits, which ``int()`` turns into a rank."""
    tail = "-" + "0" * 32 + ".ackpt"
    assert rank_of_data_file("r00001" + tail) == 1
    assert rank_of_data_file("r\u0660\u0660\u0660\u0660\u0661" + tail) is None
    assert rank_of_data_file("r00001" + tail + "\n") is None


# -- DCP metadata: chunks must tile the tensor exactly ---------------------------------------


def _dcp_checkpoint(directory: Path) -> Path:
    """A dcp.Writer directory holding ``w`` = arange(4).reshape(2, 2) as one chunk."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0).reshape(2, 2)}, storage_writer=Writer(str(directory)))
    return directory


def _edit_metadata(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    # A dcp.Writer directory's metadata, or a sharded version's (named by its attempt).
    named = sorted(directory.glob("*.metadata"))
    path = named[0] if named else directory / METADATA_NAME
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.write_text(json.dumps(doc, separators=(",", ":")))


def _tiling(size: list[int], chunks: list[list[int]]) -> Callable[[dict[str, Any]], None]:
    """An edit: ``w`` has global ``size`` and ``[2, 2]`` chunks at the row offsets
    ``chunks`` (each item pointing at the one stored chunk, which holds 16 bytes)."""

    def edit(doc: dict[str, Any]) -> None:
        md = dict(doc["state_dict_metadata"])["w"]
        md["size"] = size
        md["chunks"] = [[offsets, [2, 2]] for offsets in chunks]
        (item,) = [rec for rec in doc["items"] if rec[0] == "w"]
        others = [rec for rec in doc["items"] if rec[0] != "w"]
        unique = dict.fromkeys(map(tuple, chunks))
        doc["items"] = others + [[item[0], list(offsets), *item[2:]] for offsets in unique]

    return edit


#: (global size, chunk offsets, what the message says). Each chunk is [2, 2].
TILINGS = {
    # rows 2 and 3 are never written: two chunks' volume equals the tensor's
    "duplicate chunk": ([4, 2], [[0, 0], [0, 0]], "overlap"),
    "overlap and gap": ([4, 2], [[0, 0], [1, 0]], "overlap"),
    "overlap": ([3, 2], [[0, 0], [1, 0]], "hold 8 elements"),
    "gap": ([4, 2], [[0, 0]], "hold 4 elements"),
}


@pytest.fixture
def dcp_dir(tmp_path: Path) -> Path:
    return _dcp_checkpoint(tmp_path / "dcp")


def _dcp_error(exc: BaseException) -> BaseException:
    """The asyncckpt error DCP wrapped in its CheckpointException, or ``exc`` itself."""
    failures = getattr(exc, "failures", None)
    if failures:
        (error, _trace), *_ = failures.values()
        return error  # type: ignore[no-any-return]
    return exc


@pytest.mark.parametrize("name", list(TILINGS))
def test_chunks_that_do_not_tile_the_tensor_are_refused_on_every_path(
    dcp_dir: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    size, chunks, words = TILINGS[name]
    _edit_metadata(dcp_dir, _tiling(size, chunks))
    data = (dcp_dir / METADATA_NAME).read_bytes()
    with pytest.raises(FormatError, match=rf"m\.json: invalid DCP metadata: 'w'.*{words}"):
        decode_metadata(data, "m.json")
    # dcp.load with asyncckpt's reader
    target = {"w": torch.full(size, -1.0)}
    with pytest.raises((FormatError, CheckpointException)) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=Reader(str(dcp_dir)))
    # (DCP reports a failed metadata read in its own words, with asyncckpt's message)
    assert "invalid DCP metadata" in str(_dcp_error(info.value))
    # the consolidation (asyncckpt convert), which would hand out torch.empty's memory
    with pytest.raises(FormatError, match=words):
        ShardedSource.open(*resolve(str(dcp_dir), None), None, Settings())
    assert cli.main(["convert", str(dcp_dir), str(tmp_path / "out.ackpt")]) == 1
    assert words in capsys.readouterr().err


def _save_sharded(rank: int, world: int, workdir: Path, root: str) -> None:
    """One gloo rank saves step 1 of ``w`` = arange(4).reshape(2, 2) as a DTensor, tied."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.arange(4.0).reshape(2, 2), mesh, [Shard(0)])
    with Checkpointer(root) as ckpt:  # "tied" is w again: one shard stored under two names
        ckpt.save(1, {"w": w, "tied": w, "step": 1}).result(timeout=120)


@pytest.fixture(scope="module")
def sharded_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("sharded")
    ranks.run(__name__, "_save_sharded", 1, workdir, str(workdir / "root"), timeout=200)
    return workdir / "root"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(TILINGS))
def test_a_sharded_version_whose_chunks_do_not_tile_is_refused(
    sharded_root: Path, tmp_path: Path, name: str
) -> None:
    """Checkpointer.load consolidates a sharded version from the same kind of metadata."""
    root = tmp_path / "root"
    shutil.copytree(sharded_root, root)
    assert Checkpointer(root, read_only=True).load(1)["w"].tolist() == [[0, 1], [2, 3]]
    size, chunks, words = TILINGS[name]
    _edit_metadata(root / "1", _tiling(size, chunks))
    with pytest.raises(FormatError, match=words):
        Checkpointer(root, read_only=True).load(1)


def test_chunks_that_tile_the_tensor_load(dcp_dir: Path) -> None:
    """The control: a tensor of two [2, 2] chunks (both the stored one) at rows 0 and 2."""
    _edit_metadata(dcp_dir, _tiling([4, 2], [[0, 0], [2, 0]]))
    src = ShardedSource.open(*resolve(str(dcp_dir), None), None, Settings())
    assert src.full(src.skeleton["w"]).tolist() == [[0, 1], [2, 3], [0, 1], [2, 3]]


def _grid(shape: tuple[int, ...], parts: tuple[int, ...]) -> list[Any]:
    """The chunks of ``shape`` split evenly (the last piece shorter) into ``parts``."""
    axes = []
    for n, k in zip(shape, parts):
        step = -(-n // k)
        axes.append([(o, min(step, n - o)) for o in range(0, n, step)])
    boxes: list[Any] = [((), ())]
    for axis in axes:
        boxes = [((*off, o), (*sz, s)) for off, sz in boxes for o, s in axis]
    return boxes


@pytest.mark.parametrize("pairwise", [False, True], ids=["grid", "pairwise"])
def test_overlap_check_on_thousands_of_chunks(
    monkeypatch: pytest.MonkeyPatch, pairwise: bool
) -> None:
    if pairwise:  # the fallback for layouts whose grid is too large
        monkeypatch.setattr(schema, "_MAX_GRID_CELLS", 1)
    rows = _grid((100_000,), (5000,))
    assert schema.overlapping_chunks((100_000,), rows, "m") is None
    tiles = _grid((1000, 300, 7), (40, 30, 2))
    assert len(tiles) == 2400 and schema.overlapping_chunks((1000, 300, 7), tiles, "m") is None
    shifted = [*tiles[:-1], ((tiles[-1][0][0] - 1, *tiles[-1][0][1:]), tiles[-1][1])]
    assert schema.overlapping_chunks((1000, 300, 7), shifted, "m") is not None
    twice = [*rows[:-1], rows[0]]  # the last chunk replaced by a second copy of the first
    assert schema.overlapping_chunks((100_000,), twice, "m") == (0, len(rows) - 1)
    empty = [*rows, ((0,), (0,)), ((5,), (0,))]  # empty chunks overlap nothing
    assert schema.overlapping_chunks((100_000,), empty, "m") is None


def test_overlap_check_refuses_what_it_cannot_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema, "_MAX_GRID_CELLS", 1)
    monkeypatch.setattr(schema, "_MAX_PAIRWISE_CHUNKS", 10)
    with pytest.raises(FormatError, match=r"m: 20 chunks on a grid of 20 cells: too irregular"):
        schema.overlapping_chunks((20,), _grid((20,), (20,)), "m")


# -- memory: what a file can make a load allocate --------------------------------------------

MIB = 1 << 20


def _one_chunk_file(raw: int, storages: int) -> bytes:
    """A file whose one zstd chunk (``raw`` zero bytes) is the chunk of ``storages`` storages:
    the decoded size is ``storages * raw``. No tensor views them (a reader allocates every
    storage anyway), which keeps the manifest short."""
    payload = zstandard.ZstdCompressor().compress(bytes(raw))
    header = encode_header()
    chunk = Chunk(len(header), len(payload), raw, "zstd", zlib.crc32(payload))
    entries = tuple(StorageEntry(raw, 1, "cpu", 0, 1) for _ in range(storages))
    body = encode_manifest(Manifest((chunk,), entries, (), (), None))
    return header + payload + body + encode_footer(len(header) + len(payload), body)


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the buffers loads allocate for decoded data (every reader's allocator)."""
    sizes: list[int] = []
    real = torch.empty

    def empty(*size: Any, **kw: Any) -> torch.Tensor:
        out = real(*size, **kw)
        if out.numel():  # not the empty tensors that views are built from
            sizes.append(out.numel() * out.element_size())
        return out

    for module in (reader_module, dcp_reader, sharded_reading, consolidate):
        monkeypatch.setattr(module.torch, "empty", empty)
    return sizes


def test_a_1_kib_file_cannot_make_a_load_allocate_64_mib(
    tmp_path: Path, allocations: list[int]
) -> None:
    """Four storages sharing one chunk: 64 MiB decoded from under 1 KiB, refused first."""
    data = _one_chunk_file(16 * MIB, 4)
    assert len(data) <= 1024
    path = tmp_path / "shared.ackpt"
    path.write_bytes(data)
    with pytest.raises(FormatError, match=r"shared\.ackpt.*storage 1 starts at chunk 0"):
        asyncckpt.load(path)
    assert max(allocations, default=0) < MIB
    footer = decode_footer(data[-FOOTER_SIZE:], len(data), "f")
    body = data[footer.manifest_offset : footer.manifest_offset + footer.manifest_length]
    with pytest.raises(FormatError, match="storage 1 starts at chunk 0"):
        decode_manifest(body, footer, "f")  # the pure parser refuses it
    path.write_bytes(_one_chunk_file(16 * MIB, 1))  # the control: one storage loads
    assert asyncckpt.load(path) is None and max(allocations) == 16 * MIB


def test_the_decoded_size_is_bounded_by_the_file_size(tmp_path: Path) -> None:
    """Σ raw_len ≤ MAX_EXPANSION × stored bytes, chunk by chunk, so the total too."""
    data = _one_chunk_file(16 * MIB, 1)
    footer = decode_footer(data[-FOOTER_SIZE:], len(data), "f")
    offset, length = footer.manifest_offset, footer.manifest_length
    doc = json.loads(data[offset : offset + length])
    stored = doc["chunks"][0][1]
    for raw, words in [
        (stored * MAX_EXPANSION + 1, "more than any chunk can decode to"),
        (1 << 30, "more than any chunk can decode to"),
    ]:
        doc["chunks"][0][2] = doc["storages"][0][0] = raw
        body = json.dumps(doc).encode()
        path = tmp_path / "huge.ackpt"
        path.write_bytes(data[:offset] + body + encode_footer(offset, body))
        with pytest.raises(FormatError, match=rf"huge\.ackpt.*chunk 0.*{words}"):
            asyncckpt.load(path)
    # An empty chunk decodes to nothing (max(stored, 1) let it claim 32 KiB).
    empty = Chunk(16, 0, 100, "zstd", 0)
    manifest = Manifest((empty,), (StorageEntry(100, 1, "cpu", 0, 1),), (), (), None)
    body = encode_manifest(manifest)
    with pytest.raises(FormatError, match="chunk 0 claims 100 bytes from 0 stored bytes"):
        decode_manifest(body, Footer(16, len(body), zlib.crc32(body)), "f")


# -- memory: DCP metadata whose items share one stored entry ---------------------------------


def _names_on_one_entry(count: int, size: Callable[[int], list[int]]) -> Any:
    """An edit: ``count`` float32 tensors ``w0``..., of ``size(i)``, one chunk each, every
    item pointing at the one stored entry (the commit says so; the entry is 16 bytes)."""

    def edit(doc: dict[str, Any]) -> None:
        md = dict(doc["state_dict_metadata"])["w"]
        (item,) = doc["items"]
        doc["state_dict_metadata"], doc["items"] = [], []
        for i in range(count):
            dims = size(i)
            chunk = [[0] * len(dims), dims]
            doc["state_dict_metadata"].append([f"w{i}", {**md, "size": dims, "chunks": [chunk]}])
            nbytes = 4 * math.prod(dims)
            doc["items"].append([f"w{i}", chunk[0], None, item[3], item[4], nbytes])
        doc["planner_data"] = None

    return edit


def test_many_names_on_one_entry_cannot_claim_more_than_the_files_hold(dcp_dir: Path) -> None:
    """100 tensors of 8+ MiB each on one 16-byte entry of a file of 408 bytes: refused
    when the metadata is read, before the load allocates the tensors it names."""
    _edit_metadata(dcp_dir, _names_on_one_entry(100, lambda i: [512, 4096 + i]))
    data = (dcp_dir / METADATA_NAME).read_bytes()
    with pytest.raises(FormatError, match=r"m\.json: invalid DCP metadata: .* claim \d+ bytes"):
        decode_metadata(data, "m.json")
    with pytest.raises(FormatError, match="claim"):
        ShardedSource.open(*resolve(str(dcp_dir), None), None, Settings())


def test_names_sharing_one_entry_alike_are_one_tensor(
    dcp_dir: Path, allocations: list[int]
) -> None:
    """1,000 names for one stored tensor (ties, as a sharded save stores them) count, and
    are built, once."""
    _edit_metadata(dcp_dir, _names_on_one_entry(1000, lambda i: [2, 2]))
    src = ShardedSource.open(*resolve(str(dcp_dir), None), None, Settings())
    placeholders = {id(src.skeleton[f"w{i}"]) for i in range(1000)}
    assert len(placeholders) == 1
    allocations.clear()
    built = consolidate.materialize_all(src, src.skeleton)
    assert built["w0"] is built["w999"] and built["w7"].tolist() == [[0, 1], [2, 3]]
    assert sum(allocations) < 1000 * 16


@pytest.mark.timeout(300)
def test_a_tied_sharded_weight_loads_once(sharded_root: Path) -> None:
    loaded = Checkpointer(sharded_root, read_only=True).load(1)
    assert loaded["w"].tolist() == [[0, 1], [2, 3]]
    assert loaded["tied"] is loaded["w"]  # tied again, as a single-file load gives it back


# -- memory budget: max_bytes on every entry point -------------------------------------------


def _state() -> dict[str, Any]:
    """2 MiB of decoded data in two tensors; compressible, so the file is smaller."""
    return {"a": torch.zeros(256 * 1024), "b": torch.arange(256 * 1024, dtype=torch.int32)}


def test_load_takes_a_memory_budget(tmp_path: Path, allocations: list[int]) -> None:
    path = tmp_path / "x.ackpt"
    asyncckpt.save(_state(), path).result()
    with pytest.raises(MemoryBudgetError, match=r"x\.ackpt: loading it needs 2,097,152 bytes"):
        asyncckpt.load(path, max_bytes=2 * MIB - 1)
    assert allocations == []
    assert asyncckpt.load(path, max_bytes=2 * MIB)["b"][-1] == 256 * 1024 - 1
    with pytest.raises(ValueError, match="max_bytes"):
        asyncckpt.load(path, max_bytes=-1)
    assert issubclass(MemoryBudgetError, FormatError)


def test_checkpointer_load_takes_a_memory_budget(tmp_path: Path, allocations: list[int]) -> None:
    with Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(5, _state()).result()
        allocations.clear()
        with pytest.raises(MemoryBudgetError, match="2,097,152 bytes"):
            ckpt.load(5, max_bytes=MIB)
        assert allocations == []
        assert ckpt.load(max_bytes=2 * MIB)["a"].numel() == 256 * 1024


@pytest.mark.timeout(300)
def test_a_sharded_load_takes_a_memory_budget(sharded_root: Path, allocations: list[int]) -> None:
    """Consolidated: the whole tensor (tied, so once) and the buffers read count."""
    ckpt = Checkpointer(sharded_root, read_only=True)
    with pytest.raises(MemoryBudgetError, match=r"needs 16 bytes for the whole of w"):
        ckpt.load(1, max_bytes=15)
    assert allocations == []
    assert ckpt.load(1, max_bytes=64)["w"].sum() == 6


def test_a_dcp_reader_takes_a_memory_budget(dcp_dir: Path) -> None:
    """Only buffers count: a stored tensor decoded straight into its target needs none."""
    target = {"w": torch.zeros(2, 2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=Reader(str(dcp_dir), max_bytes=0))
        assert target["w"].sum() == 6
        half = {"w": torch.zeros(2, 2, dtype=torch.float64)}  # another dtype: a buffer
        with pytest.raises(CheckpointException) as info:
            dcp.load(half, storage_reader=Reader(str(dcp_dir), max_bytes=15))
    assert isinstance(_dcp_error(info.value), MemoryBudgetError)


@pytest.mark.parametrize(
    "args",
    [["verify"], ["inspect"], ["convert", "OUT.pt"], ["convert", "OUT.safetensors"]],
    ids=lambda a: "-".join(a).replace(".", "-"),
)
def test_the_command_line_takes_a_memory_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    path = tmp_path / "x.ackpt"
    asyncckpt.save(_state(), path).result()
    command = [args[0], str(path), *(str(tmp_path / a) for a in args[1:])]
    assert cli.main([*command, "--max-bytes", "1MiB"]) == 1
    out, err = capsys.readouterr()
    assert "2,097,152 bytes" in out + err and "1,048,576" in out + err
    assert not (tmp_path / "OUT.pt").exists() and not (tmp_path / "OUT.safetensors").exists()
    assert cli.main([*command, "--max-bytes", "2097152"]) == 0
    assert cli.main([*command, "--max-bytes", "lots"]) == 2  # a usage error
    capsys.readouterr()


@pytest.mark.parametrize("shards", [[], ["--shard-size", "1GiB"]], ids=["one-file", "hub"])
def test_convert_to_safetensors_budgets_the_dense_copy_of_a_zero_stride_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shards: list[str]
) -> None:
    """A broadcast tensor is a few bytes on disk and loaded as such (stride 0), but
    safetensors holds dense data: the copy that makes it so is what the budget must see."""
    path = tmp_path / "x.ackpt"
    wide = torch.zeros(1).expand(1 << 22)  # 4 bytes stored, 16 MiB dense
    asyncckpt.save({"w": wide}, path).result()
    assert path.stat().st_size < 4096
    out = tmp_path / "out.safetensors"
    assert cli.main(["convert", str(path), str(out), *shards, "--max-bytes", "1MiB"]) == 1
    assert "16,777,220 bytes" in capsys.readouterr().err and not out.exists()  # + 4 stored
    assert cli.main(["convert", str(path), str(out), *shards, "--max-bytes", "17MiB"]) == 0


def test_convert_of_a_sharded_checkpoint_takes_a_memory_budget(
    dcp_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Streamed outputs hold one tensor at a time, torch.save's the whole state."""
    out = tmp_path / "o.ackpt"
    assert cli.main(["convert", str(dcp_dir), str(out), "--max-bytes", "15"]) == 1
    assert "16 bytes" in capsys.readouterr().err and not out.exists()
    assert cli.main(["convert", str(dcp_dir), str(out), "--max-bytes", "16"]) == 0
