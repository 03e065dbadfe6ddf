"""The commit sequence's order and exclusivity, observed where they live.

* Durability before the commit point: on local disk the data file is fsynced before it is
  renamed into place, its directory is fsynced after, and only then is ``COMMIT`` linked
  (itself written and fsynced first); ``VERSION`` comes last. A SIGKILL keeps the page
  cache, so no crash test can see a missing fsync: a spy on ``os.fsync``, ``os.replace``
  and ``os.link`` records the order instead.
* ``COMMIT`` is created exclusively: a marker that another writer created first (a racer
  that passed its own epoch check at the same moment) is never overwritten, the save
  fails with ``ConflictError``, and the racer's version is what loads. The racer's marker
  appears at the exact moment this writer first touches its ``COMMIT`` path, whatever
  call that is, so the test holds even if the create is not the one the code uses today.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from asyncckpt import Checkpointer
from asyncckpt._storage import LocalStorage
from asyncckpt._versions.protocol import read_version_file
from asyncckpt.errors import AsyncCkptError, ConflictError
from tests.crashpoints import CrashPlan, StorageOp
from tests.testing.crash_scenarios import (
    DETERMINISTIC_ENV,
    EXPECTED,
    content_hash,
    state,
    wrapped_storage,
)


@pytest.fixture(autouse=True)
def _in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # The data file is written on this process's threads, where the spy sees it (the
    # writer process runs the same LocalStorage code).
    for name, value in DETERMINISTIC_ENV.items():
        monkeypatch.setenv(name, value)


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def test_data_is_durable_before_commit_and_commit_before_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    with Checkpointer(root, compression="none") as ckpt:
        ckpt.save(1, state(1)).result()
        events: list[tuple[str, str]] = []
        real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

        def fsync(fd: int) -> None:
            events.append(("fsync", _fd_path(fd)))
            real_fsync(fd)

        def replace(src: Any, dst: Any, **kw: Any) -> None:
            events.append(("replace", os.fspath(dst)))
            real_replace(src, dst, **kw)

        def link(src: Any, dst: Any, **kw: Any) -> None:
            events.append(("link", os.fspath(dst)))
            real_link(src, dst, **kw)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "link", link)
        ckpt.save(2, state(2)).result()
        monkeypatch.undo()
    step = str(root / "2")
    (data,) = [p for p in os.listdir(step) if p.endswith(".ackpt")]

    def first(kind: str, path: str, after: int = -1) -> int:
        for i, event in enumerate(events):
            if i > after and event == (kind, path):
                return i
        raise AssertionError(f"no {kind} of {path} after event {after}: {events}")

    def first_temp_fsync(target: str) -> int:
        for i, (kind, path) in enumerate(events):
            if kind == "fsync" and path.startswith(target + ".acktmp-"):
                return i
        raise AssertionError(f"no fsync of a temp file of {target}: {events}")

    data_path, commit, version = f"{step}/{data}", f"{step}/COMMIT", str(root / "VERSION")
    renamed = first("replace", data_path)
    assert first_temp_fsync(data_path) < renamed, "the data file was renamed before its fsync"
    dir_synced = first("fsync", step, renamed)
    linked = first("link", commit)
    assert dir_synced < linked, "COMMIT was created before the data file's rename was durable"
    assert first_temp_fsync(commit) < linked, "COMMIT was linked before its own bytes were durable"
    assert first("fsync", step, linked) < first("replace", version), "VERSION before COMMIT"


def test_a_commit_marker_that_appears_first_is_never_overwritten(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with Checkpointer(root, compression="none") as ckpt:
        ckpt.save(1, state(1)).result()
    (one,) = [p for p in (root / "1").iterdir() if p.suffix == ".ackpt"]
    racer_file = "r00000-0123456789ab.ackpt"
    racer = json.dumps(
        {
            "protocol": 1,
            "step": 2,
            "files": [racer_file],
            "sizes": [one.stat().st_size],
            "writer": "0123456789ab",
            "epoch": 1,
            "time": "2026-01-01T00:00:00+00:00",
        }
    ).encode()
    planted: list[StorageOp] = []

    def racer_commits_first(op: StorageOp) -> None:
        """The racer's version of step 2 (its data: step 1's state) lands just before this
        writer's first write to the marker's path."""
        if op.mutating and op.path == str(root / "2" / "COMMIT") and not planted:
            planted.append(op)
            shutil.copyfile(one, root / "2" / racer_file)
            with open(root / "2" / "COMMIT", "xb") as f:
                f.write(racer)

    plan = CrashPlan("count", on_call=racer_commits_first)
    with (
        wrapped_storage(plan),
        Checkpointer(root, compression="none") as ckpt,
        pytest.raises(ConflictError),
    ):
        ckpt.save(2, state(2)).result()
    assert planted, "this writer never wrote its COMMIT"
    assert (root / "2" / "COMMIT").read_bytes() == racer, "the racer's COMMIT was overwritten"
    assert sorted(os.listdir(root / "2")) == ["COMMIT", racer_file], "our data stayed"
    reader = Checkpointer(root, read_only=True)
    assert reader.latest() == 2
    assert content_hash(reader.load()) == EXPECTED[1]  # the racer's data, whole


def test_a_writer_taken_over_after_its_epoch_check_cannot_move_version_back(
    tmp_path: Path,
) -> None:
    """Writer A passes its epoch check for step 2; right then, before its COMMIT, writer B
    takes the root (claims epoch 2 and installs it in VERSION). A's COMMIT of step 2 still
    lands (the residual window of PROTOCOL.md §0: its data is whole and nothing newer was
    published, so the version stands), but its version-file replace is conditional on the
    tag A read before the takeover: VERSION keeps B's epoch, and B goes on saving."""
    root = tmp_path / "root"
    commit_2 = str(root / "2" / "COMMIT")
    taken_over: list[Checkpointer] = []

    def b_takes_over(op: StorageOp) -> None:
        if op.mutating and op.path == commit_2 and not taken_over:
            b = Checkpointer(root, compression="none")
            taken_over.append(b)
            b._writer.acquire()  # on this thread: the save threads are A's

    plan = CrashPlan("count", on_call=b_takes_over)
    with wrapped_storage(plan):
        a = Checkpointer(root, compression="none")
        a.save(1, state(1)).result()
        with contextlib.suppress(AsyncCkptError):  # A may report its step 2 as standing
            a.save(2, state(2)).result()
    assert taken_over, "A never reached its COMMIT"
    (b,) = taken_over
    record = read_version_file(LocalStorage(), str(root))
    assert record is not None and record.writer == b._writer.token, "VERSION is A's again"
    reader = Checkpointer(root, read_only=True)
    newest = reader.latest()
    assert newest in (1, 2) and content_hash(reader.load()) == EXPECTED[newest]
    b.save(5, state(5)).result()  # B still holds the root
    assert content_hash(Checkpointer(root, read_only=True).load()) == EXPECTED[5]
    b.close()
    with contextlib.suppress(AsyncCkptError):
        a.close()
