"""GPU benchmark: the stall, time to durable and loads of a state that lives on a CUDA device.

Runs only where CUDA is available (``scripts/gpu_check.sh`` runs it); elsewhere it prints a
message and exits 0. ``--device cpu`` runs every code path on the CPU instead, with tiny
sizes, to check the script itself on machines without a GPU (its figures mean nothing).

For each dtype (``--dtypes fp32 bf16``) a model-like state of ``--size-mib`` is made on the
device and, every repeat, measured in one process:

Stall (the time the training loop is held), against the *floor*: ``non_blocking`` copies
of every tensor into pinned host buffers allocated once, then a synchronize.

* ``asyncckpt.save`` (default mode: returns when the copies have landed);
* ``Checkpointer(overlap=True)`` with ``protect(optimizer)``: ``save`` returns once the
  copies are queued; a GPU workload as long as the floor copy (matmuls) runs, then
  ``optimizer.step()`` waits for the copies. Its stall is the extra time of that step over
  the same step without a save (``step_extra_s``); ``blocked_s`` is the return time;
* torch DCP ``async_save``: default, with a reused pinned stager, and with asynchronous
  staging (blocked = until staging completed: before that the state must not change);
* ``torch.save`` + fsync (blocks for everything).

Time to durable for each (fsynced files), against ``torch.save`` + fsync.

Loads (files in the page cache) onto the device, against
``torch.load(map_location="cuda:0", weights_only=True)``: ``asyncckpt.load(map_location=
"cuda:0")`` of the default and the uncompressed file, ``asyncckpt.load(into=...)`` into
existing device tensors, and DCP ``load`` in place.

Then (issue 22) a training loop on the device (an MLP + Adam, ``--train``): its extra wall
time with ``Checkpointer`` (defaults), ``torch.save`` + fsync and DCP ``async_save``; and the
caller's pure-Python speed while a save of a ``--speed-mib`` device state writes. The JSON's
``summary`` holds the figures the benchmarks page shows, with their targets.

Every timing is bracketed by ``torch.cuda.synchronize()``. ``asyncckpt.save`` runs with its
defaults unless a row names a compression.

Usage::

    python benchmarks/bench_gpu.py [--size-mib 1024] [--dtypes fp32 bf16] [--repeats 3]
        [--quick] [--device cuda|cpu] [--out DIR] [--tmp-dir DIR]

Writes ``bench_gpu.json`` and ``bench_gpu.png`` under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    MIB,
    Trainer,
    count_while,
    fsync_tree,
    idle_rate,
    loadavg,
    machine_info,
    pyplot,
    remove,
    savefig,
    settle,
    torch_save_fsync,
    write_json,
)
from common import state_bytes as nbytes_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STALL_METHODS = {
    "floor": "non_blocking copy into preallocated pinned buffers",
    "asyncckpt": "asyncckpt.save (defaults)",
    "asyncckpt_none": "asyncckpt.save (none)",
    "asyncckpt_overlap": "Checkpointer(overlap=True) + protect",
    "dcp_async_save": "DCP async_save",
    "dcp_async_save_pinned": "DCP async_save, reused pinned stager",
    "dcp_async_save_async_staging": "DCP async_save, async staging",
    "torch_save": "torch.save + fsync",
}
LOAD_METHODS = {
    "torch_load": 'torch.load(map_location="cuda")',
    "asyncckpt_load": 'asyncckpt.load(map_location="cuda"), defaults',
    "asyncckpt_load_none": 'asyncckpt.load(map_location="cuda"), none',
    "asyncckpt_load_into": "asyncckpt.load(into=device tensors), defaults",
    "dcp_load": "DCP load, in place",
}


# ----------------------------------------------------------------------------- helpers


class Device:
    """The device under test; synchronize() is a no-op on the CPU."""

    def __init__(self, name: str) -> None:
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @property
    def location(self) -> str:
        """What loads map to: ``"cuda:0"`` (the device itself), or ``"cpu"``."""
        return str(self.device) if self.cuda else "cpu"


def make_state(size_bytes: int, dtype: torch.dtype, dev: Device) -> dict[str, torch.Tensor]:
    """About ``size_bytes`` on the device: 6 large matrices (85 %) and a few hundred small
    tensors, N(0, 1) values generated on the device."""
    gen = torch.Generator(device=dev.device).manual_seed(0)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    total = max(1, size_bytes // itemsize)
    big = int(total * 0.85) // 6
    side = max(1, int(math.sqrt(big)))
    shapes = [(f"layers.{i}.weight", (side, max(1, big // side))) for i in range(6)]
    left = total - sum(math.prod(s) for _, s in shapes)
    n_small = max(8, min(300, left // 4096))
    shapes += [(f"blocks.{i}.param", (max(1, left // n_small),)) for i in range(n_small)]
    state = {}
    for name, shape in shapes:
        t = torch.randn(shape, generator=gen, device=dev.device, dtype=torch.float32)
        state[name] = t.to(dtype)
    dev.sync()
    return state


def equal_states(a: Any, b: dict[str, torch.Tensor]) -> bool:
    return isinstance(a, dict) and all(
        k in a and a[k].device.type == v.device.type and torch.equal(a[k], v) for k, v in b.items()
    )


class Recorder:
    def __init__(self) -> None:
        self.raw: dict[str, dict[str, list[float]]] = {}
        self.errors: dict[str, str] = {}

    def add(self, method: str, **metrics: float) -> None:
        for k, v in metrics.items():
            self.raw.setdefault(method, {}).setdefault(k, []).append(v)

    def attempt(self, method: str, fn: Callable[[], None]) -> None:
        if method in self.errors:
            return
        try:
            fn()
        except Exception as exc:
            self.errors[method] = f"{type(exc).__name__}: {exc}"
            print(f"  ! {method} failed: {self.errors[method]}", file=sys.stderr)
            traceback.print_exc()


# ----------------------------------------------------------------------------- one dtype


def bench_dtype(dtype_name: str, args: argparse.Namespace, dev: Device, tmp: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    import asyncckpt

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*experimental.*")
    dtype = DTYPES[dtype_name]
    state = make_state(int(args.size_mib * MIB), dtype, dev)
    nbytes = nbytes_of(state)
    print(f"{dtype_name}: {len(state)} tensors, {nbytes / MIB:.0f} MiB on {dev.device}", flush=True)
    rec = Recorder()

    def p(name: str) -> str:
        return os.path.join(tmp, f"{dtype_name}-{name}")

    # the floor: pinned buffers allocated once, non_blocking copies, one synchronize
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=dev.cuda) for k, v in state.items()}

    def floor() -> float:
        dev.sync()
        t = time.perf_counter()
        for k, v in state.items():
            pinned[k].copy_(v, non_blocking=True)
        dev.sync()
        return time.perf_counter() - t

    floor()  # fault the pinned pages in

    # the training-step stand-in for overlap: matmuls about as long as the floor copy, then
    # an optimizer step over the state's tensors (SGD with zero gradients: values unchanged)
    params = [torch.nn.Parameter(t, requires_grad=False) for t in state.values()]
    for prm in params:
        prm.grad = torch.zeros_like(prm)
    opt = torch.optim.SGD(params, lr=0.0, foreach=True)
    side = 4096 if dev.cuda else 128
    a = torch.randn(side, side, device=dev.device, dtype=torch.bfloat16 if dev.cuda else dtype)

    def matmuls(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a)

    dev.sync()
    matmuls(3)
    dev.sync()
    t = time.perf_counter()
    matmuls(10)
    dev.sync()
    mm_s = (time.perf_counter() - t) / 10
    n_mm = max(1, math.ceil(statistics.median([floor() for _ in range(3)]) / max(mm_s, 1e-6)))

    def train_step(save: Callable[[], Any] | None) -> tuple[float, float, Any]:
        """(seconds until save returned, seconds for the whole step, save's result)."""
        dev.sync()
        t0 = time.perf_counter()
        out = save() if save is not None else None
        returned = time.perf_counter() - t0
        matmuls(n_mm)
        opt.step()
        dev.sync()
        return returned, time.perf_counter() - t0, out

    ckpt = asyncckpt.Checkpointer(p("overlap-root"), keep_last=1, overlap=True)
    hook = ckpt.protect(opt)
    ckpt_step = [0]

    def save_overlap() -> Any:
        ckpt_step[0] += 1
        return ckpt.save(ckpt_step[0], state)

    # (use_pinned_memory, use_shared_memory, use_async_staging, use_non_blocking_copy)
    stagers: dict[str, Any] = {}
    for method, async_staging in (
        ("dcp_async_save_pinned", False),
        ("dcp_async_save_async_staging", True),
    ):
        rec.attempt(
            method,
            lambda m=method, a=async_staging: stagers.__setitem__(
                m, DefaultStager(StagingOptions(dev.cuda, False, a, dev.cuda))
            ),
        )

    # ---- the save methods: each returns (blocked_s, durable_s) and leaves a file at path
    def save_asyncckpt(path: str, compression: str | None) -> tuple[float, float]:
        dev.sync()
        codec = {} if compression is None else {"compression": compression}  # None: default
        t = time.perf_counter()
        handle = asyncckpt.save(state, path, **codec)
        blocked = time.perf_counter() - t
        handle.result()
        return blocked, time.perf_counter() - t

    def save_dcp(path: str, stager_: Any, staging_future: bool) -> tuple[float, float]:
        dev.sync()
        t = time.perf_counter()
        if stager_ is None:
            fut: Any = dcp.async_save(state, checkpoint_id=path)
        else:
            fut = dcp.async_save(state, checkpoint_id=path, async_stager=stager_)
        if staging_future and hasattr(fut, "staging_completion"):
            fut.staging_completion.result()
        blocked = time.perf_counter() - t
        getattr(fut, "upload_completion", fut).result()
        return blocked, time.perf_counter() - t

    def save_torch(path: str) -> tuple[float, float]:
        dev.sync()
        t = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
        fsync_tree(path)
        dt = time.perf_counter() - t
        return dt, dt

    saves: dict[str, tuple[str, Callable[[str], tuple[float, float]]]] = {
        "asyncckpt": (p("default.ackpt"), lambda q: save_asyncckpt(q, None)),
        "asyncckpt_none": (p("none.ackpt"), lambda q: save_asyncckpt(q, "none")),
        "dcp_async_save": (p("dcp"), lambda q: save_dcp(q, None, False)),
        "dcp_async_save_pinned": (
            p("dcp-pinned"),
            lambda q: save_dcp(q, stagers["dcp_async_save_pinned"], False),
        ),
        "dcp_async_save_async_staging": (
            p("dcp-async-staging"),
            lambda q: save_dcp(q, stagers["dcp_async_save_async_staging"], True),
        ),
        "torch_save": (p("torch.pt"), save_torch),
    }
    targets = {k: torch.empty_like(v) for k, v in state.items()}

    def loads() -> dict[str, Callable[[], Any]]:
        def dcp_load() -> Any:
            dcp.load(targets, checkpoint_id=saves["dcp_async_save"][0])
            return targets

        return {
            "torch_load": lambda: torch.load(
                saves["torch_save"][0], map_location=dev.location, weights_only=True
            ),
            "asyncckpt_load": lambda: asyncckpt.load(
                saves["asyncckpt"][0], map_location=dev.location
            ),
            "asyncckpt_load_none": lambda: asyncckpt.load(
                saves["asyncckpt_none"][0], map_location=dev.location
            ),
            "asyncckpt_load_into": lambda: asyncckpt.load(saves["asyncckpt"][0], into=targets),
            "dcp_load": dcp_load,
        }

    def one_round(record: bool, verify: bool) -> None:
        gc.collect()
        for _ in range(3):
            dt = floor()
            if record:
                rec.add("floor", blocked_s=dt)
        for method, (path, fn) in saves.items():

            def go(method: str = method, path: str = path, fn: Any = fn) -> None:
                remove(path)
                blocked, durable = fn(path)
                if record:
                    rec.add(method, blocked_s=blocked, durable_s=durable)

            rec.attempt(method, go)

        def overlap() -> None:
            _, base, _ = train_step(None)
            returned, total, handle = train_step(save_overlap)
            t = time.perf_counter()
            handle.result()
            durable = total + (time.perf_counter() - t)  # from the save call
            if verify:
                got = ckpt.load(ckpt_step[0], map_location=dev.location)
                if not equal_states({k: got[k] for k in state}, state):
                    raise AssertionError("overlap: the saved state differs")
            if record:
                rec.add(
                    "asyncckpt_overlap",
                    blocked_s=returned,
                    step_extra_s=max(0.0, total - base),
                    step_base_s=base,
                    durable_s=durable,
                )

        rec.attempt("asyncckpt_overlap", overlap)

        def default_in_step() -> None:  # the same step measurement for the default mode
            _, base, _ = train_step(None)
            _, total, handle = train_step(
                lambda: asyncckpt.save(state, saves["asyncckpt"][0] + ".step")
            )
            handle.result()
            remove(saves["asyncckpt"][0] + ".step")
            if record:
                rec.add("asyncckpt", step_extra_s=max(0.0, total - base), step_base_s=base)

        rec.attempt("asyncckpt", default_in_step)

        for method, fn in loads().items():

            def load(method: str = method, fn: Any = fn) -> None:
                gc.collect()
                dev.sync()
                t = time.perf_counter()
                out = fn()
                dev.sync()
                dt = time.perf_counter() - t
                if verify and not equal_states(out, state):
                    raise AssertionError(f"{method}: loaded state differs from the saved one")
                if record:
                    rec.add(method, load_s=dt)
                del out

            needs = {"torch_load": "torch_save", "dcp_load": "dcp_async_save"}.get(method)
            if needs in rec.errors:
                continue
            rec.attempt(method, load)

    try:
        # the first asyncckpt save allocates the (pinned) arena: time it apart
        dev.sync()
        t = time.perf_counter()
        handle = asyncckpt.save(state, p("cold.ackpt"))
        cold_blocked = time.perf_counter() - t
        handle.result()
        remove(p("cold.ackpt"))
        print("  warm-up round ...", flush=True)
        one_round(record=False, verify=True)
        for i in range(args.repeats):
            print(f"  round {i + 1}/{args.repeats} ...", flush=True)
            one_round(record=True, verify=False)
    finally:
        hook.remove()
        try:
            ckpt.close()
        except Exception as exc:
            rec.errors.setdefault("asyncckpt_overlap", f"close: {exc}")
        for st in stagers.values():
            try:
                st.close()
            except Exception as exc:
                print(f"  closing a DCP stager: {exc}", file=sys.stderr)
        for path, _ in saves.values():
            remove(path)
    return summarize(rec, nbytes, len(state), cold_blocked, n_mm, mm_s, dev.location)


def summarize(
    rec: Recorder,
    nbytes: int,
    n_tensors: int,
    cold_blocked: float,
    n_mm: int,
    mm_s: float,
    location: str,
) -> dict[str, Any]:
    def med(method: str, metric: str) -> float | None:
        values = rec.raw.get(method, {}).get(metric)
        return statistics.median(values) if values else None

    floor = med("floor", "blocked_s")
    torch_durable = med("torch_save", "durable_s")
    torch_load = med("torch_load", "load_s")
    stall: dict[str, Any] = {}
    for method, label in STALL_METHODS.items():
        if method in rec.errors:
            stall[method] = {"label": label, "error": rec.errors[method]}
            continue
        e: dict[str, Any] = {"label": label, "raw": rec.raw.get(method, {})}
        for metric in ("blocked_s", "durable_s", "step_extra_s", "step_base_s"):
            v = med(method, metric)
            if v is not None:
                e[metric] = v
        if floor and "blocked_s" in e:
            e["blocked_x_floor"] = e["blocked_s"] / floor
        if floor and "step_extra_s" in e:
            e["step_extra_x_floor"] = e["step_extra_s"] / floor
        if torch_durable and "durable_s" in e:
            e["durable_x_torch_save"] = e["durable_s"] / torch_durable
            e["durable_gb_s"] = nbytes / e["durable_s"] / 1e9
        stall[method] = e
    stall["asyncckpt_cold"] = {
        "label": "asyncckpt.save, first save (arena allocated and pinned)",
        "blocked_s": cold_blocked,
        "blocked_x_floor": cold_blocked / floor if floor else None,
    }
    load: dict[str, Any] = {}
    for method, label in LOAD_METHODS.items():
        label = label.replace('"cuda"', f'"{location}"')
        if method in rec.errors:
            load[method] = {"label": label, "error": rec.errors[method]}
            continue
        s = med(method, "load_s")
        if s is None:
            load[method] = {"label": label, "error": "not run"}
            continue
        load[method] = {
            "label": label,
            "raw": rec.raw[method],
            "load_s": s,
            "load_x_torch_load": s / torch_load if torch_load else None,
            "load_gb_s": nbytes / s / 1e9,
        }
    return {
        "raw_bytes": nbytes,
        "n_tensors": n_tensors,
        "floor_s": floor,
        "floor_gb_s": nbytes / floor / 1e9 if floor else None,
        "overlap_workload": {"matmuls": n_mm, "matmul_s": mm_s},
        "stall": stall,
        "load": load,
        "errors": rec.errors,
    }


# ----------------------------------------------------------------------------- training, Python


def _dcp_async(state: Any, path: str) -> Any:
    """DCP ``async_save`` as a user calls it; returns what to wait on."""
    import torch.distributed.checkpoint as dcp

    fut: Any = dcp.async_save(state, checkpoint_id=path)
    return getattr(fut, "upload_completion", fut)


def gpu_training(args: argparse.Namespace, dev: Device, tmp: str) -> dict[str, Any]:
    """A training loop on the device: an MLP + Adam, model and optimizer saved every
    ``every`` steps by ``Checkpointer`` (defaults), ``torch.save`` + fsync, DCP async_save.

    Reported: each mode's wall time (every step and the wait for the last save; a save
    waits for the one before it), and each mode's extra wall time over no checkpointing ÷
    ``torch.save``'s.
    """
    import asyncckpt

    width, depth, steps, every, rounds = args.train
    trainer = Trainer(width, depth, 32, device=str(dev.device))
    for _ in range(3):
        trainer.step()
    dev.sync()
    ckpt = asyncckpt.Checkpointer(os.path.join(tmp, "train-ckpt"), keep_last=1)
    counter = [0]

    def save_ckpt(path: str) -> Callable[[], Any]:
        counter[0] += 1
        return ckpt.save(counter[0], trainer.state()).result

    def save_torch(path: str) -> Callable[[], Any]:
        torch_save_fsync(trainer.state(), path)
        return lambda: None

    def save_dcp(path: str) -> Callable[[], Any]:
        return _dcp_async(trainer.state(), path).result

    modes: dict[str, Callable[[str], Callable[[], Any]] | None] = {
        "none": None,
        "asyncckpt": save_ckpt,
        "torch_save": save_torch,
        "dcp_async_save": save_dcp,
    }
    for name in ("asyncckpt", "dcp_async_save"):  # arena, stager, first-call costs
        fn = modes[name]
        assert fn is not None
        fn(os.path.join(tmp, f"train-warm-{name}"))()
        remove(os.path.join(tmp, f"train-warm-{name}"))
    wall = dict.fromkeys(modes, 0.0)
    for r in range(rounds):
        for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            save, wait = modes[mode], (lambda: None)
            dev.sync()
            t0 = time.perf_counter()
            for i in range(steps):
                trainer.step()
                if save is not None and (i + 1) % every == 0:
                    wait()
                    path = os.path.join(tmp, f"train-{mode}-{(i // every) % 2}")
                    remove(path)
                    wait = save(path)
            wait()
            dev.sync()
            wall[mode] += time.perf_counter() - t0
            for k in range(2):
                remove(os.path.join(tmp, f"train-{mode}-{k}"))
    ckpt.close()
    extra = {m: wall[m] - wall["none"] for m in modes if m != "none"}
    ratio = {
        f"{m}_extra_x_torch_save": (
            extra[m] / extra["torch_save"] if extra["torch_save"] > 0 else None
        )
        for m in extra
    }
    return {
        "width": width,
        "depth": depth,
        "steps": steps,
        "every": every,
        "rounds": rounds,
        "state_bytes": trainer.state_bytes(),
        "wall_s": wall,
        **ratio,
    }


def gpu_python_speed(args: argparse.Namespace, dev: Device, tmp: str) -> dict[str, Any]:
    """The caller's pure-Python speed (÷ idle) while a save of a device state writes:
    ``asyncckpt.save`` (defaults), ``torch.save`` + fsync on a thread, DCP async_save."""
    import threading

    import asyncckpt

    state = make_state(int(args.speed_mib * MIB), torch.float32, dev)

    def ours(path: str) -> Callable[[], bool]:
        handle = asyncckpt.save(state, path)
        return lambda: not handle.done()

    def thread(path: str) -> Callable[[], bool]:
        t = threading.Thread(target=torch_save_fsync, args=(state, path))
        t.start()
        return t.is_alive

    def dcp_(path: str) -> Callable[[], bool]:
        fut = _dcp_async(state, path)
        return lambda: not fut.done()

    methods = {"asyncckpt": ours, "torch_save_thread": thread, "dcp_async_save": dcp_}
    ours(os.path.join(tmp, "speed-warm"))  # the pinned arena
    asyncckpt.wait()
    out: dict[str, Any] = {"state_bytes": nbytes_of(state)}
    for name, start in methods.items():
        path = os.path.join(tmp, f"speed-{name}")
        settle(path)
        idle = idle_rate()
        rate, window = count_while(start(path))
        asyncckpt.wait()
        out[f"{name}_x_idle"] = rate / idle
        out[f"{name}_window_s"] = window
        settle(path)
    return out


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """The GPU rows of the benchmarks page: figure, value, target (issue 22)."""
    r = (res.get("results") or {}).get("fp32") or {}
    stall = r.get("stall") or {}
    load = r.get("load") or {}
    train = res.get("training") or {}
    speed = res.get("python_speed") or {}
    return {
        "stall": {
            "text": "stall of asyncckpt.save (defaults) ÷ pinned device-to-host copy, fp32",
            "value": (stall.get("asyncckpt") or {}).get("blocked_x_floor"),
            "op": "<=",
            "target": 1.2,
        },
        "overlap": {
            "text": "Checkpointer(overlap=True): extra time of the saving step ÷ that copy",
            "value": (stall.get("asyncckpt_overlap") or {}).get("step_extra_x_floor"),
            "op": "<=",
            "target": 0.1,
        },
        "overlap_returned": {
            "text": "Checkpointer(overlap=True): time until save returns ÷ that copy",
            "value": (stall.get("asyncckpt_overlap") or {}).get("blocked_x_floor"),
            "op": None,
            "target": None,
        },
        "load": {
            "text": 'asyncckpt.load(map_location="cuda:0") ÷ torch.load(map_location="cuda:0")',
            "value": (load.get("asyncckpt_load") or {}).get("load_x_torch_load"),
            "op": None,
            "target": None,
        },
        "train": {
            "text": "GPU training loop: extra wall time with Checkpointer ÷ torch.save+fsync's",
            "value": train.get("asyncckpt_extra_x_torch_save"),
            "op": "<=",
            "target": 0.75,
        },
        "train_dcp": {
            "text": "GPU training loop: extra wall time with DCP async_save ÷ torch.save+fsync's",
            "value": train.get("dcp_async_save_extra_x_torch_save"),
            "op": None,
            "target": None,
        },
        "python_speed": {
            "text": "pure-Python speed while asyncckpt.save writes a device state ÷ idle",
            "value": speed.get("asyncckpt_x_idle"),
            "op": ">=",
            "target": 0.95,
        },
        "python_speed_torch": {
            "text": "pure-Python speed beside torch.save in a thread ÷ idle",
            "value": speed.get("torch_save_thread_x_idle"),
            "op": None,
            "target": None,
        },
    }


# ----------------------------------------------------------------------------- reporting


def print_table(res: dict[str, Any]) -> None:
    def f(v: Any, spec: str) -> str:
        w = int(spec.split(".")[0] or 0)
        return "-".rjust(w) if v is None else format(v, spec)

    for dtype, r in res["results"].items():
        print(
            f"\n{dtype}: {r['raw_bytes'] / MIB:.0f} MiB, {r['n_tensors']} tensors on "
            f"{res['config']['device']}; floor {f(r['floor_s'], '.4f')} s "
            f"({f(r['floor_gb_s'], '.1f')} GB/s)"
        )
        head = (
            f"{'save':40s} {'blocked s':>9s} {'x floor':>8s} {'step+ s':>8s} {'x floor':>8s} "
            f"{'durable s':>9s} {'x t.save':>8s}"
        )
        print(head + "\n" + "-" * len(head))
        for e in r["stall"].values():
            if "error" in e:
                print(f"{e['label']:40s} failed: {e['error'][:70]}")
                continue
            print(
                f"{e['label'][:40]:40s} {f(e.get('blocked_s'), '9.4f')} "
                f"{f(e.get('blocked_x_floor'), '8.2f')} {f(e.get('step_extra_s'), '8.4f')} "
                f"{f(e.get('step_extra_x_floor'), '8.2f')} {f(e.get('durable_s'), '9.3f')} "
                f"{f(e.get('durable_x_torch_save'), '8.2f')}"
            )
        head = f"{'load (page cache)':40s} {'seconds':>9s} {'x t.load':>8s} {'GB/s':>6s}"
        print("\n" + head + "\n" + "-" * len(head))
        for e in r["load"].values():
            if "error" in e:
                print(f"{e['label']:40s} failed: {e['error'][:70]}")
                continue
            print(
                f"{e['label'][:40]:40s} {e['load_s']:9.4f} {f(e['load_x_torch_load'], '8.2f')} "
                f"{e['load_gb_s']:6.2f}"
            )


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()

    dtypes = list(res["results"])
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(13, 4.2 * len(dtypes)), squeeze=False)
    for row, dtype in enumerate(dtypes):
        r = res["results"][dtype]
        ax = axes[row][0]
        items = [(k, e) for k, e in r["stall"].items() if "error" not in e]
        ys = list(range(len(items)))[::-1]
        h = 0.27
        series = (
            ("blocked_x_floor", "blocked × floor copy", "#d95f02", h),
            ("step_extra_x_floor", "step slowed × floor copy", "#e6ab02", 0.0),
            ("durable_x_torch_save", "durable × torch.save", "#7570b3", -h),
        )
        for key, label, color, off in series:
            vals = [max(0.01, e[key]) if e.get(key) is not None else 0.0 for _, e in items]
            ax.barh([y + off for y in ys], vals, h, label=label, color=color)
        ax.set_yticks(ys, [e["label"] for _, e in items], fontsize=8)
        ax.set_xscale("log")
        ax.axvline(1.0, color="grey", ls="--", lw=0.8)
        ax.set_title(f"{dtype}, {r['raw_bytes'] / MIB:.0f} MiB: save", fontsize=10)
        # below the axes: a long bar must never run under it
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
        ax = axes[row][1]
        items = [(k, e) for k, e in r["load"].items() if "error" not in e]
        ys = list(range(len(items)))[::-1]
        vals = [e.get("load_x_torch_load") or 0.0 for _, e in items]
        bars = ax.barh(ys, vals, 0.6, color="#1b9e77")
        for bar, (_, e) in zip(bars, items):
            ax.text(
                bar.get_width(),
                bar.get_y() + bar.get_height() / 2,
                f" {e['load_s']:.3f} s",
                va="center",
                fontsize=7,
            )
        ax.set_yticks(ys, [e["label"] for _, e in items], fontsize=8)
        ax.axvline(1.0, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("× torch.load (lower is better)")
        ax.set_title(f"{dtype}: load onto {res['config']['device']}", fontsize=10)
    fig.suptitle(f"asyncckpt on {res['machine'].get('gpu', res['config']['device'])}")
    fig.tight_layout()
    savefig(fig, path, dpi=100)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--size-mib", type=float, default=None, help="state size per dtype (default 1024)"
    )
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="256 MiB, 1 repeat")
    ap.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: exercise the script without a GPU (tiny sizes; figures meaningless)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="results directory (default benchmarks/results; with --device cpu a temp dir)",
    )
    ap.add_argument("--tmp-dir", default=None, help="where checkpoints go (default: temp)")
    ap.add_argument(
        "--train",
        type=int,
        nargs=5,
        default=None,
        metavar=("WIDTH", "DEPTH", "STEPS", "EVERY", "ROUNDS"),
        help="the GPU training loop (default 4096 4 40 8 2; --device cpu: 128 2 4 2 1)",
    )
    ap.add_argument(
        "--speed-mib", type=float, default=None, help="state of the Python-speed row (512)"
    )
    args = ap.parse_args(argv)
    if args.train is None:
        args.train = [4096, 4, 40, 8, 2] if args.device == "cuda" else [128, 2, 4, 2, 1]
    if args.speed_mib is None:
        args.speed_mib = 512.0 if args.device == "cuda" else 8.0
    if args.size_mib is None:
        args.size_mib = 256.0 if args.quick else 1024.0
    if args.quick:
        args.repeats = 1
    if args.device == "cpu":
        args.size_mib = min(args.size_mib, 16.0)
    if args.out is None:
        results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        # a CPU dry run must not pass for GPU figures beside the real results
        args.out = results if args.device == "cuda" else tempfile.mkdtemp(prefix="bench_gpu-cpu-")
    if args.repeats < 1 or args.size_mib <= 0:
        ap.error("--repeats and --size-mib must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"bench_gpu: no CUDA device (torch {torch.__version__}); nothing to measure. "
            "Run it on a GPU machine (scripts/gpu_check.sh), or with --device cpu to check "
            "the script itself."
        )
        return 0
    dev = Device(args.device)
    load_before = loadavg()
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="bench_gpu-", dir=args.tmp_dir)
    results: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    try:
        for dtype in args.dtypes:
            results[dtype] = bench_dtype(dtype, args, dev, tmp)
            gc.collect()
            if dev.cuda:
                torch.cuda.empty_cache()
        for key, part in (("training", gpu_training), ("python_speed", gpu_python_speed)):
            print(f"{key} ...", flush=True)
            try:
                extra[key] = part(args, dev, tmp)
            except Exception as exc:  # the other figures are still worth writing
                traceback.print_exc()
                extra[key] = {"error": f"{type(exc).__name__}: {exc}"}
            gc.collect()
            if dev.cuda:
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {
        "benchmark": "bench_gpu",
        "machine": {
            **machine_info(),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
            "cuda_version": torch.version.cuda,
        },
        "config": {
            "device": str(dev.device),
            "size_mib": args.size_mib,
            "dtypes": args.dtypes,
            "repeats": args.repeats,
            "quick": args.quick,
            "wall_s": round(time.perf_counter() - t0, 1),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        },
        "results": results,
        **extra,
        "notes": [
            "medians over repeats; every timing is bracketed by torch.cuda.synchronize()",
            "floor: non_blocking copies of every tensor into pinned host buffers allocated "
            "once, then a synchronize; blocked_x_floor = blocked_s / floor_s",
            "step_extra_s: a training-step stand-in (matmuls about as long as the floor "
            "copy, then optimizer.step()) with the save minus the same step without it; for "
            "Checkpointer(overlap=True) + protect this is the stall (save returns once the "
            "copies are queued; optimizer.step waits for them)",
            "DCP async staging: blocked_s runs until staging completed (before that the state "
            "must not change)",
            "durable_x_torch_save = durable_s / torch.save+fsync; loads read files from the "
            "page cache onto the device",
        ],
    }
    res["summary"] = summary(res)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench_gpu.json")
    write_json(res, json_path)
    print_table(res)
    png_path = os.path.join(args.out, "bench_gpu.png")
    try:
        plot(res, png_path)
    except Exception as exc:  # the JSON is the result
        print(f"plot failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"\nwrote {json_path} and {png_path} in {res['config']['wall_s']} s")
    errors = {d: r["errors"] for d, r in results.items() if r["errors"]}
    if errors:
        print("errors:", json.dumps(errors, indent=1), file=sys.stderr)
    failed = [k for k in extra if "error" in extra[k]]
    if failed:
        print(f"failed parts: {failed}", file=sys.stderr)
    bad = any(not k.startswith("dcp") for e in errors.values() for k in e) or failed
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
