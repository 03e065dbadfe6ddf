"""Smoke test of the save/load benchmark: it runs, and its JSON has every figure.

No timing thresholds: speed is what the benchmark reports, not what tests assert.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
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


def run_script(tmp_path: Path, script: str, *args: str, timeout: float = 280) -> dict[str, Any]:
    """Run ``benchmarks/<script>`` with ``--out tmp_path/results``; return its JSON."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = script.removesuffix(".py")
    assert (out / f"{name}.png").stat().st_size > 0
    result: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    return result


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_bench_save_quick(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--tmp-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=420,
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
    # Every ratio is against the copy baseline measured in this run, from its own samples
    # (the baseline's own ratio, 1.0 by construction, would check nothing).
    copy_s = statistics.median(res["save"]["copy_baseline"]["raw"]["blocked_s"])
    for name in SAVES + [k for k in DCP_SAVES if k not in res["errors"]]:
        entry = res["save"][name]
        own = statistics.median(entry["raw"]["blocked_s"])
        assert entry["blocked_x_copy"] == pytest.approx(own / copy_s), name
    for name in ("asyncckpt_zstd", "asyncckpt_none", "asyncckpt_zstd_cold"):
        assert positive(res["save"][name]["stats_blocking_s"])
        assert positive(res["save"][name]["stats_total_s"])
    # an uncompressed file holds all the raw bytes
    assert res["save"]["asyncckpt_none"]["stored_bytes"] >= res["config"]["raw_bytes"]

    for name in LOADS + (["dcp_load"] if "dcp_load" not in res["errors"] else []):
        entry = res["load"][name]
        assert positive(entry["load_s"]) and positive(entry["load_x_torch_load"]), (name, entry)
    torch_load_s = statistics.median(res["load"]["torch_load"]["raw"]["load_s"])
    for name in LOADS + (["dcp_load"] if "dcp_load" not in res["errors"] else []):
        entry = res["load"][name]
        own = statistics.median(entry["raw"]["load_s"])
        assert entry["load_x_torch_load"] == pytest.approx(own / torch_load_s), name
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
        assert positive(paired[f"save_{c}_no_writeback_x_torch_save"]), paired
    rounds = paired["rounds"]
    assert rounds >= 2  # a count of rounds, not a duration
    assert len(paired["raw_s"]["torch_save"]) == rounds
    for mode in ("plain", "reserve", "checkpointer"):  # issue 22: Checkpointer.save too
        assert positive(res["first_save"][f"{mode}_x_copy"]), res["first_save"]
        lo, hi = res["first_save"][f"{mode}_x_copy_spread"]
        assert lo <= res["first_save"][f"{mode}_x_copy"] <= hi
    speed = res["python_speed"]
    for m in (
        "asyncckpt_default",  # issue 22: the defaults a user gets
        "asyncckpt_zstd",
        "asyncckpt_none",
        "torch_save_thread",
        "dcp_async_save",
    ):
        assert positive(speed[f"{m}_x_idle"]), speed
        assert positive(speed[f"{m}_window_s"]), speed
    assert positive(speed["state_bytes"])
    # issue 22: compression="auto" against the better of zstd and none, in paired rounds
    auto = res["auto_small"]
    for m in ("save_auto", "save_zstd", "save_none"):
        assert positive(auto[f"{m}_x_torch_save"]), auto
        assert len(auto["raw_s"][m]) == auto["rounds"] >= 2
    best = [
        min(z, n) / t
        for z, n, t in zip(
            auto["raw_s"]["save_zstd"], auto["raw_s"]["save_none"], auto["raw_s"]["torch_save"]
        )
    ]
    per_round = [
        a / t / b for a, t, b in zip(auto["raw_s"]["save_auto"], auto["raw_s"]["torch_save"], best)
    ]
    assert auto["auto_x_best"] == pytest.approx(statistics.median(per_round))
    assert (out / "python_speed.png").stat().st_size > 0
    # issue 12: durable on MiniLM weights + real Adam moments (one replica in quick mode)
    real = res["real_state"]
    assert real["source"] == "all-MiniLM-L6-v2" and real["adam_steps"] >= 1, real
    assert real["replicas"] >= 1 and real["raw_bytes"] >= real["replica_bytes"] > 0
    assert positive(real["save_zstd_x_torch_save"]) and 0 < real["stored_fraction"] < 1
    assert positive(real["save_zstd_no_writeback_x_torch_save"]), real
    assert len(real["raw_s"]["torch_save"]) == len(real["raw_s"]["save_zstd"]) == real["rounds"]

    # the benchmark's temp directory (checkpoints of every method) is removed
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("bench_save-")]


