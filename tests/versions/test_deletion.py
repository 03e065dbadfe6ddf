"""What may be deleted, by whom (issue 19): one rule, fenced writers, links, bad names, FAILED.

* a writer that lost the lease deletes nothing another writer may own: not in ``close()``'s
  retention, not in its recovery, not in a sweep, not after a failure (no ``FAILED``);
* deleting never follows a symbolic link: a step directory that links to another run's
  step is removed as a link, in retention and in recovery;
* one rule (:func:`asyncckpt._versions.retention.deletion_plan`, fed by ``list_steps``) for the
  writer's retention and recovery and ``asyncckpt gc``: a step whose ``COMMIT`` cannot be
  read (damaged, newer protocol) is never deleted, even by ``gc``;
* a ``COMMIT`` naming a file with a NUL byte (or any name a file cannot have) is an
  unreadable record: readers skip the version, writers refuse the root;
* ``FAILED`` markers name their attempt (writer, epoch): a waiter ignores an earlier job's,
  and a new writer's recovery removes them.

The multi-process scenarios (a SIGSTOPped zombie, an evaluator, two gloo ranks) are in
``tests/versions/test_roles_processes.py`` and ``tests/api/test_distributed.py``.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

import asyncckpt._versions.lease
import asyncckpt._versions.protocol
import asyncckpt._versions.writing
from asyncckpt import Checkpointer
from asyncckpt._settings import Settings
from asyncckpt._storage import AtomicWriter, resolve
from asyncckpt._versions.protocol import (
    COMMITTED,
    UNCOMMITTED,
    UNREADABLE,
    StepEntry,
    commit_from,
    delete_version,
    list_steps,
    newest_good,
    read_failure,
)
from asyncckpt._versions.retention import RetentionPolicy, deletion_plan, policy_from
from asyncckpt._versions.writing import RootWriter
from asyncckpt.errors import (
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    ConflictError,
    UnreadableRecordError,
)
from tests.api.test_checkpointer import (
    _drain_saves,  # noqa: F401 (an autouse fixture)
    _GatedWriter,
    assert_state,
    committed_root,
    contents,
    files,
    make_state,
    put,
    reader,
    record,
)


def _steps_and_bytes(root: str) -> dict[str, bytes]:
    """Every file under ``root`` but the lease records (heartbeats rewrite them)."""
    return {k: v for k, v in contents(root).items() if not k.startswith("_lease/")}


# --------------------------------------------------------------------------- 1. fenced writers


def test_a_fenced_writers_close_deletes_none_of_the_new_writers_versions(any_root: str) -> None:
    old = Checkpointer(any_root, keep_last=2)
    for step in (1, 2, 3):
        old.save(step, make_state(step))
    old.wait()
    new = Checkpointer(any_root, keep_last=3)  # a restarted job takes the root over
    new.save(4, make_state(4)).result(timeout=60)
    before = _steps_and_bytes(any_root)
    old.close()  # its retention (keep_last=2) would delete step 2, which the new one keeps
    assert _steps_and_bytes(any_root) == before
    assert reader(any_root).versions() == [2, 3, 4]
    new.close()
    assert reader(any_root).versions() == [2, 3, 4]


def test_a_writer_fenced_before_its_recovery_deletes_nothing(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    committed_root(root, [1, 5])
    storage, base = resolve(root, None)
    old = RootWriter(storage, base, "0123456789ab", Settings())
    real_recover = old._recover
    seen: dict[str, dict[str, bytes]] = {}

    def recover() -> None:
        # Between its lease install and its recovery, another writer takes the root over
        # and works: its temp file, a leftover it has not cleaned yet, a FAILED of its own.
        with Checkpointer(root) as new:
            new.save(6, make_state(6)).result(timeout=60)
        put(root, "VERSION.acktmp-0123456789ab", b"the new writer's VERSION, half written")
        put(root, "3/r00000-feedfeedfeed.ackpt", b"a leftover")
        put(root, "5/COMMIT.acktmp-0123456789ab", b"partial")
        put(root, "8/FAILED", record(step=8, error="its failure", writer=new._token, epoch=3))
        seen["before"] = _steps_and_bytes(root)
        real_recover()
        seen["after"] = _steps_and_bytes(root)

    old._recover = recover  # type: ignore[method-assign]
    try:
        old.acquire()
    finally:
        old.release()
    assert seen["after"] == seen["before"]
    assert "8/FAILED" in seen["after"]


def test_a_fenced_writer_marks_no_failure(any_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    old = Checkpointer(any_root)
    old.save(1, make_state(1)).result(timeout=60)
    new = Checkpointer(any_root)
    new.save(2, make_state(2)).result(timeout=60)  # takes the root over
    real_open = old._storage.open_atomic

    def open_atomic(path: str) -> AtomicWriter:
        if path.endswith(".ackpt"):
            raise OSError(28, "injected: no space left on device")
        return real_open(path)

    monkeypatch.setattr(old._storage, "open_atomic", open_atomic)
    with pytest.raises(OSError, match="injected"):
        old.save(3, make_state(3)).result(timeout=60)
    assert "3/FAILED" not in files(any_root)  # the root is not its own any more
    old.close()
    new.close()


def test_a_fenced_writer_whose_version_stands_does_not_sweep_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taken over between its COMMIT and the version file, with its version still the
    newest: its save succeeds, but the files of the new writer in that step stay."""
    root = str(tmp_path / "run")
    old = Checkpointer(root)
    old.save(1, make_state(1)).result(timeout=60)
    new = Checkpointer(root)
    real_publish = asyncckpt._versions.writing.publish_version
    foreign = "2/r00000-0ddba11c0ffe.ackpt"

    def publish_version(storage: Any, base: str, rec: Any, tag: Any) -> str:
        if rec.writer == old._token and rec.step == 2:
            new._writer.acquire()  # rolls VERSION forward to our step 2, which verifies
            put(root, foreign, b"the new writer's save of step 2, in flight")
        return real_publish(storage, base, rec, tag)

    monkeypatch.setattr(asyncckpt._versions.writing, "publish_version", publish_version)
    old.save(2, make_state(2)).result(timeout=60)  # its version stands (exactly one wins)
    assert foreign in files(root)
    assert_state(reader(root).load(), 2)
    old.close()
    new.close()


