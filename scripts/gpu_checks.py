"""The GPU checks of issue 28, one JSON line each, appended to ``--out`` as each ends.

Run by ``scripts/gpu_check.sh`` (which sets the interpreter and ``PYTHONPATH``); each check
is independent, so a check that fails or a timeout of the whole script loses nothing
already written. ``--device cpu`` (the script's ``DRY_RUN=1`` without a GPU) runs each
check's code on tiny CPU tensors, and skips those that need CUDA: the figures then mean
nothing, the point is that the script runs.

Checks (sizes are GiB of float32 on the device):

* ``negative_control``: a state mutated by ``optimizer.step()`` right after
  ``Checkpointer(overlap=True).save`` returns, without and with ``protect(optimizer)``:
  without, the file must show the mutation (else the control proves nothing); with, never.
* ``freed_source``: the source freed and its memory refilled right after an overlap save.
* ``stall``: the time ``asyncckpt.save`` holds the caller ÷ a pinned device-to-host copy of
  the same bytes into buffers allocated beforehand (target <= 1.2), cold (a fresh arena
  pool) and warm, at each ``--stall-gib``.
* ``first_save``: the first save of a fresh process (issue 32), each in its own interpreter:
  ``asyncckpt.save`` plain and after ``reserve``, ``Checkpointer.save``, and DCP's
  ``async_save`` as the peer; stall ÷ a pinned copy of the same bytes measured in that process
  (target <= 3).
* ``load``: ``asyncckpt.load(map_location="cuda:0")`` ÷ ``torch.load(map_location=
  "cuda:0")``; peak GPU and host memory of ``load`` and ``load(into=)``.
* ``arena_lifetime``: page-locked arenas alive and their bytes after saves of 1, 2, 1 GiB.
* ``device_assert``: a device-side assert in a child process, then ``save``: it must raise
  within 30 s (the parent gives the child 90 s).
* ``dtypes``: bf16 and float8 round trips on the device.
* ``fsdp2``: a one-rank NCCL FSDP2 sharded save and load (in a child process).

Usage::

    python scripts/gpu_checks.py --out OUT/gpu_checks.jsonl [--device cuda|cpu]
        [--stall-gib 1 16] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import torch

import asyncckpt
from asyncckpt import _threads as workers
from asyncckpt._api import staging
from asyncckpt._engine import arena
from asyncckpt._settings import Settings

GIB = 1 << 30
Check = Callable[[argparse.Namespace, Path], dict[str, Any]]
CHECKS: dict[str, Check] = {}


def check(fn: Check) -> Check:
    """Register a check under its function name."""
    CHECKS[fn.__name__] = fn
    return fn


def _elements(args: argparse.Namespace, gib: float) -> int:
    """float32 elements of ``gib`` GiB on the GPU, or of a few KiB on the CPU dry run."""
    return int(gib * GIB) // 4 if args.device == "cuda" else 4096


def _sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def _fresh_pool() -> None:
    """A new arena pool, as in a new process (the old one's arenas are dropped)."""
    staging._arenas = None
    gc.collect()


def _needs_cuda(args: argparse.Namespace) -> dict[str, Any] | None:
    return {"skipped": "needs CUDA"} if args.device != "cuda" else None


@check
def negative_control(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"gib": args.control_gib}
    for guarded in (False, True):
        x = torch.nn.Parameter(torch.randn(_elements(args, args.control_gib), device=args.device))
        x.grad = torch.ones_like(x)
        opt = torch.optim.SGD([x], lr=1.0)
        opt.step()  # its first call imports and sets up for seconds: the copy would be done
        expected = x.detach().cpu().clone()  # .cpu() of a CPU tensor is the tensor itself
        with asyncckpt.Checkpointer(tmp / f"control-{guarded}", overlap=True) as ckpt:
            if guarded:
                ckpt.protect(opt)
            ckpt.save(0, {"x": x}).result()  # the arena and the lease exist: a warm save
            if args.device == "cuda":
                # A second of GPU work queued first: the save's copy and the step below both
                # start when it ends, so they overlap however long the host takes between
                # them (with an optimizer stepped before: its first step took longer still).
                torch.cuda._sleep(2_000_000_000)
            handle = ckpt.save(1, {"x": x})
            opt.step()  # queued at once: x -= 1 while the copy may still read x
            handle.result()
            loaded = ckpt.load(1, map_location="cpu")["x"]
        out["guarded" if guarded else "unguarded"] = (
            "exact" if torch.equal(loaded, expected) else "shows the mutation"
        )
        del x, opt, loaded, expected
        gc.collect()
    # Without the guard the file must show the mutation, or the control proves nothing.
    out["control_effective"] = out["unguarded"] == "shows the mutation"
    out["ok"] = out["guarded"] == "exact" and (out["control_effective"] or args.device != "cuda")
    return out


@check
def freed_source(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    w = torch.randn(_elements(args, args.control_gib), device=args.device)
    expected = w.cpu().clone()
    with asyncckpt.Checkpointer(tmp / "freed", overlap=True) as ckpt:
        handle = ckpt.save(1, {"w": w})
        del w
        refill = torch.full_like(expected, 7.0, device=args.device)
        handle.result()
        loaded = ckpt.load(1, map_location="cpu")["w"]
    del refill
    return {"ok": bool(torch.equal(loaded, expected))}


@check
def stall(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    rows = []
    for gib in args.stall_gib:
        n = _elements(args, gib)
        state = {"w": torch.randn(n, device=args.device)}
        pinned = torch.empty(n, pin_memory=args.device == "cuda")
        _sync(args)
        t0 = time.perf_counter()
        pinned.copy_(state["w"], non_blocking=True)
        _sync(args)
        floor = time.perf_counter() - t0
        del pinned
        _fresh_pool()
        row: dict[str, Any] = {"gib": gib, "floor_s": floor}
        for kind in ("cold", "warm"):
            _sync(args)
            t0 = time.perf_counter()
            url = f"memory://gpu-check/stall-{gib}-{kind}"
            handle = asyncckpt.save(state, url, compression="none")
            blocked = time.perf_counter() - t0
            handle.result()
            fsspec.filesystem("memory").rm(url)  # host memory for the next size
            row[f"{kind}_s"] = blocked
            row[f"{kind}_ratio"] = blocked / floor if floor else None
        rows.append(row)
        del state
        _fresh_pool()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    ok = all((r["warm_ratio"] or 0) <= 1.2 for r in rows)
    return {"rows": rows, "target": "warm ratio <= 1.2", "ok": ok}


_FIRST_SAVE_CHILD = textwrap.dedent(
    """
    import json, os, sys, tempfile, time, torch, asyncckpt
    mode, gib, device = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    n = int(gib * (1 << 30)) // 4 if device == "cuda" else 4096
    state = {f"w{i}": torch.randn(n // 8, device=device) for i in range(8)}
    floor_into = {k: torch.empty(v.shape, pin_memory=device == "cuda") for k, v in state.items()}
    for k, v in state.items():  # faulted in and warm, as bench_save's floor
        floor_into[k].copy_(v, non_blocking=True)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for k, v in state.items():
        floor_into[k].copy_(v, non_blocking=True)
    if device == "cuda":
        torch.cuda.synchronize()
    floor = time.perf_counter() - t
    del floor_into
    if mode == "reserve":
        thread = asyncckpt.reserve(state)  # as a script would, once the state exists
        if thread is not None:
            thread.join()
    tmp = tempfile.mkdtemp(prefix="first-save-")
    ckpt = asyncckpt.Checkpointer(tmp) if mode == "checkpointer" else None
    if mode == "dcp_async":
        import torch.distributed.checkpoint as dcp
    t = time.perf_counter()
    if mode == "dcp_async":
        fut = dcp.async_save(state, checkpoint_id=os.path.join(tmp, "dcp"))
    elif ckpt is not None:
        fut = ckpt.save(1, state)
    else:
        fut = asyncckpt.save(state, os.path.join(tmp, "first.ackpt"))
    blocked = time.perf_counter() - t
    fut = getattr(fut, "upload_completion", fut)
    fut.result()
    if ckpt is not None:
        ckpt.close()
    print(json.dumps({"floor_s": floor, "blocked_s": blocked, "x_floor": blocked / floor}))
    """
)


@check
def first_save(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.first_save_repeats):
        for mode in ("plain", "reserve", "checkpointer", "dcp_async"):
            cmd = [sys.executable, "-c", _FIRST_SAVE_CHILD, mode, str(args.first_save_gib)]
            try:
                run = subprocess.run(
                    [*cmd, args.device], capture_output=True, text=True, timeout=60, cwd=tmp
                )
                lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
                got = (
                    json.loads(lines[-1])
                    if lines
                    else {"rc": run.returncode, "stderr": run.stderr[-800:]}
                )
            except subprocess.TimeoutExpired:
                got = {"error": "timed out at 60 s"}
            rows.setdefault(mode, []).append(got)
    medians = {
        mode: sorted(r["x_floor"] for r in runs)[len(runs) // 2]
        for mode, runs in rows.items()
        if all("x_floor" in r for r in runs)
    }
    ours = [medians.get(m) for m in ("plain", "checkpointer")]
    ok = all(x is not None and x <= 3 for x in ours)
    return {
        "gib": args.first_save_gib,
        "runs": rows,
        "median_x_floor": medians,
        "target": "plain and Checkpointer first save <= 3x the pinned copy",
        "ok": ok if args.device == "cuda" else True,
    }


def _peak_host_reset() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)


def _peak_host_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _measured(args: argparse.Namespace, fn: Callable[[], Any]) -> dict[str, Any]:
    gc.collect()
    _sync(args)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated()
    _peak_host_reset()
    base_host = _peak_host_bytes()
    t0 = time.perf_counter()
    result = fn()
    _sync(args)
    out: dict[str, Any] = {"s": time.perf_counter() - t0}
    out["host_peak_extra_bytes"] = _peak_host_bytes() - base_host
    if args.device == "cuda":
        out["gpu_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base_gpu
    del result
    return out


@check
def load(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    n = _elements(args, args.load_gib)
    state = {"w": torch.randn(n, device=args.device)}
    asyncckpt.save(state, tmp / "l.ackpt").result()
    torch.save(state, tmp / "l.pt")
    where = "cuda:0" if args.device == "cuda" else "cpu"
    out: dict[str, Any] = {"gib": args.load_gib}
    out["torch_load"] = _measured(
        args, lambda: torch.load(tmp / "l.pt", map_location=where, weights_only=True)
    )
    out["load"] = _measured(args, lambda: asyncckpt.load(tmp / "l.ackpt", map_location=where))
    target = {"w": torch.empty_like(state["w"])}
    out["load_into"] = _measured(args, lambda: asyncckpt.load(tmp / "l.ackpt", into=target))
    out["load_ratio"] = out["load"]["s"] / out["torch_load"]["s"]
    exact = torch.equal(target["w"], state["w"])
    no_second_copy = out["load_into"].get("gpu_peak_extra_bytes", 0) < state["w"].nbytes // 2
    out["ok"] = bool(exact and no_second_copy)
    return out


@check
def arena_lifetime(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    _fresh_pool()
    rows = []
    for i, gib in enumerate((1, 2, 1)):
        state = {"w": torch.randn(_elements(args, gib), device=args.device)}
        asyncckpt.save(state, tmp / f"a{i}.ackpt").result()
        del state
        workers.wait_idle(30)  # the save thread drops its arena views after the result
        gc.collect()
        pool = staging.arena_pool(Settings())
        rows.append(
            {
                "saved_gib": gib,
                "pinned_arenas": len(arena._pinned),
                "free_arena_bytes": sum(b.numel() for b in pool._free),
            }
        )
    ok = all(r["pinned_arenas"] <= staging.arena_pool(Settings()).max_inflight for r in rows)
    return {"rows": rows, "ok": ok if args.device == "cuda" else True}


_ASSERT_CHILD = textwrap.dedent(
    """
    import json, sys, time, torch, asyncckpt
    state = {"w": torch.randn(1 << 20, device="cuda")}
    trigger = "queued"
    try:  # an out-of-bounds gather: the kernel asserts on the device, after the launch
        torch.zeros(4, device="cuda")[torch.tensor([5], device="cuda")]
    except BaseException as exc:  # some torch builds report it at once
        trigger = f"raised at once: {type(exc).__name__}"
    t0 = time.perf_counter()
    try:
        asyncckpt.save(state, sys.argv[1]).result()
        outcome = "returned"
    except BaseException as exc:
        outcome = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(json.dumps({"trigger": trigger, "outcome": outcome, "s": time.perf_counter() - t0}))
    """
)


@check
def device_assert(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    if skipped := _needs_cuda(args):
        return skipped
    try:
        run = subprocess.run(
            [sys.executable, "-c", _ASSERT_CHILD, str(tmp / "assert.ackpt")],
            capture_output=True,
            text=True,
            timeout=90,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "save hung after a device-side assert (killed at 90 s)"}
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"ok": False, "rc": run.returncode, "stderr": run.stderr[-1500:]}
    got = json.loads(lines[-1])
    got["ok"] = got["outcome"] != "returned" and got["s"] <= 30
    return got


@check
def dtypes(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kinds = ["bfloat16", "float8_e4m3fn", "float8_e5m2"]
    for name in kinds:
        dtype = getattr(torch, name, None)
        if dtype is None:
            out[name] = "not in this torch"
            continue
        t = torch.randn(4096, device=args.device).to(dtype)
        try:
            asyncckpt.save({"t": t}, tmp / f"{name}.ackpt").result()
            back = asyncckpt.load(tmp / f"{name}.ackpt")["t"]
            same = back.dtype == dtype and torch.equal(
                back.view(torch.uint8).cpu(), t.view(torch.uint8).cpu()
            )
            out[name] = "exact" if same else "DIFFERS"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    out["ok"] = all(v in ("exact", "not in this torch") for v in out.values())
    return out


_FSDP_CHILD = textwrap.dedent(
    """
    import json, os, sys, torch, torch.distributed as dist, asyncckpt
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).cuda()
    fully_shard(model)
    expected = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    with asyncckpt.Checkpointer(sys.argv[1]) as ckpt:
        ckpt.save(1, {"model": model.state_dict()}).result()
        for p in model.parameters():
            p.data.zero_()
        ckpt.load(1, into={"model": model.state_dict()})
    got = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    same = all(torch.equal(got[k], expected[k]) for k in expected)
    dist.destroy_process_group()
    print(json.dumps({"exact": same}), flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@check
def fsdp2(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    if skipped := _needs_cuda(args):
        return skipped
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        run = subprocess.run(
            [sys.executable, "-c", _FSDP_CHILD, str(tmp / "fsdp")],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "timed out at 120 s"}
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"ok": False, "rc": run.returncode, "stderr": run.stderr[-1500:]}
    return {"ok": bool(json.loads(lines[-1])["exact"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the JSON-lines file to append to")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--stall-gib", type=float, nargs="+", default=[1, 16])
    ap.add_argument("--control-gib", type=float, default=2)
    ap.add_argument("--load-gib", type=float, default=1)
    ap.add_argument("--first-save-gib", type=float, default=2)
    ap.add_argument("--first-save-repeats", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, choices=list(CHECKS))
    args = ap.parse_args()
    failed = 0
    with open(args.out, "a") as out:

        def emit(record: dict[str, Any]) -> None:
            out.write(json.dumps(record, default=str) + "\n")
            out.flush()

        emit(
            {
                "check": "environment",
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                "python": sys.version.split()[0],
                "asyncckpt": asyncckpt.__version__,
            }
        )
        # Quick and decisive first, the largest (16 GiB) last: a timeout cuts the tail only.
        order = ["negative_control", "freed_source", "device_assert", "dtypes", "fsdp2"]
        order += ["first_save"]
        order += [name for name in CHECKS if name not in (*order, "stall")] + ["stall"]
        for name in order:
            fn = CHECKS[name]
            if args.only is not None and name not in args.only:
                continue
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as tmp:
                try:
                    record = fn(args, Path(tmp))
                except Exception as exc:
                    record = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                    record["traceback"] = traceback.format_exc()[-3000:]
            record = {"check": name, **record, "wall_s": time.perf_counter() - started}
            # On the CPU dry run the targets mean nothing: only a check that broke counts.
            failed += "error" in record if args.device != "cuda" else record.get("ok") is False
            emit(record)
            print(json.dumps({k: v for k, v in record.items() if k != "traceback"}), flush=True)
            _fresh_pool()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
