"""Scenarios for the crash-at-every-step harness, and the invariants checked after each.

A scenario has a *setup* (run without faults) and an *action* whose storage operations are
numbered by :class:`tests.crashpoints.CrashStorage`: a steady save (write,
commit, version file, a retention pass), a restarted writer's first save (lease takeover,
recovery of leftovers), ``asyncckpt gc``, ``rewind`` and a drop-in ``asyncckpt.save``.
After the action failed or died at a point, :func:`check_after` restarts (new objects on
the same root, no faults) and checks:

* the newest committed version loads exactly (content hash of the state, not its name),
  and is no older than before the action (rewind: no older than its target);
* ``VERSION`` never moved backwards (rewind: only to its target);
* nothing outside the root changed, and no operation named a path outside it;
* the next save succeeds, and after it (and after a ``gc``) no temp file survives.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt._storage import TEMP_MARK, LocalStorage
from asyncckpt._storage import resolve as real_resolve
from asyncckpt._versions.protocol import read_version_file
from asyncckpt.cli.main import main as cli_main
from asyncckpt.errors import AsyncCkptError, CheckpointTimeoutError
from tests.crashpoints import CrashPlan, CrashStorage
from tests.state_checks import tree

#: Settings that make a scenario's operations one deterministic sequence: writes on this
#: process's threads (the wrapper is not sent to a writer process), no heartbeat wake-up
#: during a scenario, the snapshot copied before the write starts.
DETERMINISTIC_ENV = {
    "ASYNCCKPT_WRITER_PROCESSES": "0",
    "ASYNCCKPT_LEASE_RENEW_MS": str(3_600_000),
    "ASYNCCKPT_LEASE_EXPIRY_MS": str(7_200_000),
    "ASYNCCKPT_PIPELINE_MIN_CPUS": "4096",
    "ASYNCCKPT_THREADS": "2",
}

#: Modules that turn a user's path into a storage: the harness wraps what they return.
_RESOLVERS = ("asyncckpt._api.checkpointer", "asyncckpt._api.dropin", "asyncckpt._versions.paths")


def state(step: int) -> dict[str, Any]:
    """A small state, every byte a function of ``step``."""
    g = torch.Generator().manual_seed(1009 * step + 7)
    return {
        "w": torch.randn(257, generator=g),
        "ids": torch.arange(33, dtype=torch.int64) * (step + 1),
        "step": step,
    }


def content_hash(obj: Any) -> str:
    """A hash of a state's content: keys, dtypes, shapes, exact bytes, other leaves."""
    h = hashlib.sha256()

    def walk(o: Any, key: str) -> None:
        if isinstance(o, dict):
            for k in sorted(o, key=str):
                walk(o[k], f"{key}.{k}")
        elif isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(bytes(t.reshape(-1).view(torch.uint8).numpy()))
        else:
            h.update(f"{key}={o!r};".encode())

    walk(obj, "")
    return h.hexdigest()


EXPECTED = {step: content_hash(state(step)) for step in range(16)}


@contextlib.contextmanager
def wrapped_storage(plan: CrashPlan) -> Iterator[None]:
    """Every storage the library resolves from a path is wrapped by ``plan``."""

    def resolve(f: Any, options: Any, settings: Any = None) -> tuple[Any, str]:
        storage, path = real_resolve(f, options, settings)
        return CrashStorage(storage, plan), path

    with pytest.MonkeyPatch.context() as mp:
        for module in _RESOLVERS:
            mp.setattr(f"{module}.resolve", resolve)
        yield


def outside_tree(base: Path, root: Path) -> dict[str, str]:
    return {k: v for k, v in tree(base).items() if not (base / k).is_relative_to(root)}


def temp_files(root: Path) -> list[str]:
    return [k for k in tree(root) if TEMP_MARK in k]


def version_step(root: Path) -> int | None:
    record = read_version_file(LocalStorage(), str(root))
    return None if record is None else record.step


def save(ckpt: Checkpointer, step: int) -> None:
    ckpt.save(step, state(step)).result()


@dataclass
class Scenario:
    """A setup, an action, and what the invariants allow afterwards."""

    name: str
    #: ``setup(root) -> context`` runs without faults; the context reaches the action.
    setup: Callable[[Path], Any]
    action: Callable[[Path, Any], None]
    #: ``(lowest step latest() may name afterwards, steps VERSION may name afterwards
    #: besides the ones at or after its step before)``
    floor: int
    version_back_to: frozenset[int] = frozenset()
    #: the drop-in scenario: a file, not a root
    dropin: bool = False


def _committed(root: Path, steps: range, keep_last: int | None = None) -> None:
    with Checkpointer(root, keep_last=keep_last, compression="none") as ckpt:
        for step in steps:
            save(ckpt, step)


def _setup_steady(root: Path) -> Checkpointer:
    ckpt = Checkpointer(root, keep_last=2, compression="none")
    save(ckpt, 1)
    save(ckpt, 2)
    return ckpt


def _act_steady(root: Path, ckpt: Checkpointer) -> None:
    del root
    save(ckpt, 3)  # write, commit, VERSION, retention of step 1
    ckpt.close()


def _setup_restart(root: Path) -> None:
    _committed(root, range(1, 4))
    # What a writer killed mid-save leaves: a step without COMMIT, temp files.
    (root / "4").mkdir()
    (root / "4" / f"r00000-dead.ackpt{TEMP_MARK}0123456789ab").write_bytes(b"partial")
    (root / f"VERSION{TEMP_MARK}0123456789ab").write_bytes(b"{")


