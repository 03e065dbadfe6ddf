"""Host memory benchmark: extra peak memory during saves, and growth over many saves.

Each method runs in a fresh process (``--probe``), saving a ``make_state`` state several
times while a thread samples the resident set size every 2 ms (the kernel's peak is read
too): asyncckpt (its arena included), torch DCP ``async_save`` and ``torch.save``. A leak
check saves a smaller state 50 times in one process and reports the growth after the first.

Usage::

    python benchmarks/bench_memory.py [--quick] [--out DIR] [--size-mib 1024]

Writes ``bench_memory.json`` (timelines of at most 200 points; every sample in the
git-ignored ``bench_memory.samples.json``) and ``bench_memory.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    MIB,
    RESULTS,
    RssSampler,
    loadavg,
    machine_info,
    make_state,
    maxrss_bytes,
    pyplot,
    rss_bytes,
    savefig,
    state_bytes,
    write_json,
)


def memory_probe(args: argparse.Namespace) -> dict[str, Any]:
    """One method, in a fresh process: peak RSS above the baseline during each save."""
    import torch

    state = make_state(int(args.size_mib * MIB), "normal")
    nbytes = state_bytes(state)
    tmp = tempfile.mkdtemp(prefix="bench_memory-", dir=args.tmp_dir)
    save = _probe_method(args.method, state, tmp)
    gc.collect()
    time.sleep(0.2)
    baseline = rss_bytes()
    maxrss_before = maxrss_bytes()
    sampler = RssSampler().start()
    peaks, after, seconds = [], [], []
    try:
        for i in range(args.saves):
            sampler.reset_peak()
            t = time.perf_counter()
            save(i)
            seconds.append(time.perf_counter() - t)
            gc.collect()
            peaks.append(sampler.peak() - baseline)
            after.append(rss_bytes() - baseline)
    finally:
        sampler.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    maxrss_after = maxrss_bytes()
    extra = max(peaks)
    if maxrss_after > maxrss_before:  # the saves set the process's peak: exact, unsampled
        extra = max(extra, maxrss_after - baseline)
    step = max(1, len(sampler.samples) // 1500)
    return {
        "method": args.method,
        "raw_bytes": nbytes,
        "saves": args.saves,
        "baseline_rss_bytes": baseline,
        "extra_peak_bytes": extra,
        "extra_peak_minus_state_bytes": extra - nbytes,
        "extra_peak_per_save_bytes": peaks,
        "rss_after_save_bytes": after,
        "growth_after_first_save_bytes": after[-1] - after[0],
        "maxrss_before_bytes": maxrss_before,
        "maxrss_after_bytes": maxrss_after,
        "save_seconds": seconds,
        "timeline": [(round(t, 4), r - baseline) for t, r in sampler.samples[::step]],
        "torch": torch.__version__,
    }


def _probe_method(method: str, state: Any, tmp: str) -> Callable[[int], None]:
    import torch

    if method in ("asyncckpt", "asyncckpt_none"):
        import asyncckpt

        options = {"compression": "none"} if method == "asyncckpt_none" else {}  # defaults

        def save_asyncckpt(i: int) -> None:
            path = os.path.join(tmp, "x.ackpt")
            asyncckpt.save(state, path, **options).result()

        return save_asyncckpt
    if method == "torch_save":

        def save_torch(i: int) -> None:
            with open(os.path.join(tmp, "x.pt"), "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        return save_torch
    if method == "dcp_async_save":
        import warnings

        import torch.distributed.checkpoint as dcp

        warnings.filterwarnings("ignore")

        def save_dcp(i: int) -> None:
            path = os.path.join(tmp, f"dcp-{i}")
            fut: Any = dcp.async_save(state, checkpoint_id=path)
            getattr(fut, "upload_completion", fut).result()
            shutil.rmtree(path, ignore_errors=True)

        return save_dcp
    raise ValueError(f"unknown method {method!r}")


MEMORY_METHODS = ["asyncckpt", "dcp_async_save", "torch_save"]


def memory_bench(args: argparse.Namespace) -> int:
    """Each method in its own process, then the JSON and the plot."""
    size, saves = (64.0, 3) if args.quick else (args.size_mib, args.saves)
    methods = [m for m in args.methods if not (args.quick and m == "dcp_async_save")]
    runs: list[tuple[str, str, float, int]] = [(m, m, size, saves) for m in methods]
    if args.leak_saves and not args.quick:
        n = args.leak_saves
        runs.append((f"asyncckpt_x{n}", "asyncckpt", args.leak_size_mib, n))
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    load_before = loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for key, method, size_mib, n in runs:
            out = os.path.join(tmp, f"{key}.json")
            cmd = [
                sys.executable,
                __file__,
                "--probe",
                "--method",
                method,
                "--size-mib",
                str(size_mib),
                "--saves",
                str(n),
                "--json",
                out,
            ]
            if args.tmp_dir:
                cmd += ["--tmp-dir", args.tmp_dir]
            print(f"memory: {key} ({size_mib:g} MiB, {n} saves) ...", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                errors[key] = (proc.stdout + proc.stderr)[-2000:]
                print(f"  ! {key} failed:\n{errors[key]}", file=sys.stderr)
                continue
            with open(out) as f:
                results[key] = json.load(f)
    res = {
        "benchmark": "bench_memory",
        "machine": {**machine_info(), "loadavg_before": load_before, "loadavg_after": loadavg()},
        "config": {"size_mib": size, "saves": saves, "quick": args.quick},
        "results": results,
        "errors": errors,
        "notes": [
            "each method runs in a fresh process; baseline = RSS once the state is built",
            "extra_peak_bytes: highest RSS above the baseline during the saves (sampled every "
            "2 ms, and from getrusage's peak when the saves set it), arena included",
            "rss_after_save_bytes: RSS above the baseline after each save completed; "
            "asyncckpt keeps its arena between saves by design, so this stays near the state "
            "size, and it must not grow from save to save",
            "asyncckpt_x<N> is the leak check: N consecutive saves of a smaller state",
        ],
    }
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench_memory.json")
    write_memory_json(res, json_path)
    for key, r in results.items():
        print(
            f"  {key:22s} state {r['raw_bytes'] / MIB:7.0f} MiB  extra peak "
            f"{r['extra_peak_bytes'] / MIB:7.0f} MiB (state + "
            f"{r['extra_peak_minus_state_bytes'] / MIB:5.0f} MiB)  growth after the first "
            f"save {r['growth_after_first_save_bytes'] / MIB:+6.1f} MiB over {r['saves']} saves"
        )
    if results:
        plot_memory(res, os.path.join(args.out, "bench_memory.png"))
    print(f"wrote {json_path}")
    return 1 if errors else 0


#: Points per RSS timeline in bench_memory.json (the raw samples go to an untracked file).
TIMELINE_POINTS = 200


def downsample(points: list[Any], limit: int = TIMELINE_POINTS) -> list[Any]:
    """At most ``limit`` of the ``(seconds, bytes)`` points, in order: the highest of each
    run of consecutive samples, so the peaks the figures are about survive.

    Example:
        >>> downsample([(0, 1), (1, 5), (2, 2), (3, 3), (4, 9)], limit=2)
        [(1, 5), (4, 9)]
    """
    if len(points) <= limit:
        return list(points)
    size = -(-len(points) // limit)  # ceil: every bucket but the last is full
    return [max(points[i : i + size], key=lambda p: p[1]) for i in range(0, len(points), size)]


def write_memory_json(res: dict[str, Any], json_path: str) -> None:
    """Write ``bench_memory.json`` with timelines of at most ``TIMELINE_POINTS`` points (kept in
    git) and every sample beside it in ``bench_memory.samples.json`` (ignored by git)."""
    samples_path = json_path.removesuffix(".json") + ".samples.json"
    raw = {k: r.get("timeline", []) for k, r in res["results"].items()}
    with open(samples_path, "w") as f:
        json.dump({"benchmark": "bench_memory", "timelines": raw}, f)
        f.write("\n")
    summary = {
        **res,
        "results": {k: {**r, "timeline": downsample(raw[k])} for k, r in res["results"].items()},
        "notes": [
            *res.get("notes", []),
            f"timeline: at most {TIMELINE_POINTS} points (the highest sample of each run of "
            f"consecutive ones); every sample is in {os.path.basename(samples_path)}, which git "
            "ignores",
        ],
    }
    write_json(summary, json_path)


def plot_memory(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    results = res["results"]
    leak = {k: v for k, v in results.items() if "_x" in k}
    main = {k: v for k, v in results.items() if k not in leak}
    fig, axes = plt.subplots(1, 2 if leak else 1, figsize=(12 if leak else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    state = None
    for key, r in main.items():
        ts = [t for t, _ in r["timeline"]]
        ax.plot(ts, [b / MIB for _, b in r["timeline"]], label=key, lw=1)
        state = r["raw_bytes"] / MIB
    if state is not None:
        ax.axhline(state, color="grey", ls=":", lw=1, label="state size")
        ax.axhline(state + 256, color="k", ls="--", lw=1, label="target: state + 256 MiB")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS above baseline, MiB")
    ax.set_title(f"host memory during {res['config']['saves']} consecutive saves", fontsize=10)
    ax.legend(fontsize=8)
    if leak:
        ax = axes[0][1]
        for key, r in leak.items():
            after = [b / MIB for b in r["rss_after_save_bytes"]]
            ax.plot(range(1, len(after) + 1), after, marker=".", label=f"{key}: after each save")
            ax.axhline(r["raw_bytes"] / MIB, color="grey", ls=":", lw=1, label="state size")
        ax.set_xlabel("save #")
        ax.set_ylabel("RSS above baseline, MiB")
        ax.set_ylim(bottom=0)
        ax.set_title("leak check", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    savefig(fig, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:
        ap = argparse.ArgumentParser(prog="bench_memory.py --probe")
        ap.add_argument("--method", required=True, choices=[*MEMORY_METHODS, "asyncckpt_none"])
        ap.add_argument("--size-mib", type=float, required=True)
        ap.add_argument("--saves", type=int, required=True)
        ap.add_argument("--json", required=True)
        ap.add_argument("--tmp-dir", default=None)
        args = ap.parse_args(argv[1:])
        with open(args.json, "w") as f:
            json.dump(memory_probe(args), f)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB, 3 saves, no DCP/leak run")
    ap.add_argument("--size-mib", type=float, default=1024.0)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=MEMORY_METHODS, choices=MEMORY_METHODS)
    ap.add_argument("--leak-saves", type=int, default=50, help="0 to skip the leak check")
    ap.add_argument("--leak-size-mib", type=float, default=64.0)
    ap.add_argument("--tmp-dir", default=None)
    ap.add_argument("--out", default=str(RESULTS))
    return memory_bench(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
