"""Smoke test of the object-storage benchmark: it runs, and its JSON has every figure.

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

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_storage.py"
CONFIGS = ["none/single", "none/parallel", "zstd/single", "zstd/parallel"]


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_bench_storage_quick(tmp_path: Path) -> None:
    pytest.importorskip("moto.server")
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=270,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "bench_storage.json").read_text())
    assert (out / "bench_storage.png").stat().st_size > 0
    assert res["errors"] == {}
    assert res["config"]["quick"] is True and positive(res["config"]["raw_bytes"])
    for link in ("moto", "slow"):
        assert sorted(res["results"][link]) == sorted(CONFIGS)
        for entry in res["results"][link].values():
            assert positive(entry["save_s"]) and positive(entry["load_s"])
            assert 0 < entry["ratio"] <= 1.01
        for key in ("compression_save_speedup", "compression_load_speedup"):
            assert positive(res["ratios"][link][f"{key}_parallel"])
        assert positive(res["ratios"][link]["parallel_save_speedup_zstd"])
    assert positive(res["wire_time_s"]["slow"])
    assert res["results"]["slow"]["zstd/single"]["ratio"] < 1  # compression did something
    assert "MB/s per request" in res["note"]
    servers = res["baseline"]["servers"]
    for server in servers.values():  # moto, and SeaweedFS when installed
        keys = ("save_vs_s3transfer", "load_vs_s3transfer", "s3transfer_upload_s")
        for key in (*keys, "fresh_load_vs_s3transfer"):  # fresh: what a restart waits on
            assert positive(server[key])
    assert "moto" in servers and list(servers["moto"]["sizes"]) == ["8"]  # the smallest only
    if "seaweedfs" in servers:
        # issue 22: every size, and the S3 peers beside s3transfer on the same bytes
        assert list(servers["seaweedfs"]["sizes"]) == ["8", "16"]
        for mib, entry in servers["seaweedfs"]["sizes"].items():
            assert entry["raw_bytes"] == int(mib) << 20
            assert positive(entry["load_vs_s3transfer"]) and positive(entry["stored_bytes"])
            assert set(entry["peers"]) == {"s3torchconnector DCP", "tensorizer S3 stream"}
            for peer, got in entry["peers"].items():
                assert "error" not in got, (peer, got)
                if "not_installed" in got:  # the bench extra is not installed (make test)
                    continue
                assert positive(got["load_vs_s3transfer"]) and positive(got["save_s"]), peer
