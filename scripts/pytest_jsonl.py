"""A pytest plugin for ``scripts/gpu_check.sh``: one JSON line per test, appended as it ends.

The file is ``$GPU_CHECK_JSONL``; a run cut short by a timeout keeps every line written.
Loaded with ``-p pytest_jsonl`` (``scripts/`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import json
import os
from typing import Any


def pytest_runtest_logreport(report: Any) -> None:
    """Write the outcome of each test's call (or of a setup that failed or skipped)."""
    if report.when != "call" and not (report.failed or report.skipped):
        return
    record = {
        "check": "pytest",
        "test": report.nodeid,
        "phase": report.when,
        "outcome": report.outcome,
        "s": round(report.duration, 3),
    }
    if report.failed or report.skipped:
        record["detail"] = str(report.longrepr)[-2000:]
    with open(os.environ.get("GPU_CHECK_JSONL", "gpu_check.jsonl"), "a") as out:
        out.write(json.dumps(record) + "\n")
