"""Crash at every step: each storage operation of a scenario, failed or stopped at, in turn.

For each scenario of :mod:`tests.testing.crash_scenarios` the operations are first counted
(the trace must be the same twice: the points are deterministic), then for every point:

* ``fail``: that one operation raises ``StorageError`` (every operation that changes
  storage, and the first read of each kind, is a point);
* ``crash``: the process "dies" just before that operation, in-process: it and every later
  operation raise and do nothing (every operation that changes storage is a point);
* ``kill``: a forked child runs the action and SIGKILLs itself just before that operation
  (every operation that changes storage, for the scenarios whose action starts from a
  fresh object; the steady save's object was made before the fork).

After each, a restart checks the invariants (``crash_scenarios.check_after``). Each test
counts its scenario's points first and tries them all, so the harness follows the protocol
when its operations change; ``test_the_points_are_deterministic`` prints the counts
(``-rP``), and each scenario must keep at least the points it had when it was written
(fewer would mean an operation escaped the numbering).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from asyncckpt.errors import AsyncCkptError
from tests.crashpoints import CrashPlan
from tests.testing import crash_scenarios as cs
from tests.testing.crash_scenarios import SCENARIOS, Scenario

#: Points per scenario when the harness was written: (``fail``: the writes and the first read
#: of each kind; ``crash`` and ``kill``: the operations that change storage). A scenario with
#: fewer now lost an operation from the numbering (or the protocol shrank: then lower these).
POINTS = {
    "save": (18, 13),
    "restart": (32, 23),
    "gc": (15, 10),
    "rewind": (18, 11),
    "dropin": (11, 9),
}
#: A killed child must be gone by then: a hang fails loudly.
CHILD_TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in cs.DETERMINISTIC_ENV.items():
        monkeypatch.setenv(name, value)


def _counted(base: Path, scenario: Scenario) -> CrashPlan:
    plan = CrashPlan("count", allowed=(str(base / "root"),))
    root, ctx = cs.prepare(base, scenario, plan)
    plan.arm("count")
    assert cs.run_action(root, scenario, ctx, plan) is None
    assert plan.outside == [], plan.outside
    return plan


def _snapshot(base: Path, root: Path, scenario: Scenario) -> dict[str, object]:
    return {
        "outside": cs.outside_tree(base, root),
        "version": None if scenario.dropin else cs.version_step(root),
    }


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_points_are_deterministic(tmp_path: Path, name: str) -> None:
    first = _counted(tmp_path / "a", SCENARIOS[name])
    second = _counted(tmp_path / "b", SCENARIOS[name])

    def shape(plan: CrashPlan) -> list[tuple[str, str]]:
        return [(op.op, op.path.split("/root/")[-1][:4]) for op in plan.trace]

    assert shape(first) == shape(second)
    points = (first.points("fail"), first.points("crash"))
    print(f"{name}: {len(first.trace)} operations, points: {points} (fail, crash)")
    assert points[0] >= POINTS[name][0] and points[1] >= POINTS[name][1], points


def _cases(modes: list[str]) -> list[Any]:
    return [pytest.param(name, mode) for name in sorted(SCENARIOS) for mode in modes]


def _prepared(
    tmp_path: Path, scenario: Scenario, at: int
) -> tuple[Path, CrashPlan, Path, Any, Any]:
    """A fresh root for point ``at``: its folder, an unarmed plan, the root, the scenario's
    context, and what the root and its surroundings hold before the action."""
    base = tmp_path / f"p{at}"
    plan = CrashPlan("count", allowed=(str(base / "root"),))
    root, ctx = cs.prepare(base, scenario, plan)
    return base, plan, root, ctx, _snapshot(base, root, scenario)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "mode"), _cases(["fail", "crash"]))
def test_every_point_in_process(tmp_path: Path, name: str, mode: str) -> None:
    scenario = SCENARIOS[name]
    points = _counted(tmp_path / "count", scenario).points(mode)
    for at in range(1, points + 1):
        base, plan, root, ctx, before = _prepared(tmp_path, scenario, at)
        plan.arm(mode, at)
        error = cs.run_action(root, scenario, ctx, plan)
        context = f"{name}: {mode} at point {at}/{points} ({plan.fired})"
        assert plan.fired is not None, f"{context}: the point was never reached"
        assert error is None or isinstance(error, AsyncCkptError), f"{context}: {error!r}"
        assert plan.outside == [], f"{context}: touched {plan.outside}"
        cs.check_after(base, root, scenario, before, context)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "mode"), [c for c in _cases(["kill"]) if c.values[0] != "save"])
def test_every_point_with_sigkill(tmp_path: Path, name: str, mode: str) -> None:
    scenario = SCENARIOS[name]
    points = _counted(tmp_path / "count", scenario).points(mode)
    for at in range(1, points + 1):
        base, plan, root, ctx, before = _prepared(tmp_path, scenario, at)
        pid = os.fork()
        if pid == 0:  # the child: run the action, die at the point
            try:
                plan.arm(mode, at)
                cs.run_action(root, scenario, ctx, plan)
            finally:
                os._exit(3)  # the point was never reached
        status = _wait(pid)
        context = f"{name}: SIGKILL at point {at}/{points}"
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"{context}: the child was not killed at its point (status {status})"
        )
        cs.check_after(base, root, scenario, before, context)


def _wait(pid: int) -> int:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the child {pid} hung past {CHILD_TIMEOUT_S} s")
        time.sleep(0.01)  # polling a child's exit: waitpid has no timeout
