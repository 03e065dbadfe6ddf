"""``save`` and ``load`` in a forked child: a DataLoader worker, a plain ``os.fork()``.

A child inherits the parent's pools, pending saves, arena pool and locks, but none of the
threads behind them; before ``workers.after_fork_in_child`` its first load or save waited for
ever. Each scenario runs in a script of its own (the fork happens there, not in pytest's
process) under a hard timeout, and every wait inside it has one too, so a hang fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
]


def _script(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


#: A parent that has saved and loaded (its save, encode and read pools are running).
_PARENT = """
import os, sys, threading, time, traceback
import torch
import asyncckpt
root = sys.argv[1]
asyncckpt.save({"w": torch.arange(10.0)}, root + "/a.ackpt").result(timeout=60)
assert asyncckpt.load(root + "/a.ackpt")["w"].sum() == 45
"""


def test_dataloader_workers_load_after_the_parent_saved_and_loaded(tmp_path: Path) -> None:
    done = _script(
        _PARENT
        + """
        from torch.utils.data import DataLoader, Dataset

        class Loads(Dataset):
            def __len__(self):
                return 6

            def __getitem__(self, i):
                return asyncckpt.load(root + "/a.ackpt", map_location="cpu")["w"][i]

        loader = DataLoader(
            Loads(), batch_size=1, num_workers=2, multiprocessing_context="fork", timeout=60
        )
        print("loaded", sorted(int(b) for b in loader))
        asyncckpt.save({"w": torch.ones(3)}, root + "/b.ackpt").result(timeout=60)  # still works
        print("parent ok")
        """.replace("\n        ", "\n"),
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded [0, 1, 2, 3, 4, 5]" in done.stdout and "parent ok" in done.stdout


@pytest.mark.parametrize("writer_processes", ["0", "1"])
def test_a_forked_child_saves_and_loads_while_the_parents_save_is_in_flight(
    tmp_path: Path, writer_processes: str
) -> None:
    """The fork comes while the parent's save holds the only arena inside its write, and
    while another thread of the parent holds the library's locks; the child saves, loads
    and exits normally (its exit hook must not wait for the parent's save)."""
    done = _script(
        _PARENT
        + """
        from asyncckpt._api import jobs, staging
        from asyncckpt import _threads as workers
        from asyncckpt.testing import FaultPlan

        inside, go_on = threading.Event(), threading.Event()

        def hold(op, path, call):
            if op == "open" and "held" in path:
                inside.set()
                go_on.wait(120)

        url = "faulty::file://" + root + "/held.ackpt"
        held = asyncckpt.save(
            {"w": torch.zeros(1 << 20)}, url,
            storage_options={"faulty": {"plan": FaultPlan(on_call=hold)}},
        )
        assert inside.wait(60), "the held save never started writing"
        locked = threading.Event()

        def hold_locks():
            with workers._lock, jobs._tracker.lock, staging._lock:
                locked.set()
                go_on.wait(120)

        threading.Thread(target=hold_locks, daemon=True).start()
        assert locked.wait(60)
        pid = os.fork()
        if pid == 0:
            try:
                asyncckpt.save({"w": torch.full((10,), 7.0)}, root + "/child.ackpt").result(60)
                assert asyncckpt.load(root + "/child.ackpt")["w"].sum() == 70
                assert asyncckpt.load(root + "/a.ackpt")["w"].sum() == 45
                asyncckpt.save({"w": torch.ones(2)}, root + "/child2.ackpt")  # left pending
            except BaseException:
                traceback.print_exc()
                os._exit(3)
            sys.exit(0)  # a normal exit: the exit hook runs, and finishes the child's save
        deadline = time.monotonic() + 120
        while True:
            finished, status = os.waitpid(pid, os.WNOHANG)
            if finished:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                raise SystemExit("the forked child hung")
            time.sleep(0.05)
        code = os.waitstatus_to_exitcode(status)
        go_on.set()
        held.result(timeout=60)
        assert asyncckpt.load(root + "/held.ackpt")["w"].numel() == 1 << 20
        assert asyncckpt.load(root + "/child2.ackpt")["w"].sum() == 2
        print("child exit code", code)
        """.replace("\n        ", "\n"),
        tmp_path,
        ASYNCCKPT_WRITER_PROCESSES=writer_processes,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "child exit code 0" in done.stdout, done.stderr[-3000:]
