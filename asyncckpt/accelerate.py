"""Hugging Face ``accelerate`` integration: :func:`save_state` and :func:`load_state`.

``accelerator.save_state(dir)`` pickles the optimizer, scheduler, scaler, samplers and RNG
states synchronously, one file each, and leaves a half-written folder if the job dies. Here
the same state is one :class:`~asyncckpt.Checkpointer` version, snapshotted and written in
the background, committed atomically, and loaded with every checksum verified onto each
process's own device. Nothing is pickled on the way to storage, nor read back with pickle.

What a version holds (the top-level keys; ``FORMAT`` below is bumped on a change):

- ``models``: each prepared model's ``accelerator.get_state_dict(model, unwrap=False)``;
- ``optimizers``, ``schedulers``: their ``state_dict()``, in ``prepare`` order;
- ``scaler``: the ``GradScaler``'s state dict, or None;
- ``dataloaders``: per prepared dataloader, its epoch counter (``iteration``), its
  ``SeedableRandomSampler``'s ``epoch``/``initial_seed`` and a stateful dataloader's
  ``state_dict()``, and its sampler's ``torch.Generator`` state;
- ``custom``: each object given to ``accelerator.register_for_checkpointing``;
- ``rng``: **every** process's RNG states (python, numpy, torch CPU and each accelerator),
  indexed by process; each process restores its own;
- ``step``: the version's step; ``accelerator``: ``accelerator.step`` and the project
  configuration's save iteration.

Unlike ``Accelerator.load_state``, the dataloaders' epoch counters come back too, so a
resumed ``for batch in dataloader`` shuffles as the uninterrupted run would have.
FSDP, DeepSpeed, Megatron-LM and XLA, and models with ``register_save_state_pre_hook`` /
``register_load_state_pre_hook`` hooks, are refused (:class:`~asyncckpt.errors.AsyncCkptError`).

This module imports ``accelerate`` (``pip install 'asyncckpt[transformers]'``);
``import asyncckpt`` does not import it.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

try:
    from accelerate import Accelerator
    from accelerate.data_loader import SeedableRandomSampler
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "asyncckpt.accelerate needs the `accelerate` package: pip install 'asyncckpt[transformers]'"
    ) from exc

from asyncckpt._api.checkpointer import Checkpointer
from asyncckpt._api.jobs import SaveHandle
from asyncckpt.errors import AsyncCkptError, FormatError

__all__ = ["FORMAT", "load_state", "rng_states", "save_state", "set_rng_states"]

#: Bumped when the layout of a version changes; a newer one is refused, not misread.
FORMAT = 1
_FORMAT_KEY = "asyncckpt_accelerate"

# Where the state is sharded or owned by an engine, get_state_dict/state_dict() is not the
# whole state; saving it would produce a version that cannot resume.
_SUPPORTED = {DistributedType.NO} | {
    DistributedType[f"MULTI_{kind}"] for kind in ("CPU", "GPU", "NPU", "MLU", "MUSA", "XPU", "HPU")
}
# torch.<name> modules with get_rng_state_all/set_rng_state_all (what accelerate saves).
_DEVICE_RNGS = ("cuda", "xpu", "mlu", "musa", "npu", "hpu")


def rng_states() -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU and each available accelerator.

    Returns:
        A dict of plain data and tensors, as :func:`set_rng_states` takes it.
    """
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    for name in _DEVICE_RNGS:
        module = getattr(torch, name, None)
        if module is not None and module.is_available():
            states[name] = module.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any], where: str) -> None:
    """Restore what :func:`rng_states` returned (devices this machine lacks are skipped).

    Args:
        states: the loaded dict.
        where: the checkpoint it came from, for the error message.

    Raises:
        FormatError: ``states`` is not such a dict.
    """
    try:
        python = states["python"]
        random.setstate((python[0], tuple(python[1]), python[2]))
        numpy = states["numpy"]
        np.random.set_state((numpy[0], np.asarray(numpy[1]), *numpy[2:]))
        torch.random.set_rng_state(states["cpu"].cpu())
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise FormatError(f"{where}: the RNG states under key 'rng' are malformed: {exc}") from exc
    for name in _DEVICE_RNGS:
        module = getattr(torch, name, None)
        if name in states and module is not None and module.is_available():
            module.set_rng_state_all([s.cpu() for s in states[name]])


