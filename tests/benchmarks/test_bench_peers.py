"""Smoke test of ``benchmarks/bench_peers.py --quick``: asyncckpt beside the peers (issue 22).

Structure and behaviour only, no timing thresholds: every method runs in its own process and
reports every row (or the error that stopped it), and the snapshot check tells a method
that copies the state (asyncckpt) from one that hands the live tensors to its writer
(nvidia-resiliency-ext's worker on the CPU, torch.save on a thread).
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
ROWS = (
    "stall_x_copy",
    "durable_x_torch_save",
    "load_x_torch_load",
    "stored_fraction",
    "extra_peak_x_state",
    "first_save_x_copy",
)


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_peers_quick(tmp_path: Path) -> None:
    pytest.importorskip("tensorizer")  # the bench extra (make bench)
    out = tmp_path / "results"
    # A copy, no copy, synchronous. Not NVRx: its worker's feeder thread, starved of the GIL
    # by the pure-Python probe, takes minutes over 400 tensors even at 16 MiB.
    methods = ("asyncckpt", "torch_save_thread", "tensorizer")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_peers.py"),
            *("--quick", "--out", str(out), "--tmp-dir", str(tmp_path), "--methods", *methods),
        ],
        capture_output=True,
        text=True,
        timeout=380,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "bench_peers.json").read_text())
    assert (out / "bench_peers.png").stat().st_size > 0
    assert list(res["methods"]) == list(methods)
    for name, rec in res["methods"].items():
        assert "error" not in rec, (name, rec.get("traceback"))
        assert rec["version"], name
        for key in ROWS:
            assert finite(rec[key]) and rec[key] >= 0, (name, key, rec.get(key))
        for key in ("stall_x_copy", "durable_x_torch_save", "load_x_torch_load"):
            # one round in --quick: the spread over rounds is that round's ratio
            assert rec[f"{key}_spread"] == pytest.approx([rec[key]] * 2), (name, key)
        assert rec["load_equal"] is True, name  # each loader returned what was saved
        assert rec["tensors"] > 0 and isinstance(rec["snapshot"], bool), name
        train = rec["train"]
        assert set(train["wall_s"]) == {"none", "method", "torch_save"}, name
    # asyncckpt copies the state before save returns, tensorizer writes before it returns;
    # torch.save on a thread serializes the live tensors after the change
    snapshot = {name: rec["snapshot"] for name, rec in res["methods"].items()}
    assert snapshot["asyncckpt"] is True and snapshot["tensorizer"] is True, snapshot
    assert snapshot["torch_save_thread"] is False, snapshot
    assert res["methods"]["tensorizer"]["python_speed_x_idle"] is None  # synchronous
    assert finite(res["methods"]["asyncckpt"]["python_speed_x_idle"])
    # the benchmark's temp directories are removed
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("bench_peers-")]


def test_the_weights_state_is_every_tensor_of_the_real_training_state() -> None:
    """``--state weights``: MiniLM's weights and Adam's moments, flat, every tensor once."""
    bench_peers = _load_bench_peers()
    from common import real_training_state, tensor_bytes  # on the path since bench_peers

    flat = bench_peers.peer_state("weights", 1)
    tree, desc = real_training_state(1)
    assert desc["replicas"] == 1
    assert sum(v.numel() * v.element_size() for v in flat.values()) == tensor_bytes(tree)
    model = tree["replica0"]["model"]
    assert all(flat[f"replica0/model/{k}"].equal(v) for k, v in model.items())
    moments = [k for k in flat if k.endswith("/exp_avg_sq")]
    assert len(moments) == len(tree["replica0"]["optimizer"]["state"])
    assert any(flat[k].abs().sum() > 0 for k in moments)  # real steps, not zeros


class _SyncTorchSave:
    """A method that writes before ``save`` returns (a snapshot by construction)."""

    def save(self, state: dict, path: str) -> object:
        import torch

        torch.save(state, path)
        return _load_bench_peers().DONE

    def load(self, path: str, like: dict) -> dict:
        import torch

        return torch.load(path, weights_only=True)


def _load_bench_peers():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_peers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bench_peers


def test_the_snapshot_check_changes_integer_tensors_too(tmp_path: Path) -> None:
    """The real-weights state holds int64 buffers; the check changes every tensor."""
    import torch

    state = {"w": torch.zeros(4), "position_ids": torch.arange(4)}
    got = _load_bench_peers()._snapshot_check(_SyncTorchSave(), state, str(tmp_path / "x.pt"))
    assert got == {"snapshot": True, "torn_tensors": 0, "tensors": 2}
    assert state["position_ids"].tolist() == [1, 2, 3, 4] and state["w"].tolist() == [1.0] * 4
