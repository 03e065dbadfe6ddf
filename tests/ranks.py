"""Run a test function on several gloo ranks on loopback, failing loudly instead of hanging.

Each rank is a process that joins a ``gloo`` group through a ``TCPStore`` the parent owns
(127.0.0.1, port chosen by the OS); the group and every wait have timeouts, and the parent
kills all ranks as soon as one fails or the deadline passes, then shows every rank's
traceback. Test modules wrap :func:`run` as their own ``run_ranks``.

Ranks are forked from a ``forkserver`` that has imported torch, torch.distributed and
asyncckpt once (each ``spawn`` imported torch again: seconds of CPU per rank). A rank gets
the parent's environment and working directory as they are when it starts, as a spawned
one did (the server's own are those of the moment it started). ``pristine=True`` spawns a
fresh interpreter instead, for a test that needs one.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WAIT = timedelta(seconds=120)  # every store wait and collective in a rank


#: What every forked rank finds imported already.
_PRELOAD = ["torch", "torch.distributed", "asyncckpt", "tests.ranks"]


def _rank_main(
    target: tuple[str, str, bool],
    rank: int,
    world: int,
    port: int,
    workdir: str,
    args: Any,
    env: dict[str, str],
    cwd: str,
) -> None:
    """Entry point of one rank: join the group, run ``module.name``, report failures."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=WAIT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=WAIT)
        try:
            module, name, with_store = target
            fn = getattr(importlib.import_module(module), name)
            if with_store:
                fn(rank, world, store, Path(workdir), *args)
            else:
                fn(rank, world, Path(workdir), *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        text = traceback.format_exc()
        Path(workdir, f"rank{rank}.traceback").write_text(text)
        print(f"rank {rank} failed:\n{text}", flush=True)
        raise SystemExit(1) from None
    # The rank's work is done and checked. Skip the interpreter's teardown: a gloo or store
    # thread still alive in a C++ destructor there aborts the process now and then
    # ("terminate called without an active exception"), which says nothing about the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(
    module: str,
    name: str,
    world: int,
    workdir: Path,
    *args: Any,
    timeout: float = 200,
    killed: tuple[int, ...] = (),
    with_store: bool = False,
    pristine: bool = False,
) -> None:
    """Run ``module.name(rank, world, workdir, *args)`` on ``world`` ranks; fail on any error.

    With ``with_store`` the function also gets the ``TCPStore`` after ``world``. Ranks in
    ``killed`` must end by SIGKILL (they kill themselves on purpose). ``pristine`` starts
    each rank in a fresh interpreter (``spawn``) rather than from the preloaded server.
    """
    expected = [-signal.SIGKILL if r in killed else 0 for r in range(world)]
    for old in workdir.glob("rank*.traceback"):
        old.unlink()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, WAIT, wait_for_workers=False)
    ctx = mp.get_context("spawn" if pristine else "forkserver")
    if not pristine:
        ctx.set_forkserver_preload(_PRELOAD)
    env, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=((module, name, with_store), r, world, store.port, str(workdir), args, env, cwd),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outcome = _watch(procs, expected, timeout)
    if outcome != "ok":
        report = [f"{name}: {outcome}; exit codes {[p.exitcode for p in procs]}"]
        for r in range(world):
            tb = workdir / f"rank{r}.traceback"
            if tb.exists():
                report.append(f"--- rank {r} ---\n{tb.read_text()}")
        pytest.fail("\n".join(report), pytrace=False)
    del store


def _watch(procs: list[Any], expected: list[int], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.exitcode for p in procs]
            if codes == expected:
                return "ok"
            if any(c not in (None, e) for c, e in zip(codes, expected)):
                return "a rank failed"
            if time.monotonic() > deadline:
                return f"ranks still running after {timeout} s (hang?)"
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(30)


def fsdp_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small FSDP2 model over all ranks, and its Adam optimizer (call inside a rank).

    5 output features: the last layer's weight and bias shard unevenly over 2, 3, 4 ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` optimizer steps on random data."""
    for _ in range(steps):
        model(torch.randn(4, 8)).square().sum().backward()
        optim.step()
        optim.zero_grad()