# --------------------------------------------------------------------------- 2. symbolic links


def test_retention_removes_a_linked_step_as_a_link(tmp_path: Path) -> None:
    other, mine = tmp_path / "other", tmp_path / "mine"
    committed_root(str(other), [5])
    mine.mkdir()
    (mine / "5").symlink_to(other / "5", target_is_directory=True)
    with Checkpointer(mine, keep_last=1) as ckpt:
        ckpt.save(6, make_state(6)).result(timeout=60)
        ckpt.save(7, make_state(7)).result(timeout=60)
    assert not os.path.lexists(mine / "5")  # the link is gone ...
    assert (other / "5" / "COMMIT").exists()  # ... and what it pointed to is whole
    assert reader(str(other)).versions() == [5]
    assert_state(reader(str(other)).load(step=5), 5)
    assert reader(str(mine)).versions() == [7]


def test_recovery_never_deletes_temp_files_through_a_linked_version(tmp_path: Path) -> None:
    other, mine = tmp_path / "other", tmp_path / "mine"
    committed_root(str(other), [2, 5])
    in_progress = other / "5" / "COMMIT.acktmp-0123456789ab"  # the other run's temp file
    in_progress.write_bytes(b"partial")
    committed_root(str(mine), [1])
    (mine / "5").symlink_to(other / "5", target_is_directory=True)
    with Checkpointer(mine) as ckpt:  # its first save's recovery: published step 5 (linked)
        ckpt.save(6, make_state(6)).result(timeout=60)
    assert in_progress.exists()
    assert os.path.islink(mine / "5")  # a committed version: kept
    assert reader(str(other)).versions() == [2, 5]


def test_recovery_removes_a_linked_leftover_as_a_link(tmp_path: Path) -> None:
    other, mine = tmp_path / "other", tmp_path / "mine"
    (other / "3").mkdir(parents=True)
    leftover = other / "3" / "r00000-0123456789ab.ackpt"
    leftover.write_bytes(b"the other run's save in progress")
    committed_root(str(mine), [5])
    (mine / "3").symlink_to(other / "3", target_is_directory=True)
    with Checkpointer(mine) as ckpt:
        ckpt.save(6, make_state(6)).result(timeout=60)
    assert not os.path.lexists(mine / "3")  # an uncommitted leftover: removed, as a link
    assert leftover.read_bytes() == b"the other run's save in progress"


# --------------------------------------------------------------------------- 3. one rule


def _entries(**states: str) -> list[StepEntry]:
    return [StepEntry(int(s.removeprefix("s")), state) for s, state in states.items()]


