"""The torchtitan recipe of docs/sharded.md, without torchtitan: the exact DCP calls its
``CheckpointManager.dcp_save``/``dcp_load`` make (torchtitan b5bcd76, 2026-08-21,
``torchtitan/components/checkpointer/dcp.py``), with asyncckpt's Writer and Reader passed
as the storage, on 2 gloo ranks.

torchtitan saves ``dcp.async_save(state, storage_writer=None, checkpoint_id=<folder>/step-N,
process_group=<a gloo group of its own>)`` (``async_mode="async"``) or ``dcp.save(state,
storage_writer=None, checkpoint_id=...)`` (``"disabled"``), over a state of ``Stateful``
wrappers (model, optimizer, dataloader, train state), and finds the step to resume from by
listing ``step-N`` folders that hold a ``.metadata`` file. The recipe overrides the two
methods to pass ``storage_writer=Writer(checkpoint_id)`` and
``storage_reader=Reader(checkpoint_id)``; everything else in torchtitan stays as it is.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from asyncckpt.dcp import Reader, Writer
from tests import ranks, state_checks


class ModelWrapper(Stateful):
    """torchtitan's ModelWrapper: the model's state dict, loaded with strict=False."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerWrapper(Stateful):
    """What torchtitan's OptimizersContainer saves: the optimizer state of the model."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, state_dict)


class TrainState(Stateful):
    """torchtitan's Trainer as a Stateful: ``{"step": int, "ntokens_seen": int}``."""

    def __init__(self, step: int = 0, ntokens_seen: int = 0) -> None:
        self.step, self.ntokens_seen = step, ntokens_seen

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def dcp_save(state: dict[str, Any], checkpoint_id: str, async_mode: str, pg: Any) -> Any:
    """The override of ``CheckpointManager.dcp_save`` (not the HF export path)."""
    writer = Writer(checkpoint_id)
    if async_mode == "async":
        return dcp.async_save(
            state, storage_writer=writer, checkpoint_id=checkpoint_id, process_group=pg
        )
    return dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id)


def dcp_load(state: dict[str, Any], checkpoint_id: str) -> None:
    """The override of ``CheckpointManager.dcp_load`` (not the HF import path)."""
    dcp.load(state, storage_reader=Reader(checkpoint_id), checkpoint_id=checkpoint_id)


def find_load_step(folder: Path) -> int:
    """torchtitan's ``_find_load_step``: the newest ``step-N`` holding ``.metadata``."""
    steps = [
        int(m.group(1))
        for p in folder.iterdir()
        if (m := re.search(r"step-(\d+)", p.name)) and (p / ".metadata").is_file()
    ]
    return max(steps, default=-1)


def states(seed: int, step: int) -> tuple[dict[str, Any], torch.nn.Module, Any]:
    model, optim = ranks.fsdp_model(seed=seed)
    state = {
        "model": ModelWrapper(model),
        "optimizer": OptimizerWrapper(model, optim),
        "train_state": TrainState(step, 1000 * step),
    }
    return state, model, optim


def snapshot(model: torch.nn.Module, optim: Any) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def _titan_ranks(rank: int, world: int, workdir: Path) -> None:
    folder = workdir / "checkpoint"
    pg = dist.new_group(backend="gloo")  # torchtitan's own group for async saves
    state, model, optim = states(seed=0, step=0)
    for step, mode in ((1, "disabled"), (2, "async")):
        ranks.train(model, optim, 1)
        state["train_state"].step, state["train_state"].ntokens_seen = step, 1000 * step
        want = state_checks.cloned(snapshot(model, optim))
        future = dcp_save(state, str(folder / f"step-{step}"), mode, pg)
    ranks.train(model, optim, 1)  # the staged copy, not the live parameters, is saved
    future.result()  # torchtitan waits here before its next save or at close
    dist.barrier()
    assert find_load_step(folder) == 2
    fresh, model2, optim2 = states(seed=1, step=0)
    ranks.train(model2, optim2, 1)  # Adam's state exists, with other values
    with pytest.raises(AssertionError):  # so the comparison below is not vacuous
        state_checks.assert_same(snapshot(model2, optim2), want)
    dcp_load(fresh, str(folder / f"step-{find_load_step(folder)}"))
    assert fresh["train_state"].state_dict() == {"step": 2, "ntokens_seen": 2000}
    state_checks.assert_same(snapshot(model2, optim2), want)
    dist.barrier()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchtitans_dcp_calls_with_asyncckpt_on_two_ranks(tmp_path: Path) -> None:
    ranks.run("tests.integrations.test_torchtitan_recipe", "_titan_ranks", 2, tmp_path)
    for step in (1, 2):
        names = sorted(p.name for p in (tmp_path / "checkpoint" / f"step-{step}").iterdir())
        assert ".metadata" in names and sum(n.endswith(".ackpt") for n in names) == 2, names
