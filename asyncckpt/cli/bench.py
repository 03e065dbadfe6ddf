"""``asyncckpt bench URL``: sync vs async save and load on your storage."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncckpt._storage import Storage, resolve
from asyncckpt.cli.common import (
    EXIT_OK,
    FileRef,
    UsageError,
    display,
    emit,
    plural,
    progress,
)
from asyncckpt.cli.formats import load_torch, save_torch
from asyncckpt.cli.progress import Progress, format_bytes
from asyncckpt.cli.terminal import table
from asyncckpt.errors import AsyncCkptError


def _bench_state(nbytes: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors totalling about ``nbytes``, in pieces of at most 16 MiB."""
    g = torch.Generator().manual_seed(0)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    piece = (16 << 20) // itemsize
    left = max(1, nbytes // itemsize)
    state: dict[str, torch.Tensor] = {}
    while left > 0:
        n = min(piece, left)
        state[f"layer{len(state)}.weight"] = (torch.randn(n, generator=g) * 0.02).to(dtype)
        left -= n
    return state


def _url_join(url: str, name: str) -> str:
    if "://" in url:
        return url.rstrip("/") + "/" + name
    return os.path.join(url, name)


#: What ``bench`` times, in the order of its table.
OPERATIONS = (
    "copy into preallocated buffers",
    "torch.save (sync, durable)",
    "asyncckpt.save: caller blocked",
    "asyncckpt.save: until durable",
    "torch.load (weights_only)",
    "asyncckpt.load",
)
#: What the first ``asyncckpt.save`` of a process does that later saves reuse.
FIRST_SAVE_NOTE = (
    "the first asyncckpt.save of a process also sets up what later saves reuse (host memory "
    "for the snapshot, the writer process)"
)


@dataclass
class _Bench:
    """One ``bench`` run: the state, where it goes, and the times measured."""

    args: argparse.Namespace
    state: dict[str, torch.Tensor]
    storage: Storage
    folder: str
    folder_url: str
    runs: dict[str, list[float]] = field(default_factory=lambda: {n: [] for n in OPERATIONS})
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def raw(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        out = fn()
        self.runs[name].append(time.perf_counter() - started)
        return out

    def one_round(self, bar: Progress, label: str, buffers: list[torch.Tensor]) -> None:
        """Time each operation once."""
        from asyncckpt._api import dropin as api

        ackpt_url = _url_join(self.folder_url, "state.ackpt")
        pt = FileRef(self.storage, self.storage.join(self.folder, "state.pt"))
        self.timed(
            OPERATIONS[0], lambda: [b.copy_(t) for b, t in zip(buffers, self.state.values())]
        )
        bar.relabel(f"{label} torch.save")
        self.sizes["torch"] = self.timed(
            OPERATIONS[1], lambda: save_torch(self.state, pt.storage, pt.path)
        )
        bar.update(self.raw)
        bar.relabel(f"{label} asyncckpt.save")
        info = api.save(self.state, ackpt_url, storage_options=self.args.options).result()
        self.runs[OPERATIONS[2]].append(info.stats.blocking_s)
        self.runs[OPERATIONS[3]].append(info.stats.total_s or math.nan)
        self.sizes["asyncckpt"] = info.stats.stored_bytes or 0
        bar.update(self.raw)
        bar.relabel(f"{label} torch.load")
        self.timed(OPERATIONS[4], lambda: load_torch(pt, mmap=False))
        bar.update(self.raw)
        bar.relabel(f"{label} asyncckpt.load")
        options = self.args.options
        self.timed(
            OPERATIONS[5],
            lambda: api.load(ackpt_url, map_location="cpu", storage_options=options),
        )
        bar.update(self.raw)

    def run(self) -> None:
        """All rounds, then the folder is removed (unless ``--keep``)."""
        from asyncckpt._api import dropin as api

        buffers = [t.clone() for t in self.state.values()]  # its pages faulted in before timing
        repeat = self.args.repeat
        try:
            with progress(self.args, self.raw * repeat * 4, "bench") as bar:
                for r in range(repeat):
                    self.one_round(bar, f"bench {r + 1}/{repeat}", buffers)
        finally:
            with contextlib.suppress(AsyncCkptError):
                api.wait()
            if not self.args.keep:
                with contextlib.suppress(AsyncCkptError):
                    self.storage.delete_tree(self.folder)

    def results(self) -> dict[str, dict[str, Any]]:
        """Median, runs, ratio to the in-memory copy and throughput of each operation."""
        floor = statistics.median(self.runs[OPERATIONS[0]])
        results = {}
        for name, values in self.runs.items():
            median = statistics.median(values)
            results[name] = {
                "median_s": median,
                "runs_s": values,
                "ratio_to_copy": median / floor if floor > 0 else None,
                "raw_gb_per_s": self.raw / median / 1e9 if median > 0 else None,
            }
        return results


def _lines(bench: _Bench, results: dict[str, dict[str, Any]], plot: str | None) -> list[str]:
    args, raw, sizes = bench.args, bench.raw, bench.sizes
    rows = [
        [
            name,
            f"{r['median_s']:.3f}",
            f"{r['ratio_to_copy']:.1f}" if r["ratio_to_copy"] is not None else "-",
            f"{r['raw_gb_per_s']:.2f}" if r["raw_gb_per_s"] is not None else "-",
        ]
        for name, r in results.items()
    ]
    lines = [
        f"bench on {args.url}: {format_bytes(raw)} of {args.dtype} in "
        f"{plural(len(bench.state), 'tensor')}, median of {plural(args.repeat, 'run')}",
        "",
        *table(["OPERATION", "SECONDS", "x COPY", "GB/s (raw)"], rows),
        "",
        f"stored: torch.save {format_bytes(sizes.get('torch', 0))}, asyncckpt "
        f"{format_bytes(sizes.get('asyncckpt', 0))}"
        + (f" ({100 * sizes['asyncckpt'] / raw:.1f}% of raw)" if sizes.get("asyncckpt") else ""),
        "loads read files just written, so they may come from the page cache",
        FIRST_SAVE_NOTE
        + (
            ": with --repeat 1 that is all these figures show; --repeat 3 or more gives the "
            "steady state"
            if args.repeat < 3
            else f" (the median of {args.repeat} runs counts it once)"
        ),
    ]
    if plot:
        lines.append(f"plot: {plot}")
    elif not args.no_plot:
        lines.append("plot: skipped (matplotlib is not installed)")
    if args.keep:
        lines.append(f"files kept under {display(bench.storage, bench.folder)}")
    return lines


def cmd_bench(args: argparse.Namespace) -> int:
    """``asyncckpt bench URL``."""
    if args.size_mib <= 0 or args.repeat < 1:
        raise UsageError("asyncckpt bench: --size-mib must be positive and --repeat at least 1")
    state = _bench_state(int(args.size_mib * (1 << 20)), getattr(torch, args.dtype))
    folder_url = _url_join(args.url, f"asyncckpt-bench-{uuid.uuid4().hex[:8]}")
    storage, folder = resolve(folder_url, args.options, args.settings)
    bench = _Bench(args, state, storage, folder, folder_url)
    bench.run()
    results = bench.results()
    plot = None if args.no_plot else _plot(results, args.plot, bench.raw, args.url)
    doc = {
        "url": args.url,
        "raw_bytes": bench.raw,
        "dtype": args.dtype,
        "repeat": args.repeat,
        "threads": args.settings.threads,
        "results": results,
        "stored_bytes": bench.sizes,
        "plot": plot,
        "kept": display(storage, folder) if args.keep else None,
    }
    emit(args, doc, _lines(bench, results, plot))
    return EXIT_OK


def _plot(results: dict[str, dict[str, Any]], path: str, raw: int, url: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(results)[::-1]
    values = [results[n]["median_s"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = [
        "#2b6cb0" if n.startswith("asyncckpt") else "#dd6b20" if n.startswith("torch") else "#999"
        for n in names
    ]
    bars = ax.barh(names, values, color=colors)
    for bar, name in zip(bars, names):
        ratio = results[name]["ratio_to_copy"]
        if ratio is not None:
            ax.text(
                bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {ratio:.1f}x", va="center"
            )
    ax.set_xlabel("seconds (median); labels: x the in-memory copy")
    ax.set_title(f"asyncckpt bench: {format_bytes(raw)} on {url}", fontsize=10)
    ax.margins(x=0.2)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
