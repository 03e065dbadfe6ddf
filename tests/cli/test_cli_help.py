"""``asyncckpt --help`` and every subcommand's ``--help`` return without importing torch.

Importing torch takes seconds; a user asking for help should not wait for it. Each check runs
in a fresh interpreter (``python -m asyncckpt``, as a user runs it) and asks it whether torch
was imported by the time the help was printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ["ls", "inspect", "verify", "gc", "convert", "bench"]

# Runs the command line as ``python -m asyncckpt`` does, then reports whether torch was loaded.
_PROBE = """
import runpy, sys
sys.argv = ["asyncckpt", *sys.argv[1:]]
try:
    runpy.run_module("asyncckpt", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print("TORCH_IMPORTED=" + str("torch" in sys.modules), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [["--help"], ["--version"], *([c, "--help"] for c in COMMANDS)])
def test_help_does_not_import_torch(args: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="100")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: asyncckpt" in done.stdout or "asyncckpt " in done.stdout
    assert "TORCH_IMPORTED=False" in done.stderr, done.stderr