def load_bench(name: str) -> Any:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_real_training_state_holds_real_adam_moments() -> None:
    """The state of the real-state durable row: MiniLM weights and nonzero Adam moments."""
    common = load_bench("common")  # bench_save and bench_peers build it
    state, desc = common.real_training_state(0, steps=2)
    assert desc["replicas"] == 1 and desc["source"] in ("all-MiniLM-L6-v2", "synthetic")
    one = state["replica0"]
    moments = one["optimizer"]["state"]
    assert len(moments) == sum(1 for t in one["model"].values() if t.is_floating_point())
    for m in moments.values():
        assert int(m["step"]) == 2
        assert m["exp_avg"].abs().sum() > 0 and m["exp_avg_sq"].min() >= 0
        assert m["exp_avg_sq"].abs().sum() > 0
    assert desc["raw_bytes"] == common.tensor_bytes(state)
    # tiling makes separate copies (nothing shared that a writer could deduplicate)
    tiled, tdesc = common.real_training_state(desc["replica_bytes"] + 1, steps=1)
    assert tdesc["replicas"] == 2
    a, b = (tiled[f"replica{i}"]["model"] for i in range(2))
    name = next(iter(a))
    assert torch.equal(a[name], b[name]) and a[name].data_ptr() != b[name].data_ptr()


def test_bench_train_overhead_ratio() -> None:
    bench_train = load_bench("bench_train")
    ratio = bench_train.overhead_ratio
    assert ratio({"asyncckpt_mean_x_none": 1.3, "torch_save_mean_x_none": 1.6}) == pytest.approx(
        0.5
    )
    assert ratio({"asyncckpt_mean_x_none": 1.3, "torch_save_mean_x_none": 1.0}) is None
    assert ratio({"asyncckpt_mean_x_none": None, "torch_save_mean_x_none": 1.5}) is None


def test_bench_train_extra_wall_ratio() -> None:
    """Issue 22's figure: extra wall time over torch.save's, None when torch.save cost nothing."""
    extra = load_bench("bench_train").extra_wall_ratio
    modes = {
        "none": {"wall_s": 10.0},
        "asyncckpt": {"wall_s": 11.5},
        "torch_save": {"wall_s": 12.0},
    }
    assert extra(modes) == pytest.approx(0.75)
    assert extra({**modes, "torch_save": {"wall_s": 9.0}}) is None
    assert extra({"none": {"wall_s": 1.0}}) is None


def test_bench_train_paired_extra_wall() -> None:
    """The paired-block figure: medians of per-cycle differences, one per slice of cycles."""
    paired = load_bench("bench_train").paired_extra_wall
    walls = {
        "none": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        "asyncckpt": [1.1, 1.1, 9.0, 1.3, 1.3, 1.3],  # one outlier cycle
        "torch_save": [1.4, 1.4, 1.4, 1.4, 1.4, 1.4],
    }
    assert paired(walls) == [pytest.approx(0.75)]  # the median ignores the outlier
    assert paired(walls, groups=2) == [pytest.approx(0.25), pytest.approx(0.75)]
    assert paired({**walls, "torch_save": [0.9] * 6}) == [None]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("writer", ["threads1_nice", "pace"])