def test_the_deletion_rule() -> None:
    listing = _entries(
        s1=COMMITTED, s2=UNREADABLE, s3=UNCOMMITTED, s4=COMMITTED, s5=COMMITTED, s6=UNCOMMITTED
    )

    def plan(policy: RetentionPolicy, pinned: int | None, spare: tuple[int, ...] = ()) -> Any:
        return [e.step for e in deletion_plan(listing, policy, pinned, spare, good=pinned)]

    assert plan(policy_from({"keep_last": 1}), 5) == [1, 3, 4]
    assert plan(policy_from({"keep_last": 1}), 5, spare=(4,)) == [1, 3]
    assert plan(policy_from({"keep_last": 1}), None) == []  # newest unknown: nothing goes
    assert plan(policy_from({}), 5) == [3]  # keep every committed version: leftovers only
    assert plan(policy_from({"keep_last": 1}), 4) == [1, 3]  # nothing newer than the pinned
    assert plan(policy_from({"keep_last": 10}), 6) == [3]  # never the unreadable step 2
    # The version file lags a newer commit (a crash between COMMIT 5 and VERSION 5): the
    # step it names stays, though the rules keep only 5, the newest that verifies.
    lagging = deletion_plan(listing, policy_from({"keep_last": 1}), 4, good=5)
    assert [e.step for e in lagging] == [1, 3]


def test_list_steps_tells_committed_uncommitted_unreadable_and_links(tmp_path: Path) -> None:
    root = tmp_path / "run"
    committed_root(str(root), [1, 2])
    (root / "3").mkdir()
    (root / "4").mkdir()
    (root / "4" / "COMMIT").write_bytes(record(step=4, files=["x.ackpt"], writer="w") + b"}")
    (root / "7").symlink_to(root / "2", target_is_directory=True)
    listing = {e.step: e for e in list_steps(*resolve(str(root), None))}
    assert {s: e.state for s, e in listing.items()} == {
        1: COMMITTED,
        2: COMMITTED,
        3: UNCOMMITTED,
        4: UNREADABLE,
        7: UNREADABLE,  # a link to step 2: its COMMIT names step 2, not 7
    }
    assert [s for s, e in listing.items() if e.link] == [7]
    assert listing[4].problem is not None and "4/COMMIT" in listing[4].problem


@pytest.mark.parametrize("damage", ["not-json", "newer-protocol"])
def test_gc_never_deletes_a_step_whose_commit_it_cannot_read(tmp_path: Path, damage: str) -> None:
    from asyncckpt.cli import main

    root = tmp_path / "run"
    committed_root(str(root), [10, 20, 30, 40])
    marker = root / "20" / "COMMIT"
    if damage == "not-json":
        marker.write_text("{not json")
    else:
        doc = json.loads(marker.read_text())
        marker.write_text(json.dumps({**doc, "protocol": 2}))
    (root / "15").mkdir()  # a leftover of an interrupted save
    assert main(["gc", str(root), "--keep-last", "2", "--json"]) == 0
    assert sorted(p.name for p in root.iterdir() if p.name.isdigit()) == ["20", "30", "40"]
    assert marker.exists()
    # ... and the writer's retention agrees: it refuses the root, as for any unreadable record
    with pytest.raises(ConflictError, match="refusing to write"):
        Checkpointer(root, keep_last=2).save(50, make_state(50)).result(timeout=60)


def _damage(root: Path, how: str) -> None:
    """Leave ``root`` (steps 10..40 committed, VERSION naming 40) with its version file
    naming a step that is gone or unreadable, as a killed ``rewind`` or a bad disk does."""
    if how == "version-names-a-deleted-step":  # a rewind killed after its first deletion
        delete_version(*resolve(str(root), None), 40)
    elif how == "version-names-a-damaged-commit":
        (root / "40" / "COMMIT").write_text("{not json")
    else:  # "version-names-truncated-data": COMMIT parses, its data file does not verify
        data = next((root / "40").glob("*.ackpt"))
        data.write_bytes(data.read_bytes()[:100])


