"""Preemption (issue 21): SIGTERM during a background write lets it finish, then one last
version is saved, within a grace period; without the handler the previous version stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncckpt import Checkpointer
from asyncckpt._api.preemption import Preemption

# A training loop on a slow link (every request waits 0.3 s): SIGTERM arrives while step 2
# is being written.
_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch, asyncckpt
    from asyncckpt.testing.faults import FaultPlan
    root, handle = sys.argv[1], sys.argv[2] == "handle"
    opts = {"faulty": {"plan": FaultPlan(latency_s=0.3)}}
    ckpt = asyncckpt.Checkpointer("faulty::file://" + root, storage_options=opts)
    stop = ckpt.on_preemption() if handle else None
    ckpt.save(1, {"w": torch.full((1000,), 1.0)})
    ckpt.wait()
    ckpt.save(2, {"w": torch.full((1000,), 2.0)})
    print("writing", flush=True)
    while stop is None or not stop.requested:  # training steps (until killed, without)
        time.sleep(0.01)
    print("preempted", flush=True)
    ckpt.save(3, {"w": torch.full((1000,), 3.0)})  # one last version
    ckpt.wait(timeout=60)  # the grace period
    ckpt.close()
    print("saved", flush=True)
    """
)


def _run(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    root = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "writing\n" + out, err), root


@pytest.mark.timeout(180)
def test_sigterm_mid_write_lets_it_finish_and_saves_one_last(tmp_path: Path) -> None:
    done, root = _run(tmp_path, "handle")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["writing", "preempted", "saved"]
    ckpt = Checkpointer(root, read_only=True)
    assert ckpt.versions() == [1, 2, 3]
    assert ckpt.load(2)["w"][0].item() == 2.0 and ckpt.load()["w"][0].item() == 3.0


@pytest.mark.timeout(180)
def test_sigterm_without_the_handler_leaves_the_previous_version_latest(tmp_path: Path) -> None:
    done, root = _run(tmp_path, "default")
    assert done.returncode == -signal.SIGTERM
    ckpt = Checkpointer(root, read_only=True)
    assert ckpt.latest() == 1 and ckpt.versions() == [1]
    assert ckpt.load()["w"][0].item() == 1.0


def test_a_second_signal_ends_the_process_as_before() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda n, f: seen.append(n))
    try:
        with Preemption([signal.SIGUSR1]) as stop:
            signal.raise_signal(signal.SIGUSR1)
            assert stop.requested and stop.signal == "SIGUSR1" and seen == []
            signal.raise_signal(signal.SIGUSR1)  # the second: the earlier handler runs
            assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_on_preemption_outside_the_main_thread_is_refused(tmp_path: Path) -> None:
    import threading

    errors: list[BaseException] = []

    def call() -> None:
        try:
            Checkpointer(tmp_path).on_preemption()
        except ValueError as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert errors and "main thread" in str(errors[0])


def test_the_flag_is_public_for_the_drop_in_api_too() -> None:
    import asyncckpt

    stop = asyncckpt.Preemption([signal.SIGUSR1])  # no Checkpointer: asyncckpt.save users
    try:
        assert stop.requested is False
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested is True
    finally:
        stop.remove()
    assert asyncckpt.Preemption is Preemption and "Preemption" in asyncckpt.__all__
