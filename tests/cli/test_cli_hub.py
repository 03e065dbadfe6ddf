"""``asyncckpt convert ROOT@STEP OUT_DIR --key model --shard-size SIZE``: sharded
safetensors and ``model.safetensors.index.json``, the layout ``from_pretrained`` reads.

The output is read back by ``transformers``' own sharded-checkpoint loader
(``load_sharded_checkpoint``) into a fresh model, and file by file with ``safetensors``;
every tensor equals the saved one. A sharded source (an ``asyncckpt.dcp`` directory) is
written the same way, one tensor at a time.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

from asyncckpt import Checkpointer, cli
from asyncckpt.dcp import Writer

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is")]


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 8))
    net[3].weight = net[2].weight  # type: ignore[index,assignment]  (tied weights)
    return net


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def read_back(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(folder / name))
    return index, tensors


def test_export_for_the_hub_from_a_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    net = model()
    state = {"model": net.state_dict(), "step": 3}
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(3, state)
    out = tmp_path / "export" / "hub"  # neither folder exists yet
    code, _, err = run(
        capsys, "convert", f"{tmp_path / 'run'}@3", out, "--key", "model", "--shard-size", "1KiB"
    )
    assert code == 0, err
    index, tensors = read_back(out)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    stored = {k: v for k, v in net.state_dict().items() if k != "3.weight"}  # tied: once
    assert set(index["weight_map"]) == set(stored) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in stored.values())
    assert all(torch.equal(tensors[k], v) for k, v in stored.items())

    pytest.importorskip("transformers")
    # Where the loader lives moved between transformers versions.
    try:
        from transformers.trainer_utils import load_sharded_checkpoint
    except ImportError:
        from transformers.modeling_utils import load_sharded_checkpoint
    fresh = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 8))
    fresh[3].weight = fresh[2].weight  # type: ignore[index,assignment]
    load_sharded_checkpoint(fresh, str(out), strict=False)
    for key, value in net.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_export_for_the_hub_from_a_dcp_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(1)
    weights = {f"layer{i}.weight": torch.randn(8, 8) for i in range(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": weights}, storage_writer=Writer(str(tmp_path / "dcpdir")))
    out = tmp_path / "hub"
    args = ["convert", tmp_path / "dcpdir", out, "--key", "model", "--shard-size", "300"]
    code, _, err = run(capsys, *args)
    assert code == 0, err
    index, tensors = read_back(out)
    assert len(set(index["weight_map"].values())) == 4  # 256 bytes each: two would be 512 > 300
    assert all(torch.equal(tensors[k], v) for k, v in weights.items())


def test_shard_size_writes_safetensors_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    code, _, err = run(
        capsys,
        "convert",
        tmp_path / "m.pt",
        tmp_path / "o",
        "--to",
        "torch",
        "--shard-size",
        "1KiB",
    )
    assert code == 2 and "safetensors" in err
