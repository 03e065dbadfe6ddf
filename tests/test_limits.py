"""What a crafted file can make a reader do: names, sizes and memory, bounded before use.

Files are built with the pure functions of ``asyncckpt.format`` (and DCP metadata by hand),
so each test says exactly what is crafted.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from asyncckpt import Checkpointer, cli
from asyncckpt.consolidate import ShardedSource
from asyncckpt.dcp import Reader, Writer, schema
from asyncckpt.dcp.schema import METADATA_NAME, decode_metadata
from asyncckpt.errors import FormatError
from asyncckpt.sharded_load import _RANK_FILE
from asyncckpt.storage import resolve
from tests import ranks


def test_rank_file_names_take_ascii_digits_only() -> None:
    """``\\d`` would accept other scripts' digits, which ``int()`` turns into a rank."""
    tail = "-" + "0" * 32 + ".ackpt"
    assert _RANK_FILE.fullmatch("r00001" + tail)
    assert not _RANK_FILE.fullmatch("r\u0660\u0660\u0660\u0660\u0661" + tail)
    assert not _RANK_FILE.fullmatch("r00001" + tail + "\n")


# -- DCP metadata: chunks must tile the tensor exactly ---------------------------------------


def _dcp_checkpoint(directory: Path) -> Path:
    """A dcp.Writer directory holding ``w`` = arange(4).reshape(2, 2) as one chunk."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0).reshape(2, 2)}, storage_writer=Writer(str(directory)))
    return directory


def _edit_metadata(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = directory / METADATA_NAME
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.write_text(json.dumps(doc, separators=(",", ":")))


def _tiling(size: list[int], chunks: list[list[int]]) -> Callable[[dict[str, Any]], None]:
    """An edit: ``w`` has global ``size`` and ``[2, 2]`` chunks at the row offsets
    ``chunks`` (each item pointing at the one stored chunk, which holds 16 bytes)."""

    def edit(doc: dict[str, Any]) -> None:
        (fqn, md), *_ = doc["state_dict_metadata"]
        assert fqn == "w"
        md["size"] = size
        md["chunks"] = [[offsets, [2, 2]] for offsets in chunks]
        (item,) = doc["items"]
        unique = dict.fromkeys(map(tuple, chunks))
        doc["items"] = [[item[0], list(offsets), *item[2:]] for offsets in unique]

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
        ShardedSource.open(*resolve(str(dcp_dir), None))
    assert cli.main(["convert", str(dcp_dir), str(tmp_path / "out.ackpt")]) == 1
    assert words in capsys.readouterr().err


def _save_sharded(rank: int, world: int, workdir: Path, root: str) -> None:
    """One gloo rank saves step 1 of ``w`` = arange(4).reshape(2, 2) as a DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.arange(4.0).reshape(2, 2), mesh, [Shard(0)])
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": w, "step": 1}).result(timeout=120)


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
    src = ShardedSource.open(*resolve(str(dcp_dir), None))
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
