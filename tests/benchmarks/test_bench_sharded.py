"""Smoke test of ``benchmarks/bench_sharded.py --quick`` (the sharded benchmarks of issue 11).

Structure and positivity only, no timing thresholds: the simulation (1, 8 and 64 simulated
ranks on the fault-injection filesystem) commits a version at every rank count, every
rank makes the same number of storage requests, and the FSDP2 part (2 gloo ranks) reports
every method's stall, durable and load times.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_sharded_quick(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sharded.py"), "--quick", "--out", out],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env={
            **os.environ,
            "TMPDIR": str(tmp_path),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads((out / "bench_sharded.json").read_text())
    assert (out / "bench_sharded.png").stat().st_size > 0
    assert res["quick"] is True

    sim = res["sim"]
    assert [r["ranks"] for r in sim["results"]] == [1, 8, 64]
    assert positive(sim["throughput_8_over_1"])
    for r in sim["results"]:
        assert positive(r["raw_bytes"]) and positive(r["throughput_mib_s"]), r
        assert positive(r["slowest_rank_write_s"]) and r["commit_after_last_durable_s"] >= 0, r
        assert positive(r["coordinator_requests"]), r
        if r["ranks"] > 1:
            requests = r["requests_per_rank"]
            assert positive(requests["mean"]), r
            assert requests["min"] == requests["max"], r  # every rank: the same pattern
            assert requests["by_kind"].get("data:open", 0) == 1, requests  # one file each
    per_rank = {r["ranks"]: r["requests_per_rank"]["mean"] for r in sim["results"][1:]}
    assert per_rank[8] == per_rank[64]  # does not grow with the rank count

    fsdp = res["fsdp"]
    assert fsdp["world"] == 2 and positive(fsdp["state_bytes"])
    assert all(positive(b) for b in fsdp["own_shard_bytes"])
    assert positive(fsdp["stall_over_copy_max"])
    assert isinstance(fsdp["extra_rss_over_own_mib_max"], (int, float))
    for name, method in fsdp["methods"].items():
        assert len(method["durable_s"]) == 2 and all(positive(v) for v in method["durable_s"])
        assert positive(method["stall_s_max"]), name
    for name in ("dcp.save via asyncckpt.dcp", "dcp.save via FileSystemWriter"):
        assert positive(fsdp["methods"][name]["load_s_max"])
        assert positive(fsdp["methods"][name]["stored_bytes"])
