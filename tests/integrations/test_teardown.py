"""Interpreter teardown of a distributed job: every rank of a script that saves, loads,
calls ``destroy_process_group()`` and ends normally exits with status 0.

``tests/ranks.py`` ends its ranks with ``os._exit(0)`` and so never sees a teardown; here
each rank is a plain ``python`` process running a script to its end, several jobs at once
(the abort this guards against needs a loaded machine: a gloo worker thread preempted right
after the job's last collective, which then drops that collective's tensors while the
interpreter finalizes; see ``workers.wait_torch_threads_quiet``).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from asyncckpt import _threads as workers
from asyncckpt._api import sharded_save as sharded

REPO = Path(__file__).resolve().parents[2]
WORLD = 3
JOBS = 4  # at once: the load that makes the race likely
ROUNDS = 2

#: One rank of a job: FSDP2 over gloo, a sharded Checkpointer save, its collective load
#: (DCP through asyncckpt.dcp.Reader), dcp.load with asyncckpt.dcp.Reader, then
#: destroy_process_group() and the end of the script: no os._exit anywhere.
_RANK = """
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import asyncckpt
import asyncckpt.dcp

port, rank, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
wait = timedelta(seconds=120)
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=wait)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
mesh = init_device_mesh("cpu", (WORLD,))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optim = torch.optim.Adam(model.parameters(), lr=1e-3)
model(torch.randn(8, 16)).square().sum().backward()
optim.step()


def state():
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "step": 1}


ckpt = asyncckpt.Checkpointer(root, keep_last=2)
ckpt.save(1, state())
ckpt.wait()
loaded = ckpt.load(into=state())
assert loaded["step"] == 1
ckpt.close()
fresh = state()
dcp.load({"model": fresh["model"]}, storage_reader=asyncckpt.dcp.Reader(root + "/1"))
dist.destroy_process_group()
print("rank", rank, "done", flush=True)
"""


def _start_job(tmp_path: Path, job: int) -> tuple[Any, list[subprocess.Popen[str]]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    # One script per job: a rank starting while the next job rewrites a shared script
    # could read it truncated, run nothing and exit 0, leaving its peers to time out.
    script = tmp_path / f"rank{job}.py"
    script.write_text(textwrap.dedent(_RANK).replace("WORLD", str(WORLD)))
    store = dist.TCPStore(
        "127.0.0.1", 0, WORLD + 1, True, timedelta(seconds=120), wait_for_workers=False
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo"}
    root = str(tmp_path / f"job{job}")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(store.port), str(rank), root],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    return store, procs


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
def test_every_rank_of_a_job_that_ends_normally_exits_with_status_0(tmp_path: Path) -> None:
    outcomes = []
    for round_ in range(ROUNDS):
        jobs = [_start_job(tmp_path / f"r{round_}", job) for job in range(JOBS)]
        deadline = time.monotonic() + 400
        for store, procs in jobs:
            for rank, proc in enumerate(procs):
                try:
                    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, _ = proc.communicate()
                outcomes.append((round_, rank, proc.returncode, out[-1500:]))
            del store
    failed = [o for o in outcomes if o[2] != 0 or "done" not in o[3]]
    assert not failed, "\n".join(f"round {r} rank {k}: exit {c}\n{out}" for r, k, c, out in failed)


# --------------------------------------------------------------------------- the causes


class _Mesh:
    """Stands for a DeviceMesh (which holds its ProcessGroups)."""


class _FakeDTensor:
    def __init__(self, mesh: _Mesh) -> None:
        self.device_mesh, self.placements, self.shape = mesh, ("Shard(0)",), (4, 2)
        self.computed = 0

    def __create_chunk_list__(self) -> list[Any]:
        self.computed += 1
        return [object()]


def test_the_chunk_cache_does_not_keep_a_mesh_and_its_groups_alive() -> None:
    mesh = _Mesh()
    dt = _FakeDTensor(mesh)
    first = sharded._chunks(dt)
    assert sharded._chunks(dt) is first and dt.computed == 1  # still a cache
    alive = weakref.ref(mesh)
    del dt, mesh
    gc.collect()
    assert alive() is None


def test_waiting_for_torch_threads_returns_at_once_without_them() -> None:
    assert workers._torch_worker_threads() == []  # this test process has no gloo group
    assert workers.wait_torch_threads_quiet(0.0)
