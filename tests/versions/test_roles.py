"""Roles and fencing in one process: readers never write, one fenced writer, no lost failure.

The multi-process scenarios (a polling evaluator, a frozen writer, racing writers) are in
``tests/versions/test_roles_processes.py``; collective loads that must not hang are in
``tests/api/test_distributed.py``.
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt import _liveness as liveness
from asyncckpt import _threads as workers
from asyncckpt._storage import TEMP_MARK, resolve
from asyncckpt._versions.protocol import parse_step, read_version_file
from asyncckpt.errors import AsyncCkptError, ConflictError, StorageError

REPO = Path(__file__).resolve().parents[2]


def state(step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.full((1000,), float(step)), "ids": torch.arange(10) * step}


def check(got: Any, step: int) -> None:
    assert got["step"] == step
    assert torch.equal(got["w"], state(step)["w"])
    assert torch.equal(got["ids"], state(step)["ids"])


def listing(root: str) -> dict[str, bytes]:
    storage, base = resolve(root, None)
    out: dict[str, bytes] = {}

    def walk(path: str, prefix: str) -> None:
        for name in storage.list_dir(path):
            child = storage.join(path, name)
            try:
                out[prefix + name] = storage.read_range(child, 0, 1 << 30)
            except (AsyncCkptError, IsADirectoryError):
                walk(child, prefix + name + "/")

    walk(base, "")
    return out


# --------------------------------------------------------------------------- readers


@pytest.mark.parametrize("root_state", ["healthy", "lagging"])
def test_readers_change_nothing(any_root: str, root_state: str) -> None:
    """A reader writes nothing, on a healthy root and on one a writer would repair: a
    version file that lags the newest COMMIT (its write failed after the commit), a temp
    file and an uncommitted step left by a killed save."""
    storage, base = resolve(any_root, None)
    version = storage.join(base, "VERSION")
    with Checkpointer(any_root) as ckpt:
        ckpt.save(1, state(1)).result()
        lagging = storage.read_bytes(version, 1 << 20)
        ckpt.save(2, state(2))
    if root_state == "lagging":
        storage.write_bytes(version, lagging)
        storage.write_bytes(storage.join(base, f"VERSION{TEMP_MARK}0123456789ab"), b"{")
        storage.write_bytes(storage.join(base, "3", "r00000-0123456789ab.ackpt"), b"partial")
    before = listing(any_root)
    reader = Checkpointer(any_root)  # not read_only: constructing and loading still write nothing
    assert reader.latest() == 2 and reader.versions() == [1, 2]
    check(reader.load(), 2)
    check(reader.load(step=1), 1)
    reader.close()
    assert listing(any_root) == before


def test_read_only_save_raises_at_once(any_root: str) -> None:
    ckpt = Checkpointer(any_root, read_only=True)
    with pytest.raises(AsyncCkptError, match="read-only"):
        ckpt.save(1, state(1))
    assert listing(any_root) == {}
    assert "read-only" in repr(ckpt)


def test_world_size_without_a_process_group_is_an_error(
    any_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpointer(any_root)  # constructing is fine: the rank is resolved when needed
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(AsyncCkptError, match="init_process_group"):
        ckpt.save(1, state(1))
    assert listing(any_root) == {}
    monkeypatch.setenv("WORLD_SIZE", "1")
    ckpt.save(1, state(1))
    ckpt.close()


def test_step_names_are_canonical_decimals(any_root: str) -> None:
    with Checkpointer(any_root) as ckpt:
        ckpt.save(7, state(7))
    storage, base = resolve(any_root, None)
    for odd in ("007", "²", "١٢", "+3", "99999999999999999999"):
        storage.write_bytes(storage.join(base, odd, "junk"), b"x")
    assert Checkpointer(any_root).versions() == [7]
    with Checkpointer(any_root) as ckpt:
        ckpt.save(8, state(8))  # recovery neither crashes on them nor aliases step 7
    check(Checkpointer(any_root).load(step=7), 7)
    assert [parse_step(n) for n in ("0", "10", "01", "²", "1e3")] == [0, 10, None, None, None]


# --------------------------------------------------------------------------- the writer


def test_version_file_write_failing_after_commit_keeps_the_save(
    any_root: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = Checkpointer(any_root)
    ckpt.save(1, state(1)).result(timeout=60)
    storage = ckpt._storage
    real = storage.replace_if

    def replace_if(path: str, data: bytes, tag: str | None) -> str:
        raise StorageError(f"{path}: injected: the version file write failed")

    monkeypatch.setattr(storage, "replace_if", replace_if)
    ckpt.save(2, state(2)).result(timeout=60)  # committed: the save succeeds
    assert "version file was not moved" in caplog.text
    assert read_version_file(*resolve(any_root, None)).step == 1  # type: ignore[union-attr]
    files = listing(any_root)
    assert "2/COMMIT" in files and "2/FAILED" not in files
    check(ckpt.load(), 2)  # the writer and every reader load it
    assert Checkpointer(any_root).latest() == 2
    check(Checkpointer(any_root).load(), 2)
    monkeypatch.setattr(storage, "replace_if", real)
    ckpt.save(3, state(3)).result(timeout=60)
    assert read_version_file(*resolve(any_root, None)).step == 3  # type: ignore[union-attr]
    ckpt.close()


def test_a_commit_marker_we_created_but_did_not_hear_about_is_ours(
    any_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost response to the COMMIT create, then a 412 on the retry: never delete our data."""
    ckpt = Checkpointer(any_root)
    storage = ckpt._storage
    real = storage.create_exclusive

    def create_exclusive(path: str, data: bytes) -> None:
        real(path, data)
        if path.endswith("COMMIT"):
            raise ConflictError(f"{path} already exists (the first try's response was lost)")

    monkeypatch.setattr(storage, "create_exclusive", create_exclusive)
    ckpt.save(1, state(1)).result(timeout=60)
    ckpt.close()
    check(Checkpointer(any_root).load(), 1)


