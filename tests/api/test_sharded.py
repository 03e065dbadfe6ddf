"""Sharded versions: ``Checkpointer.save``/``load`` of DTensor states (FSDP2, replicated).

* 4 ranks save an FSDP2 model + Adam state, a replicated DTensor, a DTensor replicated on
  one dimension of a 2-D mesh, and per-rank plain values (an RNG state, an int, a tensor);
  they load it back on 4 ranks, bit for bit, each rank getting its own plain values;
* the version's layout: a file per rank, a completion record per rank, the metadata, a
  ``COMMIT`` of kind ``sharded`` naming them; replicated pieces stored once;
* resharding: the 4-rank version loaded on 2 ranks; a 2-rank version on 3 ranks (the third
  rank gets rank 0's plain values); in one process without a group, as the full state;
* damage: a flipped byte in one rank's file raises ``ChecksumError``;
* a rank SIGKILLed mid-save: no ``COMMIT``, the previous version stays the latest on every
  surviving rank, and the writer's save fails instead of hanging; the same for a rank that
  dies before it wrote any marker (given up ``lease_expiry_ms`` after the writer started,
  not after the group's timeout), while a rank slow to start is not given up;
* retention deleting the version a reader loads: a load of the newest version moves on, a
  load of that step raises, a damaged version is not taken for a retired one;
* a sharded round trip on S3 (moto and SeaweedFS).

Rank processes are spawned with ``torch.multiprocessing`` and meet through a ``TCPStore`` on
127.0.0.1 (port chosen by the OS); the process group and every wait have timeouts, and the
parent kills every rank as soon as one fails or the deadline passes, then shows every
rank's traceback (the harness of ``tests/api/test_distributed.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from asyncckpt import Checkpointer
from asyncckpt._format.container import HEADER_SIZE
from asyncckpt._format.tree import holds_dtensor
from asyncckpt._settings import Settings
from asyncckpt._storage import resolve
from asyncckpt._versions.protocol import (
    SHARDED,
    SINGLE,
    CommitRecord,
    commit_from,
    read_commit,
)
from asyncckpt._versions.rank_records import Piece, RankDone, metadata_bytes
from asyncckpt.errors import (
    CheckpointTimeoutError,
    ChecksumError,
    FormatError,
    IncompleteCheckpointError,
    UnreadableRecordError,
)
from tests import ranks, state_checks
from tests.fake_clock import fake_clock

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:torch.distributed is unavailable"),
]

_WAIT = timedelta(seconds=120)  # every store wait and collective in a rank
_ATTEMPT = "0123456789abcdef" * 2

# --------------------------------------------------------------------------- harness


def run_ranks(
    name: str, world: int, workdir: Path, *args: Any, timeout: float = 200, killed: tuple = ()
) -> None:
    """Run ``name(rank, world, workdir, *args)`` of this module on ``world`` gloo ranks."""
    ranks.run(__name__, name, world, workdir, *args, timeout=timeout, killed=killed)


# --------------------------------------------------------------------------- helpers


def _replicated(fill: float) -> dict[str, Any]:
    """A DTensor replicated on every rank, and (4 ranks) one replicated on one mesh dim."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    out = {
        "rep": distribute_tensor(
            fill * torch.randn(6, 3, generator=g), init_device_mesh("cpu", (world,)), [Replicate()]
        )
    }
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        out["rep2d"] = distribute_tensor(
            fill * torch.randn(4, 5, generator=g), mesh, [Replicate(), Shard(0)]
        )
    return out


def _plain(rank: int) -> dict[str, Any]:
    """Per-rank plain values: an RNG state, an int, a tensor."""
    torch.manual_seed(100 + rank)
    return {"rng": torch.get_rng_state(), "value": 10 * rank + 7, "local": torch.full((3,), rank)}


def _state(model: nn.Module, optim: torch.optim.Optimizer, fill: float, rank: int) -> Any:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "dist": _replicated(fill), "plain": _plain(rank)}