@pytest.mark.parametrize(
    "how",
    [
        "version-names-a-deleted-step",
        "version-names-a-damaged-commit",
        "version-names-truncated-data",
    ],
)
@pytest.mark.parametrize(
    "rule",
    [["--keep-every", "1000"], ["--keep-best", "1", "--best-metric", "loss"], ["--keep-last", "1"]],
    ids=str,
)
def test_gc_never_deletes_the_newest_good_version_whatever_the_version_file_says(
    tmp_path: Path, how: str, rule: list[str]
) -> None:
    from asyncckpt.cli import main

    root = tmp_path / "run"
    committed_root(str(root), [10, 20, 30, 40])
    _damage(root, how)
    assert main(["gc", str(root), *rule]) == 0
    assert (root / "30" / "COMMIT").exists()  # the newest version that loads
    assert_state(reader(str(root)).load(30), 30)


@pytest.mark.parametrize(
    "how",
    [
        "version-names-a-deleted-step",
        "version-names-a-damaged-commit",
        "version-names-truncated-data",
    ],
)
def test_the_deletion_rule_never_deletes_the_newest_good_version(tmp_path: Path, how: str) -> None:
    root = tmp_path / "run"
    committed_root(str(root), [10, 20, 30, 40])
    _damage(root, how)
    entries = list_steps(*resolve(str(root), None))
    good = newest_good(*resolve(str(root), None), entries)
    assert good == 30
    # whatever step a caller pins (the version file's 40), the newest good one stays
    plan = deletion_plan(entries, policy_from({"keep_every": 1000}), 40, good=good)
    assert 30 not in [e.step for e in plan]


def test_rewind_to_a_version_whose_data_is_damaged_deletes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with Checkpointer(str(root)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, make_state(step))
        ckpt.wait()
        data = next((root / "2").glob("*.ackpt"))
        data.write_bytes(data.read_bytes()[:100])
        with pytest.raises(CheckpointNotFoundError, match=r"step 2 .*does not verify"):
            ckpt.rewind(2)
        assert ckpt.versions() == [1, 2, 3] and ckpt.latest() == 3


def test_ls_shows_an_unreadable_commit_as_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncckpt.cli import main

    root = tmp_path / "run"
    committed_root(str(root), [1, 2])
    (root / "2" / "COMMIT").write_text("{not json")
    assert main(["ls", str(root), "--json"]) == 0
    versions = {v["step"]: v for v in json.loads(capsys.readouterr().out)["versions"]}
    assert versions[1]["state"] == "committed"
    assert versions[2]["state"] == "unreadable" and "not valid JSON" in versions[2]["problem"]


# --------------------------------------------------------------------------- 9. file names


