"""``asyncckpt convert`` of sharded checkpoints: consolidated, streamed, bit-exact.

* A sharded ``Checkpointer`` version written by 2 FSDP2 gloo ranks (model + Adam state,
  uneven shards, per-rank plain values) converts to ``.ackpt``, ``.safetensors`` (with
  ``--key model``) and ``.pt``; every tensor equals the full state gathered on the ranks
  bit for bit, and the plain values are rank 0's.
* A directory written by ``asyncckpt.dcp.Writer`` (one process, ``no_dist=True``)
  converts the same way, DCP's bytes items included.
* Memory: while converting to ``.ackpt`` and ``.safetensors``, the bytes of live tensors
  allocated with ``torch.empty`` (the whole tensor being built and the reader's chunk
  buffers: every tensor the consolidation allocates) never exceed the largest tensor plus
  the largest chunk storage, far below the checkpoint's total.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn

import asyncckpt
import asyncckpt.dcp
from asyncckpt import Checkpointer, cli
from asyncckpt._convert.consolidate import ShardedSource, safetensors_header
from asyncckpt._engine.decode import open_file
from asyncckpt._settings import Settings
from asyncckpt._storage import resolve
from tests import ranks, state_checks

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:torch.distributed is unavailable"),
]

_LAYERS = 12
_WIDTH = 96  # 96 x 96 float32 = 36 KiB per weight; 7 Linear layers; Adam doubles it


# --------------------------------------------------------------------------- 2 ranks


def _save_sharded(rank: int, world: int, workdir: Path, root: str) -> None:
    """2 FSDP2 ranks save step 3; rank 0 keeps the full state (gathered) as the reference."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(_LAYERS):
        layers += [nn.Linear(_WIDTH, _WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(_WIDTH, 5))  # 5 rows: uneven over 2 ranks
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, _WIDTH)).square().sum().backward()
        optim.step()
        optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    torch.manual_seed(100 + rank)
    plain = {"rng": torch.get_rng_state(), "value": 10 * rank + 7}
    full_msd, full_osd = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True)
    )
    if rank == 0:
        torch.save({"model": full_msd, "optim": full_osd, "plain": plain}, workdir / "full.pt")
    ckpt = Checkpointer(root)
    ckpt.save(3, {"model": msd, "optim": osd, "plain": plain}).result(timeout=120)
    ckpt.close()
    dist.barrier()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root holding sharded step 3 of 2 FSDP2 ranks, and ``full.pt`` (the reference)."""
    workdir = tmp_path_factory.mktemp("sharded")
    ranks.run(__name__, "_save_sharded", 2, workdir, str(workdir / "ckpt"), timeout=200)
    return workdir


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> dict[str, Any]:
    code = cli.main(["--json", *[str(a) for a in args]])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


def _reference(workdir: Path) -> dict[str, Any]:
    ref: dict[str, Any] = torch.load(workdir / "full.pt", weights_only=True)
    return ref


def test_sharded_version_to_ackpt_bit_exact(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "full.ackpt"
    doc = run(capsys, "convert", f"{sharded / 'ckpt'}@3", out)
    assert doc["src_format"] == "sharded" and doc["streamed"] and doc["src_files"] == 2
    loaded = asyncckpt.load(out)
    state_checks.assert_same(loaded, _reference(sharded))  # whole tensors, rank 0's plain values
    # The same as the in-process consolidation of Checkpointer.load().
    state_checks.assert_same(loaded, Checkpointer(sharded / "ckpt", read_only=True).load(3))


def test_sharded_version_to_safetensors_bit_exact(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.safetensors"
    doc = run(capsys, "convert", sharded / "ckpt", out, "--key", "model")
    want = _reference(sharded)["model"]
    assert doc["tensors"] == len(want) and doc["dst_bytes"] == out.stat().st_size
    with safe_open(str(out), framework="pt") as f:  # the library reads what we wrote
        got = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a dict)
        assert f.metadata()["format"] == "pt"
    state_checks.assert_same(got, want)
    # asyncckpt's own reader restores the key order.
    back = run(capsys, "convert", out, tmp_path / "back.pt")
    assert back["tensors"] == len(want)
    assert list(torch.load(tmp_path / "back.pt", weights_only=True)) == list(want)


def test_sharded_version_to_torch_save_bit_exact(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "full.pt"
    doc = run(capsys, "convert", f"{sharded / 'ckpt'}@3", out)
    assert not doc["streamed"]  # torch.save pickles one object: the state is held whole
    state_checks.assert_same(torch.load(out, weights_only=True), _reference(sharded))


def test_safetensors_needs_a_flat_part(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["convert", str(sharded / "ckpt"), str(tmp_path / "x.safetensors")])
    assert code != 0
    assert "--key" in capsys.readouterr().err


class _LiveTensorBytes:
    """Counts the bytes of storages allocated by ``torch.empty`` that are still alive."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._empty = torch.empty

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        t = self._empty(*args, **kwargs)
        storage = t.untyped_storage()
        n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, n)  # fires when the last view goes
        return t

    def _freed(self, n: int) -> None:
        self.live -= n


