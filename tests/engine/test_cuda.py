"""CUDA paths: pinned arenas, side-stream copies, overlap + protect, device placement.

Skipped on machines without CUDA; ``scripts/gpu_check.sh`` runs them where there is one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt._api import dropin as api
from asyncckpt._api import staging
from asyncckpt._engine import arena
from asyncckpt._settings import Settings

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


#: Large enough that the device-to-host copy (tens of ms on an H200) is still running when
#: the next kernel is launched, so that a missing wait shows up as a torn snapshot.
RACE_ELEMENTS = 1 << 28  # 1 GiB of float32


def _big(fill: float | None = None) -> torch.Tensor:
    if fill is None:
        return torch.randn(RACE_ELEMENTS, device="cuda")
    return torch.full((RACE_ELEMENTS,), fill, device="cuda")


def test_arena_is_pinned_and_snapshot_is_exact(tmp_path: Path) -> None:
    state = {"w": _big(), "cpu": torch.arange(5)}
    expected = {"w": state["w"].cpu(), "cpu": state["cpu"].clone()}
    snap = api.stage(state, api.write_options("none", Settings.resolve()), in_this_process=True)
    snap.wait_copied()  # a new arena is page-locked behind the save (see the test below)
    assert snap.lease.buffer.is_pinned()
    snap.lease.release()
    handle = asyncckpt.save(state, tmp_path / "x.ackpt")
    state["w"].add_(1)  # launched while a copy that save() did not wait for would still run
    state["cpu"].zero_()
    handle.result()
    loaded = asyncckpt.load(tmp_path / "x.ackpt")
    assert loaded["w"].device == torch.device("cuda", torch.cuda.current_device())
    assert torch.equal(loaded["w"].cpu(), expected["w"])
    assert torch.equal(loaded["cpu"], expected["cpu"]) and loaded["cpu"].device.type == "cpu"


def test_a_first_save_is_exact_while_its_arena_is_page_locked_behind_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staging, "_arenas", None)  # a fresh pool, as in a new process
    state = {"w": _big()}
    expected = state["w"].cpu()
    handle = asyncckpt.save(state, tmp_path / "x.ackpt")  # copied in device memory first
    state["w"].add_(1)
    del state  # freed too: the allocator must not lend its block before the copy read it
    refill = _big(7.0)
    handle.result()
    del refill
    assert torch.equal(asyncckpt.load(tmp_path / "x.ackpt", map_location="cpu")["w"], expected)
    free = staging.arena_pool(Settings())._free
    assert [arena.pinned_for(b) for b in free] == [torch.cuda.current_device()]


def test_freed_source_memory_is_not_reused_before_the_copy(tmp_path: Path) -> None:
    # overlap=True: save returns with the copy still queued; only record_stream keeps the
    # allocator from handing the freed block to the next tensor before the copy read it.
    w = _big()
    expected = w.cpu()
    with asyncckpt.Checkpointer(tmp_path / "run", overlap=True) as ckpt:
        handle = ckpt.save(1, {"w": w})
        del w
        refill = _big(7.0)  # the same size: the caching allocator's freed block, if free
        handle.result()
        loaded = ckpt.load(1, map_location="cpu")
    del refill
    assert torch.equal(loaded["w"], expected)


def test_overlap_and_protect(tmp_path: Path) -> None:
    # About 1 GiB of parameters (3 GiB with Adam's moments): Adam's first kernels are
    # launched while the copy still runs, so a protect() that waited for nothing would tear.
    model = torch.nn.Sequential(*(torch.nn.Linear(8192, 8192) for _ in range(4))).cuda()
    opt = torch.optim.Adam(model.parameters())
    with asyncckpt.Checkpointer(tmp_path / "run", overlap=True) as ckpt:
        ckpt.protect(opt)
        for step in range(1, 4):
            model(torch.randn(64, 8192, device="cuda")).sum().backward()
            expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            ckpt.save(step, model.state_dict())
            opt.step()  # the device waits for the copies, then mutates
            opt.zero_grad()
            loaded = ckpt.load(step, map_location="cpu")
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), key


def test_the_own_device_rule_with_set_device(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    asyncckpt.save({"w": torch.ones(4, device="cuda:0")}, tmp_path / "x.ackpt").result()
    previous = torch.cuda.current_device()
    torch.cuda.set_device(1)
    try:
        assert asyncckpt.load(tmp_path / "x.ackpt")["w"].device == torch.device("cuda", 1)
    finally:
        torch.cuda.set_device(previous)


def test_load_into_cuda_makes_no_second_device_copy(tmp_path: Path) -> None:
    state = {"w": _big()}
    asyncckpt.save(state, tmp_path / "x.ackpt").result()
    target = {"w": torch.zeros_like(state["w"])}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    asyncckpt.load(tmp_path / "x.ackpt", into=target)
    # No device buffer the size of the state beside the target (it was 1 GiB before).
    assert torch.cuda.max_memory_allocated() - before < state["w"].nbytes // 2
    assert torch.equal(target["w"], state["w"])


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
