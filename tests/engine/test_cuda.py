"""CUDA paths: pinned arenas, side-stream copies, overlap + protect, device placement.

Skipped on machines without CUDA; ``scripts/gpu_check.sh`` runs them where there is one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt._api import dropin as api

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_arena_is_pinned_and_snapshot_is_exact(tmp_path: Path) -> None:
    state = {"w": torch.randn(1024, 1024, device="cuda"), "cpu": torch.arange(5)}
    expected = {k: v.clone() for k, v in state.items()}
    snap = api.stage(state)
    assert snap.lease.buffer.is_pinned()
    snap.lease.release()
    handle = asyncckpt.save(state, tmp_path / "x.ackpt")
    state["w"].add_(1)  # queued on the current stream after the save's copies
    state["cpu"].zero_()
    handle.result()
    loaded = asyncckpt.load(tmp_path / "x.ackpt")
    assert loaded["w"].device == torch.device("cuda", torch.cuda.current_device())
    assert torch.equal(loaded["w"], expected["w"])
    assert torch.equal(loaded["cpu"], expected["cpu"]) and loaded["cpu"].device.type == "cpu"


def test_freed_source_memory_is_not_reused_before_the_copy(tmp_path: Path) -> None:
    w = torch.randn(4096, 1024, device="cuda")
    expected = w.cpu()
    handle = asyncckpt.save({"w": w}, tmp_path / "x.ackpt")
    del w
    torch.full((4096, 1024), 7.0, device="cuda")  # would reuse the freed block
    handle.result()
    assert torch.equal(asyncckpt.load(tmp_path / "x.ackpt", map_location="cpu")["w"], expected)


def test_overlap_and_protect(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)).cuda()
    opt = torch.optim.Adam(model.parameters())
    with asyncckpt.Checkpointer(tmp_path / "run", overlap=True) as ckpt:
        ckpt.protect(opt)
        for step in range(1, 6):
            model(torch.randn(64, 512, device="cuda")).sum().backward()
            expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            ckpt.save(step, model.state_dict())
            opt.step()  # waits for the copies, then mutates
            opt.zero_grad()
            loaded = ckpt.load(step, map_location="cpu")
            for key, value in expected.items():
                assert torch.equal(loaded[key], value)


@pytest.mark.parametrize("map_location", [None, "cuda", "cuda:0", {"cuda:0": "cuda:0"}])
def test_map_location_to_cuda(tmp_path: Path, map_location: object) -> None:
    state = {"w": torch.randn(64, 64, device="cuda"), "n": torch.arange(3)}
    asyncckpt.save(state, tmp_path / "x.ackpt").result()
    loaded = asyncckpt.load(tmp_path / "x.ackpt", map_location=map_location)
    assert loaded["w"].is_cuda and torch.equal(loaded["w"], state["w"])


def test_load_into_cuda_tensors(tmp_path: Path) -> None:
    source = torch.nn.Linear(64, 64).cuda()
    asyncckpt.save(source.state_dict(), tmp_path / "m.ackpt").result()
    target = torch.nn.Linear(64, 64).cuda()
    asyncckpt.load(tmp_path / "m.ackpt", into=target.state_dict())
    assert torch.equal(target.weight, source.weight)


def test_cpu_saved_state_loads_on_cpu_by_default(tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.ones(3)}, tmp_path / "c.ackpt").result()
    assert asyncckpt.load(tmp_path / "c.ackpt")["w"].device.type == "cpu"