def test_checkpointers_racing_on_one_step(any_root: str) -> None:
    """Four writers save step 7 at once: exactly one wins, and its data is what loads."""
    barrier = threading.Barrier(4)
    outcomes: dict[int, BaseException | None] = {}

    def run(i: int) -> None:
        ckpt = Checkpointer(any_root)
        barrier.wait()
        try:
            ckpt.save(7, {**state(7), "who": i}).result(timeout=60)
            outcomes[i] = None
        except ConflictError as exc:
            outcomes[i] = exc
        ckpt.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    winners = [i for i, exc in outcomes.items() if exc is None]
    assert len(outcomes) == 4 and len(winners) == 1, outcomes
    got = Checkpointer(any_root).load(step=7)
    assert got["who"] == winners[0]
    check(got, 7)


# --------------------------------------------------------------------------- failures reach someone


def test_load_of_a_file_whose_save_failed_raises_that_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "m.ackpt")
    asyncckpt.save(state(1), path).result(timeout=60)
    gate = threading.Event()
    from asyncckpt._engine import writer_process

    real = writer_process.write

    def failing(*args: Any, **kwargs: Any) -> int:
        gate.wait(60)
        raise StorageError(f"{path}: injected: disk full")

    monkeypatch.setattr(writer_process, "write", failing)
    asyncckpt.save(state(2), path)
    gate.set()
    with pytest.raises(StorageError, match="disk full"):  # not the old file, silently
        asyncckpt.load(path)
    monkeypatch.setattr(writer_process, "write", real)
    check(asyncckpt.load(path), 1)  # raised once; the old file is intact
    asyncckpt.wait()


