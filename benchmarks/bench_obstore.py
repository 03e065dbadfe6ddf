"""Issue 30: the S3 backend on s3fs or on obstore, measured with one harness on SeaweedFS.

For each size (``--sizes-mib``, default 128 and 1024) and each of ``--rounds`` paired
rounds, on the same bytes: boto3's s3transfer (``upload_file``/``download_file``), then
asyncckpt on s3fs, then asyncckpt on obstore (the order of the two backends alternates
from round to round). Each asyncckpt round saves (until durable) and loads in the process
that saved (warm: client, connections and imports ready). Then ``--rounds`` fresh-process
loads of each (a new interpreter that has imported torch; timed: ``import asyncckpt`` +
``load``, or ``import boto3`` + client + ``download_file``). Each ratio against
s3transfer is taken within its round; medians and the spread of the rounds are reported.

Also: the import time of each client stack in a fresh interpreter that has imported torch
(``import s3fs`` against ``import obstore, obstore.store``), and the load average at the
start and end.

Usage::

    python benchmarks/bench_obstore.py [--sizes-mib 128 1024] [--rounds 3] [--out DIR]

Writes ``bench_obstore.json`` under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_storage import (
    _FRESH_ASYNCCKPT,
    _FRESH_S3TRANSFER,
    BUCKET,
    MIB,
    _child_seconds,
    make_state,
    measure,
    s3transfer_pair,
)
from common import write_json
from obstore_route import use_obstore

from tests.servers import SeaweedServer, fake_aws_environment

BACKENDS = ("s3fs", "obstore")

#: A fresh-process load through obstore: as ``_FRESH_ASYNCCKPT``, with s3:// routed first.
_FRESH_OBSTORE = """
import json, sys, time
import torch
t = time.perf_counter()
import asyncckpt
sys.path.insert(0, sys.argv[3])
from obstore_route import use_obstore
use_obstore()
got = asyncckpt.load(sys.argv[1], storage_options=json.loads(sys.argv[2]))
assert "s3fs" not in sys.modules, "the obstore load imported s3fs"
print(json.dumps({"s": time.perf_counter() - t}))
"""
#: The import of one client stack in a fresh interpreter that has imported torch.
_IMPORT = """
import json, sys, time
import torch
t = time.perf_counter()
for name in sys.argv[1].split(","):
    __import__(name)
