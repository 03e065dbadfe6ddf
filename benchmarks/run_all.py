"""Run every benchmark, then write the page of targets (``make bench``).

Each benchmark runs as a subprocess with its own JSON and PNG under ``--out``; then the rows
of ``report.py`` are evaluated against those JSONs and written to ``run_all.json`` (under
``--out``) and ``docs/benchmarks.md``. A benchmark that fails is reported as such; the
others still run, and its rows say "not measured".

Usage::

    python benchmarks/run_all.py [--quick] [--out DIR] [--docs PATH] [--skip NAME ...]

``--quick`` runs every benchmark in its quick mode and writes its results and
``benchmarks.md`` to ``--out`` (a new temporary directory by default), never to ``docs/``.
``--skip`` leaves benchmarks out; their figures are taken from a JSON already in ``--out``
if there is one (marked as reused), otherwise reported as not run. ``bench_gpu.json``, written
by ``scripts/gpu_check.sh`` on a GPU machine, is shown when it is in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report
from common import DOCS, HERE, REPO, RESULTS, code_state, loadavg, machine_info, write_json

#: The methods of bench_peers.py that snapshot (on N(0,1) they all run).
_SNAPSHOTS = ("asyncckpt", "dcp_async_save", "tensorizer")
#: name -> (full run, quick run, JSON, PNGs with their titles).
BENCHES: dict[str, dict[str, Any]] = {
    "save": {
        "cmd": ["bench_save.py", "--size-mib", "1024", "--repeats", "3"],
        "quick": ["bench_save.py", "--quick"],
        "json": "bench_save.json",
        "png": {
            "bench_save.png": "save, load and stall against torch.save and DCP",
            "python_speed.png": "pure-Python speed beside a background save, per method",
        },
    },
    "codec": {
        "cmd": ["bench_codec.py"],
        "quick": ["bench_codec.py", "--quick"],
        "json": "bench_codec.json",
        "png": {"bench_codec.png": "compression on all-MiniLM-L6-v2"},
    },
    "memory": {
        "cmd": ["bench_memory.py"],
        "quick": ["bench_memory.py", "--quick"],
        "json": "bench_memory.json",
        "png": {"bench_memory.png": "host memory during saves"},
    },
    "train": {
        "cmd": ["bench_train.py"],
        "quick": ["bench_train.py", "--quick"],
        "json": "bench_train.json",
        "png": {
            "bench_train.png": "training step time while checkpointing",
            "bench_train_trace.png": "step times of one round of each mode: dashed red where "
            "a save is called, orange while a write is in flight",
        },
    },
    "gil": {
        "cmd": ["gil_window.py", "--size-mib", "512", "--repeats", "2"],
        "quick": ["gil_window.py", "--size-mib", "8", "--repeats", "1"],
        "json": "gil_window.json",
        "png": {"gil_window.png": "time to durable beside a busy Python thread"},
    },
    "storage": {
        "cmd": ["bench_storage.py"],
        "quick": ["bench_storage.py", "--quick"],
        "json": "bench_storage.json",
        "png": {"bench_storage.png": "S3 (moto) and a slow link"},
    },
    "sharded": {
        "cmd": ["bench_sharded.py"],
        "quick": ["bench_sharded.py", "--quick"],
        "json": "bench_sharded.json",
        "png": {"bench_sharded.png": "sharded checkpoints: FSDP2 on 2 gloo ranks, 1-512 ranks"},
    },
    "peers": {
        "cmd": ["bench_peers.py"],
        "quick": ["bench_peers.py", "--quick"],
        "json": "bench_peers.json",
        "png": {"bench_peers.png": "asyncckpt beside the peers a user would pick instead"},
    },
    "peers_weights": {
        # Time to durable on real weights beside the peers that snapshot (issue 32: only
        # those can be the best peer); no training loop.
        "cmd": ["bench_peers.py", "--state", "weights", "--no-train", "--methods", *_SNAPSHOTS],
        "quick": ["bench_peers.py", "--state", "weights", "--no-train", "--quick"],
        "json": "bench_peers_weights.json",
        "png": {"bench_peers_weights.png": "the same on MiniLM weights and Adam moments"},
    },
    "dropin": {
        "cmd": ["bench_dropin.py", "--saves", "300"],
        "quick": ["bench_dropin.py", "--saves", "10", "--no-seaweed"],
        "json": "bench_dropin.json",
        "png": {},
    },
    "partial": {
        "cmd": ["bench_partial.py"],
        "quick": ["bench_partial.py", "--quick"],
        "json": "bench_partial.json",
        "png": {"bench_partial.png": 'model-only load (keys=["model"]) of a model+Adam file'},
    },
}
#: Written elsewhere (scripts/gpu_check.sh), shown when present.
EXTERNAL_JSON = ["bench_gpu.json"]


def run_bench(name: str, out: Path, quick: bool, timeout: float, log_dir: Path) -> dict[str, Any]:
    """Run one benchmark as a subprocess, echoing its output and logging it to ``log_dir``."""
    spec = BENCHES[name]
    argv = spec["quick" if quick else "cmd"]
    cmd = [sys.executable, str(HERE / argv[0]), *argv[1:], "--out", str(out)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    record: dict[str, Any] = {"name": name, "cmd": cmd[1:], "loadavg_before": loadavg()}
    t0 = time.perf_counter()
    with open(log_dir / f"{name}.log", "w") as log:
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
    record["log"] = str(log_dir / f"{name}.log")
    has_json = (out / spec["json"]).exists()
    record["status"] = "ok" if rc == 0 and has_json else ("partial" if has_json else "failed")
    missing = [p for p in spec["png"] if not (out / p).exists()]
    if missing:
        record["png_missing"] = missing
    print(f"=== {name}: {record['status']} in {record['wall_s']} s", flush=True)
    return record


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
    earlier = _earlier_summary(out)
    machine = machine_info()
    machine["code_at_start"] = code_state()
    machine["measured_at"] = _now()
    print(f"results under {out}; load average {machine['loadavg']}", flush=True)
    runs: list[dict[str, Any]] = []
    log_dir = Path(tempfile.mkdtemp(prefix="asyncckpt-bench-logs-"))  # not in the results
    t0 = time.perf_counter()
    timeout = 600.0 if args.quick else 3600.0
    for name, spec in BENCHES.items():
        if name in args.skip:
            if not (out / spec["json"]).exists():
                runs.append({"name": name, "status": "not run"})
                continue
            before = next((r for r in earlier.get("runs", []) if r.get("name") == name), {})
            runs.append({**before, "name": name, "status": "reused"})
            continue
        stale = out / spec["json"]
        if stale.exists():
            stale.unlink()  # never report an earlier run's figures as this run's
        runs.append(run_bench(name, out, args.quick, timeout, log_dir))
    machine["code_at_end"] = code_state()
    if earlier.get("machine") and all(r["status"] != "ok" for r in runs):
        machine = earlier["machine"]  # nothing measured now: the figures are that run's
    data = report.load_results(out, [s["json"] for s in BENCHES.values()] + EXTERNAL_JSON)
    rows = report.evaluate_all(data)
    summary = {
        "benchmark": "run_all",
        "quick": args.quick,
        "machine": machine,
        "wall_s": round(time.perf_counter() - t0, 1),
        "runs": runs,
        "figures": rows,
        "peers": report.peer_winners(data.get("bench_peers.json") or {}),
    }
    write_json(summary, out / "run_all.json")
    image_dir = os.path.relpath(out, docs.parent.resolve()).replace(os.sep, "/")
    plots = [
        (png, title)
        for run in runs
        if run["status"] in ("ok", "partial", "reused")
        for png, title in BENCHES[run["name"]]["png"].items()
        if (out / png).exists()
    ]
    page = report.render(
        rows, runs, data, machine, quick=args.quick, image_dir=image_dir, plots=plots
    )
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(page, encoding="utf-8")
    print_rows(rows)
    print(f"\nwrote {out / 'run_all.json'} and {docs} in {summary['wall_s']} s")
    failed = [r["name"] for r in runs if r["status"] in ("failed", "partial")]
    if failed:
        print(f"failed: {failed} (see their .log under {log_dir})", file=sys.stderr)
    return 1 if failed else 0


def _earlier_summary(out: Path) -> dict[str, Any]:
    """The ``run_all.json`` of the run before this one in ``out`` (empty if none)."""
    try:
        earlier = json.loads((out / "run_all.json").read_text())
    except (OSError, ValueError):
        return {}
    return earlier if isinstance(earlier, dict) else {}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The target table on the terminal."""
    print(f"\n{'figure':30s} {'value':>10s} {'target':>12s}  verdict")
    for r in rows:
        print(
            f"{r['id']:30s} {report.fmt(r['value'], r['unit']):>10s} "
            f"{report.target_text(r):>12s}  {r['verdict']}"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
