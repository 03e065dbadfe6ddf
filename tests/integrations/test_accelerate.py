"""asyncckpt.accelerate: save_state/load_state of an Accelerator, one and two CPU processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

import asyncckpt
from asyncckpt.accelerate import load_state, save_state
from asyncckpt.errors import AsyncCkptError, FormatError
from tests import ranks


class Counter:
    """A custom object for register_for_checkpointing."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def _setup(seed: int) -> tuple[Accelerator, Any, Any, Any, Any, Counter]:
    """A fresh Accelerator with a model, AdamW, a scheduler, a shuffled loader, a counter."""
    acc = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    torch.manual_seed(seed)  # the same initial weights in every run and on every process
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, loader, sched, counter


def _epoch(
    acc: Accelerator, model: Any, opt: Any, loader: Any, sched: Any, counter: Counter
) -> None:
    for x, y in loader:
        # Noise from the global RNG: a resumed process must continue its own RNG stream.
        x = x + 0.1 * torch.randn_like(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.count += 1


def _final(model: Any, opt: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "opt": opt.state_dict()["state"]}


def _assert_equal_states(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for i, s in a["opt"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["opt"][i][k])), (i, k)


def _resume_equals_uninterrupted(rank: int, world: int, workdir: Path) -> None:
    """Run A: 2 epochs, saving after the first. Run B: load that version, train epoch 2."""
    if world > 1:  # accelerate reads the launcher's variables; ranks.run made the gloo group
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        os.environ.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    root = workdir / "ckpt"
    torch.manual_seed(100 + rank)  # each process's own RNG stream
    acc, model, opt, loader, sched, counter = _setup(seed=7)
    torch.manual_seed(100 + rank)
    with asyncckpt.Checkpointer(root) as ckpt:
        _epoch(acc, model, opt, loader, sched, counter)
        save_state(acc, ckpt, step=1, metrics={"loss": 0.5})
        _epoch(acc, model, opt, loader, sched, counter)
    expected, expected_count = _final(model, opt), counter.count

    acc, model, opt, loader, sched, counter = _setup(seed=8)  # other weights, other RNG
    with asyncckpt.Checkpointer(root) as ckpt:
        assert load_state(acc, ckpt) == 1
        assert counter.count == expected_count // 2
        _epoch(acc, model, opt, loader, sched, counter)
    _assert_equal_states(_final(model, opt), expected)
    assert counter.count == expected_count


@pytest.mark.timeout(300)
def test_two_processes_resume_equals_uninterrupted(tmp_path: Path) -> None:
    ranks.run(__name__, "_resume_equals_uninterrupted", 2, tmp_path, timeout=240)


@pytest.mark.timeout(120)
def test_one_process_resume_equals_uninterrupted(tmp_path: Path) -> None:
    _resume_equals_uninterrupted(0, 1, tmp_path)


@pytest.mark.timeout(120)
def test_version_holds_every_part_and_the_metrics(tmp_path: Path) -> None:
    acc, model, opt, loader, sched, counter = _setup(seed=1)
    _epoch(acc, model, opt, loader, sched, counter)
    with asyncckpt.Checkpointer(tmp_path) as ckpt:
        save_state(acc, ckpt, step=5, metrics={"loss": 0.25})
        state = ckpt.load(5)
        metrics = ckpt.info(5).metrics
    assert state["step"] == 5
    assert metrics == {"loss": 0.25}  # in the COMMIT record, not in the state
    assert "asyncckpt_metrics" not in state
    assert state["custom"] == [{"count": 8}]
    assert len(state["rng"]) == 1 and set(state["rng"][0]) >= {"python", "numpy", "cpu"}
    assert state["dataloaders"][0]["iteration"] == 1
    assert state["dataloaders"][0]["sampler"]["epoch"] == 1
    assert state["accelerator"]["iteration"] == 0
    assert acc.project_configuration.iteration == 1


@pytest.mark.timeout(120)
def test_refuses_a_version_with_other_objects(tmp_path: Path) -> None:
    acc, *_ = _setup(seed=1)
    with asyncckpt.Checkpointer(tmp_path) as ckpt:
        save_state(acc, ckpt, step=1)
        acc.register_for_checkpointing(Counter())  # now two custom objects, one saved
        with pytest.raises(FormatError, match="'custom' holds 1 entries"):
            load_state(acc, ckpt)
        ckpt.save(2, {"w": torch.ones(1)})
        with pytest.raises(FormatError, match=r"not written by asyncckpt\.accelerate"):
            load_state(acc, ckpt, step=2)


@pytest.mark.timeout(120)
def test_refuses_state_hooks(tmp_path: Path) -> None:
    acc, *_ = _setup(seed=1)
    acc.register_save_state_pre_hook(lambda models, weights, out: None)
    with asyncckpt.Checkpointer(tmp_path) as ckpt, pytest.raises(AsyncCkptError, match="hook"):
        save_state(acc, ckpt, step=1)
