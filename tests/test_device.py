"""The device seam: each rank's own CUDA device, through the fake CUDA (no GPU needed)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt._api import collective
from asyncckpt._device import Placement, cuda
from asyncckpt.errors import AsyncCkptWarning
from tests.fake_cuda import FakeCuda


def _default_placement() -> torch.device:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AsyncCkptWarning)
        return Placement(None).device_for("cuda:0")


def test_torchrun_ranks_load_on_their_local_rank(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.devices, fake_cuda.rank = 4, 6  # node 1 of two, LOCAL_RANK names the GPU
    monkeypatch.setenv("LOCAL_RANK", "2")
    with warnings.catch_warnings():
        warnings.simplefilter("error", AsyncCkptWarning)  # nothing to guess: no warning
        assert Placement(None).device_for("cuda:0") == torch.device("cuda", 2)


def test_mp_spawn_ranks_load_on_rank_modulo_devices_with_a_warning(fake_cuda: FakeCuda) -> None:
    fake_cuda.devices, fake_cuda.rank = 4, 3  # the DDP tutorial: no set_device, no LOCAL_RANK
    with pytest.warns(AsyncCkptWarning, match="process-group rank 3"):
        assert Placement(None).device_for("cuda:0") == torch.device("cuda", 3)
    fake_cuda.rank = 5
    assert _default_placement() == torch.device("cuda", 1)


def test_an_explicit_choice_wins_over_local_rank(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.devices, fake_cuda.rank = 4, 0
    monkeypatch.setenv("LOCAL_RANK", "2")
    fake_cuda.set_device(3)
    assert _default_placement() == torch.device("cuda", 3)
    fake_cuda.set_device(0)
    fake_cuda.bound = 1  # init_process_group(device_id=cuda:1)
    assert _default_placement() == torch.device("cuda", 1)


def test_no_choice_at_all_is_the_current_device_with_a_warning(fake_cuda: FakeCuda) -> None:
    fake_cuda.devices = 4
    with pytest.warns(AsyncCkptWarning, match="current device"):
        assert Placement(None).device_for("cuda:3") == torch.device("cuda", 0)


def test_the_nccl_collective_runs_on_the_ranks_own_device(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.devices, fake_cuda.rank = 4, 2
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(collective.dist, "get_backend", lambda group=None: "nccl")
    assert collective.collective_device(None) == torch.device("cuda", 2)


def test_a_file_saved_on_cuda0_loads_on_each_ranks_own_device(
    fake_cuda: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.devices = 4
    state = {"w": fake_cuda.put(torch.arange(8.0), 0)}
    asyncckpt.save(state, tmp_path / "x.ackpt").result()
    monkeypatch.setenv("LOCAL_RANK", "3")
    loaded = asyncckpt.load(tmp_path / "x.ackpt")
    assert fake_cuda.device_of(loaded["w"]) == torch.device("cuda", 3)
    assert torch.equal(loaded["w"], torch.arange(8.0))


def test_a_map_location_callable_returning_none_keeps_the_saved_location(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    fake_cuda.devices = 4
    asyncckpt.save({"w": fake_cuda.put(torch.ones(4), 2)}, tmp_path / "x.ackpt").result()
    seen: list[Any] = []
    loaded = asyncckpt.load(tmp_path / "x.ackpt", map_location=lambda s, loc: seen.append(loc))
    assert seen == ["cuda:2"]
    assert fake_cuda.device_of(loaded["w"]) == torch.device("cuda", 2)  # as torch.load does


def test_a_cpu_only_save_and_load_never_initializes_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arena_allocations: list[int]
) -> None:
    def initialized() -> bool:
        raise AssertionError("torch.cuda.is_available() called: it initializes the driver")

    monkeypatch.setattr(torch.cuda, "is_available", initialized)
    asyncckpt.save({"w": torch.ones(4)}, tmp_path / "x.ackpt").result()
    assert torch.equal(asyncckpt.load(tmp_path / "x.ackpt")["w"], torch.ones(4))
    assert arena_allocations  # a fresh arena was allocated, without asking CUDA


def test_the_real_seam_answers_on_this_machine() -> None:
    assert cuda().device_of(torch.zeros(1)) == torch.device("cpu")


def test_a_child_forked_from_a_cuda_parent_loads_on_the_cpu_with_a_warning(
    fake_cuda: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncckpt import _device

    asyncckpt.save({"w": fake_cuda.put(torch.ones(4), 0)}, tmp_path / "x.ackpt").result()
    previous = _device.use_cuda(_device.Cuda())  # the real seam, in a "forked child"
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
        with pytest.warns(AsyncCkptWarning, match="loaded on the CPU"):
            loaded = asyncckpt.load(tmp_path / "x.ackpt")
    finally:
        _device.use_cuda(previous)
    assert loaded["w"].device.type == "cpu" and torch.equal(loaded["w"], torch.ones(4))
