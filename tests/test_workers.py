"""Background threads: the ``writer_nice`` tunable lowers the writer's threads, not the reader's."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt import _threads as workers
from asyncckpt._settings import Settings

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread niceness is a Linux feature"
)


def niceness(pool: workers.DaemonPool) -> int:
    """The niceness of the thread that runs a task of ``pool``."""
    return pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()


def main_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, os.getpid())


@pytest.fixture
def fresh_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pools are created once per process; give this test its own (the old ones idle on)."""
    monkeypatch.setattr(workers, "_pools", {})


def test_writer_nice_accepts_zero_and_refuses_negatives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCCKPT_WRITER_NICE", raising=False)
    assert Settings.resolve().writer_nice == Settings.help()["writer_nice"][0]
    assert Settings.resolve(writer_nice=0).writer_nice == 0
    monkeypatch.setenv("ASYNCCKPT_WRITER_NICE", "7")
    assert Settings.resolve().writer_nice == 7
    monkeypatch.setenv("ASYNCCKPT_WRITER_NICE", "-1")
    with pytest.raises(ValueError, match=r"non-negative integer.*ASYNCCKPT_WRITER_NICE"):
        Settings.resolve()
    # 0 stays refused where it means nothing
    with pytest.raises(ValueError, match="must be a positive integer"):
        Settings.resolve(threads=0)


@linux_only
@pytest.mark.usefixtures("fresh_pools")
def test_writer_pools_run_lowered_and_readers_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    base = main_niceness()
    assert niceness(workers.save_queue(3)) == min(19, base + 3)
    assert niceness(workers.pool("encode", 2, 3)) == min(19, base + 3)
    assert niceness(workers.pool("read", 2)) == base
    assert main_niceness() == base  # the process itself is untouched


@linux_only
@pytest.mark.usefixtures("fresh_pools")
def test_threads_started_by_a_lowered_thread_are_not_lowered_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer creates the encode pool from the save thread, whose niceness it inherits."""
    base = main_niceness()
    encoders = workers.save_queue(2).submit(workers.pool, "encode", 3, 2).result()
    assert niceness(encoders) == min(19, base + 2)


@linux_only
@pytest.mark.usefixtures("fresh_pools")
def test_zero_leaves_the_threads_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert niceness(workers.save_queue(0)) == main_niceness()
    assert workers.lower_priority(0) is False


@linux_only
@pytest.mark.usefixtures("fresh_pools")
def test_a_save_runs_its_encoders_lowered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ASYNCCKPT_WRITER_NICE", "4")
    monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "0")  # the encoders of this process
    monkeypatch.setenv("ASYNCCKPT_THREADS", "3")  # a pool size no other test creates first
    state = {"w": torch.randn(1 << 16)}
    asyncckpt.save(state, str(tmp_path / "a.ackpt")).result()
    encoders = workers._pools[("encode", 3)]
    assert encoders.nice == 4
    assert niceness(encoders) == min(19, main_niceness() + 4)
    assert torch.equal(asyncckpt.load(str(tmp_path / "a.ackpt"))["w"], state["w"])


def may_raise_priority() -> bool:
    """Whether this process may lower a niceness again (root, or RLIMIT_NICE allows it)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or 20 - soft <= main_niceness()


@linux_only
@pytest.mark.usefixtures("fresh_pools")
@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not may_raise_priority(),
    reason="raising a thread's priority back needs CAP_SYS_NICE or RLIMIT_NICE",
)
def test_a_reader_pool_started_by_a_writer_thread_is_not_lowered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool first asked for on the save thread (a heartbeat's, say) inherits its niceness."""
    readers = workers.save_queue(3).submit(workers.pool, "read", 3).result()
    assert niceness(readers) == main_niceness()


def test_wait_idle_returns_once_the_thread_dropped_its_task() -> None:
    import weakref

    pool = workers.DaemonPool(1, "idle-test")
    gate, held = threading.Event(), torch.zeros(4)
    alive = weakref.ref(held)
    # A done-callback runs on the pool thread after the result is published, before the
    # thread drops the task's arguments: the window in which an exit used to abort.
    future = pool.submit(lambda t: float(t[0]), held)
    future.add_done_callback(lambda _: gate.wait(30))
    del held
    assert future.result(30) == 0.0
    assert not pool.wait_idle(0.2) and alive() is not None  # still holding the tensor
    gate.set()
    assert pool.wait_idle(30) and alive() is None


_SAVE_AND_EXIT = """
import torch, asyncckpt
asyncckpt.save({"w": torch.zeros(1 << 20)}, "a.ackpt").result()
asyncckpt.save({"w": torch.zeros(1 << 20)}, "b.ackpt", compression="none").result()
"""


@pytest.mark.timeout(300)
def test_a_script_that_saves_and_exits_never_aborts(tmp_path: Path) -> None:
    # Before the exit hook waited for idle pools, a lowered save thread still freeing the
    # snapshot while the interpreter shut down aborted the process ("terminate called
    # without an active exception") in about one run in four on 2 cores.
    import subprocess

    env = dict(os.environ, ASYNCCKPT_WRITER_NICE="10", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(Path(asyncckpt.__file__).parent.parent)
    for run in range(12):
        done = subprocess.run(
            [sys.executable, "-c", _SAVE_AND_EXIT],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"run {run}: exit status {done.returncode}\n{done.stderr}"