def _act_restart(root: Path, ctx: None) -> None:
    del ctx
    ckpt = Checkpointer(root, keep_last=2, compression="none")
    try:
        save(ckpt, 5)  # lease takeover, recovery, write, commit, retention
    finally:
        ckpt.close()


def _setup_versions(root: Path) -> None:
    _committed(root, range(1, 5))
    (root / "3" / f"COMMIT{TEMP_MARK}0123456789ab").write_bytes(b"{")


def _act_gc(root: Path, ctx: None) -> None:
    del ctx
    code = cli_main(["gc", str(root), "--keep-last", "1"])
    if code != 0:
        raise AsyncCkptError(f"asyncckpt gc exited with {code}")


def _act_rewind(root: Path, ctx: None) -> None:
    del ctx
    ckpt = Checkpointer(root, compression="none")
    try:
        ckpt.rewind(2)
    finally:
        ckpt.close()


def _setup_dropin(root: Path) -> None:
    root.mkdir()
    asyncckpt.save(state(1), root / "model.ckpt", compression="none").result()


def _act_dropin(root: Path, ctx: None) -> None:
    del ctx
    asyncckpt.save(state(2), root / "model.ckpt", compression="none").result()


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("save", _setup_steady, _act_steady, floor=2),
        Scenario("restart", _setup_restart, _act_restart, floor=3),
        Scenario("gc", _setup_versions, _act_gc, floor=4),
        Scenario("rewind", _setup_versions, _act_rewind, floor=2, version_back_to=frozenset({2})),
        Scenario("dropin", _setup_dropin, _act_dropin, floor=1, dropin=True),
    )
}


def prepare(base: Path, scenario: Scenario, plan: CrashPlan) -> tuple[Path, Any]:
    """Lay out ``base`` (a sibling file and folder beside the root) and run the setup."""
    root = base / "root"
    (base / "neighbour").mkdir(parents=True)
    (base / "neighbour" / "data.bin").write_bytes(b"not ours")
    (base / "root.txt").write_bytes(b"beside the root")
    with wrapped_storage(plan):
        ctx = scenario.setup(root)
    return root, ctx


def run_action(root: Path, scenario: Scenario, ctx: Any, plan: CrashPlan) -> BaseException | None:
    """The action under ``plan``; what it raised (None if it succeeded)."""
    with wrapped_storage(plan):
        try:
            scenario.action(root, ctx)
        except Exception as exc:  # checked by the caller: only asyncckpt's errors may escape
            return exc
        finally:
            if isinstance(ctx, Checkpointer):
                with contextlib.suppress(AsyncCkptError):
                    ctx.close()  # a dead process's object: its storage refuses everything
    return None


def check_after(
    base: Path, root: Path, scenario: Scenario, before: dict[str, Any], context: str
) -> None:
    """The invariants after the action failed or stopped at one point (see the module)."""
    assert outside_tree(base, root) == before["outside"], f"{context}: outside the root changed"
    if scenario.dropin:
        _check_dropin(root, context)
        return
    reader = Checkpointer(root, read_only=True)
    latest = reader.latest()
    assert latest is not None and latest >= scenario.floor, f"{context}: latest {latest}"
    assert content_hash(reader.load()) == EXPECTED[latest], f"{context}: step {latest} differs"
    for step in reader.versions():
        got = content_hash(reader.load(step=step))
        assert got == EXPECTED[step], f"{context}: version {step} differs"
    vstep = version_step(root)
    old = before["version"]
    assert vstep is not None, f"{context}: VERSION is gone"
    assert vstep >= old or vstep in scenario.version_back_to, f"{context}: VERSION {old}->{vstep}"
    # The next save succeeds, leaves no temp file, and its version loads exactly.
    nxt = max([latest, vstep, *[int(n) for n in os.listdir(root) if n.isdigit()]]) + 1
    with Checkpointer(root, compression="none") as ckpt:
        save(ckpt, nxt)
    assert temp_files(root) == [], f"{context}: temp files after the next save"
    assert Checkpointer(root, read_only=True).latest() == nxt
    assert content_hash(Checkpointer(root, read_only=True).load()) == EXPECTED[nxt]
    assert cli_main(["gc", str(root), "--keep-last", "1"]) == 0
    assert temp_files(root) == [], f"{context}: temp files after gc"


class LeftoverTempFile(AssertionError):
    """Issue 29 defect 12: a killed drop-in save's ``<path>.acktmp-*`` outlives later saves."""


def _check_dropin(root: Path, context: str) -> None:
    path = root / "model.ckpt"
    try:
        got = asyncckpt.load(path, dead_writer="load")
    except CheckpointTimeoutError as exc:  # pragma: no cover - reported with the context
        raise AssertionError(f"{context}: a dead save still blocks loads: {exc}") from exc
    assert content_hash(got) in (EXPECTED[1], EXPECTED[2]), f"{context}: a mixed or lost file"
    asyncckpt.save(state(3), path, compression="none").result()
    assert content_hash(asyncckpt.load(path)) == EXPECTED[3], context
    if temp_files(root):  # raised last: every other invariant of this point has held
        raise LeftoverTempFile(f"{context}: temp files after the next save: {temp_files(root)}")