def test_load_raises_the_failure_of_a_save_that_already_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The failed save ended before the load looked (found by a quiet make test, where the
    # test above let the write fail before load() ran): it is no longer running, but its
    # failure is still nobody's, so the load raises it instead of the old file.
    path = str(tmp_path / "m.ackpt")
    asyncckpt.save(state(1), path).result(timeout=60)
    from asyncckpt._engine import writer_process

    def failing(*args: Any, **kwargs: Any) -> int:
        raise StorageError(f"{path}: injected: disk full")

    monkeypatch.setattr(writer_process, "write", failing)
    handle = asyncckpt.save(state(2), path)
    concurrent.futures.wait([handle], timeout=60)  # ended; nobody has looked at its failure
    assert handle.done()
    with pytest.raises(StorageError, match="disk full"):
        asyncckpt.load(path)
    check(asyncckpt.load(path), 1)  # raised once; the old file is intact
    asyncckpt.wait()


def test_commit_failure_while_the_next_save_stages_is_raised_by_wait(
    any_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpointer(any_root)
    ckpt.save(1, state(1)).result(timeout=60)
    failed, staging = threading.Event(), threading.Event()
    real_commit = ckpt._writer.commit

    def commit(step: int, files: Any, sizes: Any, **kinds: Any) -> None:
        if step == 2:
            staging.wait(60)
            failed.set()
            raise StorageError("injected: the commit of step 2 failed")
        real_commit(step, files, sizes, **kinds)

    monkeypatch.setattr(ckpt._writer, "commit", commit)
    import asyncckpt._api.checkpointer as module

    real_stage = module.stage

    def slow_stage(*args: Any, **kwargs: Any) -> Any:
        staging.set()
        failed.wait(60)  # save 2 fails while save 3 is staging
        return real_stage(*args, **kwargs)

    ckpt.save(2, state(2))
    monkeypatch.setattr(module, "stage", slow_stage)
    ckpt.save(3, state(3))
    with pytest.raises(StorageError, match="step 2 failed"):
        ckpt.wait()
    ckpt.wait()  # once
    ckpt.close()
    assert Checkpointer(any_root).versions() == [1, 3]


EXIT_SCRIPT = """
import sys, torch, asyncckpt
from asyncckpt.errors import StorageError
from asyncckpt._engine import writer_process
def fail(*a, **k):
    raise StorageError(sys.argv[1] + ": injected: no space left on device")
writer_process.write = fail
asyncckpt.save({"w": torch.ones(3)}, sys.argv[1])
print("main finished")
"""


def test_an_unobserved_failure_at_exit_is_printed_and_fails_the_process(tmp_path: Path) -> None:
    target = str(tmp_path / "never.ackpt")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, target],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert "main finished" in done.stdout
    assert done.returncode == 1, done.stderr
    assert target in done.stderr and "no space left" in done.stderr


def test_an_observed_failure_does_not_fail_the_exit(tmp_path: Path) -> None:
    script = EXIT_SCRIPT.replace(
        'asyncckpt.save({"w": torch.ones(3)}, sys.argv[1])',
        'h = asyncckpt.save({"w": torch.ones(3)}, sys.argv[1])\n'
        "try:\n    h.result()\nexcept StorageError:\n    pass",
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "x.ackpt")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- object stores


def test_lost_responses_to_commit_and_version_on_s3(
    s3_root: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store performs the PUT, the client never hears: every save still succeeds."""
    ckpt = Checkpointer(s3_root, storage_options=s3_server.storage_options)
    fs = ckpt._storage.fs  # type: ignore[attr-defined]
    real = fs.call_s3
    lost: list[tuple[str, bytes]] = []

    def call_s3(method: str, *args: Any, **kwargs: Any) -> Any:
        result = real(method, *args, **kwargs)
        request = (str(kwargs.get("Key", "")), bytes(kwargs.get("Body") or b""))
        if (
            method == "put_object"
            and request[0].endswith(("/COMMIT", "/VERSION"))
            and request not in lost
        ):
            lost.append(request)  # each write's first try only: its retry gets through
            raise ConnectionResetError(104, "injected: response lost after the store applied it")
        return result

    monkeypatch.setattr(fs, "call_s3", call_s3)
    for step in (1, 2, 3):
        ckpt.save(step, state(step)).result(timeout=120)
    ckpt.close()
    assert len(lost) >= 5  # VERSION at takeover and per save, COMMIT per save
    reader = Checkpointer(s3_root, storage_options=s3_server.storage_options)
    assert reader.versions() == [1, 2, 3]
    for step in (1, 2, 3):
        check(reader.load(step=step), step)


def test_a_store_without_conditional_writes_is_refused_unless_opted_in(
    s3_root: str, s3_server: Any
) -> None:
    from asyncckpt.testing import FaultPlan

    url = f"faulty::{s3_root}"
    options = {
        "faulty": {"plan": FaultPlan(ignore_conditional=True)},
        "s3": s3_server.storage_options,
    }
    with pytest.raises(StorageError, match="unsafe_unconditional_writes"):
        Checkpointer(url, storage_options=options).save(1, state(1)).result(timeout=120)
    unsafe = {**options, "unsafe_unconditional_writes": True}
    with Checkpointer(url, storage_options=unsafe) as ckpt:
        ckpt.save(2, state(2)).result(timeout=120)
    check(Checkpointer(s3_root, storage_options=s3_server.storage_options).load(), 2)


def test_version_record_carries_the_epoch(any_root: str) -> None:
    for expected in (1, 2):
        with Checkpointer(any_root) as ckpt:
            ckpt.save(expected, state(expected))
        storage, base = resolve(any_root, None)
        doc = json.loads(storage.read_bytes(storage.join(base, "VERSION"), 4096))
        assert doc["epoch"] == expected and doc["step"] == expected


RESTARTED_JOB = """
import json, sys, torch, asyncckpt
with asyncckpt.Checkpointer(sys.argv[1], storage_options=json.loads(sys.argv[2])) as ckpt:
    for step in (10, 20):
        ckpt.save(step, {"step": step, "w": torch.full((1000,), float(step)),
                         "ids": torch.arange(10) * step})
"""


def test_a_zombie_writer_on_s3_cannot_move_the_version_backwards(
    s3_root: str, s3_server: Any
) -> None:
    """Writer A's VERSION PUT is held on the wire while job B takes over and commits 10, 20."""
    from tests.proxy import FaultProxy

    with FaultProxy(s3_server) as proxy:
        zombie = Checkpointer(s3_root, storage_options=proxy.storage_options)
        for step in (1, 2):
            zombie.save(step, state(step)).result(timeout=120)
        rule = proxy.hold("PUT", "/VERSION", count=100)  # its retries are held too
        handle = zombie.save(3, state(3))
        rule.wait_held(timeout=120)
        restarted = subprocess.run(
            [sys.executable, "-c", RESTARTED_JOB, s3_root, json.dumps(s3_server.storage_options)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert restarted.returncode == 0, restarted.stderr[-3000:]
        rule.release()
        with pytest.raises(ConflictError, match=r"took .* over"):
            handle.result(timeout=120)
        zombie.close()
    reader = Checkpointer(s3_root, storage_options=s3_server.storage_options)
    record = read_version_file(reader._storage, reader._root)
    assert record is not None and record.step == 20 and record.epoch == 2
    assert reader.latest() == 20
    check(reader.load(), 20)


def test_lost_responses_on_the_wire_to_commit_and_version(s3_root: str, s3_server: Any) -> None:
    """Through a proxy: the store performs the COMMIT and VERSION PUTs, the client's
    connection closes before the answer; the client library and our retry see a reset."""
    from tests.proxy import FaultProxy

    with FaultProxy(s3_server) as proxy:
        ckpt = Checkpointer(s3_root, storage_options=proxy.storage_options)
        ckpt.save(1, state(1)).result(timeout=120)
        commit_rule = proxy.drop_response("PUT", "/2/COMMIT")
        version_rule = proxy.drop_response("PUT", "/VERSION")
        ckpt.save(2, state(2)).result(timeout=120)  # succeeds: nothing of ours deleted
        commit_rule.wait_done(timeout=60)
        version_rule.wait_done(timeout=60)
        ckpt.close()
    reader = Checkpointer(s3_root, storage_options=s3_server.storage_options)
    assert reader.versions() == [1, 2]
    record = read_version_file(reader._storage, reader._root)
    assert record is not None and record.step == 2
    check(reader.load(), 2)


def test_a_lease_claim_whose_temp_file_a_newer_writer_pruned_claims_a_later_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers claiming at once: the one that took the later epoch prunes the other's
    claim in flight (an older epoch's temp file). That claim must move on to a later epoch,
    as when the record itself was taken first, not fail the save (found by scripts/soak.sh:
    test_racing_writer_processes_on_local_disk)."""
    from asyncckpt._storage import local

    root = tmp_path / "ckpt"
    with Checkpointer(root) as first:
        first.save(1, {"w": torch.zeros(2)}).result()
    real_link, pruned = os.link, []

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if "_lease" in str(dst) and not pruned:  # the racer pruned our temp file just now
            os.unlink(src)
            pruned.append(dst)
        real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(local.os, "link", link)
    with Checkpointer(root) as second:
        second.save(2, {"w": torch.ones(2)}).result()
        assert second.latest() == 2
    assert pruned and not Path(pruned[0]).exists()  # the lost claim's epoch stays free


def test_a_new_writer_removes_temp_files_of_older_lease_writes(tmp_path: Path) -> None:
    # A writer killed while (re)writing its lease record leaves a temp file in _lease/.
    from asyncckpt._storage import TEMP_MARK

    root = tmp_path / "ckpt"
    with Checkpointer(root) as first:
        first.save(1, {"w": torch.zeros(2)}).result()
    (old,) = (root / "_lease").iterdir()
    (root / "_lease" / f"{old.name}{TEMP_MARK}0123456789ab").write_bytes(b'{"epoch"')
    with Checkpointer(root) as second:
        second.save(2, {"w": torch.ones(2)}).result()
    (record,) = (root / "_lease").iterdir()  # the older record and its temp file are gone
    assert TEMP_MARK not in record.name and int(record.name) > int(old.name)


# --------------------------------------------------------------------------- lease heartbeats


def _heartbeat(ckpt: Checkpointer) -> liveness.Beat:
    thread = ckpt._writer._heartbeat
    assert thread is not None and thread.is_alive()
    return thread


def test_a_fenced_writers_heartbeat_stops_and_never_brings_back_its_lease_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_LEASE_RENEW_MS", "20")
    root = tmp_path / "ckpt"
    old = Checkpointer(root)
    old.save(1, state(1)).result()
    beating = _heartbeat(old)
    # the record itself (the heartbeat's rewrite may have its temp file beside it)
    (old_record,) = [p for p in (root / "_lease").iterdir() if TEMP_MARK not in p.name]
    with Checkpointer(root) as new:  # a restarted job: takes the root, prunes old's record
        new.save(2, state(2)).result()
        beating.join(timeout=60)  # the fenced writer's heartbeat ends on its own
        assert not beating.is_alive()
        assert not old_record.exists()  # and did not write it again
    old.close()


def test_a_renewal_that_raced_the_takeover_leaves_no_record_behind(tmp_path: Path) -> None:
    # The fenced writer's renewal checked the version file, then wrote, and the newer
    # writer's pruning of its record fell in between (found by scripts/soak.sh): the
    # record came back. Its next beat finds the writer fenced and takes the record away.
    root = tmp_path / "ckpt"
    old = Checkpointer(root)
    old.save(1, state(1)).result()
    beat = _heartbeat(old)
    (old_record,) = [p for p in (root / "_lease").iterdir() if TEMP_MARK not in p.name]
    content = old_record.read_bytes()
    with Checkpointer(root) as new:
        new.save(2, state(2)).result()
        assert not old_record.exists()  # pruned by the newer writer
        old_record.write_bytes(content)  # the racing renewal lands after the pruning
        beat.renew()
        assert not beat.is_alive()
        assert not old_record.exists()
        assert new.load()["step"] == 2
    old.close()


def test_a_renewal_never_writes_back_a_pruned_record(tmp_path: Path) -> None:
    # A newer writer's claim pruned the record before it committed anything (the version
    # file still names the old writer): the old writer's beat ends instead of recreating it.
    root = tmp_path / "ckpt"
    old = Checkpointer(root)
    old.save(1, state(1)).result()
    beat = _heartbeat(old)
    (old_record,) = [p for p in (root / "_lease").iterdir() if TEMP_MARK not in p.name]
    old_record.unlink()
    beat.renew()
    assert not beat.is_alive()
    assert not old_record.exists()
    old.close()


def test_the_heartbeat_of_a_checkpointer_never_closed_ends_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The beat ends at its next renewal: a short period makes that come soon.
    monkeypatch.setenv("ASYNCCKPT_LEASE_RENEW_MS", "20")
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, state(1)).result()
    beating = _heartbeat(ckpt)
    del ckpt
    # The save thread drops its last task (which held the Checkpointer) just after the
    # result is published: wait for that, as the exit hook does.
    assert workers.wait_idle(60)
    gc.collect()
    beating.join(timeout=60)
    assert not beating.is_alive()