def _full(model: nn.Module, optim: torch.optim.Optimizer, state: Any) -> dict[str, Any]:
    """The full state (every tensor whole), as one process loads it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)  # on every rank (no cpu_offload)
    msd, osd = get_state_dict(model, optim, options=options)
    # A DTensor saved but not asked for (rep2d, on 2 ranks) is not loaded: None.
    whole = {k: v.full_tensor() for k, v in state["dist"].items() if v is not None}
    return {"model": msd, "optim": osd, "dist": whole}


def _load_into_fresh(ckpt: Checkpointer, rank: int, step: int | None = None) -> Any:
    """Load into a fresh FSDP model (another seed) and return (loaded state, model, optim)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, optim = ranks.fsdp_model(seed=1)
    into = _state(model, optim, 0.0, rank + 50)
    loaded = ckpt.load(step, into=into)
    set_state_dict(model, optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    return loaded, model, optim


# --------------------------------------------------------------------------- 4 ranks


def _save_then_load(rank: int, world: int, workdir: Path, root: str) -> None:
    """Save steps 1 and 2 (training in between and after), then load step 2 back."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ckpt = Checkpointer(root)
    model, optim = ranks.fsdp_model(seed=0)
    ranks.train(model, optim, 2)
    ckpt.save(1, _state(model, optim, 1.0, rank)).result(timeout=120)
    ranks.train(model, optim, 1)
    state = _state(model, optim, 2.0, rank)
    want = state_checks.cloned(state)
    full = _full(model, optim, state)  # collective: before the save, like the training step
    if rank == 0:  # the reference for loads on other world sizes and in one process
        torch.save({**full, "plain": want["plain"]}, workdir / "full.pt")
    torch.save(want["plain"], workdir / f"plain{rank}.pt")
    handle = ckpt.save(2, state)
    ranks.train(model, optim, 1)  # the snapshot, not the live parameters, is saved
    handle.result(timeout=120)

    loaded, model2, optim2 = _load_into_fresh(ckpt, rank)
    msd, osd = get_state_dict(model2, optim2)
    got = {"model": msd, "optim": osd, "dist": loaded["dist"], "plain": loaded["plain"]}
    state_checks.assert_same(got, want)
    assert loaded["plain"]["value"] == 10 * rank + 7
    ckpt.close()
    dist.barrier()


def _load_resharded(rank: int, world: int, workdir: Path, root: str) -> None:
    """Load the newest version on this world size; compare the full state and plain values."""
    ckpt = Checkpointer(root, read_only=True)
    loaded, model, optim = _load_into_fresh(ckpt, rank)
    want = torch.load(workdir / "full.pt", weights_only=True)
    got = _full(model, optim, loaded)
    if world != 4:
        assert loaded["dist"].get("rep2d", None) is None
        want["dist"].pop("rep2d", None)
    state_checks.assert_same(got, {k: want[k] for k in ("model", "optim", "dist")})
    saved_by = rank if (workdir / f"plain{rank}.pt").exists() else 0
    state_checks.assert_same(
        loaded["plain"], torch.load(workdir / f"plain{saved_by}.pt", weights_only=True)
    )
    ckpt.close()
    dist.barrier()


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root holding steps 1 and 2, saved by 4 FSDP2 ranks (and loaded back by them)."""
    workdir = tmp_path_factory.mktemp("four")
    run_ranks("_save_then_load", 4, workdir, str(workdir / "ckpt"))
    return workdir


def _rank_files(directory: Path, suffix: str = ".ackpt") -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(suffix))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_ranks_round_trip_bit_exact_with_per_rank_plain_values(four: Path) -> None:
    # The ranks compared everything themselves; here the layout of what they wrote.
    step = four / "ckpt" / "2"
    commit = read_commit(*_root(four), 2)
    assert commit is not None and commit.kind == SHARDED
    files = [p.name for p in _rank_files(step)]
    # The metadata is named by the save's attempt, like every file of the save (issue 19).
    metadata = files[0].removesuffix(".ackpt") + ".metadata"
    assert commit.metadata_file == metadata and not (step / ".metadata").exists()
    assert list(commit.files) == [*files, metadata] and len(files) == 4
    assert [f[:6] for f in files] == ["r00000", "r00001", "r00002", "r00003"]
    assert list(commit.sizes) == [(step / f).stat().st_size for f in commit.files]
    assert len(_rank_files(step, ".done")) == 4  # the completion records stay
    assert not _rank_files(step, ".beat") and not (step / "FAILED").exists()
    assert json.loads((four / "ckpt" / "VERSION").read_text())["step"] == 2


