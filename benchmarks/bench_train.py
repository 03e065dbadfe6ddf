"""Training-loop benchmark: step time while checkpoints are written, on the CPU.

An MLP (by default 8 x Linear(1536, 1536), 19 M parameters: some 216 MiB of parameters and
Adam state) trains on random data. Each mode runs the same number of steps and, except
``none``, saves ``{"model": ..., "optimizer": ...}`` every ``--every`` steps (default 8;
``--every 0`` chooses it from a warm-up: twice the time of one background write over the
step time):

* ``none``: no checkpointing, the baseline;
* ``asyncckpt``: ``asyncckpt.Checkpointer.save`` with every default a user gets: the step
  that saves blocks only for the snapshot; the write runs in the background during the next
  steps, on the same cores;
* ``asyncckpt_none``: the same, uncompressed;
* ``torch_save``: ``torch.save`` + fsync of the file and its directory, in the step.

Reported per mode: the loop's wall time (every step and the wait for the last write),
median and mean step time (the mean includes the saving steps), the saving steps alone, and
the steps that ran while a background write was in flight; ratios to ``none`` from the same
run. Modes alternate in rounds (the order reversed every other round) so that drift of the
machine is shared.

The target (issue 22): asyncckpt's extra wall time <= 0.75 x torch.save+fsync's. Whole
rounds measure it too coarsely (the loop's wall without checkpointing moves by as much as
torch.save adds), so it comes from *paired blocks*: ``--blocks`` cycles in which each mode
in turn runs ``--every`` steps, saves after the first and ends when that save is durable;
a save's extra wall time is its block minus the ``none`` block of the same cycle, and the
figure is the ratio of the medians over cycles (its spread: the figure on each third).

``--writer`` picks how the background write shares the CPU (issue 12, "training
interference"); the figures of different variants come from separate runs:

* ``default``: the library's defaults (``writer_nice`` and ``threads`` in asyncckpt._settings);
* ``nice0``: writer threads at the caller's priority (the behaviour before issue 12);
* ``nice``: writer threads niced by ``--nice`` (``ASYNCCKPT_WRITER_NICE``);
* ``threads1``: one encode thread (``ASYNCCKPT_THREADS=1``), not niced;
* ``threads1_nice``: both;
* ``pace``: not niced; each encode thread sleeps ``--pace-ms`` after every chunk;
* ``process``: the write runs in a writer process (``ASYNCCKPT_WRITER_PROCESSES=1``), at
  the default niceness.

Usage::

    python benchmarks/bench_train.py [--width 1536] [--depth 8] [--batch 32] [--steps 5*every]
        [--every 8] [--rounds 2] [--blocks 24] [--writer default] [--quick] [--out DIR]

Writes ``bench_train.json``, ``bench_train.png`` (step-time ratios) and
``bench_train_trace.png`` (the step times of one run of each mode, saves and background
writes marked) under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    MIB,
    Trainer,
    loadavg,
    machine_info,
    pyplot,
    savefig,
    torch_save_fsync,
    tree_cpu_s,
    write_json,
)

import asyncckpt
from asyncckpt._settings import Settings

#: --writer: environment variables set before the first save (None: --nice's value).
WRITER_VARIANTS: dict[str, dict[str, str | None]] = {
    "default": {},
    "nice0": {"ASYNCCKPT_WRITER_NICE": "0"},
    "nice": {"ASYNCCKPT_WRITER_NICE": None},
    "threads1": {"ASYNCCKPT_THREADS": "1", "ASYNCCKPT_WRITER_NICE": "0"},
    "threads1_nice": {"ASYNCCKPT_THREADS": "1", "ASYNCCKPT_WRITER_NICE": None},
    "pace": {"ASYNCCKPT_WRITER_NICE": "0"},
    "process": {"ASYNCCKPT_WRITER_PROCESSES": "1"},
}
MODES = {
    "none": "no checkpointing",
    "asyncckpt": "asyncckpt.Checkpointer (defaults)",
    "asyncckpt_none": "asyncckpt.Checkpointer (none)",
    "torch_save": "torch.save + fsync",
}


def run_mode(
    mode: str, trainer: Trainer, args: argparse.Namespace, tmp: str, first_step: int
) -> dict[str, list[Any]]:
    """``args.steps`` timed steps; saves where ``step % every == every // 2``.

    Besides step times it records, for the trace plot, when each step began and when each
    background write ran (seconds from the mode's first step), and how many saves were
    called while the previous write was still in flight (they wait for the arena).
    """
    steps: list[float] = []
    began: list[float] = []
    saved: list[bool] = []
    overlapped: list[bool] = []
    blocked: list[float] = []
    save_at: list[float] = []
    handles: list[tuple[float, asyncckpt.SaveHandle]] = []
    ckpt = checkpointer(mode, os.path.join(tmp, mode))
    handle: asyncckpt.SaveHandle | None = None
    save: Callable[[int], None] | None = None
    if ckpt is not None:

        def save_ckpt(step: int) -> None:
            nonlocal handle
            assert ckpt is not None
            t_call = time.perf_counter() - t0
            handle = ckpt.save(step, trainer.state())
            handles.append((t_call, handle))

        save = save_ckpt
    elif mode == "torch_save":
        path = os.path.join(tmp, "torch.pt")

        def save_torch(step: int) -> None:
            torch_save_fsync(trainer.state(), path)

        save = save_torch

    tail = 0.0
    waited = 0  # saves called while the previous write was still in flight
    t0 = time.perf_counter()
    try:
        for i in range(args.steps):
            step = first_step + i
            overlapped.append(handle is not None and not handle.done())
            do_save = save is not None and (i + 1) % args.every == args.every // 2
            t = time.perf_counter()
            began.append(t - t0)
            trainer.step()
            if do_save:
                assert save is not None
                waited += handle is not None and not handle.done()
                t_save = time.perf_counter()
                save_at.append(t_save - t0)
                save(step)
                blocked.append(time.perf_counter() - t_save)
            steps.append(time.perf_counter() - t)
            saved.append(do_save)
        t = time.perf_counter()
        if ckpt is not None:
            ckpt.wait()
        tail = time.perf_counter() - t
        wall = time.perf_counter() - t0  # every step and the wait for the last write
    finally:
        if ckpt is not None:
            ckpt.close()
    writes: list[list[float]] = []
    stored = [h.result().stats.ratio for _, h in handles]
    for start, h in handles:
        end = start + (h.result().stats.total_s or 0.0)
        # saves run one at a time: a write starts once the one before it has ended
        writes.append([max(start, writes[-1][1]) if writes else start, end])
    return {
        "step_s": steps,
        "began_s": began,
        "saved": saved,
        "overlapped": overlapped,
        "blocked_s": blocked,
        "tail_s": [tail],
        "wall_s": [wall],
        "writes_s": writes,
        "save_at_s": save_at,
        "stored_fraction": [r for r in stored if r is not None],
        "saves_waited": [waited],
    }


def checkpointer(mode: str, root: str) -> asyncckpt.Checkpointer | None:
    """The mode's Checkpointer: ``asyncckpt`` every default a user gets, ``asyncckpt_none``
    uncompressed; None for the modes that do not use one."""
    if not mode.startswith("asyncckpt"):
        return None
    options: dict[str, Any] = {"compression": "none"} if mode == "asyncckpt_none" else {}
    return asyncckpt.Checkpointer(root, keep_last=1, **options)


def cpu_per_save(trainer: Trainer, args: argparse.Namespace, tmp: str) -> dict[str, dict[str, Any]]:
    """CPU seconds (this process and the writer process) and wall time of one durable save
    with no training beside it, ``args.cpu_saves`` times per mode, after a warm-up save.

    What a background write takes from training on a CPU the loop keeps busy is at least
    its CPU time; unlike the loop's wall time, that figure hardly moves with the machine.
    """
    out: dict[str, dict[str, Any]] = {}
    step = 0  # roots of their own: any steps will do
    path = os.path.join(tmp, "cpu-torch.pt")
    for mode in MODES:
        if mode == "none":
            continue
        ckpt = checkpointer(mode, os.path.join(tmp, f"cpu-{mode}"))
        cpus: list[float] = []
        walls: list[float] = []
        try:
            for i in range(args.cpu_saves + 1):
                c, t = tree_cpu_s(), time.perf_counter()
                if ckpt is not None:
                    ckpt.save(step, trainer.state()).result()
                else:
                    torch_save_fsync(trainer.state(), path)
                step += 1
                if i:  # the first one allocates the arena and starts the writer process
                    walls.append(time.perf_counter() - t)
                    cpus.append(tree_cpu_s() - c)
        finally:
            if ckpt is not None:
                ckpt.close()
        out[mode] = {
            "cpu_s": statistics.median(cpus),
            "wall_s": statistics.median(walls),
            "cpu_s_all": cpus,
        }
    return out


def run_paired_blocks(
    trainer: Trainer, args: argparse.Namespace, tmp: str, first_step: int
) -> dict[str, list[float]]:
    """``args.blocks`` cycles; in each, every mode runs one block of ``args.every`` steps.

    A block saves after its first step (``none`` does not) and ends when that save is
    durable, so a block's wall time holds the stall, the write's cost to the steps it
    overlaps, and any wait for it; ``block(mode) - block(none)`` of the same cycle is that
    save's extra wall time. Modes rotate their order every cycle, so drift of the machine
    is shared; one ``Checkpointer`` per mode stays open, its arena warmed by an untimed save.
    """
    ckpts = {m: ck for m in MODES if (ck := checkpointer(m, os.path.join(tmp, f"paired-{m}")))}
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    path = os.path.join(tmp, "paired-torch.pt")
    step = first_step
    try:
        for ckpt in ckpts.values():
            ckpt.save(step, trainer.state()).result()
            step += 1
        modes = list(MODES)
        for c in range(args.blocks):
            gc.collect()
            for mode in modes[c % len(modes) :] + modes[: c % len(modes)]:
                t0 = time.perf_counter()
                for i in range(args.every):
                    trainer.step()
                    if i == 0 and mode in ckpts:
                        ckpts[mode].save(step, trainer.state())
                    elif i == 0 and mode == "torch_save":
                        torch_save_fsync(trainer.state(), path)
                    step += 1
                if mode in ckpts:
                    ckpts[mode].wait()
                walls[mode].append(time.perf_counter() - t0)
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    return walls


def paired_extra_wall(
    walls: dict[str, list[float]], mode: str = "asyncckpt", groups: int = 1
) -> list[float | None]:
    """``mode``'s extra wall time per save over torch.save+fsync's, from paired blocks:
    the median over cycles of ``block(mode) - block(none)`` over the same for torch.save,
    computed on each of ``groups`` consecutive slices of the cycles (None where torch.save
    cost nothing measurable).

    Example:
        >>> paired_extra_wall({"none": [1.0, 1.0, 1.0], "asyncckpt": [1.25, 1.5, 1.25],
        ...                    "torch_save": [1.5, 2.0, 1.5]})
        [0.5]
    """
    n = len(walls["none"])
    out: list[float | None] = []
    for g in range(groups):
        cycles = range(g * n // groups, (g + 1) * n // groups)
        ours = statistics.median(walls[mode][c] - walls["none"][c] for c in cycles)
        theirs = statistics.median(walls["torch_save"][c] - walls["none"][c] for c in cycles)
        out.append(float(ours / theirs) if theirs > 0 else None)
    return out


def summarize_mode(raw: dict[str, list[Any]], label: str) -> dict[str, Any]:
    steps = raw["step_s"]
    ordered = sorted(steps)
    e: dict[str, Any] = {
        "label": label,
        "raw": raw,
        "median_s": statistics.median(steps),
        "mean_s": statistics.fmean(steps),
        "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max_s": ordered[-1],
        "n_steps": len(steps),
        "n_saves": sum(raw["saved"]),
    }
    saving = [s for s, sv in zip(steps, raw["saved"]) if sv]
    others = [s for s, sv in zip(steps, raw["saved"]) if not sv]
    over = [s for s, sv, ov in zip(steps, raw["saved"], raw["overlapped"]) if ov and not sv]
    quiet = [s for s, sv, ov in zip(steps, raw["saved"], raw["overlapped"]) if not ov and not sv]
    e["saving_steps_mean_s"] = statistics.fmean(saving) if saving else None
    e["other_steps_median_s"] = statistics.median(others) if others else None
    e["overlapped_steps"] = len(over)
    e["overlapped_median_s"] = statistics.median(over) if over else None
    e["quiet_median_s"] = statistics.median(quiet) if quiet else None
    e["blocked_mean_s"] = statistics.fmean(raw["blocked_s"]) if raw["blocked_s"] else None
    e["tail_max_s"] = max(raw["tail_s"]) if raw["tail_s"] else None
    e["wall_s"] = sum(raw.get("wall_s", []))  # all rounds: steps and the final wait
    writes = [end - start for start, end in raw.get("writes_s", [])]
    e["write_median_s"] = statistics.median(writes) if writes else None
    # saves called while the previous write was in flight: they waited for the arena
    e["saves_waited"] = sum(raw.get("saves_waited", []))
    stored = raw.get("stored_fraction") or []
    e["stored_fraction"] = statistics.median(stored) if stored else None
    return e


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = loadavg()
    if args.every == 0:
        args.every = None
    every_auto = args.every is None
    trainer = Trainer(args.width, args.depth, args.batch)
    params = sum(p.numel() for p in trainer.model.parameters())
    tmp = tempfile.mkdtemp(prefix="bench_train-", dir=args.tmp_dir)
    keys = ("step_s", "saved", "overlapped", "blocked_s", "tail_s", "wall_s", "writes_s")
    keys += ("saves_waited",)
    keys += ("stored_fraction",)
    raw: dict[str, dict[str, list[Any]]] = {m: {k: [] for k in keys} for m in MODES}
    trace: dict[str, dict[str, list[Any]]] = {}  # one run of each mode, for the trace plot
    try:
        # warm-up: kernels, Adam state, and asyncckpt's host arena (kept across saves)
        warm_steps = []
        for _ in range(6):
            t = time.perf_counter()
            trainer.step()
            warm_steps.append(time.perf_counter() - t)
        with asyncckpt.Checkpointer(os.path.join(tmp, "warmup")) as ckpt:
            ckpt.save(0, trainer.state()).result()  # allocates the arena
            write_s = ckpt.save(1, trainer.state()).result().stats.total_s or 0.0
        step_s = statistics.median(warm_steps[1:])
        if args.every is None:
            # save rarely enough that a background write can finish between two saves
            args.every = min(60, max(5, math.ceil(2 * write_s / step_s)))
        if args.steps is None:
            args.steps = 5 * args.every
        state_bytes = trainer.state_bytes()
        print(
            f"MLP {args.depth} x {args.width}: {params / 1e6:.1f} M parameters, "
            f"{state_bytes / MIB:.0f} MiB with Adam state; {args.steps} steps per mode, "
            f"a save every {args.every}, {args.rounds} round(s)",
            flush=True,
        )
        step = 1
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                gc.collect()
                t = time.perf_counter()
                got = run_mode(mode, trainer, args, tmp, step)
                step += args.steps
                trace.setdefault(mode, got)
                for k in keys:
                    raw[mode][k].extend(got[k])
                print(
                    f"  round {r + 1} {mode:15s} median step "
                    f"{statistics.median(got['step_s']):.3f} s, "
                    f"{time.perf_counter() - t:.1f} s in all",
                    flush=True,
                )
        print(f"  paired blocks: {args.blocks} cycles of {len(MODES)} blocks", flush=True)
        paired = run_paired_blocks(trainer, args, tmp, step) if args.blocks else {}
        print(f"  CPU per save: {args.cpu_saves} saves of each mode alone", flush=True)
        cpu = cpu_per_save(trainer, args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    modes = {m: summarize_mode(raw[m], label) for m, label in MODES.items()}
    base = modes["none"]
    ratios: dict[str, Any] = {}
    for m in MODES:
        if m == "none":
            continue
        ratios[f"{m}_median_x_none"] = modes[m]["median_s"] / base["median_s"]
        ratios[f"{m}_mean_x_none"] = modes[m]["mean_s"] / base["mean_s"]
        over = modes[m]["overlapped_median_s"]
        ratios[f"{m}_overlapped_median_x_none"] = (
            over / base["median_s"] if over is not None else None
        )
        saving = modes[m]["saving_steps_mean_s"]
        ratios[f"{m}_saving_step_x_none"] = (
            saving / base["median_s"] if saving is not None else None
        )
    ratios["asyncckpt_mean_x_torch_save"] = (
        modes["asyncckpt"]["mean_s"] / (modes["torch_save"]["mean_s"])
    )
    ratios["asyncckpt_overhead_x_torch_save_overhead"] = overhead_ratio(ratios)
    ratios["asyncckpt_extra_wall_rounds_x_torch_save_extra_wall"] = extra_wall_ratio(modes)
    for m in ("asyncckpt", "asyncckpt_none"):
        theirs = cpu["torch_save"]["cpu_s"]  # 0 where a tiny state (--quick) took under a tick
        ratios[f"{m}_cpu_per_save_x_torch_save"] = cpu[m]["cpu_s"] / theirs if theirs else None
    for m in ("asyncckpt", "asyncckpt_none"):
        whole = paired_extra_wall(paired, m)[0] if paired else None
        thirds = paired_extra_wall(paired, m, groups=3) if len(paired.get("none", [])) >= 3 else []
        known = [r for r in thirds if r is not None]
        ratios[f"{m}_extra_wall_x_torch_save_extra_wall"] = whole
        ratios[f"{m}_extra_wall_x_torch_save_extra_wall_spread"] = (
            [min(known), max(known)] if known else None
        )
    return {
        "benchmark": "bench_train",
        "machine": {
            **machine_info(),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
        },
        "config": {
            "width": args.width,
            "depth": args.depth,
            "batch": args.batch,
            "steps": args.steps,
            "every": args.every,
            "every_auto": every_auto,
            "warmup_step_s": step_s,
            "warmup_write_s": write_s,
            "rounds": args.rounds,
            "blocks": args.blocks,
            "cpu_saves": args.cpu_saves,
            "parameters": params,
            "state_bytes": state_bytes,
            "state_mib": round(state_bytes / MIB, 1),
            "torch_threads": torch.get_num_threads(),
            "asyncckpt_threads": Settings.resolve().threads,
            "writer": args.writer,
            "writer_nice": Settings.resolve().writer_nice,
            "pace_ms": args.pace_ms if args.writer == "pace" else 0,
            "quick": args.quick,
        },
        "modes": modes,
        "ratios": ratios,
        "paired_blocks_s": paired,
        "cpu_per_save": cpu,
        "trace": trace,
        "notes": [
            "step_s: wall seconds of forward + backward + optimizer step, plus the save "
            "call on saving steps (for asyncckpt only the snapshot; the write runs on)",
            "mean_s includes the saving steps: the cost of checkpointing per step, amortised",
            "overlapped: a step that began while an asyncckpt background write was in "
            "flight; the write competes with training for the same cores",
            "tail_s: after the last step, the wait for the last background write",
            "asyncckpt's host arena is allocated by an untimed warm-up save",
            "saves_waited: saves called while the previous background write was still in "
            "flight (with max_inflight=1 they wait for the arena)",
            "asyncckpt_overhead_x_torch_save_overhead: (asyncckpt mean x none - 1) / "
            "(torch.save mean x none - 1)",
            "asyncckpt_extra_wall_x_torch_save_extra_wall: from paired blocks (every steps, "
            "a save after the first, ended when the save is durable; the modes take turns "
            "block by block): median over cycles of block(asyncckpt) - block(none) over the "
            "same for torch.save; _spread: the figure on each third of the cycles; issue "
            "22's target is <= 0.75",
            "cpu_per_save: CPU seconds of this process and the writer process for one "
            "durable save with nothing else running (median of cpu_saves); "
            "asyncckpt_cpu_per_save_x_torch_save divides it by torch.save+fsync's",
            "asyncckpt_extra_wall_rounds_x_torch_save_extra_wall: (wall(asyncckpt) - "
            "wall(none)) / (wall(torch.save) - wall(none)) over whole rounds (wall = every "
            "step and the wait for the last write); noisier: one figure per run",
            "trace: every step of the first round of each mode; writes_s: [start, end] of "
            "each background write, seconds from the mode's first step",
        ],
    }


def overhead_ratio(ratios: dict[str, float | None]) -> float | None:
    """asyncckpt's extra mean step time over torch.save's (None if torch.save cost nothing)."""
    ours, theirs = ratios.get("asyncckpt_mean_x_none"), ratios.get("torch_save_mean_x_none")
    if ours is None or theirs is None or theirs <= 1.0:
        return None
    return (ours - 1.0) / (theirs - 1.0)


def extra_wall_ratio(modes: dict[str, dict[str, Any]], mode: str = "asyncckpt") -> float | None:
    """The loop's extra wall time with ``mode`` over torch.save+fsync's extra wall time,
    ``(wall(mode) - wall(none)) / (wall(torch_save) - wall(none))``, over all rounds; None
    if torch.save cost nothing measurable.

    Example:
        >>> extra_wall_ratio({"none": {"wall_s": 10.0}, "asyncckpt": {"wall_s": 11.0},
        ...                   "torch_save": {"wall_s": 14.0}})
        0.25
    """
    none, ours, theirs = (modes.get(m, {}).get("wall_s") for m in ("none", mode, "torch_save"))
    if none is None or ours is None or theirs is None or theirs <= none:
        return None
    return float((ours - none) / (theirs - none))


def print_table(res: dict[str, Any]) -> None:
    cfg = res["config"]
    print(
        f"\nMLP {cfg['depth']} x {cfg['width']}, batch {cfg['batch']}: {cfg['state_mib']} MiB "
        f"state; a save every {cfg['every']} steps; {cfg['torch_threads']} torch threads"
    )
    head = (
        f"{'mode':32s} {'median s':>9s} {'mean s':>8s} {'x none':>7s} {'saving s':>9s} "
        f"{'overlap s':>9s} {'blocked s':>9s}"
    )
    print(head + "\n" + "-" * len(head))
    base = res["modes"]["none"]["mean_s"]

    def f(v: float | None, spec: str) -> str:
        return "-".rjust(int(spec.split(".")[0])) if v is None else format(v, spec)

    for e in res["modes"].values():
        print(
            f"{e['label']:32s} {e['median_s']:9.3f} {e['mean_s']:8.3f} {e['mean_s'] / base:7.2f} "
            f"{f(e['saving_steps_mean_s'], '9.3f')} {f(e['overlapped_median_s'], '9.3f')} "
            f"{f(e['blocked_mean_s'], '9.3f')}"
        )
    waited = {m: e["saves_waited"] for m, e in res["modes"].items() if m.startswith("async")}
    print(f"\nsaves that found the previous write still in flight: {waited}")
    print("\nratios:")
    for k, v in res["ratios"].items():
        shown = (
            "-" if v is None else "–".join(f"{x:.2f}" for x in (v if isinstance(v, list) else [v]))
        )
        print(f"  {k:36s} {shown}")


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    from matplotlib.patches import Patch

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    colour = {}
    for mode, e in res["modes"].items():
        steps = e["raw"]["step_s"]
        (line,) = ax1.plot(range(len(steps)), steps, lw=1, label=e["label"])
        colour[mode] = line.get_color()
        xs = [i for i, s in enumerate(e["raw"]["saved"]) if s]
        ax1.plot(xs, [steps[i] for i in xs], "o", color=line.get_color(), ms=4)
    ax1.set_xlabel("step (all rounds of a mode, in order; dots: saving steps)")
    ax1.set_ylabel("seconds")
    ax1.set_yscale("log")
    ax1.set_title(
        f"step times, {res['config']['state_mib']} MiB state, a save every "
        f"{res['config']['every']} steps",
        fontsize=10,
    )
    ax1.legend(fontsize=8)
    modes = [m for m in res["modes"] if m != "none"]
    w = 0.38
    # Each method's bars in its line's colour (the left panel's legend names it); median
    # solid, mean hatched: the bar legend names the two statistics, never a method.
    for x, m in enumerate(modes):
        for off, stat, hatch in ((-w / 2, "median", None), (w / 2, "mean", "///")):
            v = res["ratios"][f"{m}_{stat}_x_none"]
            ax2.bar(x + off, v, w, color=colour[m], hatch=hatch, edgecolor="white")
            ax2.text(x + off, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    statistics_legend = [
        Patch(facecolor="grey", edgecolor="white", label="median step"),
        Patch(facecolor="grey", edgecolor="white", hatch="///", label="mean step"),
    ]
    top = max(res["ratios"][f"{m}_{s}_x_none"] for m in modes for s in ("median", "mean"))
    ax2.set_ylim(0, 1.25 * max(top, 1.0))  # room for the values and the legend
    ax2.axhline(1.0, color="grey", ls="--", lw=1)
    # the same names as the legend of the step-time panel
    ax2.set_xticks(range(len(modes)), [_wrap(res["modes"][m]["label"]) for m in modes])
    ax2.tick_params(axis="x", labelsize=8)
    ax2.set_ylabel("× no checkpointing (lower is better)")
    ax2.legend(handles=statistics_legend, fontsize=8, loc="upper right")
    fig.tight_layout()
    savefig(fig, path)


def _wrap(label: str) -> str:
    """A method's label on short lines, for tick labels: "asyncckpt.\nCheckpointer\n(none)".

    Example:
        >>> _wrap("torch.save + fsync")
        'torch.save\n+ fsync'
    """
    head, sep, tail = label.partition(" ")
    if "." in head and len(head) > 12:
        head = head.replace(".", ".\n", 1)
    return f"{head}\n{tail}" if sep else head


def plot_trace(res: dict[str, Any], path: str) -> None:
    """Step times of one run of each mode against time, saves and background writes marked."""
    plt = pyplot()
    trace = res["trace"]
    fig, axes = plt.subplots(len(trace), 1, figsize=(12, 1.9 * len(trace) + 0.8), sharex=True)
    axes = list(axes) if len(trace) > 1 else [axes]
    base = res["modes"]["none"]["median_s"]
    top = 1.05 * max(max(t["step_s"]) for t in trace.values())
    for ax, (mode, t) in zip(axes, trace.items()):
        for start, end in t["writes_s"]:
            ax.axvspan(start, end, color="tab:orange", alpha=0.25, lw=0)
        for at in t["save_at_s"]:
            ax.axvline(at, color="tab:red", lw=1, ls="--")
        # each step drawn as a flat segment over the time it ran
        xs = [*t["began_s"], t["began_s"][-1] + t["step_s"][-1]]
        ax.step(xs, [*t["step_s"], t["step_s"][-1]], where="post", color="tab:blue", lw=1.2)
        ax.axhline(base, color="grey", ls=":", lw=1)
        ax.set_ylim(0, top)
        ax.set_ylabel("step s")
        ax.set_title(f"{res['modes'][mode]['label']}", fontsize=9, loc="left")
    axes[-1].set_xlabel(
        "seconds from the mode's first step (first round)\ndashed red: a save is called; "
        "orange: a background write in flight; dotted grey: median step without checkpointing"
    )
    cfg = res["config"]
    fig.suptitle(
        f"step times, {cfg['state_mib']} MiB state, a save every {cfg['every']} steps, "
        f"writer: {cfg.get('writer', 'default')} (nice {cfg.get('writer_nice', 0)})",
        fontsize=10,
    )
    fig.tight_layout()
    savefig(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--steps", type=int, default=None, help="timed steps per mode and round (5 x every)"
    )
    ap.add_argument(
        "--every",
        type=int,
        default=8,
        help="save every N steps (default 8, issue 22's loop); 0: twice the warm-up write "
        "time over the step time, between 5 and 60",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--blocks",
        type=int,
        default=24,
        help="cycles of paired blocks for the extra-wall figure (24; 0: none)",
    )
    ap.add_argument(
        "--writer",
        choices=list(WRITER_VARIANTS),
        default="default",
        help="how the background write shares the CPU (see the module docstring)",
    )
    ap.add_argument("--nice", type=int, default=10, help="niceness for --writer *nice (10)")
    ap.add_argument(
        "--pace-ms", type=float, default=20.0, help="--writer pace: sleep after each chunk (20)"
    )
    ap.add_argument(
        "--cpu-saves", type=int, default=6, help="saves of each mode alone, for CPU per save (6)"
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: a tiny MLP, few steps")
    ap.add_argument("--tmp-dir", default=None, help="where checkpoints go (default: temp)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.batch, args.steps, args.every, args.rounds = (
            512,
            3,
            16,
            8,
            4,
            1,
        )
        args.blocks, args.cpu_saves = 3, 2
    counts = [args.width, args.depth, args.batch, args.rounds, args.steps or 1, args.every or 1]
    if min(counts) < 1 or args.blocks < 0 or args.cpu_saves < 1:
        ap.error("sizes and counts must be positive")
    if not 0 <= args.nice <= 19 or args.pace_ms < 0:
        ap.error("--nice must be 0-19 and --pace-ms non-negative")
    return args


def apply_writer_variant(args: argparse.Namespace) -> None:
    """Set the variant's environment (read at the first save) and, for ``pace``, the sleep."""
    for key, value in WRITER_VARIANTS[args.writer].items():
        os.environ[key] = str(args.nice) if value is None else value
    if args.writer != "pace":
        return
    from asyncckpt._engine import encode as writer

    encode = writer.encode_chunk
    pause = args.pace_ms / 1000

    def paced(*a: Any) -> Any:
        try:
            return encode(*a)
        finally:
            time.sleep(pause)  # hands the core back to training between chunks

    writer.encode_chunk = paced  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_writer_variant(args)
    res = run(args)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench_train.json")
    write_json(res, json_path)
    print_table(res)
    png_path = os.path.join(args.out, "bench_train.png")
    plot(res, png_path)
    trace_path = os.path.join(args.out, "bench_train_trace.png")
    plot_trace(res, trace_path)
    print(f"\nwrote {json_path}, {png_path} and {trace_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
