"""What a model-only load saves: ``asyncckpt.load(f, keys=["model"])`` of a model+Adam file.

An evaluation or inference job needs the weights, not the optimizer; for Adam the optimizer
states (``exp_avg``, ``exp_avg_sq``) are twice the weights. This saves one checkpoint
``{"model": ..., "optim": ..., "step": ...}`` (an MLP after one Adam step, default
compression) and then, in the same process, loads it in turns, the order reversed every
other round: the whole file, and ``keys=["model"]``. For each it records

* ``time_s``: the load's wall time (median and [min, max] over the rounds);
* ``bytes_read``: the bytes the process read while loading (``rchar`` of ``/proc/self/io``,
  every thread; the file is in the page cache, so this is what the load asks for, not what
  the disk delivers).

``ratios.bytes_read_fraction`` (model-only ÷ full) is compared with ``model_share``, the
model's share of the checkpoint's tensor bytes (about a third for Adam): reading only the
model's chunks gives about that, plus the manifest both loads read.

Usage::

    python benchmarks/bench_partial.py [--quick] [--model-mib 128] [--rounds 7]
                                       [--out benchmarks/results]

Writes ``bench_partial.json`` and ``bench_partial.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import asyncckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    code_state,
    loadavg,
    machine_info,
    pyplot,
    savefig,
    tensor_bytes,
    write_json,
)

METHODS = ("full", "model_only")


def read_chars() -> int | None:
    """Bytes this process has read through read syscalls so far (Linux), None elsewhere."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def model_and_adam(model_mib: float) -> dict[str, Any]:
    """An MLP of about ``model_mib`` MiB of fp32 weights after one Adam step."""
    width = 1024
    layers = max(1, round(model_mib * (1 << 20) / (4 * width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(8, width)).square().mean().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": 1}


def one_load(path: str, method: str) -> tuple[float, int | None]:
    keys = ["model"] if method == "model_only" else None
    before = read_chars()
    t0 = time.perf_counter()
    got = asyncckpt.load(path, map_location="cpu", keys=keys)
    elapsed = time.perf_counter() - t0
    after = read_chars()
    assert ("optim" in got) == (method == "full")
    return elapsed, None if before is None or after is None else after - before


def summary(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "spread": [min(xs), max(xs)]}


def run(model_mib: float, rounds: int, out: str | None) -> dict[str, Any]:
    state = model_and_adam(model_mib)
    model_bytes, all_bytes = tensor_bytes(state["model"]), tensor_bytes(state)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    reads: dict[str, list[float]] = {m: [] for m in METHODS}
    load_before = loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.ackpt")
        asyncckpt.save(state, path).result()
        file_bytes = os.path.getsize(path)
        one_load(path, "full")  # warm-up: thread pools, page cache
        for r in range(rounds):
            for method in METHODS if r % 2 == 0 else METHODS[::-1]:
                elapsed, read = one_load(path, method)
                times[method].append(elapsed)
                if read is not None:
                    reads[method].append(float(read))
    methods = {
        m: {
            "time_s": summary(times[m]),
            "bytes_read": summary(reads[m]) if reads[m] else None,
        }
        for m in METHODS
    }
    ratios: dict[str, Any] = {
        "time_fraction": statistics.median(
            p / f for p, f in zip(times["model_only"], times["full"], strict=True)
        ),
    }
    if reads["full"]:
        ratios["bytes_read_fraction"] = (
            methods["model_only"]["bytes_read"]["median"] / methods["full"]["bytes_read"]["median"]
        )
    res = {
        "benchmark": "bench_partial",
        "config": {"model_mib": model_mib, "rounds": rounds, "compression": "zstd"},
        "model_bytes": model_bytes,
        "tensor_bytes": all_bytes,
        "file_bytes": file_bytes,
        "model_share": model_bytes / all_bytes,
        "methods": methods,
        "ratios": ratios,
        "machine": {**machine_info(), "loadavg_before": load_before, "loadavg_after": loadavg()},
        "code": code_state(),
    }
    if out is not None:
        write_json(res, os.path.join(out, "bench_partial.json"))
        plot(res, os.path.join(out, "bench_partial.png"))
    return res


def plot(res: dict[str, Any], path: str) -> None:
    """Two panels: MiB read and seconds, full load beside the model-only load."""
    plt = pyplot()
    fig, (ax_bytes, ax_time) = plt.subplots(1, 2, figsize=(9, 4))
    labels = ["full load", 'keys=["model"]']
    colors = ["#888888", "#1f77b4"]
    panels = ((ax_bytes, "bytes_read", 1 / (1 << 20), "MiB read"), (ax_time, "time_s", 1, "s"))
    for ax, key, scale, unit in panels:
        stats = [res["methods"][m][key] for m in METHODS]
        if any(s is None for s in stats):
            ax.set_title(f"{unit}: not measured on this system")
            continue
        med = [s["median"] * scale for s in stats]
        err = [
            [(s["median"] - s["spread"][0]) * scale for s in stats],
            [(s["spread"][1] - s["median"]) * scale for s in stats],
        ]
        ticks = [
            f"{label}\n{v:.3g} {unit.split()[0]}" for label, v in zip(labels, med, strict=True)
        ]
        ax.bar(ticks, med, color=colors, yerr=err, capsize=6)
        ax.set_ylabel(unit)
        ax.set_ylim(0, max(s["spread"][1] for s in stats) * scale * 1.1)
    ax_bytes.set_title("bytes read (median, min–max)")
    ax_time.set_title("load time (median, min–max)")
    share = res["model_share"]
    fig.suptitle(
        f"model-only load of a model+Adam checkpoint ({res['model_bytes'] / (1 << 20):.0f} MiB "
        f"model, {res['file_bytes'] / (1 << 20):.0f} MiB file; model's share {share:.0%})"
    )
    fig.tight_layout()
    savefig(fig, path)


def print_table(res: dict[str, Any]) -> None:
    print(f"{'load':12s} {'median s':>9s} {'min–max s':>17s} {'MiB read':>9s}")
    for m in METHODS:
        t, b = res["methods"][m]["time_s"], res["methods"][m]["bytes_read"]
        mib = "–" if b is None else f"{b['median'] / (1 << 20):.1f}"
        lo, hi = t["spread"]
        print(f"{m:12s} {t['median']:9.4f} {lo:8.4f}–{hi:8.4f} {mib:>9s}")
    print(f"model's share of tensor bytes {res['model_share']:.3f}; ratios {res['ratios']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 4 MiB model, 3 rounds (seconds)")
    ap.add_argument("--model-mib", type=float, default=128.0, help="model size (default 128)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of both loads (default 7)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    model_mib, rounds = (4.0, 3) if args.quick else (args.model_mib, args.rounds)
    res = run(model_mib, rounds, args.out)
    print_table(res)
    print(f"\nwrote {os.path.join(args.out, 'bench_partial.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
