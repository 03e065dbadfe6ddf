"""The main demo: DDP training with asynchronous checkpoints, a crash, and a resume.

Run it plainly (``make demo`` does): ``python examples/train_ddp.py``. It launches two jobs
with ``torchrun --standalone --nproc_per_node=2``, as a cluster scheduler would:

1. the training job: a synchronous ``torch.save`` run of the loop (the usual recipe: save on
   rank 0, fsync, barrier) to measure its stall, then the same loop with
   ``asyncckpt.Checkpointer``, which is killed with SIGKILL in the middle of a save;
2. the restarted job: it resumes on every rank from the newest committed step, checks that
   the state it got is exactly what was saved, finishes training, and prints the table.

It exits non-zero if the resumed state differs from what was saved.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import asyncckpt


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt-url", default="checkpoints", help="local path or fsspec URL")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--crash-at", type=int, default=27, help="step whose save is killed")
    p.add_argument("--width", type=int, default=1536, help="hidden width of the MLP")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--phase", choices=["train", "resume"], help=argparse.SUPPRESS)
    return p.parse_args()


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 10),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def digest(state: dict[str, Any]) -> str:
    """A hash of every tensor's bytes and the step, to prove a resume is bit-exact."""
    h = hashlib.sha256(str(state["step"]).encode())
    for key, t in sorted(state["model"].items()):
        h.update(key.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for pid, s in sorted(state["optim"]["state"].items()):
        for name in ("exp_avg", "exp_avg_sq"):
            h.update(f"{pid}{name}".encode())
            h.update(s[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def stats_path(args: argparse.Namespace) -> str:
    return os.path.join("checkpoints", ".demo-stats.json")


def sync_run(args: argparse.Namespace, rank: int) -> list[float]:
    """The usual recipe: rank 0 torch.save + fsync, then a barrier; returns stalls."""
    model = DistributedDataParallel(make_model(args.width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    path = os.path.join("checkpoints", ".sync-baseline.pt")
    stalls = []
    for step in range(1, args.steps + 1):
        train_step(model, opt, step, rank)
        if step % args.every == 0:
            start = time.perf_counter()
            if rank == 0:
                with open(path, "wb") as f:
                    torch.save(state_of(model, opt, step), f)
                    f.flush()
                    os.fsync(f.fileno())
            dist.barrier()
            stalls.append(time.perf_counter() - start)
    if rank == 0:
        os.remove(path)
    return stalls


def async_run(args: argparse.Namespace, rank: int, resume: bool) -> dict[str, Any]:
    """Train with a Checkpointer; the first attempt is killed in the middle of a save."""
    model = DistributedDataParallel(make_model(args.width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    result: dict[str, Any] = {"stalls": []}
    records: list[tuple[int, str, asyncckpt.SaveHandle]] = []
    crash_step = args.crash_at // args.every * args.every
    with asyncckpt.Checkpointer(args.ckpt_url, keep_last=args.keep_last) as ckpt:
        first = 1
        if resume:
            state = ckpt.load()  # collective: every rank gets the same committed step
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            result["resumed"], first = state["step"], state["step"] + 1
            result["resumed_digest"] = digest(state_of(model, opt, state["step"]))
        for step in range(first, args.steps + 1):
            train_step(model, opt, step, rank)
            if step % args.every:
                continue
            handle = ckpt.save(step, state_of(model, opt, step))
            result["stalls"].append(handle.stats.blocking_s)
            if rank == 0:
                # Bookkeeping for the check after the resume (not part of the stall).
                records.append((step, digest(state_of(model, opt, step)), handle))
            if not resume and step == crash_step:
                if rank == 0:
                    record_saves(args, records, crashed=True)
                    print(
                        f"[demo] killing the job in the middle of the save of step {step}; "
                        "torchrun will restart it",
                        flush=True,
                    )
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
    if rank == 0:
        record_saves(args, records)
    return result


def record_saves(
    args: argparse.Namespace,
    records: list[tuple[int, str, asyncckpt.SaveHandle]],
    crashed: bool = False,
) -> None:
    """Persist what each step held and how its save went, to check the resume against."""
    stats = load_stats(args)
    stats["crashed"] = stats.get("crashed", False) or crashed
    for step, state_digest, handle in records:
        stats["digests"][str(step)] = state_digest
        if handle.done() and not handle.failed():
            info = handle.result()
            stats["async_raw"].append(info.stats.raw_bytes)
            stats["async_stored"].append(info.stats.stored_bytes)
            stats["async_durable"].append(info.stats.total_s)
    save_stats(args, stats)
    records.clear()


def load_stats(args: argparse.Namespace) -> dict[str, Any]:
    try:
        with open(stats_path(args)) as f:
            data: dict[str, Any] = json.load(f)
            return data
    except (FileNotFoundError, ValueError):
        return {"digests": {}, "async_raw": [], "async_stored": [], "async_durable": []}


def save_stats(args: argparse.Namespace, stats: dict[str, Any]) -> None:
    tmp = stats_path(args) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(stats, f)
    os.replace(tmp, stats_path(args))


def launch(phase: str) -> int:
    """Run this file as a 2-rank torchrun job in the given phase; returns its exit code."""
    argv = [a for a in sys.argv[1:] if not a.startswith("--phase")]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        __file__,
        *argv,
        f"--phase={phase}",
    ]
    print(f"[demo] launching the {phase} job: torchrun --nproc_per_node=2 ...", flush=True)
    return subprocess.run(cmd, check=False).returncode


def drive(args: argparse.Namespace) -> int:
    """Start the training job, let it crash, start it again, report."""
    if "://" not in args.ckpt_url:
        shutil.rmtree(args.ckpt_url, ignore_errors=True)
    os.makedirs("checkpoints", exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(stats_path(args))
    # A job that fails for another reason (a process group that could not connect, on a
    # busy machine) is simply launched again, up to three times, as a scheduler would.
    for _ in range(3):
        launch("train")
        if load_stats(args).get("crashed"):
            break
    else:
        print("[demo] the training job never reached the simulated crash", file=sys.stderr)
        return 1
    for _ in range(3):
        launch("resume")
        verdict = load_stats(args).get("verdict")
        if verdict is not None:
            return 0 if verdict == "identical" else 1
    print("[demo] the resumed job did not finish", file=sys.stderr)
    return 1


def main() -> int:
    args = parse_args()
    if args.phase is None:
        return drive(args)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.phase == "train":
        sync = sync_run(args, rank)
        if rank == 0:
            stats = load_stats(args)
            stats["sync_stalls"] = sync
            save_stats(args, stats)
        dist.barrier()
        async_run(args, rank, resume=False)
        return 1  # not reached: the job kills itself during a save
    result = async_run(args, rank, resume=True)
    dist.barrier()
    ok = check_and_report(args, rank, result)
    dist.destroy_process_group()
    return 0 if ok else 1


def check_and_report(args: argparse.Namespace, rank: int, result: dict[str, Any]) -> bool:
    stats = load_stats(args)
    expected = stats["digests"].get(str(result["resumed"]))
    ok = expected == result["resumed_digest"]
    print(
        f"[rank {rank}] resumed from step {result['resumed']}: "
        f"{'identical to what was saved' if ok else 'DIFFERENT from what was saved'}",
        flush=True,
    )
    dist.barrier()
    if rank != 0:
        return ok
    stats["verdict"] = "identical" if ok else "different"
    save_stats(args, stats)
    sync, stalls = stats["sync_stalls"], result["stalls"]
    raw, stored = sum(stats["async_raw"]), sum(stats["async_stored"])
    rows = [
        ("saves (async, both attempts)", f"{len(stats['async_raw'])}"),
        (
            "stall per save, torch.save+fsync+barrier",
            f"median {statistics.median(sync):.3f} s, max {max(sync):.3f} s",
        ),
        (
            "stall per save, asyncckpt",
            f"median {statistics.median(stalls):.3f} s, max {max(stalls):.3f} s",
        ),
        (
            "stall ratio (torch.save / asyncckpt)",
            f"{statistics.median(sync) / statistics.median(stalls):.1f}x",
        ),
        (
            "time to durable, asyncckpt (background)",
            f"median {statistics.median(stats['async_durable']):.3f} s",
        ),
        ("bytes written, raw -> stored", f"{raw / 2**20:.1f} MiB -> {stored / 2**20:.1f} MiB"),
        ("compression ratio (stored / raw)", f"{stored / raw:.3f}"),
        ("killed during the save of step", f"{args.crash_at // args.every * args.every}"),
        ("resumed from step (newest committed)", f"{result['resumed']}"),
        ("resumed state equals saved state", "yes" if ok else "NO"),
    ]
    width = max(len(r[0]) for r in rows)
    print("\nasyncckpt DDP demo (2 ranks, gloo, CPU)")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