def test_bench_train_quick_variants(tmp_path: Path, writer: str) -> None:
    """Each --writer variant runs, says what it ran with, and draws the step-time trace."""
    res = run_script(
        tmp_path,
        "bench_train.py",
        *("--quick", "--writer", writer, "--nice", "5", "--pace-ms", "1"),
    )
    cfg = res["config"]
    assert cfg["writer"] == writer
    if writer == "threads1_nice":
        assert (cfg["writer_nice"], cfg["asyncckpt_threads"], cfg["pace_ms"]) == (5, 1, 0)
    else:
        assert cfg["writer_nice"] == 0 and cfg["pace_ms"] == 1
    assert set(res["trace"]) == set(res["modes"])
    for mode, t in res["trace"].items():
        n = cfg["steps"]
        assert len(t["began_s"]) == len(t["step_s"]) == len(t["saved"]) == n, mode
        assert t["began_s"] == sorted(t["began_s"])
        assert len(t["save_at_s"]) == sum(t["saved"]) == (0 if mode == "none" else 2), mode
        if mode.startswith("asyncckpt"):
            assert len(t["writes_s"]) == 2
            for (start, end), at in zip(t["writes_s"], t["save_at_s"]):
                assert at <= start <= end
            assert 0 <= res["modes"][mode]["saves_waited"] <= 2
        else:
            assert t["writes_s"] == []
    assert (tmp_path / "results" / "bench_train_trace.png").stat().st_size > 0
    assert "asyncckpt_overhead_x_torch_save_overhead" in res["ratios"]
    assert "asyncckpt_extra_wall_x_torch_save_extra_wall" in res["ratios"]
    assert "asyncckpt_extra_wall_rounds_x_torch_save_extra_wall" in res["ratios"]
    blocks = res["paired_blocks_s"]
    assert set(blocks) == set(res["modes"])
    assert all(len(b) == cfg["blocks"] == 3 and min(b) > 0 for b in blocks.values()), blocks
    assert set(res["cpu_per_save"]) == {"asyncckpt", "asyncckpt_none", "torch_save"}
    for mode, c in res["cpu_per_save"].items():
        assert len(c["cpu_s_all"]) == cfg["cpu_saves"] == 2 and c["wall_s"] > 0, mode
    for mode, e in res["modes"].items():
        assert positive(e["wall_s"]), mode  # steps and the wait for the last write


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gil_window_measures_every_row(tmp_path: Path) -> None:
    """Both states, both writers, both codecs, the caller waiting and spinning."""
    res = run_script(tmp_path, "gil_window.py", "--size-mib", "4", "--repeats", "1")
    rows = [
        f"{state}_{writer}_{codec}"
        for state in ("model", "small")
        for writer in ("threads", "process")
        for codec in ("zstd", "none")
    ]
    for row in rows:
        wait, spin = res[f"{row}_wait_s"], res[f"{row}_spin_s"]
        assert positive(wait) and positive(spin), row
        assert res[f"{row}_spin_x_wait"] == pytest.approx(spin / wait), row
    assert len(res) == 3 * len(rows)


@pytest.mark.timeout(120)
def test_bench_partial_quick_reads_about_the_models_share(tmp_path: Path) -> None:
    """A model-only load reads the model's chunks: about a third of a model+Adam file."""
    res = run_script(tmp_path, "bench_partial.py", "--quick", timeout=100)
    assert res["model_share"] == pytest.approx(1 / 3, abs=0.01)  # Adam: two moments per weight
    for method in ("full", "model_only"):
        m = res["methods"][method]
        assert m["time_s"]["median"] > 0 and len(m["time_s"]["spread"]) == 2
    if res["methods"]["full"]["bytes_read"] is None:
        pytest.skip("no /proc/self/io on this system")
    assert res["ratios"]["bytes_read_fraction"] == pytest.approx(res["model_share"], abs=0.05)