@pytest.mark.parametrize("suffix", [".ackpt", ".safetensors"])
def test_peak_memory_is_bounded_by_the_largest_tensor(
    sharded: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    suffix: str,
) -> None:
    src = ShardedSource.open(*resolve(str(sharded / "ckpt" / "3"), None), None, Settings())
    _count, total, largest = src.raw_bytes(src.skeleton)
    stored = max(  # the largest storage of any rank file (a shard's chunk buffer)
        s.nbytes
        for path in (sharded / "ckpt" / "3").glob("r*.ackpt")
        for s in open_file(*resolve(str(path), None)).manifest.storages
    )
    counter = _LiveTensorBytes()
    monkeypatch.setattr(torch, "empty", counter)
    args = ["convert", str(sharded / "ckpt"), str(tmp_path / f"out{suffix}")]
    if suffix == ".safetensors":
        args += ["--key", "model"]
    doc = run(capsys, *args)
    monkeypatch.undo()
    assert counter.peak > 0  # the counter saw the allocations
    # A thread of asyncckpt._threads' pools keeps its last task's arguments until it takes
    # the next task: a reader thread a view of a chunk buffer, an encoder thread a view of
    # a whole tensor. So up to one of each per thread lingers besides the ones in use
    # (bounded by the thread count, never by the checkpoint).
    threads = Settings.resolve().threads
    bound = (threads + 1) * (largest + stored) + (64 << 10)  # + plain values (RNG state)
    assert counter.peak <= bound, (counter.peak, bound, largest, total)
    assert counter.peak * 4 < total, (counter.peak, total)  # not the checkpoint
    assert doc["largest_tensor_bytes"] <= largest


# --------------------------------------------------------------------------- asyncckpt.dcp


def test_dcp_writer_directory_converts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = torch.Generator().manual_seed(3)
    state = {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "b": torch.randn(32, generator=g).to(torch.bfloat16),
            "i": torch.arange(10, dtype=torch.int64),
        },
        "step": 12,  # a DCP bytes item
    }
    url = tmp_path / "dcp-ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=asyncckpt.dcp.Writer(str(url)), no_dist=True)
    doc = run(capsys, "convert", url, tmp_path / "x.ackpt")
    assert doc["src_format"] == "sharded"
    state_checks.assert_same(asyncckpt.load(tmp_path / "x.ackpt"), state)
    run(capsys, "convert", url, tmp_path / "x.safetensors", "--key", "model")
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        state_checks.assert_same({k: f.get_tensor(k) for k in f.keys()}, state["model"])  # noqa: SIM118
    run(capsys, "convert", url, tmp_path / "x.pt")
    state_checks.assert_same(torch.load(tmp_path / "x.pt", weights_only=True), state)


def test_an_uncommitted_dcp_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = tmp_path / "half"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, storage_writer=asyncckpt.dcp.Writer(str(url)), no_dist=True)
    os.remove(url / ".metadata")
    code = cli.main(["convert", str(url), str(tmp_path / "x.ackpt")])
    assert code != 0
    assert not (tmp_path / "x.ackpt").exists()


def test_safetensors_header_layout() -> None:
    head = safetensors_header(
        [("a", torch.float32, (2, 3)), ("b", torch.bfloat16, (5,))], {"format": "pt"}
    )
    n = int.from_bytes(head[:8], "little")
    doc = json.loads(head[8 : 8 + n])
    assert doc["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert doc["b"]["data_offsets"] == [24, 34]
    assert (8 + n) % 8 == 0