def _root(workdir: Path) -> tuple[Any, str]:
    from asyncckpt._storage import resolve

    return resolve(str(workdir / "ckpt"), None)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replicated_dtensor_is_written_once(four: Path) -> None:
    step = four / "ckpt" / "2"
    stored: dict[str, list[int]] = {}
    for marker in _rank_files(step, ".done"):
        doc = json.loads(marker.read_text())
        for piece in doc["pieces"]:
            stored.setdefault(piece["fqn"], []).append(doc["rank"])
    assert stored["dist.rep"] == [0]  # replicated on the 1-D mesh: rank 0 only
    assert stored["dist.rep2d"] == [0, 1]  # mesh (2, 2), [Replicate(), Shard(0)]: row 0
    assert stored["model.0.weight"] == [0, 1, 2, 3]  # FSDP: every rank its own shard
    assert stored["model.2.bias"] == [0, 1, 2]  # 5 rows on 4 ranks: the last shard is empty
    meta = json.loads(_rank_files(step, ".metadata")[0].read_text())
    items = [i for i in meta["items"] if i[0] == "dist.rep2d"]
    assert sorted(i[1] for i in items) == [[0, 0], [2, 0]]  # two chunks, each stored once
    # A rank that stores nothing of a replicated tensor keeps None in its own file's tree.
    import asyncckpt

    rank3 = asyncckpt.load(str(_rank_files(step)[3]))
    assert rank3["dist"]["rep"] is None and rank3["plain"]["value"] == 37


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_ranks_to_two(four: Path) -> None:
    run_ranks("_load_resharded", 2, four, str(four / "ckpt"))


@pytest.mark.timeout(300)
def test_one_process_without_a_group_loads_the_full_state(four: Path) -> None:
    loaded = Checkpointer(four / "ckpt").load()
    want = torch.load(four / "full.pt", weights_only=True)
    state_checks.assert_same(loaded, want)  # every tensor whole, and rank 0's plain values
    assert not holds_dtensor(loaded)
    # Into an existing plain state (a model's full state dict): in place.
    into = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}}
    again = Checkpointer(four / "ckpt").load(1, into=into)
    assert again["model"]["0.weight"] is into["model"]["0.weight"]
    assert not torch.equal(into["model"]["0.weight"], want["model"]["0.weight"])  # step 1


