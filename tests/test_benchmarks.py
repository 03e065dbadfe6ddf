"""Smoke test of the save/load benchmark: it runs, and its JSON has every figure.

No timing thresholds: speed is what the benchmark reports, not what tests assert.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_save.py"

SAVES = [
    "copy_baseline",
    "asyncckpt_zstd",
    "asyncckpt_none",
    "asyncckpt_zstd_cold",
    "torch_save",
]
DCP_SAVES = ["dcp_async_save", "dcp_async_save_reused_stager", "dcp_save"]
LOADS = ["torch_load", "asyncckpt_load_zstd", "asyncckpt_load_none"]


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_bench_save_quick(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--tmp-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "bench_save.json").read_text())
    assert (out / "bench_save.png").stat().st_size > 0

    assert positive(res["machine"]["cpu_count"])
    assert res["machine"]["torch"]
    assert res["config"]["repeats"] == 1 and res["config"]["quick"] is True
    assert positive(res["config"]["raw_bytes"])
    assert positive(res["baseline"]["copy_s"])
    # asyncckpt and torch must work; DCP failures are recorded, not fatal, but none expected
    assert not {k for k in res["errors"] if not k.startswith("dcp")}, res["errors"]

    for name in SAVES + [k for k in DCP_SAVES if k not in res["errors"]]:
        entry = res["save"][name]
        assert "error" not in entry, entry
        assert positive(entry["blocked_s"]), (name, entry)
        assert positive(entry["blocked_x_copy"]), (name, entry)
        if name != "copy_baseline":
            assert positive(entry["durable_s"]) and positive(entry["durable_x_copy"]), name
            assert entry["durable_s"] >= entry["blocked_s"], (name, entry)
            assert positive(entry["stored_bytes"]) and positive(entry["stored_fraction"]), name
    assert res["save"]["copy_baseline"]["blocked_x_copy"] == pytest.approx(1.0)
    for name in ("asyncckpt_zstd", "asyncckpt_none", "asyncckpt_zstd_cold"):
        assert positive(res["save"][name]["stats_blocking_s"])
        assert positive(res["save"][name]["stats_total_s"])
    # an uncompressed file holds all the raw bytes
    assert res["save"]["asyncckpt_none"]["stored_bytes"] >= res["config"]["raw_bytes"]

    for name in LOADS + (["dcp_load"] if "dcp_load" not in res["errors"] else []):
        entry = res["load"][name]
        assert positive(entry["load_s"]) and positive(entry["load_x_torch_load"]), (name, entry)
    assert res["load"]["torch_load"]["load_x_torch_load"] == pytest.approx(1.0)
    # the warm-up round checked that every loader returned the saved values
    for name in LOADS:
        assert res["load"][name].get("verified_equal") is True, name

    # issue 12: durable paired with torch.save by two methods, first save, Python speed
    paired = res["durable_paired"]
    for c in ("none", "zstd"):
        for m in (f"save_{c}", f"checkpointer_{c}"):
            assert positive(paired[f"{m}_x_torch_save"]), (m, paired)
            lo, hi = paired[f"{m}_x_torch_save_spread"]
            assert lo <= paired[f"{m}_x_torch_save"] <= hi
        assert 0 <= paired[f"agreement_{c}"] < 1
    rounds = paired["rounds"]
    assert rounds >= 2  # a count of rounds, not a duration
    assert len(paired["raw_s"]["torch_save"]) == rounds
    for mode in ("plain", "reserve"):
        assert positive(res["first_save"][f"{mode}_x_copy"]), res["first_save"]
    for m in ("asyncckpt_zstd", "asyncckpt_none", "torch_save_thread", "dcp_async_save"):
        assert positive(res["python_speed"][f"{m}_x_idle"]), res["python_speed"]

    # the benchmark's temp directory (checkpoints of every method) is removed
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("bench_save-")]