BAD_NAMES = [
    "r00000-ab\x00cd.ackpt",
    "r00000-\x01.ackpt",
    "r00000-\x7f.ackpt",
    "sub\\r00000-a.ackpt",
    "../r00000-a.ackpt",
    "..ackpt",
    "r00000-\udc80.ackpt",
    "",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_commit_naming_an_impossible_file_name_is_unreadable(name: str) -> None:
    doc = {"protocol": 1, "step": 3, "files": [name], "writer": "w"}
    with pytest.raises(UnreadableRecordError, match=r"step 3 names the file") as info:
        commit_from(doc, 3, "ROOT/3/COMMIT")
    assert repr(name) in str(info.value) and "ROOT/3/COMMIT" in str(info.value)


def test_a_nul_byte_in_a_commits_file_name_skips_the_version(
    any_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncckpt.cli import main

    committed_root(any_root, [1])
    put(any_root, "2/COMMIT", record(step=2, files=["r00000-ab\x00cd.ackpt"], writer="w"))
    other = reader(any_root)
    assert other.latest() == 1 and other.versions() == [1]
    assert_state(other.load(), 1)
    with pytest.raises(CheckpointTimeoutError):  # the version does not exist for readers
        other.load(step=2, timeout=0.2)
    assert main(["ls", any_root, "--json"]) == 0
    versions = {v["step"]: v for v in json.loads(capsys.readouterr().out)["versions"]}
    assert versions[2]["state"] == "unreadable" and "\\x00" in versions[2]["problem"]
    assert main(["verify", any_root]) == 0  # the latest, step 1
    assert main(["verify", f"{any_root}@2"]) == 1
    assert "not committed" in capsys.readouterr().err
    with pytest.raises(ConflictError, match=r"step 2 names the file 'r00000-ab\\x00cd.ackpt'"):
        Checkpointer(any_root).save(3, make_state(3)).result(timeout=60)


_DEEP = b"[" * 100_000 + b"]" * 100_000  # far past Python's recursion limit, under 1 MiB


@pytest.mark.parametrize(
    "marker",
    [
        b'{"protocol": 1, "step": 2, "files": ' + _DEEP + b', "writer": "w"}',
        record(step=2, files=["r00000-a.ackpt"], writer="w", metrics={"n": 0}).replace(
            b'"n": 0', b'"n": ' + b"9" * 400
        ),
    ],
    ids=["deeply-nested", "400-digit-metric"],
)
def test_a_commit_that_cannot_be_parsed_is_an_unreadable_record_never_a_crash(
    any_root: str, capsys: pytest.CaptureFixture[str], marker: bytes
) -> None:
    from asyncckpt.cli import main

    committed_root(any_root, [1])
    put(any_root, "2/COMMIT", marker)
    other = reader(any_root)
    assert other.latest() == 1 and other.versions() == [1]
    assert_state(other.load(), 1)
    assert main(["ls", any_root, "--json"]) == 0
    versions = {v["step"]: v for v in json.loads(capsys.readouterr().out)["versions"]}
    assert versions[2]["state"] == "unreadable"
    with pytest.raises(ConflictError, match="refusing to write"):
        Checkpointer(any_root).save(3, make_state(3)).result(timeout=60)


# --------------------------------------------------------------------------- 16. FAILED


def test_a_failed_marker_names_its_attempt(any_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = Checkpointer(any_root)
    ckpt.save(1, make_state(1)).result(timeout=60)
    # On the class: a function on the instance would travel, pickled, to the writer
    # process, which would import this test module (and torch) to run the data write.
    monkeypatch.setattr(type(ckpt._storage), "create_exclusive", _refuse)
    with pytest.raises(OSError, match="injected"):
        ckpt.save(2, make_state(2)).result(timeout=60)
    failure = read_failure(*resolve(any_root, None), 2)
    assert failure is not None and "injected" in failure.error
    assert (failure.writer, failure.epoch) == (ckpt._token, ckpt._writer.epoch)
    ckpt.close()


def _refuse(storage: object, path: str, data: bytes) -> None:
    raise OSError(5, "injected: cannot create the commit record")


def _hold_data_writes(ckpt: Checkpointer, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold ``ckpt``'s data-file writes until the returned event is set."""
    gate = threading.Event()
    real = ckpt._storage.open_atomic

    def open_atomic(path: str) -> AtomicWriter:
        inner = real(path)
        return _GatedWriter(inner, gate) if path.endswith(".ackpt") else inner

    monkeypatch.setattr(ckpt._storage, "open_atomic", open_atomic)
    return gate


def test_a_waiter_ignores_an_earlier_jobs_failed_marker_of_the_same_step(
    any_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    committed_root(any_root, [1])
    new = Checkpointer(any_root)  # the restarted job: its save of step 2 is held
    gate = _hold_data_writes(new, monkeypatch)
    handle = new.save(2, make_state(2))
    _until(lambda: new._writer._heartbeat is not None)  # lease taken, recovery done
    # The earlier job's marker of the same step (its writer, frozen past its lease check,
    # wrote it late; or the new writer's recovery has not removed it yet).
    put(any_root, "2/FAILED", record(step=2, error="old disk full", writer="0ldj0b", epoch=1))
    polled = threading.Event()  # the waiter went past its FAILED check once
    real = asyncckpt._versions.lease.read_version_file

    def read_version_file(*args: Any) -> Any:
        polled.set()
        return real(*args)

    monkeypatch.setattr(asyncckpt._versions.lease, "read_version_file", read_version_file)
    outcome: list[Any] = []

    def wait() -> None:
        try:
            outcome.append(reader(any_root).load(2, timeout=60))
        except Exception as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        _until(lambda: polled.is_set() or bool(outcome))
    finally:
        gate.set()
    handle.result(timeout=60)
    waiter.join(60)
    assert len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
    assert_state(outcome[0], 2)
    new.close()


def _until(condition: Any) -> None:
    import time

    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.005)


def test_a_new_writer_removes_failed_markers_of_earlier_epochs(any_root: str) -> None:
    committed_root(any_root, [1])
    storage, base = resolve(any_root, None)
    put(any_root, "2/FAILED", record(step=2, error="old", writer="0ldj0b", epoch=1))
    put(any_root, "3/FAILED", record(step=3, error="written before markers named attempts"))
    put(any_root, "4/FAILED", b"{damaged")
    new = RootWriter(storage, base, "0123456789ab", Settings())
    new.acquire()
    new.release()
    assert not {"2/FAILED", "3/FAILED", "4/FAILED"} & files(any_root)
