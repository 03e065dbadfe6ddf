"""Smoke tests of ``benchmarks/run_all.py`` (``make bench``) and of the GPU benchmark script.

No timing thresholds: the benchmarks report speed, tests only check that they run and that
their JSON and the generated page hold every figure. ``bench_save --quick`` and
``bench_storage --quick`` are smoke-tested by their own tests (test_benchmarks.py,
test_bench_storage.py), so here they are skipped and a bench_save JSON built by
bench_save's own ``summarize`` stands in for them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
FIGURES = {
    "stall_zstd",
    "stall_none",
    "stall_first_save",
    "durable_uncompressed",
    "durable_compressed",
    "load_uncompressed",
    "load_compressed",
    "stored_fp32",
    "stored_bf16",
    "compression_gb_s",
    "memory_extra_peak",
    "train_mean",
    "train_median",
    # issue 12
    "train_overhead_vs_torch",
    "train_overlapped",
    "durable_paired_none",
    "durable_paired_zstd",
    "durable_real_state",
    "stall_first_save_reserve",
    "stall_first_save_plain",
    "python_speed",
    "s3_save_seaweedfs",
    "s3_load_seaweedfs",
    # issue 11
    "sharded_stall",
    "sharded_durable",
    "sharded_memory",
    "dcp_stored",
    "dcp_durable",
    "dcp_load",
    "sharded_scaling",
    "sharded_commit_latency",
}
#: Rows with no value in the quick run: not measured yet, or from the skipped storage run.
UNMEASURED = {"s3_save_seaweedfs", "s3_load_seaweedfs"}
#: Ratios of differences of tiny quick-run step times: on a loaded machine torch.save may
#: cost nothing measurable, and the ratio is then undefined (None) rather than wrong.
NOISY = {"train_overhead_vs_torch"}
#: Figures that the quick run (without bench_save) measures itself.
MEASURED = {
    "stored_fp32",
    "stored_bf16",
    "compression_gb_s",
    "memory_extra_peak",
    "train_mean",
    "train_median",
    "train_overlapped",
    "sharded_stall",
    "sharded_durable",
    "dcp_stored",
    "dcp_durable",
    "dcp_load",
    "sharded_scaling",
}


def number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def positive(x: object) -> bool:
    return number(x) and x > 0  # type: ignore[operator]


def load_module(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def fake_bench_save(out: Path) -> dict[str, Any]:
    """A bench_save.json with made-up seconds, in bench_save's own schema."""
    bench_save = load_module("bench_save")
    rec = bench_save.Recorder()
    for seconds in (0.1, 0.11, 0.12):
        rec.add("copy_baseline", "blocked_s", seconds)
    for i, method in enumerate(m for m in bench_save.SAVE_METHODS if m != "copy_baseline"):
        rec.add(method, "blocked_s", 0.1 + 0.05 * i)
        rec.add(method, "durable_s", 1.0 + 0.1 * i)
        rec.note(method, stored_bytes=1000, stored_fraction=0.9)
    for i, method in enumerate(bench_save.LOAD_METHODS):
        rec.add(method, "load_s", 0.5 + 0.1 * i)
    state = {"w": torch.zeros(256)}
    args = argparse.Namespace(size_mib=0.001, kind="normal", repeats=1, quick=True)
    res: dict[str, Any] = bench_save.summarize(args, rec, state, 1024, str(out))
    methods = (
        "torch_save",
        "save_none",
        "save_zstd",
        "checkpointer_none",
        "checkpointer_zstd",
        "save_zstd_no_writeback",
    )
    res["durable_paired"] = bench_save.paired_summary(
        {m: [1.0 + 0.1 * i, 1.1 + 0.1 * i] for i, m in enumerate(methods)}
    )
    res["first_save"] = bench_save.spread_summary({"plain": [3.0], "reserve": [1.2]}, "_x_copy")
    res["python_speed"] = bench_save.spread_summary(
        {m: [0.9] for m in ("asyncckpt_zstd", "asyncckpt_none", "torch_save_thread")}
        | {"dcp_async_save": [0.8]},
        "_x_idle",
    )
    res["real_state"] = {
        "source": "all-MiniLM-L6-v2",
        "adam_steps": 5,
        "replica_bytes": 300 << 20,
        "replicas": 4,
        "raw_bytes": 1200 << 20,
        "stored_fraction": 0.8,
        "rounds": 2,
        **bench_save.spread_summary(
            {"save_zstd": [0.8, 0.9], "save_zstd_no_writeback": [1.2, 1.4]}, "_x_torch_save"
        ),
    }
    (out / "bench_save.json").write_text(json.dumps(res))
    return res


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_all_quick(tmp_path: Path) -> None:
    out = tmp_path / "results"
    out.mkdir()
    fake_bench_save(out)
    docs = ROOT / "docs" / "benchmarks.md"
    before = docs.read_bytes() if docs.exists() else None
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "run_all.py"),
            "--quick",
            "--out",
            str(out),
            "--skip",
            "save",
            "storage",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # --quick never touches docs/benchmarks.md
    assert (docs.read_bytes() if docs.exists() else None) == before

    summary = json.loads((out / "run_all.json").read_text())
    assert summary["quick"] is True and positive(summary["machine"]["cpu_count"])
    status = {r["name"]: r["status"] for r in summary["runs"]}
    assert status == {
        "save": "reused",
        "codec": "ok",
        "memory": "ok",
        "train": "ok",
        "gil": "ok",
        "storage": "not run",
        "sharded": "ok",
    }
    rows = {r["id"]: r for r in summary["figures"]}
    assert set(rows) >= FIGURES, FIGURES - set(rows)
    for rid, row in rows.items():
        if rid in UNMEASURED:
            assert row["value"] is None and row["met"] is None, (rid, row)
            continue
        if rid in NOISY and row["value"] is None:
            assert row["met"] is None, (rid, row)
            continue
        assert number(row["value"]), (rid, row)  # the fake bench_save fills the rest
        if row["target"] is not None:
            assert isinstance(row["met"], bool), row
    for rid in MEASURED - {"memory_extra_peak"}:
        assert positive(rows[rid]["value"]), rows[rid]
    for rid in ("stored_fp32", "stored_bf16"):
        assert 0 < rows[rid]["value"] < 1  # the codec shrinks real (or synthetic) weights
        assert all(positive(i["value"]) for i in rows[rid]["incumbents"]), rows[rid]

    codec = json.loads((out / "bench_codec.json").read_text())
    for dt in ("fp32", "bf16"):
        r = codec["results"][dt]
        for key in ("asyncckpt_file_fraction", "zstd1_chunked_fraction", "zstd1_stream_fraction"):
            assert 0 < r[key] <= 1.01, (dt, key, r[key])
        for key in ("asyncckpt_encode", "zstd1_pool", "zstd1_native_mt", "asyncckpt_save_memory"):
            assert positive(r["throughput_gb_s"][key]), (dt, key)
    assert set(codec["targets"]) == {
        "stored_fraction_fp32",
        "stored_fraction_bf16",
        "compression_gb_s",
    }
    assert codec["source"]["kind"] in ("all-MiniLM-L6-v2", "synthetic")

    memory = json.loads((out / "bench_memory.json").read_text())
    assert memory["errors"] == {}
    for method in ("asyncckpt", "torch_save"):
        r = memory["results"][method]
        assert positive(r["raw_bytes"]) and positive(r["extra_peak_bytes"])
        assert len(r["rss_after_save_bytes"]) == r["saves"] == 3
        assert r["timeline"]

    train = json.loads((out / "bench_train.json").read_text())
    assert set(train["modes"]) == {"none", "asyncckpt", "asyncckpt_none", "torch_save"}
    for mode, e in train["modes"].items():
        assert positive(e["median_s"]) and positive(e["mean_s"]), mode
        assert e["n_saves"] == (0 if mode == "none" else 2), (mode, e["n_saves"])
    assert positive(train["ratios"]["asyncckpt_mean_x_none"])

    for name in ("bench_codec", "bench_memory", "bench_train", "bench_sharded"):
        assert (out / f"{name}.png").stat().st_size > 0, name
    page = (out / "benchmarks.md").read_text()
    assert "Quick mode" in page and "## Targets (issue 5)" in page
    assert "| figure | asyncckpt | best | target | met? |" in page
    for name in (
        "bench_codec",
        "bench_memory",
        "bench_train",
        "bench_train_trace",
        "bench_sharded",
    ):
        assert f"(./{name}.png)" in page, name
    assert (out / "bench_train_trace.png").stat().st_size > 0
    # issue 12's training rows, and the real-state row from the (fake) bench_save
    assert rows["durable_real_state"]["value"] == pytest.approx(0.85)
    assert "4 replicas after 5 Adam steps" in rows["durable_real_state"]["note"]
    for rid, ratio in (("durable_real_state", 1.3), ("durable_paired_zstd", (1.5 + 1.6 / 1.1) / 2)):
        off = {i["label"]: i["value"] for i in rows[rid]["incumbents"]}
        assert off["asyncckpt.save, writeback left to the fsync (`writeback_mib=0`)"] == (
            pytest.approx(ratio)
        ), rid
    assert rows["train_overhead_vs_torch"]["target"] == 0.75
    assert rows["train_overlapped"]["target"] == 1.5
    assert "previous write was still in flight" in page
    assert "## Sharded checkpoints (issue 11)" in page
    assert page.count("**yes**") + page.count("**no**") == sum(
        1 for r in rows.values() if r["target"] is not None and r["value"] is not None
    )


