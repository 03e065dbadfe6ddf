"""Time to durable of a background save while the caller waits or runs pure Python.

A threaded writer releases the GIL for each zstd call, regroup, checksum and write, and must
take it back afterwards; a thread running pure Python gives it up only at the switch
interval (5 ms). This measures what that costs the write, threads against the writer
process (``writer_processes=1``), on two states:

* ``model``: ``bench_save.make_state`` (6 large matrices, 400 small tensors);
* ``small``: 2048 tensors of 256 KiB (a model of many biases and norms).

Usage::

    python benchmarks/gil_window.py [--size-mib 512] [--repeats 2] [--out DIR]

Prints and writes ``gil_window.json`` (median seconds per state, writer, compression and
caller, and each spinning median over the waiting one of the same row) and
``gil_window.png`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_state, pyplot, savefig, settle, writer_processes

import asyncckpt


def small_state(size_bytes: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(64 << 10, generator=gen) for i in range(size_bytes >> 18)}


def durable_s(state: dict[str, torch.Tensor], path: str, compression: str, spin: bool) -> float:
    settle(path)
    started = time.perf_counter()
    handle = asyncckpt.save(state, path, compression=compression)
    n = 0
    while spin and not handle.done():
        for _ in range(200):
            n += 1
    handle.result()
    return time.perf_counter() - started


def measure(size_bytes: int, repeats: int, tmp: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, state in (("model", make_state(size_bytes, "normal")), ("small", None)):
        state = state if state is not None else small_state(size_bytes)
        times: dict[str, list[float]] = {}
        for processes in (0, 1):  # warm both writers (arena, child process) first
            with writer_processes(processes):
                asyncckpt.save(state, os.path.join(tmp, "warm"), compression="none").result()
        for r in range(repeats):
            for processes in (0, 1) if r % 2 == 0 else (1, 0):
                with writer_processes(processes):
                    for compression in ("zstd", "none"):
                        for caller in ("wait", "spin"):
                            key = f"{name}_{'process' if processes else 'threads'}_{compression}"
                            path = os.path.join(tmp, "x")
                            spin = caller == "spin"
                            seconds = durable_s(state, path, compression, spin)
                            times.setdefault(f"{key}_{caller}_s", []).append(seconds)
        for key, values in times.items():
            out[key] = statistics.median(values)
        for key in [k for k in out if k.startswith(name) and k.endswith("_spin_s")]:
            out[key.replace("_spin_s", "_spin_x_wait")] = out[key] / out[key[:-7] + "_wait_s"]
        del state
    return out


def plot(result: dict[str, float], path: str) -> None:
    plt = pyplot()
    rows = sorted({k.rsplit("_", 2)[0] for k in result if k.endswith("_wait_s")})
    fig, ax = plt.subplots(figsize=(9, 4))
    for offset, caller in ((-0.2, "wait"), (0.2, "spin")):
        ax.bar(
            [i + offset for i in range(len(rows))],
            [result[f"{row}_{caller}_s"] for row in rows],
            width=0.4,
            label="caller waits" if caller == "wait" else "caller runs pure Python",
        )
    ax.set_xticks(range(len(rows)), [r.replace("_", "\n") for r in rows], fontsize=8)
    ax.set_ylabel("seconds to durable")
    ax.set_title("Background save beside a busy Python thread: threads vs writer process")
    ax.legend()
    fig.tight_layout()
    savefig(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gil_window-") as tmp:
        result = measure(args.size_mib << 20, args.repeats, tmp)
    text = json.dumps(result, indent=1, sort_keys=True)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gil_window.json"), "w") as f:
        f.write(text + "\n")
    plot(result, os.path.join(args.out, "gil_window.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