print(json.dumps({"s": time.perf_counter() - t}))
"""
IMPORTS = {"s3fs": "s3fs", "obstore": "obstore,obstore.store"}


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max and every value."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": values,
    }


def one_size(server: Any, client: Any, mib: float, rounds: int, tmp: str) -> dict[str, Any]:
    """Paired rounds at one size: s3transfer, then both backends (alternating order)."""
    state = make_state(int(mib * MIB), "mixed")
    src, dst = os.path.join(tmp, "raw.bin"), os.path.join(tmp, "back.bin")
    with open(src, "wb") as f:
        for t in state.values():
            f.write(t.view(__import__("torch").uint8).numpy().tobytes())
    raw_key = f"raw-{uuid.uuid4().hex[:6]}.bin"
    opts = server.storage_options
    rows: dict[str, list[float]] = {}
    warm = make_state(1 << 20, "mixed")  # writer process, clients, connections, codecs
    for backend in BACKENDS:
        undo = use_obstore() if backend == "obstore" else None
        measure(warm, f"s3://{BUCKET}/warmup-{backend}", opts, None, 1)
        if undo is not None:
            undo()
    for r in range(rounds):
        up, down = s3transfer_pair(client, src, dst, raw_key)
        rows.setdefault("s3transfer_up", []).append(up)
        rows.setdefault("s3transfer_down", []).append(down)
        for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
            undo = use_obstore() if backend == "obstore" else None
            try:
                got = measure(state, f"s3://{BUCKET}/{backend}", opts, None, 1)
            finally:
                if undo is not None:
                    undo()
            rows.setdefault(f"{backend}_save", []).append(got["save_s"])
            rows.setdefault(f"{backend}_load", []).append(got["load_s"])
            rows.setdefault(f"{backend}_save_vs_s3transfer", []).append(up / got["save_s"])
            rows.setdefault(f"{backend}_load_vs_s3transfer", []).append(down / got["load_s"])
        print(f"  {mib:g} MiB round {r + 1}: " + _line(rows, -1), flush=True)
    rows.update(fresh_loads(server, state, raw_key, rounds, tmp))
    return {k: spread(v) for k, v in rows.items()}


def _line(rows: dict[str, list[float]], i: int) -> str:
    return ", ".join(f"{k} {v[i]:.3f}" for k, v in rows.items())


def fresh_loads(
    server: Any, state: Any, raw_key: str, rounds: int, tmp: str
) -> dict[str, list[float]]:
    """A restart's load in a fresh process: s3transfer, s3fs, obstore, in turn per round."""
    import asyncckpt

    url = f"s3://{BUCKET}/fresh-{uuid.uuid4().hex[:6]}.ackpt"
    asyncckpt.save(state, url, storage_options=server.storage_options).result()
    opts = json.dumps(server.storage_options)
    here = os.path.dirname(os.path.abspath(__file__))
    commands = {
        "fresh_s3transfer": [
            sys.executable,
            "-c",
            _FRESH_S3TRANSFER,
            server.endpoint_url,
            BUCKET,
            raw_key,
            os.path.join(tmp, "fresh.bin"),
        ],
        "fresh_s3fs": [sys.executable, "-c", _FRESH_ASYNCCKPT, url, opts],
        "fresh_obstore": [sys.executable, "-c", _FRESH_OBSTORE, url, opts, here],
    }
    rows: dict[str, list[float]] = {}
    for _ in range(rounds):
        got = {name: _child_seconds(cmd, subprocess) for name, cmd in commands.items()}
        for name, seconds in got.items():
            rows.setdefault(name, []).append(seconds)
        for backend in BACKENDS:
            rows.setdefault(f"fresh_{backend}_vs_s3transfer", []).append(
                got["fresh_s3transfer"] / got[f"fresh_{backend}"]
            )
    return rows


def import_times(rounds: int) -> dict[str, Any]:
    """Seconds to import each client stack in a fresh interpreter that has imported torch."""
    out: dict[str, list[float]] = {}
    for _ in range(rounds):
        for backend, modules in IMPORTS.items():
            cmd = [sys.executable, "-c", _IMPORT, modules]
            out.setdefault(backend, []).append(_child_seconds(cmd, subprocess))
    return {k: spread(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[128.0, 1024.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))  # the writer process unpickles the
    path = [here, os.environ.get("PYTHONPATH", "")]  # obstore backend: it must find it
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    for name, value in fake_aws_environment().items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    import boto3

    res: dict[str, Any] = {"loadavg_start": os.getloadavg(), "cpu_count": os.cpu_count()}
    res["import_s"] = import_times(max(args.rounds, 5))
    print("  imports:", {k: round(v["median"], 3) for k, v in res["import_s"].items()})
    with SeaweedServer() as server, tempfile.TemporaryDirectory() as tmp:
        server.create_bucket(BUCKET)
        client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
        res["sizes"] = {
            f"{mib:g}": one_size(server, client, mib, args.rounds, tmp) for mib in args.sizes_mib
        }
    res["loadavg_end"] = os.getloadavg()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_obstore.json")
    write_json(res, path)
    for mib, rows in res["sizes"].items():
        print(f"\n{mib} MiB (median [min-max] of {args.rounds} rounds)")
        for name, s in rows.items():
            print(f"  {name:32s} {s['median']:8.3f}  [{s['min']:.3f}-{s['max']:.3f}]")
    print(f"\nload average {res['loadavg_start']} -> {res['loadavg_end']}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