def gathered_rng_states() -> list[dict[str, Any]]:
    """Every process's :func:`rng_states`, by rank (a collective with a process group).

    The states travel between the job's own processes (``all_gather_object``); what is
    stored is plain data and tensors, read back without unpickling.
    """
    mine = rng_states()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def save_state(
    accelerator: Accelerator,
    checkpointer: Checkpointer,
    step: int,
    metrics: dict[str, Any] | None = None,
) -> SaveHandle:
    """Save everything ``accelerator.save_state`` saves as version ``step``, in the background.

    Call it on every process, as ``save_state``: the RNG states of all processes are
    gathered (one collective), then the writer process snapshots the state and returns while
    the version is written; the others return a completed handle.

    Args:
        accelerator: the ``Accelerator`` that prepared the models, optimizers, schedulers
            and dataloaders.
        checkpointer: where versions go (e.g. ``Checkpointer("ckpts/")``).
        step: the version's step, greater than every one saved before.
        metrics: small JSON metadata kept in the version's ``COMMIT`` record
            (``Checkpointer.save(metrics=...)``: read by ``checkpointer.info(step)``,
            ``keep_best`` and ``asyncckpt ls``), e.g. ``{"loss": 0.3}``.

    Returns:
        The :class:`~asyncckpt.SaveHandle` of the write; ``checkpointer.wait()`` waits too.

    Raises:
        AsyncCkptError: a distributed type or a save/load hook this cannot honour.
        UnsupportedObjectError: a state dict (e.g. a registered object's) holds something
            that is not plain data; the message names its key.

    Example:
        >>> import tempfile, torch, asyncckpt
        >>> from accelerate import Accelerator
        >>> from asyncckpt.accelerate import load_state, save_state
        >>> acc = Accelerator(cpu=True)
        >>> model = torch.nn.Linear(2, 2)
        >>> model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> with asyncckpt.Checkpointer(tempfile.mkdtemp()) as ckpt:
        ...     _ = save_state(acc, ckpt, step=1)
        ...     load_state(acc, ckpt)
        1
    """
    _check_supported(accelerator)
    state = {
        _FORMAT_KEY: FORMAT,
        "step": step,
        "models": [accelerator.get_state_dict(m, unwrap=False) for m in accelerator._models],
        "optimizers": [o.state_dict() for o in accelerator._optimizers],
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "scaler": None if accelerator.scaler is None else accelerator.scaler.state_dict(),
        "dataloaders": [_dataloader_state(d) for d in accelerator._dataloaders],
        "custom": [o.state_dict() for o in accelerator._custom_objects],
        "rng": gathered_rng_states(),
        "accelerator": {
            "step": int(accelerator.step),
            "iteration": int(accelerator.project_configuration.iteration),
        },
    }
    handle = checkpointer.save(step, state, metrics=metrics)
    accelerator.project_configuration.iteration += 1  # as save_state does
    return handle


