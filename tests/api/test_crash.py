"""``kill -9`` of a saving process never leaves a partial or mixed checkpoint at the target.

A subprocess saves states of a few tens of MB, each tagged with its iteration, over and over
to one path that already holds an older file. The test kills it with SIGKILL at random
moments. After each kill the target must load (every checksum verified) and be bit for bit
the state of one iteration: the last one the child reported durable, or the one after it.
Anything else beside the target must be a temp file named with ``.acktmp-``; a save marker
(``.ackpending``) left by a save in flight makes a load give up at once, naming the killed
writer, until it is deleted.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import asyncckpt
from asyncckpt._storage import TEMP_MARK
from asyncckpt._versions.pending_record import PENDING_SUFFIX
from asyncckpt.errors import CheckpointTimeoutError

REPO = Path(__file__).resolve().parents[2]
TRIALS_PER_MODE = 5

_base: tuple[torch.Tensor, torch.Tensor] | None = None


def _bases() -> tuple[torch.Tensor, torch.Tensor]:
    global _base
    if _base is None:
        g = torch.Generator().manual_seed(1234)
        floats = torch.randn(5_000_000, generator=g)  # 20 MB, hardly compressible
        ints = torch.randint(0, 2**40, (1_500_000,), generator=g)  # 12 MB
        _base = (floats, ints)
    return _base


def make_state(i: int) -> dict[str, Any]:
    """The state of iteration ``i``: every value depends on ``i``, deterministically."""
    floats, ints = _bases()
    return {
        "iteration": i,
        "w": floats + i,
        "ints": ints + i,
        "half": (floats[:1_000_000] * (i + 2)).to(torch.bfloat16),
        "tag": f"iteration {i}",
        "nested": {"list": [i, i / 3], "arr": np.full(100, i, dtype=np.int64)},
    }


def update_state_(state: dict[str, Any], i: int) -> None:
    """Turn ``state`` into ``make_state(i)`` in place (tensors and arrays are overwritten)."""
    fresh = make_state(i)
    for key in ("w", "ints", "half"):
        state[key].copy_(fresh[key])
    state["nested"]["arr"][:] = i
    state["nested"]["list"][:] = fresh["nested"]["list"]
    state["iteration"] = i
    state["tag"] = fresh["tag"]


def assert_is_state_of(loaded: dict[str, Any], i: int) -> None:
    expected = make_state(i)
    assert set(loaded) == set(expected)
    assert loaded["iteration"] == i and loaded["tag"] == expected["tag"]
    for key in ("w", "ints", "half"):
        assert loaded[key].dtype == expected[key].dtype, key
        assert torch.equal(loaded[key].view(torch.uint8), expected[key].view(torch.uint8)), key
    assert loaded["nested"]["list"] == expected["nested"]["list"]
    assert np.array_equal(loaded["nested"]["arr"], expected["nested"]["arr"])


_CHILD = textwrap.dedent(
    """
    import sys
    import asyncckpt
    from tests.api.test_crash import make_state, update_state_

    path, mode = sys.argv[1], sys.argv[2]
    state = make_state(0)
    print("ready", flush=True)
    i = 0
    while True:
        handle = asyncckpt.save(state, path)
        if mode == "durable":
            handle.result()
            print(f"durable {i}", flush=True)
        else:  # overlap: change the tensors in place while the write goes on
            print(f"queued {i}", flush=True)
        i += 1
        if mode == "durable":
            state = make_state(i)
        else:
            update_state_(state, i)
    """
)


def _run_and_kill(path: Path, mode: str, delay: float) -> tuple[list[str], int]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), mode],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        first = child.stdout.readline()
        if first.strip() != "ready":
            child.kill()
            _, err = child.communicate(timeout=30)
            raise AssertionError(f"child failed to start: {first!r}\n{err}")
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL, err
    return out.split(), child.pid


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["durable", "overlap"])
def test_kill_9_never_leaves_a_partial_checkpoint(tmp_path: Path, mode: str) -> None:
    old = tmp_path / "old.ackpt"
    asyncckpt.save(make_state(-1), old).result()
    rng = random.Random(f"asyncckpt-crash-{mode}")
    seen: list[int] = []
    for trial in range(TRIALS_PER_MODE):
        folder = tmp_path / f"trial-{trial}"
        folder.mkdir()
        target = folder / "ckpt.ackpt"
        shutil.copyfile(old, target)
        words, pid = _run_and_kill(target, mode, rng.uniform(0.0, 2.5))
        reported = [int(n) for w, n in zip(words[::2], words[1::2]) if w in ("durable", "queued")]
        last = reported[-1] if reported else -1

        marker = folder / ("ckpt.ackpt" + PENDING_SUFFIX)
        if marker.exists():  # killed while a save was in flight: its marker is left, and a
            # load gives up at once (the writer was on this machine and is gone) rather than
            # return what may be an older file; deleting the marker clears it, as it says
            with pytest.raises(CheckpointTimeoutError, match=rf"pid {pid} .*delete {marker}"):
                asyncckpt.load(target)
            marker.unlink()
        loaded = asyncckpt.load(target)  # verifies every checksum
        it = loaded["iteration"]
        if mode == "durable":
            # The last save reported durable is there, or the one in flight got committed.
            assert it in (last, last + 1), (it, last)
        else:
            # save(i) returns only once save(i - 1) is committed (one arena), so the file is
            # at least that one; the next two may have been committed since.
            assert it >= last - 1, (it, last)
            assert it <= last + 1, (it, last)
        assert_is_state_of(loaded, it)

        for name in os.listdir(folder):
            if name != "ckpt.ackpt":
                assert name.startswith("ckpt.ackpt" + TEMP_MARK), name
        seen.append(it)
    assert len(seen) == TRIALS_PER_MODE


_TEMP_WRITER = """
import sys
from asyncckpt._storage import LocalStorage
with LocalStorage().atomic_write(sys.argv[1]) as out:  # a write of the file in flight
    out.write(b"half a checkpoint")
    print("ready", flush=True)
    sys.stdin.read()  # until the test ends it
"""


@pytest.mark.timeout(120)
def test_the_next_save_removes_the_temp_file_of_a_killed_save_and_only_that(
    tmp_path: Path,
) -> None:
    target = tmp_path / "model.ackpt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen(
        [sys.executable, "-c", _TEMP_WRITER, str(target)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        (temp,) = tmp_path.glob(f"model.ackpt{TEMP_MARK}*")
        asyncckpt.save(make_state(1), target).result()
        assert temp.exists()  # a live writer's: another process still writes it
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert temp.exists()  # killed mid-write: left behind ...
    asyncckpt.save(make_state(2), target).result()
    assert not temp.exists()  # ... until the next save of the file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ackpt"]
    assert_is_state_of(asyncckpt.load(target), 2)
