"""asyncckpt beside the checkpointers a user would pick instead, on local disk (issue 22).

Each method runs in a fresh process (``--child``) with its best documented configuration:

* ``asyncckpt``: ``asyncckpt.save`` with every default (a writer process);
  ``asyncckpt_threads``: the same with ``writer_processes=0`` (a tunable, an extra row: the
  write on threads of the calling process);
* ``dcp_async_save``: torch DCP ``async_save`` with a reused ``DefaultStager`` (shared
  memory; pinned memory, asynchronous staging and non-blocking copies where CUDA is there)
  and ``AsyncCheckpointerType.PROCESS``, the best configuration of torch 2.13;
* ``torchsnapshot``: ``Snapshot.async_take``;
* ``nvrx``: nvidia-resiliency-ext's ``AsyncCallsQueue(persistent=True)`` (the persistent
  worker Megatron uses) running ``torch.save`` on the tensors ``preload_tensors`` hands it
  (``TorchAsyncCheckpoint.async_save`` does the same and then ``torch.cuda.synchronize()``,
  which fails without CUDA);
* ``tensorizer``: ``TensorSerializer.write_state_dict`` (synchronous);
* ``torch_save_thread``: ``torch.save`` + fsync on a thread.

Per method, in its own process, against baselines measured in that process: the stall of its
first save (÷ a copy into preallocated buffers), then the warm stall, time to durable (÷
``torch.save`` + fsync; files are fsynced for every method), load time (÷ ``torch.load``),
stored bytes, the peak extra memory of the process tree (PSS: worker processes count, shared
memory once), the pure-Python speed of the caller while the write runs, the extra wall time
of the 8 x 1536² MLP training loop (÷ ``torch.save``+fsync's), and whether the save is a
*snapshot*: the state is changed right after the call returns, and the file must still hold
the values at the call. A peer that cannot be imported or fails is recorded with its error.

Usage::

    python benchmarks/bench_peers.py [--size-mib 1024] [--repeats 3] [--quick]
        [--state normal|weights] [--methods NAME ...] [--out DIR]

Writes ``bench_peers.json`` and ``bench_peers.png`` under ``--out`` (``--state weights``:
``bench_peers_weights.*``, all-MiniLM-L6-v2's weights and Adam moments tiled to the size).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    MIB,
    RESULTS,
    RssSampler,
    Trainer,
    count_while,
    disk_bytes,
    fsync_tree,
    idle_rate,
    init_single_process_group,
    loadavg,
    machine_info,
    make_state,
    pyplot,
    real_training_state,
    remove,
    savefig,
    settle,
    state_bytes,
    states_equal,
    torch_save_durable,
    torch_save_fsync,
    write_json,
)

#: What each ``--state`` is, in titles.
STATES = {"normal": "N(0,1) fp32", "weights": "MiniLM weights + Adam moments"}


#: name -> (label, the package whose version is reported, family for report.PEER_MECHANISM)
METHODS: dict[str, tuple[str, str, str]] = {
    "asyncckpt": ("asyncckpt.save (defaults)", "asyncckpt", "asyncckpt"),
    "asyncckpt_threads": (
        "asyncckpt.save, writer threads (writer_processes=0)",
        "asyncckpt",
        "asyncckpt_threads",
    ),
    "dcp_async_save": (
        "DCP async_save (reused stager, PROCESS)",
        "torch",
        "dcp_async_save",
    ),
    "torchsnapshot": ("torchsnapshot async_take", "torchsnapshot", "torchsnapshot"),
    "nvrx": ("NVRx persistent async worker", "nvidia-resiliency-ext", "nvrx"),
    "tensorizer": ("tensorizer TensorSerializer", "tensorizer", "tensorizer"),
    "torch_save_thread": ("torch.save + fsync in a thread", "torch", "torch_save_thread"),
}


class Pending:
    """A save in flight: ``done()`` without blocking, ``wait()`` until durable."""

    def __init__(self, done: Callable[[], bool], wait: Callable[[], Any]) -> None:
        self.done, self.wait = done, wait


DONE = Pending(lambda: True, lambda: None)


class Method:
    """One checkpointer: ``save(state, path) -> Pending``, ``load(path, like) -> state``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.close: Callable[[], None] = lambda: None
        getattr(self, f"_setup_{name}")()

    def save(self, state: dict[str, torch.Tensor], path: str) -> Pending:
        raise NotImplementedError

    def load(self, path: str, like: dict[str, torch.Tensor]) -> Any:
        return torch.load(path, weights_only=True)

    # -- the methods ------------------------------------------------------------------

    def _setup_asyncckpt(self) -> None:
        import asyncckpt

        def save(state: dict[str, torch.Tensor], path: str) -> Pending:
            handle = asyncckpt.save(state, path)
            return Pending(handle.done, handle.result)

        self.save = save  # type: ignore[method-assign]
        self.load = lambda path, like: asyncckpt.load(path)  # type: ignore[method-assign]

    def _setup_asyncckpt_threads(self) -> None:
        os.environ["ASYNCCKPT_WRITER_PROCESSES"] = "0"
        self._setup_asyncckpt()

    def _setup_dcp_async_save(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        init_single_process_group()
        cuda = torch.cuda.is_available()
        # pinned memory, async staging and non-blocking copies need an accelerator
        stager = DefaultStager(StagingOptions(cuda, True, cuda, cuda))

        def save(state: dict[str, torch.Tensor], path: str) -> Pending:
            resp: Any = dcp.async_save(
                state,
                checkpoint_id=path,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=stager,
            )
            staged = getattr(resp, "staging_completion", None)
            if staged is not None:
                staged.result()  # before this the state must not change
            upload = getattr(resp, "upload_completion", resp)
            return Pending(upload.done, upload.result)

        def load(path: str, like: dict[str, torch.Tensor]) -> Any:
            into = {k: torch.empty_like(v) for k, v in like.items()}
            dcp.load(into, checkpoint_id=path)
            return into

        self.save, self.load = save, load  # type: ignore[method-assign]
        self.close = stager.close

    def _setup_torchsnapshot(self) -> None:
        import torchsnapshot

        def save(state: dict[str, torch.Tensor], path: str) -> Pending:
            pending = torchsnapshot.Snapshot.async_take(
                path, app_state={"s": torchsnapshot.StateDict(**state)}
            )

            def wait() -> None:
                pending.wait()
                fsync_tree(path)  # torchsnapshot does not fsync: durable means fsynced

            return Pending(pending.done, wait)

        def load(path: str, like: dict[str, torch.Tensor]) -> Any:
            into = torchsnapshot.StateDict(**{k: torch.empty_like(v) for k, v in like.items()})
            torchsnapshot.Snapshot(path).restore({"s": into})
            return dict(into)

        self.save, self.load = save, load  # type: ignore[method-assign]

    def _setup_nvrx(self) -> None:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import (
            AsyncCallsQueue,
            AsyncRequest,
        )
        from nvidia_resiliency_ext.checkpointing.utils import preload_tensors

        init_single_process_group()
        queue = AsyncCallsQueue(persistent=True)

        def save(state: dict[str, torch.Tensor], path: str) -> Pending:
            staged = preload_tensors(state)  # .to("cpu", non_blocking=True), as NVRx does
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            queue.schedule_async_request(AsyncRequest(torch_save_fsync, (staged, path), []))

            def done() -> bool:
                queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
                return queue.get_num_unfinalized_calls() == 0

            return Pending(done, lambda: queue.maybe_finalize_async_calls(True, no_dist=True))

        self.save = save  # type: ignore[method-assign]
        self.close = queue.close

    def _setup_tensorizer(self) -> None:
        from tensorizer import TensorDeserializer, TensorSerializer

        def save(state: dict[str, torch.Tensor], path: str) -> Pending:
            serializer = TensorSerializer(path)
            serializer.write_state_dict(state)
            serializer.close()
            fsync_tree(path)
            return DONE

        def load(path: str, like: dict[str, torch.Tensor]) -> Any:
            reader = TensorDeserializer(path, device="cpu")
            out = {k: v for k, v in reader.items()}
            reader.close()
            return out

        self.save, self.load = save, load  # type: ignore[method-assign]

    def _setup_torch_save_thread(self) -> None:
        def save(state: dict[str, torch.Tensor], path: str) -> Pending:
            thread = threading.Thread(target=torch_save_fsync, args=(state, path))
            thread.start()
            return Pending(lambda: not thread.is_alive(), thread.join)

        self.save = save  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- one method


def _throttled(done: Callable[[], bool], every_s: float = 0.001) -> Callable[[], bool]:
    """``done`` asked at most every ``every_s``: the caller's loop, not the poll, is timed."""
    state = {"next": 0.0, "done": False}

    def check() -> bool:
        now = time.perf_counter()
        if not state["done"] and now >= state["next"]:
            state["done"] = done()
            state["next"] = now + every_s
        return not state["done"]

    return check


def _copy_floor(state: dict[str, torch.Tensor], repeats: int = 3) -> float:
    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        buffers[k].copy_(v)  # fault the pages in: the floor is a copy into ready memory
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _timed_save(method: Method, state: dict[str, torch.Tensor], path: str) -> tuple[float, float]:
    """(stall, durable) seconds of one save."""
    t = time.perf_counter()
    pending = method.save(state, path)
    stall = time.perf_counter() - t
    pending.wait()
    return stall, time.perf_counter() - t


def train_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The model and Adam's moments as one flat ``{name: tensor}`` (every peer takes it)."""
    out = {f"model.{k}": v for k, v in trainer.model.state_dict().items()}
    for i, s in enumerate(trainer.opt.state.values()):
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{k}"] = v
    return out


def training_overhead(
    method: Method, tmp: str, width: int, depth: int, steps: int, every: int, rounds: int
) -> dict[str, Any]:
    """Wall time of the MLP loop with no checkpointing, with ``method``, with torch.save.

    A save every ``every`` steps; a save waits for the previous one (one in flight, as
    each peer documents), the loop ends with the wait for the last. Modes alternate.
    """
    trainer = Trainer(width, depth, 32)
    for _ in range(3):
        trainer.step()  # kernels and Adam's state
    saves: dict[str, Callable[[dict[str, torch.Tensor], str], Pending]] = {
        "none": lambda s, p: DONE,
        "method": method.save,
        "torch_save": lambda s, p: (torch_save_fsync(s, p), DONE)[1],
    }
    method.save(train_state(trainer), os.path.join(tmp, "train-warm")).wait()  # arenas, workers
    remove(os.path.join(tmp, "train-warm"))
    wall: dict[str, float] = dict.fromkeys(saves, 0.0)
    for r in range(rounds):
        for mode in list(saves) if r % 2 == 0 else list(saves)[::-1]:
            pending = DONE
            t0 = time.perf_counter()
            for i in range(steps):
                trainer.step()
                if (i + 1) % every == 0:
                    pending.wait()
                    path = os.path.join(tmp, f"train-{mode}-{(i // every) % 2}")
                    remove(path)
                    pending = saves[mode](train_state(trainer), path)
            pending.wait()
            wall[mode] += time.perf_counter() - t0
            for k in range(2):
                remove(os.path.join(tmp, f"train-{mode}-{k}"))
    extra, torch_extra = wall["method"] - wall["none"], wall["torch_save"] - wall["none"]
    return {
        "wall_s": wall,
        "steps": steps,
        "every": every,
        "rounds": rounds,
        "extra_x_torch_save": extra / torch_extra if torch_extra > 0 else None,
    }


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of one method, in this (fresh) process."""
    warnings.filterwarnings("ignore")
    name = args.child
    label, package, family = METHODS[name]
    rec: dict[str, Any] = {"label": label, "family": family}
    try:
        rec["version"] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        rec["version"] = None
    state = peer_state(args.state, int(args.size_mib * MIB))
    nbytes = state_bytes(state)
    tmp = tempfile.mkdtemp(prefix=f"bench_peers-{name}-", dir=args.tmp_dir)
    method: Method | None = None
    sampler = RssSampler(interval=0.01, tree=True)
    try:
        copy_s = _copy_floor(state)
        rec["copy_s"] = copy_s
        base = sampler.now()
        sampler.start()
        method = Method(name)
        p = lambda tag: os.path.join(tmp, f"ckpt-{tag}")  # noqa: E731
        stall, durable = _timed_save(method, state, p("first"))
        rec["first_save_s"], rec["first_save_x_copy"] = stall, stall / copy_s
        remove(p("first"))
        stalls, durables, torch_s = [], [], []
        for i in range(args.repeats):
            settle()
            torch_s.append(torch_save_durable(state, p("torch.pt")))
            settle(p(str(i - 1)))
            stall, durable = _timed_save(method, state, p(str(i)))
            stalls.append(stall)
            durables.append(durable)
        last = p(str(args.repeats - 1))
        rec["stored_bytes"] = disk_bytes(last)
        rec["stored_fraction"] = rec["stored_bytes"] / nbytes
        rec["stall_s"] = statistics.median(stalls)
        rec["stall_x_copy"] = rec["stall_s"] / copy_s
        rec["stall_x_copy_spread"] = [min(stalls) / copy_s, max(stalls) / copy_s]
        rec["durable_s"] = statistics.median(durables)
        rec["torch_save_durable_s"] = statistics.median(torch_s)
        rec["durable_x_torch_save"] = rec["durable_s"] / rec["torch_save_durable_s"]
        rec["durable_x_torch_save_spread"] = _paired_spread(durables, torch_s)
        rec["raw_s"] = {"stall": stalls, "durable": durables, "torch_save": torch_s}
        sampler.stop()
        rec["extra_peak_bytes"] = sampler.peak() - base
        rec["extra_peak_x_state"] = rec["extra_peak_bytes"] / nbytes
        rec.update(_timed_loads(method, state, last, p("torch.pt"), args.repeats))
        remove(last)
        rec.update(_python_speed(method, state, p("speed")))
        if not args.no_train:
            train = training_overhead(method, tmp, *args.train)
            rec["train"] = train
            rec["train_extra_x_torch_save"] = train["extra_x_torch_save"]
        rec.update(_snapshot_check(method, state, p("snap")))  # last: it changes the state
    except Exception as exc:  # the peer does not run here: its rows say so
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc()[-3000:]
    finally:
        with contextlib.suppress(Exception):
            sampler.stop()
        if method is not None:
            with contextlib.suppress(Exception):
                method.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return rec


def peer_state(kind: str, size_bytes: int) -> dict[str, torch.Tensor]:
    """The state every method saves: ``"normal"``, N(0,1) fp32 (:func:`make_state`), or
    ``"weights"``, all-MiniLM-L6-v2's weights with real Adam moments tiled to at least
    ``size_bytes`` (:func:`real_training_state`), flattened to ``{"a/b/c": tensor}`` since
    every peer takes a flat dict of tensors.

    Example:
        >>> abs(state_bytes(peer_state("normal", 1 << 20)) - (1 << 20)) < 4096
        True
    """
    if kind == "normal":
        return make_state(size_bytes, "normal")
    tree, _ = real_training_state(size_bytes)
    flat: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            flat[path] = node
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}/{key}" if path else str(key))

    walk(tree, "")
    return flat


def _paired_spread(ours: list[float], theirs: list[float]) -> list[float]:
    """[min, max] of ``ours[i] / theirs[i]`` over rounds measured side by side."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return [min(ratios), max(ratios)]


def _timed_loads(
    method: Method, state: dict[str, torch.Tensor], path: str, torch_path: str, repeats: int
) -> dict[str, Any]:
    """``repeats`` rounds of ``torch.load`` then the method's load of the same state."""
    ours, torch_s, equal = [], [], True
    for _ in range(repeats):
        t = time.perf_counter()
        back = torch.load(torch_path, weights_only=True)
        torch_s.append(time.perf_counter() - t)
        del back
        t = time.perf_counter()
        back = method.load(path, state)
        ours.append(time.perf_counter() - t)
        equal = equal and states_equal(back, state)
        del back
    return {
        "torch_load_s": statistics.median(torch_s),
        "load_s": statistics.median(ours),
        "load_x_torch_load": statistics.median(ours) / statistics.median(torch_s),
        "load_x_torch_load_spread": _paired_spread(ours, torch_s),
        "load_equal": equal,
    }


def _python_speed(method: Method, state: dict[str, torch.Tensor], path: str) -> dict[str, Any]:
    """The caller's pure-Python speed from the save's return until durable, ÷ idle."""
    settle()
    idle = idle_rate()
    pending = method.save(state, path)
    rate, window = count_while(_throttled(pending.done))
    pending.wait()
    remove(path)
    if pending is DONE or window < 0.01:  # no background write: nothing ran beside it
        return {"python_speed_x_idle": None, "python_window_s": window}
    return {"python_speed_x_idle": rate / idle, "python_window_s": window}


def _snapshot_check(method: Method, state: dict[str, torch.Tensor], path: str) -> dict[str, Any]:
    """Change every tensor right after ``save`` returns; the file must hold the old values."""
    settle()
    before = {k: v.clone() for k, v in state.items()}
    pending = method.save(state, path)
    for v in state.values():
        v.add_(1)  # an integer: the real state holds int64 buffers (MiniLM's position_ids)
    pending.wait()
    back = method.load(path, before)
    torn = [k for k in before if not torch.equal(back[k].cpu(), before[k])]
    remove(path)
    return {"snapshot": not torn, "torn_tensors": len(torn), "tensors": len(before)}


# ----------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = loadavg()
    methods: dict[str, Any] = {}
    for name in args.methods:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "child.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--json", out]
            cmd += ["--size-mib", str(args.size_mib), "--repeats", str(args.repeats)]
            cmd += ["--state", args.state]
            cmd += ["--train", *map(str, args.train)]
            if args.no_train:
                cmd.append("--no-train")
            if args.tmp_dir:
                cmd += ["--tmp-dir", args.tmp_dir]
            print(f"{name} ...", flush=True)
            t = time.perf_counter()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                rec = json.loads(Path(out).read_text()) if os.path.exists(out) else None
                if rec is None:
                    rec = {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
            except subprocess.TimeoutExpired:
                rec = {"error": f"timed out after {args.timeout:g} s"}
            rec.setdefault("label", METHODS[name][0])
            rec.setdefault("family", METHODS[name][2])
            rec["wall_s"] = round(time.perf_counter() - t, 1)
            methods[name] = rec
            print(f"  {_summary_line(rec)}", flush=True)
    return {
        "benchmark": "bench_peers",
        "machine": {**machine_info(), "loadavg_before": load_before, "loadavg_after": loadavg()},
        "config": {
            "state_mib": args.size_mib,
            "state": args.state,
            "repeats": args.repeats,
            "train": dict(zip(("width", "depth", "steps", "every", "rounds"), args.train)),
            "quick": args.quick,
        },
        "methods": methods,
        "notes": [
            "every method in a fresh process; ratios against baselines of that process",
            "stall_x_copy: seconds until save returned ÷ a copy into preallocated buffers",
            "durable_x_torch_save: until fsynced (torchsnapshot and tensorizer files are "
            "fsynced by this benchmark, inside the timed window) ÷ torch.save + fsync",
            "extra_peak_x_state: peak PSS of the process and its children above the PSS "
            "before the first save, ÷ the state's bytes",
            "python_speed_x_idle: None for a synchronous save (nothing runs beside it)",
            "snapshot: False when a change made right after save returned reached the file",
        ],
    }


def _summary_line(rec: dict[str, Any]) -> str:
    if "error" in rec:
        return f"{rec['label']}: does not run here: {rec['error'][:200]}"

    def f(key: str) -> str:
        v = rec.get(key)
        return "-" if v is None else f"{v:.2f}"

    return (
        f"{rec['label']}: stall {f('stall_x_copy')}x copy, durable "
        f"{f('durable_x_torch_save')}x torch.save, load {f('load_x_torch_load')}x, stored "
        f"{f('stored_fraction')}, memory {f('extra_peak_x_state')}x state, python "
        f"{f('python_speed_x_idle')}x idle, train {f('train_extra_x_torch_save')}x, first "
        f"{f('first_save_x_copy')}x, snapshot {rec.get('snapshot')}"
    )


#: The panels of bench_peers.png: (key, title, better).
PANELS = (
    ("stall_x_copy", "stall ÷ copy floor", "lower"),
    ("durable_x_torch_save", "durable ÷ torch.save+fsync", "lower"),
    ("load_x_torch_load", "load ÷ torch.load", "lower"),
    ("stored_fraction", "stored ÷ raw", "lower"),
    ("extra_peak_x_state", "peak extra memory ÷ state", "lower"),
    ("python_speed_x_idle", "pure-Python speed ÷ idle", "higher"),
    ("train_extra_x_torch_save", "training extra wall ÷ torch.save's", "lower"),
    ("first_save_x_copy", "first save: stall ÷ copy floor", "lower"),
)


def plot(res: dict[str, Any], path: str) -> None:
    """One small panel per row; every panel names the methods the same way, in the same
    order; hatched bars: not a snapshot."""
    plt = pyplot()
    methods = {k: r for k, r in res["methods"].items() if "error" not in r}
    labels = [r["label"] for r in methods.values()]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7.5), sharey=True)
    ys = list(range(len(labels)))[::-1]
    for ax, (key, title, better) in zip(axes.flat, PANELS):
        vals = [r.get(key) for r in methods.values()]
        bars = ax.barh(
            ys,
            [v or 0.0 for v in vals],
            0.6,
            color=["#d95f02" if m.startswith("asyncckpt") else "#7570b3" for m in methods],
        )
        for bar, v, r in zip(bars, vals, methods.values()):
            if r.get("snapshot") is False:
                bar.set_hatch("//")
                bar.set_edgecolor("white")
            text = "n/a" if v is None else f"{v:.2f}"
            ax.annotate(
                text,
                (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
        known = [v for v in vals if v is not None]
        top, low = max(known, default=1.0), min([0.0, *known])
        ax.set_xlim(low * 1.3, top * 1.3 or 1.0)
        ax.axvline(0, color="grey", lw=0.6)
        ax.set_title(f"{title} ({better} is better)", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    axes[0][0].set_yticks(ys, labels, fontsize=8)
    axes[1][0].set_yticks(ys, labels, fontsize=8)
    cfg = res["config"]
    what = STATES[cfg.get("state", "normal")]
    fig.suptitle(
        f"asyncckpt and its peers, {cfg['state_mib']:g} MiB of {what}, each in a fresh "
        "process (hatched: not a snapshot)",
        fontsize=11,
    )
    fig.tight_layout()
    savefig(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=1024.0, help="state size (default 1024)")
    ap.add_argument("--repeats", type=int, default=3, help="timed saves per method (default 3)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument(
        "--train",
        type=int,
        nargs=5,
        default=[1536, 8, 40, 8, 2],
        metavar=("WIDTH", "DEPTH", "STEPS", "EVERY", "ROUNDS"),
        help="the training loop (default 1536 8 40 8 2)",
    )
    ap.add_argument(
        "--state",
        choices=tuple(STATES),
        default="normal",
        help="N(0,1) fp32, or MiniLM weights with Adam moments (writes bench_peers_weights.*)",
    )
    ap.add_argument("--no-train", action="store_true", help="leave the training loop out")
    ap.add_argument("--quick", action="store_true", help="smoke test: 16 MiB, 1 repeat")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per method")
    ap.add_argument("--tmp-dir", default=None)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--child", choices=list(METHODS), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mib, args.repeats, args.train = 16.0, 1, [128, 2, 4, 2, 1]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        rec = child(args)
        with open(args.json, "w") as f:
            json.dump(rec, f)
        # The figures are written: leave now, so that no peer's worker thread or process
        # (NVRx keeps one) can hold the interpreter's exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    res = run(args)
    os.makedirs(args.out, exist_ok=True)
    name = "bench_peers" if args.state == "normal" else f"bench_peers_{args.state}"
    json_path = os.path.join(args.out, f"{name}.json")
    write_json(res, json_path)
    png_path = os.path.join(args.out, f"{name}.png")
    plot(res, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