def load_state(
    accelerator: Accelerator, checkpointer: Checkpointer, step: int | None = None
) -> int:
    """Restore what :func:`save_state` saved into the accelerator's prepared objects.

    Call it on every process (with a process group it is a collective load: every process
    gets the same version). Tensors are verified and placed on ``accelerator.device``; each
    process restores its own RNG states (those of process 0 if the version was saved by
    fewer processes).

    Args:
        accelerator: prepared with the same models, optimizers, schedulers, dataloaders and
            registered objects, in the same order, as the one that saved.
        checkpointer: the root the version is under.
        step: the step to load; None: the newest committed one.

    Returns:
        The step loaded.

    Raises:
        CheckpointNotFoundError: nothing is committed under the root.
        FormatError: the version was not written by :func:`save_state`, or holds a
            different number of models, optimizers, ... than the accelerator has.
        AsyncCkptError: a distributed type or a hook this cannot honour.
    """
    _check_supported(accelerator)
    # step=None is resolved by the load itself: collectively, the same on every process.
    state = checkpointer.load(step, map_location=accelerator.device)
    where = f"{checkpointer.root} step {'newest' if step is None else step}"
    _check_layout(state, accelerator, where)
    if accelerator.scaler is not None and state["scaler"] is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    for model, sd in zip(accelerator._models, state["models"]):
        model.load_state_dict(sd)
    for opt, sd in zip(accelerator._optimizers, state["optimizers"]):
        opt.load_state_dict(sd)
    for sched, sd in zip(accelerator._schedulers, state["schedulers"]):
        sched.load_state_dict(sd)
    for loader, sd in zip(accelerator._dataloaders, state["dataloaders"]):
        _load_dataloader_state(loader, sd)
    for obj, sd in zip(accelerator._custom_objects, state["custom"]):
        obj.load_state_dict(sd)
    rngs = state["rng"]
    index = accelerator.process_index
    set_rng_states(rngs[index] if index < len(rngs) else rngs[0], where)
    accelerator.step = state["accelerator"]["step"]
    return int(state["step"])


def _check_supported(accelerator: Accelerator) -> None:
    kind = accelerator.distributed_type
    if kind not in _SUPPORTED:
        raise AsyncCkptError(
            f"asyncckpt.accelerate supports replicated training (DDP or one process), not "
            f"{kind}: use accelerator.save_state for it"
        )
    if accelerator._save_model_state_pre_hook or accelerator._load_model_state_pre_hook:
        raise AsyncCkptError(
            "asyncckpt.accelerate does not run register_save_state_pre_hook / "
            "register_load_state_pre_hook hooks (they take a folder of files); remove them "
            "or use accelerator.save_state"
        )


def _dataloader_state(loader: Any) -> dict[str, Any]:
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    seeded = None
    if isinstance(sampler, SeedableRandomSampler):
        seeded = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
    stateful = loader.state_dict() if getattr(loader, "use_stateful_dataloader", False) else None
    generator = getattr(sampler, "generator", None)
    # A RandomSampler's own generator (accelerate's synchronized one) decides the next
    # epoch's order; accelerate's save_state does not keep it.
    gen_state = generator.get_state() if isinstance(generator, torch.Generator) else None
    return {
        "iteration": int(getattr(loader, "iteration", 0)),
        "sampler": seeded,
        "generator": gen_state,
        "state": stateful,
    }


def _load_dataloader_state(loader: Any, saved: dict[str, Any]) -> None:
    if hasattr(loader, "iteration"):
        loader.iteration = saved["iteration"]
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if saved["sampler"] is not None and isinstance(sampler, SeedableRandomSampler):
        sampler.epoch = saved["sampler"]["epoch"]
        sampler.initial_seed = saved["sampler"]["initial_seed"]
    generator = getattr(sampler, "generator", None)
    if saved["generator"] is not None and isinstance(generator, torch.Generator):
        generator.set_state(saved["generator"].cpu())
    if saved["state"] is not None and getattr(loader, "use_stateful_dataloader", False):
        loader.load_state_dict(saved["state"])


def _check_layout(state: Any, accelerator: Accelerator, where: str) -> None:
    if not isinstance(state, dict) or _FORMAT_KEY not in state:
        raise FormatError(f"{where} was not written by asyncckpt.accelerate.save_state")
    if state[_FORMAT_KEY] != FORMAT:
        raise FormatError(
            f"{where}: key {_FORMAT_KEY!r} is {state[_FORMAT_KEY]!r}; this asyncckpt reads "
            f"layout {FORMAT}"
        )
    counts = {
        "models": len(accelerator._models),
        "optimizers": len(accelerator._optimizers),
        "schedulers": len(accelerator._schedulers),
        "dataloaders": len(accelerator._dataloaders),
        "custom": len(accelerator._custom_objects),
    }
    for key, have in counts.items():
        if len(state[key]) != have:
            raise FormatError(
                f"{where}: key {key!r} holds {len(state[key])} entries but the accelerator "
                f"has {have}; prepare (and register) the same objects as the run that saved"
            )