@pytest.mark.timeout(300)
def test_a_consolidated_load_puts_whole_and_plain_tensors_on_one_device(
    four: Path, fake_cuda: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As if the four ranks had saved from their GPUs: their files name cuda:0 (through the
    # fake CUDA, no GPU). One process loads the whole state: everything on its own device.
    import dataclasses

    from asyncckpt._versions import sharded_reading

    real = sharded_reading.rank_file

    def saved_on_cuda(*args: Any) -> Any:
        opened, skip = real(*args)
        storages = [dataclasses.replace(s, device="cuda:0") for s in opened.manifest.storages]
        manifest = dataclasses.replace(opened.manifest, storages=tuple(storages))
        return dataclasses.replace(opened, manifest=manifest), skip

    monkeypatch.setattr(sharded_reading, "rank_file", saved_on_cuda)
    monkeypatch.setenv("LOCAL_RANK", "1")
    fake_cuda.devices = 2
    loaded = Checkpointer(four / "ckpt").load()
    devices = {str(fake_cuda.device_of(t)) for t in tensor_leaves(loaded)}
    assert devices == {"cuda:1"}
    state_checks.assert_same(loaded, torch.load(four / "full.pt", weights_only=True))


@pytest.fixture
def read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of each chunk read (every chunk goes through ``OpenedFile.read_into``)."""
    from asyncckpt._engine.opened import OpenedFile

    counts: list[int] = []
    real = OpenedFile.read_into

    def counting(self: OpenedFile, start: int, out: memoryview) -> int:
        counts.append(real(self, start, out))
        return counts[-1]

    monkeypatch.setattr(OpenedFile, "read_into", counting)
    return counts


@pytest.mark.timeout(300)
def test_one_process_loads_only_the_keys_asked_for(four: Path, read: list[int]) -> None:
    from asyncckpt.errors import MissingKeyError

    want = torch.load(four / "full.pt", weights_only=True)
    full = Checkpointer(four / "ckpt").load()
    everything, read[:] = sum(read), []
    loaded = Checkpointer(four / "ckpt").load(keys=["model"])
    assert list(loaded) == ["model"]
    state_checks.assert_same(loaded["model"], want["model"])
    optim_bytes = sum(t.numel() * t.element_size() for t in tensor_leaves(full["optim"]))
    assert optim_bytes > 0 and sum(read) + optim_bytes <= everything  # optim never fetched
    with pytest.raises(MissingKeyError, match="top-level keys are"):
        Checkpointer(four / "ckpt").load(keys=["ema"])


@pytest.mark.timeout(300)
def test_open_of_a_sharded_version_lists_whole_shapes_and_loads_one_key_at_a_time(
    four: Path, read: list[int]
) -> None:
    from asyncckpt._versions.sharded_reading import key_path
    from asyncckpt.errors import MissingKeyError

    want = torch.load(four / "full.pt", weights_only=True)
    with Checkpointer(four / "ckpt").open() as version:
        assert not read  # opening reads manifests and metadata, no chunk
        assert sorted(version) == sorted(want) and "model" in version
        shapes = version.tensors()
        for name, tensor in want["model"].items():  # whole shapes, not this rank's shard
            assert shapes[key_path(("model", name))] == (tensor.shape, tensor.dtype)
        model = version["model"]
        state_checks.assert_same(model, want["model"])
        optim_bytes = sum(t.numel() * t.element_size() for t in tensor_leaves(want["optim"]))
        model_read = sum(read)
        state_checks.assert_same(version.get_tensor("optim"), want["optim"])
        assert sum(read) - model_read >= optim_bytes  # the optimizer came with its own read
        assert version.nbytes() >= optim_bytes + model_read
        with pytest.raises(MissingKeyError, match="top-level keys are"):
            version["ema"]
    with Checkpointer(four / "ckpt").open(1) as first:  # an older step, by number
        assert not torch.equal(first["model"]["0.weight"], want["model"]["0.weight"])


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    from asyncckpt._format.tree import tensor_paths

    return list(tensor_paths(tree).values())


@pytest.mark.timeout(300)
def test_dcp_reader_finds_a_versions_metadata_through_its_commit(four: Path) -> None:
    import asyncckpt.dcp

    step = four / "ckpt" / "2"
    assert not (step / ".metadata").exists()
    metadata = asyncckpt.dcp.Reader(step).read_metadata()  # as docs/sharded.md says
    assert metadata.state_dict_metadata["model.0.weight"].size == (32, 8)


@pytest.mark.timeout(300)
def test_a_root_whose_commit_names_dot_metadata_still_loads(four: Path, tmp_path: Path) -> None:
    """Roots written before the metadata was named by its attempt: COMMIT names .metadata."""
    import asyncckpt.dcp
    from asyncckpt.cli import main

    root = tmp_path / "ckpt"
    shutil.copytree(four / "ckpt", root)
    for step in (1, 2):
        directory = root / str(step)
        (named,) = _rank_files(directory, ".metadata")
        named.rename(directory / ".metadata")
        doc = json.loads((directory / "COMMIT").read_text())
        doc["files"] = [".metadata" if f == named.name else f for f in doc["files"]]
        (directory / "COMMIT").write_text(json.dumps(doc))
    commit = read_commit(*resolve(str(root), None), 2)
    assert commit is not None and commit.metadata_file == ".metadata"
    loaded = Checkpointer(root).load()
    state_checks.assert_same(loaded, torch.load(four / "full.pt", weights_only=True))
    metadata = asyncckpt.dcp.Reader(root / "2").read_metadata()
    assert metadata.state_dict_metadata["model.0.weight"].size == (32, 8)
    assert main(["convert", f"{root}@2", str(tmp_path / "full.ackpt")]) == 0


@pytest.mark.timeout(300)
def test_a_flipped_byte_in_one_rank_file_is_reported(four: Path, tmp_path: Path) -> None:
    shutil.copytree(four / "ckpt", tmp_path / "ckpt")
    rank1 = _rank_files(tmp_path / "ckpt" / "2")[1]
    with open(rank1, "r+b") as f:
        f.seek(HEADER_SIZE + 3)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 3)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ChecksumError) as info:
        Checkpointer(tmp_path / "ckpt").load()
    assert info.value.path == str(rank1)


# --------------------------------------------------------------------------- 2 -> 3 ranks


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_round_trip_then_three(tmp_path: Path) -> None:
    run_ranks("_save_then_load", 2, tmp_path, str(tmp_path / "ckpt"))
    run_ranks("_load_resharded", 3, tmp_path, str(tmp_path / "ckpt"))


def _save_then_load_in_writer_processes(rank: int, world: int, workdir: Path, root: str) -> None:
    from asyncckpt._engine import writer_process

    os.environ["ASYNCCKPT_WRITER_PROCESSES"] = "1"
    _save_then_load(rank, world, workdir, root)
    process = writer_process.current()
    assert process is not None and process.jobs == 2  # each rank's own file, both steps


def test_two_ranks_write_their_shards_in_writer_processes(tmp_path: Path) -> None:
    run_ranks("_save_then_load_in_writer_processes", 2, tmp_path, str(tmp_path / "ckpt"))
    run_ranks("_load_resharded", 3, tmp_path, str(tmp_path / "ckpt"))


# --------------------------------------------------------------------------- a rank dies


def _rank_killed_mid_save(rank: int, world: int, workdir: Path) -> None:
    import asyncckpt._versions.ranks

    os.environ["ASYNCCKPT_LEASE_RENEW_MS"] = "100"
    os.environ["ASYNCCKPT_LEASE_EXPIRY_MS"] = "2000"
    root = workdir / "ckpt"
    ckpt = Checkpointer(root)
    model, optim = ranks.fsdp_model(seed=0)
    ckpt.save(1, _state(model, optim, 1.0, rank)).result(timeout=120)
    dist.barrier()  # step 1 is committed on every rank's view
    if rank == 1:

        def die(*args: Any, **kwargs: Any) -> int:
            os.kill(os.getpid(), signal.SIGKILL)  # its progress record exists; its file not
            raise AssertionError("unreachable")

        asyncckpt._versions.ranks.writer_process.write = die  # type: ignore[assignment]
    handle = ckpt.save(2, _state(model, optim, 2.0, rank))
    if rank == 0:
        with pytest.raises(CheckpointTimeoutError, match="rank 1 has not recorded progress"):
            handle.result(timeout=120)
        assert (root / "2" / "FAILED").exists()
    else:
        handle.result(timeout=120)  # this rank's part does not depend on the others
        with pytest.raises(IncompleteCheckpointError, match="failed"):
            ckpt.load(2, collective=False, timeout=120)
    assert read_commit(*_root(workdir), 2) is None
    assert ckpt.latest() == 1 == Checkpointer(root, read_only=True).latest()
    assert ckpt.load(collective=False)["dist"]["rep"].shape == (6, 3)  # step 1, whole
    Path(workdir, f"rank{rank}.done").touch()
    os._exit(0)  # the group's peer is dead: skip its orderly teardown


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_mid_save_leaves_the_previous_version(tmp_path: Path) -> None:
    run_ranks("_rank_killed_mid_save", 3, tmp_path, killed=(1,))
    assert (tmp_path / "rank0.done").exists() and (tmp_path / "rank2.done").exists()
    assert Checkpointer(tmp_path / "ckpt").latest() == 1
    assert not (tmp_path / "ckpt" / "2" / "COMMIT").exists()


# --------------------------------------------------------------------------- pure parts


def test_a_sharded_commit_marker_names_rank_files_and_the_metadata() -> None:
    doc = {"step": 3, "files": ["r00000-a.ackpt", ".metadata"], "sizes": [9, 2], "writer": "w"}
    assert commit_from({**doc, "kind": SHARDED}, 3, "x").files[1] == ".metadata"
    with pytest.raises(UnreadableRecordError):  # only a sharded version has metadata
        commit_from(doc, 3, "x")
    with pytest.raises(UnreadableRecordError):  # a kind this asyncckpt does not know
        commit_from({**doc, "kind": "incremental"}, 3, "x")
    assert CommitRecord(3, ("r00000-a.ackpt",), "w").kind == SINGLE


def test_a_sharded_commit_names_exactly_one_metadata_file() -> None:
    rank_file, named = f"r00000-{_ATTEMPT}.ackpt", f"r00000-{_ATTEMPT}.metadata"
    doc = {"step": 3, "kind": SHARDED, "sizes": [], "writer": "w"}
    assert commit_from({**doc, "files": [rank_file, named]}, 3, "x").metadata_file == named
    for files in ([rank_file], [rank_file, named, ".metadata"], [rank_file, "x.metadata"]):
        with pytest.raises(UnreadableRecordError):
            commit_from({**doc, "files": files}, 3, "x")


def test_metadata_refuses_inconsistent_markers() -> None:
    def piece(offsets: tuple[int, ...], shape: tuple[int, ...] = (4,)) -> Piece:
        return Piece("w", ("w",), shape, "float32", offsets, (2,), 0, 8)

    file0, file1 = (f"r0000{r}-{_ATTEMPT}.ackpt" for r in (0, 1))
    whole = {
        0: RankDone(0, file0, 99, (piece((0,)),)),
        1: RankDone(1, file1, 99, (piece((2,)),)),
    }
    assert json.loads(metadata_bytes(whole, _ATTEMPT, "x"))["planner_data"] == {"w": ["w"]}
    with pytest.raises(FormatError, match="stored twice"):
        metadata_bytes({0: whole[0], 1: RankDone(1, file1, 99, (piece((0,)),))}, _ATTEMPT, "x")
    with pytest.raises(FormatError, match="disagree"):
        metadata_bytes(
            {0: whole[0], 1: RankDone(1, file1, 99, (piece((2,), (6,)),))}, _ATTEMPT, "x"
        )
    with pytest.raises(FormatError, match="cover"):  # half of the tensor is stored nowhere
        metadata_bytes({0: whole[0]}, _ATTEMPT, "x")


# --------------------------------------------------------------------------- retention vs loads


def _retire_on_first_call(root: Path, stash: Path, real: Any) -> Any:
    """Wrap ``real``: its first call first does what a trainer with ``keep_last=1`` does to
    ``root`` while a reader loads step 1: commit step 2 (put back from ``stash``), then
    retire step 1 (``COMMIT`` first, as retention does)."""
    from asyncckpt._storage import resolve
    from asyncckpt._versions.protocol import delete_version

    calls: list[int] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not calls:
            calls.append(1)
            stash.rename(root / "2")
            delete_version(*resolve(str(root), None), 1)
        return real(*args, **kwargs)

    return wrapped


#: Where in a sharded load the version disappears: before anything is read, while DCP
#: reads the chunks, while this rank's plain values are read.
_RETIRE_AT = ["step_dir", "_dcp_load", "open_data_file"]


def _root_at_step_1(four: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str) -> Path:
    """A copy of the 4-rank root whose step 2 is not there yet, and a hook in the sharded
    load at ``at`` that commits step 2 and retires step 1 when it is first reached."""
    import asyncckpt._versions.sharded_reading

    root, stash = tmp_path / "ckpt", tmp_path / "stash"
    shutil.copytree(four / "ckpt", root)
    (root / "2").rename(stash)  # VERSION names 2, not committed: latest() falls back to 1
    assert Checkpointer(root).latest() == 1
    real = getattr(asyncckpt._versions.sharded_reading, at)
    monkeypatch.setattr(
        asyncckpt._versions.sharded_reading, at, _retire_on_first_call(root, stash, real)
    )
    return root


def _load(ckpt: Checkpointer, step: int, *, follow_latest: bool) -> Any:
    """The load ``Checkpointer.load`` plans for ``step`` of ``ckpt`` (not collective),
    executed with the version's ``COMMIT`` read first, as it does."""
    from asyncckpt._device import Placement
    from asyncckpt._versions import loading

    commit = ckpt._reader.commit_of(step)
    assert commit is not None
    request = ckpt._load_request(Placement(None), follow_latest=follow_latest)
    return loading.load(ckpt._reader, step, commit, request)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("at", _RETIRE_AT)
def test_a_newest_sharded_load_follows_when_retention_deletes_its_version(
    four: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    root = _root_at_step_1(four, tmp_path, monkeypatch, at)
    ckpt = Checkpointer(root)
    loaded = _load(ckpt, 1, follow_latest=True)
    assert ckpt.versions() == [2]  # step 1 really was deleted under the loader
    state_checks.assert_same(loaded, torch.load(four / "full.pt", weights_only=True))


@pytest.mark.timeout(300)
def test_an_evaluator_loading_the_newest_follows_retention(
    four: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _root_at_step_1(four, tmp_path, monkeypatch, "_dcp_load")
    loaded = Checkpointer(root).load()  # an evaluator: no group, no step
    state_checks.assert_same(loaded, torch.load(four / "full.pt", weights_only=True))


@pytest.mark.timeout(300)
def test_a_version_retired_before_its_commit_is_read_is_followed(
    four: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The evaluator picks step 1; retention retires it before its COMMIT is read: the load
    # moves to the newest version, which is sharded (a single-file read would refuse it).
    from asyncckpt._versions.reading import RootReader

    root, stash = tmp_path / "ckpt", tmp_path / "stash"
    shutil.copytree(four / "ckpt", root)
    (root / "2").rename(stash)
    hook = _retire_on_first_call(root, stash, RootReader.commit_of)
    monkeypatch.setattr(RootReader, "commit_of", hook)
    loaded = Checkpointer(root).load()
    assert Checkpointer(root).versions() == [2]
    state_checks.assert_same(loaded, torch.load(four / "full.pt", weights_only=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("at", _RETIRE_AT)
def test_an_explicit_sharded_step_deleted_while_loading_is_an_error(
    four: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    root = _root_at_step_1(four, tmp_path, monkeypatch, at)
    with pytest.raises(IncompleteCheckpointError, match=f"step 1 under {root} was deleted"):
        Checkpointer(root).load(1)
    assert Checkpointer(root).versions() == [2]


@pytest.mark.timeout(300)
def test_a_damaged_version_is_not_mistaken_for_a_retired_one(four: Path, tmp_path: Path) -> None:
    shutil.copytree(four / "ckpt", tmp_path / "ckpt")
    _rank_files(tmp_path / "ckpt" / "1")[2].unlink()  # COMMIT stays: not retention's work
    ckpt = Checkpointer(tmp_path / "ckpt")
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        _load(ckpt, 1, follow_latest=True)


# --------------------------------------------------------------------------- a rank never starts


def _rank_dies_before_its_first_beat(rank: int, world: int, workdir: Path, how: str) -> None:
    import asyncckpt._versions.ranks

    os.environ["ASYNCCKPT_LEASE_RENEW_MS"] = "100"
    os.environ["ASYNCCKPT_LEASE_EXPIRY_MS"] = "2000"
    root = workdir / "ckpt"
    ckpt = Checkpointer(root)
    model, optim = ranks.fsdp_model(seed=0)
    ckpt.save(1, _state(model, optim, 1.0, rank)).result(timeout=120)
    dist.barrier()  # step 1 is committed on every rank's view
    state = _state(model, optim, 2.0, rank)  # collective (the replicated DTensors)
    if rank == 1 and how == "before-save":
        os.kill(os.getpid(), signal.SIGKILL)  # dies in training: never calls save(2)
    if rank == 1 and how == "before-beat":

        def die(*args: Any, **kwargs: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)  # in save(), before any marker

        asyncckpt._versions.ranks.RankJob.start_beat = die  # type: ignore[method-assign]
    handle = ckpt.save(2, state)
    if rank == 0:
        # Well before the group's timeout (120 s): lease_expiry_ms after the writer started.
        with pytest.raises(CheckpointTimeoutError, match=r"step 2 .*: rank 1 "):
            handle.result(timeout=60)
        assert (root / "2" / "FAILED").exists()
    else:
        handle.result(timeout=120)
        with pytest.raises(IncompleteCheckpointError, match="failed"):
            ckpt.load(2, collective=False, timeout=120)
    assert read_commit(*_root(workdir), 2) is None
    assert ckpt.latest() == 1 == Checkpointer(root, read_only=True).latest()
    Path(workdir, f"rank{rank}.done").touch()
    os._exit(0)  # the group's peer is dead: skip its orderly teardown


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["before-save", "before-beat"])
def test_a_rank_dead_before_its_first_marker_fails_the_save_after_lease_expiry(
    tmp_path: Path, how: str
) -> None:
    run_ranks("_rank_dies_before_its_first_beat", 3, tmp_path, how, killed=(1,))
    assert (tmp_path / "rank0.done").exists() and (tmp_path / "rank2.done").exists()
    assert Checkpointer(tmp_path / "ckpt").latest() == 1


def _writer_job(tmp_path: Path, world: int) -> Any:
    """The writer rank's (rank 0's) job of step 5, its own completion record written."""
    from asyncckpt._storage import resolve
    from asyncckpt._versions.rank_records import DONE
    from asyncckpt._versions.ranks import RankJob

    storage, root = resolve(str(tmp_path), None)
    job = RankJob(storage, root, 5, _ATTEMPT, 0, world, None, [], None, Settings.resolve())  # type: ignore[arg-type]
    _write_done(job, 0)
    assert job.path(DONE).endswith("r00000-" + _ATTEMPT + DONE)
    return job


def _write_done(job: Any, rank: int) -> None:
    from asyncckpt._versions.protocol import data_file_name
    from asyncckpt._versions.rank_records import DONE

    marker = RankDone(rank, data_file_name(rank, _ATTEMPT), 0, ())
    job.storage.write_bytes(job.path(DONE, rank), marker.encode(job.step, _ATTEMPT))


def test_the_writer_gives_up_on_a_rank_that_never_writes_a_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncckpt._versions.ranks import await_ranks

    monkeypatch.setenv("ASYNCCKPT_LEASE_RENEW_MS", "50")
    monkeypatch.setenv("ASYNCCKPT_LEASE_EXPIRY_MS", "500")
    job = _writer_job(tmp_path, 2)
    with fake_clock() as clock:
        start = clock.now()
        with pytest.raises(CheckpointTimeoutError, match=r"step 5 .*: rank 1 ") as info:
            await_ranks(job, timeout=120)
        assert clock.now() - start == pytest.approx(0.5)  # lease_expiry_ms, not the timeout
    assert "group" not in str(info.value)


def test_a_rank_slow_to_start_is_not_declared_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncckpt._versions.ranks import RankJob, await_ranks

    monkeypatch.setenv("ASYNCCKPT_LEASE_RENEW_MS", "50")
    monkeypatch.setenv("ASYNCCKPT_LEASE_EXPIRY_MS", "1500")
    job = _writer_job(tmp_path, 2)
    with fake_clock() as clock:
        start = clock.now()
        rank1 = RankJob(
            job.storage, job.root, 5, _ATTEMPT, 1, 2, None, [], None, Settings.resolve()
        )  # type: ignore[arg-type]

        def rank1_done() -> None:
            assert rank1.beat is not None
            rank1.beat.stop()
            _write_done(job, 1)

        # Starts late, then writes for longer than lease_expiry_ms.
        clock.at(start + 0.3, rank1.start_beat)
        clock.at(start + 3.8, rank1_done)
        assert sorted(await_ranks(job, timeout=120)) == [0, 1]
        assert clock.now() >= start + 3.8


# --------------------------------------------------------------------------- S3


def _save_then_load_on(rank: int, world: int, workdir: Path, root: str, options: Any) -> None:
    """Save steps 1 and 2 under ``root`` (with ``storage_options``), load step 2 back."""
    ckpt = Checkpointer(root, storage_options=options, keep_last=1)
    model, optim = ranks.fsdp_model(seed=0)
    ranks.train(model, optim, 2)
    ckpt.save(1, _state(model, optim, 1.0, rank)).result(timeout=120)
    ranks.train(model, optim, 1)
    state = _state(model, optim, 2.0, rank)
    want = state_checks.cloned(state)
    full = _full(model, optim, state)
    if rank == 0:
        torch.save({**full, "plain": want["plain"]}, workdir / "full.pt")
    ckpt.save(2, state).result(timeout=120)
    ranks.train(model, optim, 1)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    loaded, model2, optim2 = _load_into_fresh(ckpt, rank)
    msd, osd = get_state_dict(model2, optim2)
    got = {"model": msd, "optim": osd, "dist": loaded["dist"], "plain": loaded["plain"]}
    state_checks.assert_same(got, want)
    ckpt.close()  # the writer applies keep_last=1 again: step 1 goes
    dist.barrier()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_round_trip_on_s3(tmp_path: Path, s3_root: str, s3_server: Any) -> None:
    options = s3_server.storage_options
    run_ranks("_save_then_load_on", 2, tmp_path, s3_root, options)
    ckpt = Checkpointer(s3_root, storage_options=options, read_only=True)
    assert ckpt.versions() == [2]
    commit = ckpt._reader.commit_of(2)
    assert commit is not None and commit.kind == SHARDED and len(commit.files) == 3
    loaded = ckpt.load()  # one process, no group: the consolidated state
    state_checks.assert_same(loaded, torch.load(tmp_path / "full.pt", weights_only=True))
    from asyncckpt._storage import resolve

    storage, path = resolve(f"{s3_root}/2", options)
    names = storage.list_dir(path)
    assert not [n for n in names if n.endswith((".beat", ".failed"))], names
    assert len([n for n in names if n.endswith(".done")]) == 2, names
