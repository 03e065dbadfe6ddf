"""Demo: train a small MLP on CPU, checkpointing with asyncckpt, then with torch.save.

The same training loop runs twice from the same seed:

1. checkpointing every ``--every`` steps with ``asyncckpt.save`` (returns once the state is
   copied into reused host memory; compression and the fsynced atomic write happen on a
   background thread);
2. checkpointing at the same steps with ``torch.save`` + ``fsync`` (the loop waits for all).

It then loads the last asyncckpt checkpoint into a fresh model and optimizer, checks that
it equals the trained state (and that one more step from it matches one more step of the
original), and prints the stall each save caused next to the ``torch.save`` run. Exits
non-zero if the restored state differs.

Run from the repository root::

    .venv/bin/python examples/train.py [--steps 40] [--every 10] [--ckpt-dir checkpoints/demo]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import asyncckpt

MB = 1e6


def make_model(d_in: int, hidden: int, depth: int, d_out: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(d_in, hidden), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.GELU()]
    layers += [nn.LayerNorm(hidden), nn.Linear(hidden, d_out)]
    return nn.Sequential(*layers)


@dataclass
class RunLog:
    name: str
    stalls: list[float] = field(default_factory=list)  # seconds the loop waited per save
    durable: list[float] = field(default_factory=list)  # seconds from save call to durable
    raw_bytes: list[int] = field(default_factory=list)
    stored_bytes: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)  # training step time, saves excluded
    step_s_overlapped: list[float] = field(default_factory=list)  # ... while a save runs
    wall_s: float = 0.0
    last_path: str = ""
    last_step: int = 0
    last_rng: torch.Tensor | None = None


class Trainer:
    """Model, optimizer and a synthetic regression task, all seeded."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(args.seed)
        self.args = args
        self.model = make_model(args.d_in, args.hidden, args.depth, args.d_out)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)
        teacher_gen = torch.Generator().manual_seed(args.seed + 1)
        self.teacher = torch.randn(args.d_in, args.d_out, generator=teacher_gen) / args.d_in**0.5
        self.step = 0

    def train_step(self) -> float:
        x = torch.randn(self.args.batch, self.args.d_in)  # global RNG: part of the checkpoint
        y = torch.tanh(x @ self.teacher)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.optim.step()
        self.step += 1
        return loss.item()

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.optim.state_dict(),
            "step": self.step,
            "rng": torch.get_rng_state(),
        }


def save_steps(steps: int, every: int) -> set[int]:
    """Steps after which to checkpoint: every ``every`` steps, and always the last one."""
    return {s for s in range(every, steps + 1, every)} | {steps}


def run_async(args: argparse.Namespace, ckpt_dir: str) -> tuple[RunLog, Trainer]:
    log = RunLog("asyncckpt.save")
    trainer = Trainer(args)
    handles: list[tuple[str, asyncckpt.SaveHandle]] = []
    when = save_steps(args.steps, args.every)
    start = time.perf_counter()
    for _ in range(args.steps):
        in_flight = any(not h.done() for _, h in handles)
        t = time.perf_counter()
        loss = trainer.train_step()
        (log.step_s_overlapped if in_flight else log.step_s).append(time.perf_counter() - t)
        if trainer.step in when:
            path = os.path.join(ckpt_dir, f"step_{trainer.step:06d}.ackpt")
            t = time.perf_counter()
            handle = asyncckpt.save(trainer.state(), path)
            stall = time.perf_counter() - t
            handles.append((path, handle))
            log.last_path, log.last_step = path, trainer.step
            log.last_rng = torch.get_rng_state()
            print(f"  step {trainer.step:4d}  loss {loss:.4f}  async save stalled {stall:.3f} s")
            prune(handles, args.keep)
    asyncckpt.wait()  # every save durable (or raise)
    log.wall_s = time.perf_counter() - start
    for _, handle in handles:
        stats = handle.result().stats
        assert stats.total_s is not None and stats.stored_bytes is not None
        log.stalls.append(stats.blocking_s)
        log.durable.append(stats.total_s)
        log.raw_bytes.append(stats.raw_bytes)
        log.stored_bytes.append(stats.stored_bytes)
    prune(handles, args.keep)
    return log, trainer