def test_table_without_results() -> None:
    """Missing benchmarks give rows that say 'not measured', not a crash."""
    run_all = load_module("run_all")
    rows = run_all.figure_rows({name: None for name in run_all.BENCHES})
    assert {r["id"] for r in rows} >= FIGURES
    assert all(r["value"] is None and r["met"] is None for r in rows)
    page = run_all.markdown(rows, [], {}, run_all.machine_info(), False, "../results")
    # The verdict cells only: the notes below the table also say "not measured".
    assert page.count("| not measured |") == sum(1 for r in rows if r["target"] is not None)


def test_verdict_margins() -> None:
    run_all = load_module("run_all")
    met = run_all._row("a", "a", 1.2, "<=", 1.5)
    assert met["met"] is True and run_all._verdict(met) == "**yes** (by 20.0 %)"
    missed = run_all._row("b", "b", 0.6, ">=", 0.7, unit=" GB/s")
    assert missed["met"] is False and run_all._verdict(missed) == "**no** (off by 14.3 %)"
    mem = run_all._row("c", "c", 100.0, "<=", 256.0, unit="state")
    assert run_all._verdict(mem) == "**yes** (by 156 MiB)"
    assert run_all._fmt(100.0, "state") == "state + 100 MiB"
    assert run_all._fmt(-63.0, "state") == "state − 63 MiB"
    close = run_all._row("d", "d", 0.8297, "<=", 0.83, unit="")
    assert run_all._verdict(close) == "**yes** (by 0.04 %)"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_gpu_script_runs(tmp_path: Path) -> None:
    """Without CUDA the GPU benchmark exits 0; its code paths run on the CPU with --device cpu."""
    script = str(BENCH / "bench_gpu.py")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    if not torch.cuda.is_available():
        proc = subprocess.run(
            [sys.executable, script, "--out", str(tmp_path / "none")],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=env,
        )
        assert proc.returncode == 0 and "no CUDA device" in proc.stdout, proc.stderr
        assert not (tmp_path / "none").exists()
    out = tmp_path / "cpu"
    proc = subprocess.run(
        [
            *(sys.executable, script, "--device", "cpu", "--quick"),
            *("--size-mib", "4", "--dtypes", "fp32", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "bench_gpu.json").read_text())
    r = res["results"]["fp32"]
    assert not {k for k in r["errors"] if not k.startswith("dcp")}, r["errors"]
    assert positive(r["floor_s"])
    for method in ("asyncckpt", "asyncckpt_none", "asyncckpt_overlap", "torch_save"):
        e = r["stall"][method]
        assert positive(e["blocked_s"]) and positive(e["durable_s"]), (method, e)
        assert positive(e["blocked_x_floor"]) and positive(e["durable_x_torch_save"]), method
    assert number(r["stall"]["asyncckpt_overlap"]["step_extra_s"])
    for method in ("torch_load", "asyncckpt_load", "asyncckpt_load_none", "asyncckpt_load_into"):
        assert positive(r["load"][method]["load_x_torch_load"]), method
    assert (out / "bench_gpu.png").stat().st_size > 0


def test_train_rows_judge_issue_12_targets() -> None:
    """Mean overhead: (asyncckpt - 1) <= 0.75 (torch.save - 1); overlapped steps <= 1.5x."""
    run_all = load_module("run_all")
    train = {
        "ratios": {
            "asyncckpt_mean_x_none": 1.45,
            "torch_save_mean_x_none": 1.6,
            "asyncckpt_overhead_x_torch_save_overhead": 0.75,
            "asyncckpt_overlapped_median_x_none": 1.6,
        },
        "config": {"writer": "default", "writer_nice": 10, "asyncckpt_threads": 2},
        "modes": {"asyncckpt": {"saves_waited": 3, "n_saves": 10}},
    }
    rows = {r["id"]: r for r in run_all._train_rows(train)}
    assert rows["train_overhead_vs_torch"]["met"] is True  # exactly on the target
    assert rows["train_overlapped"]["met"] is False
    assert "nice 10" in rows["train_overlapped"]["note"]
    assert rows["train_mean"]["value"] == 1.45 and rows["train_mean"]["target"] is None
    assert "3 of 10 saves" in run_all._waited_text(train)