def prune(handles: list[tuple[str, asyncckpt.SaveHandle]], keep: int) -> None:
    """Delete files beyond the newest ``keep``, but only once a newer save is durable."""
    newest_durable = max(
        (i for i, (_, h) in enumerate(handles) if h.done() and h.result()),  # raises if failed
        default=-1,
    )
    for i, (path, _) in enumerate(handles[: max(0, len(handles) - keep)]):
        if i < newest_durable and os.path.exists(path):
            os.remove(path)


def run_torch(args: argparse.Namespace, ckpt_dir: str) -> RunLog:
    log = RunLog("torch.save + fsync")
    trainer = Trainer(args)
    when = save_steps(args.steps, args.every)
    written: list[str] = []
    start = time.perf_counter()
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = trainer.train_step()
        log.step_s.append(time.perf_counter() - t)
        if trainer.step in when:
            path = os.path.join(ckpt_dir, f"step_{trainer.step:06d}.pt")
            t = time.perf_counter()
            state = trainer.state()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            stall = time.perf_counter() - t
            log.stalls.append(stall)
            log.durable.append(stall)
            log.raw_bytes.append(tensor_bytes(state))
            log.stored_bytes.append(os.path.getsize(path))
            written.append(path)
            print(f"  step {trainer.step:4d}  loss {loss:.4f}  torch.save stalled {stall:.3f} s")
            for old in written[: max(0, len(written) - args.keep)]:
                if os.path.exists(old):
                    os.remove(old)
    log.wall_s = time.perf_counter() - start
    return log


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def same(a: Any, b: Any, where: str = "state") -> list[str]:
    """Paths where two nested states differ (types, keys, values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if ok else [where]
    if type(a) is not type(b):
        return [f"{where} (type {type(a).__name__} vs {type(b).__name__})"]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{where} (keys)"]
        return [d for k in a for d in same(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def check_restore(args: argparse.Namespace, log: RunLog, trained: Trainer) -> list[str]:
    """Load the last checkpoint into a fresh trainer; compare, then step both once more."""
    loaded = asyncckpt.load(log.last_path)
    # a differently initialized model and optimizer, on the same task (teacher)
    fresh = Trainer(argparse.Namespace(**{**vars(args), "seed": args.seed + 100}))
    fresh.teacher = trained.teacher
    fresh.model.load_state_dict(loaded["model"])
    fresh.optim.load_state_dict(loaded["optim"])
    fresh.step = loaded["step"]
    problems = same(fresh.model.state_dict(), trained.model.state_dict(), "model")
    problems += same(fresh.optim.state_dict(), trained.optim.state_dict(), "optim")
    if loaded["step"] != trained.step:
        problems.append(f"step {loaded['step']} != {trained.step}")
    assert log.last_rng is not None
    problems += same(loaded["rng"], log.last_rng, "rng")
    if problems:
        return problems
    # Resume: one more step of each, from the same RNG state, must give identical weights.
    torch.set_rng_state(loaded["rng"])
    fresh.train_step()
    torch.set_rng_state(log.last_rng)
    trained.train_step()
    return same(fresh.model.state_dict(), trained.model.state_dict(), "model after resume step")


def report(a: RunLog, s: RunLog, n_params: int) -> None:
    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    rows: list[tuple[str, str, str]] = [
        ("saves", f"{len(a.stalls)}", f"{len(s.stalls)}"),
        ("stall per save, median", f"{med(a.stalls):.3f} s", f"{med(s.stalls):.3f} s"),
        ("stall per save, max", f"{max(a.stalls):.3f} s", f"{max(s.stalls):.3f} s"),
        ("stall, first save", f"{a.stalls[0]:.3f} s", f"{s.stalls[0]:.3f} s"),
        ("stall, all saves", f"{sum(a.stalls):.3f} s", f"{sum(s.stalls):.3f} s"),
        ("time to durable, median", f"{med(a.durable):.3f} s", f"{med(s.durable):.3f} s"),
        ("time to durable, max", f"{max(a.durable):.3f} s", f"{max(s.durable):.3f} s"),
        ("raw bytes per save", f"{a.raw_bytes[-1] / MB:.1f} MB", f"{s.raw_bytes[-1] / MB:.1f} MB"),
        (
            "stored bytes per save",
            f"{a.stored_bytes[-1] / MB:.1f} MB",
            f"{s.stored_bytes[-1] / MB:.1f} MB",
        ),
        (
            "stored / raw",
            f"{100 * a.stored_bytes[-1] / a.raw_bytes[-1]:.1f} %",
            f"{100 * s.stored_bytes[-1] / s.raw_bytes[-1]:.1f} %",
        ),
        ("train step, median (no save)", f"{med(a.step_s):.3f} s", f"{med(s.step_s):.3f} s"),
        (
            "train step, median (save in flight)",
            f"{med(a.step_s_overlapped):.3f} s" if a.step_s_overlapped else "-",
            "-",
        ),
        ("steps that overlapped a save", f"{len(a.step_s_overlapped)}", "0"),
        ("loop wall time (incl. saves)", f"{a.wall_s:.2f} s", f"{s.wall_s:.2f} s"),
    ]
    print()
    print(f"model: {n_params / 1e6:.1f} M parameters; checkpoint = model + AdamW state + RNG")
    w0 = max(len(r[0]) for r in rows)
    print(f"{'':<{w0}}  {a.name:>16}  {s.name:>20}")
    print("-" * (w0 + 40))
    for name, x, y in rows:
        print(f"{name:<{w0}}  {x:>16}  {y:>20}")
    print(
        f"\nasyncckpt stalls {med(s.stalls) / max(med(a.stalls), 1e-9):.1f}x less per save "
        "(median). The first asyncckpt save also allocates its reusable host arena. Async "
        "wall time includes waiting for the last save to be durable; the background "
        "compression and write share the CPUs with training: steps that overlap a save "
        "run slower on a small machine."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="training steps per run")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    ap.add_argument("--ckpt-dir", default=os.path.join("checkpoints", "demo"))
    ap.add_argument("--keep", type=int, default=2, help="checkpoint files kept per run")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--d-in", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=3, help="hidden-to-hidden layers")
    ap.add_argument("--d-out", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.keep < 1:
        ap.error("--steps, --every and --keep must be positive")

    async_dir = os.path.join(args.ckpt_dir, "asyncckpt")
    torch_dir = os.path.join(args.ckpt_dir, "torch_save")
    os.makedirs(async_dir, exist_ok=True)
    os.makedirs(torch_dir, exist_ok=True)

    shape = (args.d_in, args.hidden, args.depth, args.d_out)
    n_params = sum(p.numel() for p in make_model(*shape).parameters())
    print(
        f"training a {n_params / 1e6:.1f} M-parameter MLP for {args.steps} steps on "
        f"{torch.get_num_threads()} CPU threads, checkpointing every {args.every} steps"
    )
    print("run 1: asyncckpt.save ->", async_dir)
    alog, trained = run_async(args, async_dir)
    print("run 2: torch.save + fsync ->", torch_dir)
    slog = run_torch(args, torch_dir)

    n_params = sum(p.numel() for p in trained.model.parameters())
    report(alog, slog, n_params)
    problems = check_restore(args, alog, trained)
    print()
    if problems:
        print(f"RESTORE FAILED from {alog.last_path}: differs at {', '.join(problems[:10])}")
        return 1
    print(
        f"restore OK: {alog.last_path} (step {alog.last_step}) loaded into a fresh model and "
        "optimizer equals the trained state, and one more step from it matches bit for bit"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
