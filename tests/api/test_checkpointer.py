"""``asyncckpt.Checkpointer`` in one process: versions, commit protocol, retention, recovery.

Covers the contract of issue 3 that does not need several ranks: round trips over many
steps, step validation and conflicts, keep-last-N retention, clean-up of leftovers, reopening
a root (roll-forward after a crash between the commit record and the version file), damaged
version files and commit records, waiting for a step, two writers on one root, failed writes
(FAILED record), loads racing with retention, the context manager and non-writer ranks.
Runs on every backend of the ``any_root`` fixture where that makes sense.

Readers are ``Checkpointer(root, writer_rank=1)``: without a process group this process is
rank 0, so such a Checkpointer never writes and polls storage like a non-writer rank would.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import pytest
import torch

import asyncckpt
import asyncckpt._api.checkpointer
import asyncckpt._versions.reading
from asyncckpt import Checkpointer
from asyncckpt._api import jobs
from asyncckpt._api import staging as staging_api
from asyncckpt._api.jobs import raise_unobserved_failure
from asyncckpt._engine import snapshot as staging
from asyncckpt._settings import Settings
from asyncckpt._storage import TEMP_MARK, AtomicWriter, Storage, resolve
from asyncckpt._versions.protocol import (
    COMMITTED,
    UNCOMMITTED,
    CommitRecord,
    StepEntry,
    VersionRecord,
    create_commit,
    data_file_name,
    read_version_file,
    write_version_file,
)
from asyncckpt._versions.retention import deletion_plan, policy_from
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    ConflictError,
    IncompleteCheckpointError,
    InvalidMetricsError,
    UnsupportedObjectError,
)
from tests.fake_clock import fake_clock

# --------------------------------------------------------------------------- helpers


def make_state(step: int, n: int = 257) -> dict[str, Any]:
    """A state whose every value depends on ``step`` (deterministically)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "step": step,
        "w": torch.randn(n, generator=g),
        "ids": torch.arange(7, dtype=torch.int64) * step,
        "nested": {
            "name": f"step-{step}",
            "half": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "pair": (step, [step + 1.5]),
        },
    }


def assert_same(got: Any, expected: Any, where: str = "state") -> None:
    """Exact equality: types, dtypes, shapes and every bit of tensor data."""
    assert type(got) is type(expected), f"{where}: {type(got)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype, where
        assert got.shape == expected.shape, where
        assert got.device == torch.device("cpu"), where
        assert torch.equal(
            got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)
        ), f"{where}: tensor data differs"
    elif isinstance(expected, dict):
        assert list(got) == list(expected), f"{where}: keys differ"
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def assert_state(got: Any, step: int) -> None:
    assert_same(got, make_state(step), f"state of step {step}")


def storage_of(root: str) -> tuple[Storage, str]:
    return resolve(root, None)


def path_in(root: str, rel: str) -> tuple[Storage, str]:
    storage, base = storage_of(root)
    return storage, storage.join(base, *rel.split("/"))


def put(root: str, rel: str, data: bytes) -> None:
    """Write a file under ``root`` behind the Checkpointer's back."""
    storage, path = path_in(root, rel)
    storage.write_bytes(path, data)


def get(root: str, rel: str) -> bytes:
    storage, path = path_in(root, rel)
    return storage.read_bytes(path, 1 << 30)


def remove(root: str, rel: str) -> None:
    storage, path = path_in(root, rel)
    storage.delete(path)


def files(root: str) -> set[str]:
    """Every file and directory under ``root``, relative, with ``/`` separators."""
    fs, base = fsspec.core.url_to_fs(root)
    if not fs.exists(base):
        return set()
    prefix = base.rstrip("/") + "/"
    return {p[len(prefix) :] for p in fs.find(base, withdirs=True) if p.startswith(prefix)}


def contents(root: str) -> dict[str, bytes]:
    """Every file under ``root`` (relative name) with its bytes."""
    fs, base = fsspec.core.url_to_fs(root)
    prefix = base.rstrip("/") + "/"
    found = fs.find(base) if fs.exists(base) else []
    return {p[len(prefix) :]: fs.cat_file(p) for p in found}


def step_dirs(root: str) -> set[int]:
    return {int(name) for name in files(root) if name.isdigit()}


def temp_files(root: str) -> set[str]:
    return {name for name in files(root) if TEMP_MARK in name}


def data_files(root: str, step: int) -> set[str]:
    return {n for n in files(root) if n.startswith(f"{step}/") and n.endswith(".ackpt")}


def version_file_step(root: str) -> int | None:
    storage, base = storage_of(root)
    record = read_version_file(storage, base)
    return None if record is None else record.step


def record(**doc: Any) -> bytes:
    return json.dumps({"protocol": 1, **doc}).encode()


def reader(root: str) -> Checkpointer:
    """A Checkpointer that never writes (rank 0 here, writer rank 1)."""
    return Checkpointer(root, writer_rank=1)


def committed_root(root: str, steps: list[int], **kwargs: Any) -> None:
    """Commit ``steps`` under ``root`` with a writer that is then closed."""
    with Checkpointer(root, **kwargs) as ckpt:
        for step in steps:
            ckpt.save(step, make_state(step))


class _GatedWriter(AtomicWriter):
    def __init__(self, inner: AtomicWriter, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def write(self, data: bytes | memoryview) -> None:
        assert self.gate.wait(60), "test gate never opened"
        self.inner.write(data)

    def commit(self) -> None:
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


@pytest.fixture(autouse=True)
def _drain_saves(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, let its saves finish, and fail the test if one of them failed
    without anyone observing it (a save failure the test did not see is a defect, or a
    test that does not look at what it checks).

    Drained either way, so that a failure never surfaces in the next test's ``save``. A
    test that leaves an unobserved failure on purpose says so with
    ``@pytest.mark.leaves_unobserved_failure``.
    """
    yield
    for handle in jobs.pending():
        handle.exception(timeout=120)
    unobserved: list[str] = []
    for _ in range(100):
        try:
            raise_unobserved_failure()
            break
        except Exception as exc:
            unobserved.append(f"{type(exc).__name__}: {exc}")
    if unobserved and request.node.get_closest_marker("leaves_unobserved_failure") is None:
        pytest.fail("save failures nobody observed:\n" + "\n".join(unobserved))


@pytest.fixture
def gated() -> Iterator[Callable[[Checkpointer], threading.Event]]:
    """``gated(ckpt)`` holds ``ckpt``'s data-file writes until the returned event is set."""
    events: list[threading.Event] = []

    def install(ckpt: Checkpointer) -> threading.Event:
        gate = threading.Event()
        events.append(gate)
        real = ckpt._storage.open_atomic

        def open_atomic(path: str) -> AtomicWriter:
            inner = real(path)
            return _GatedWriter(inner, gate) if path.endswith(".ackpt") else inner

        ckpt._storage.open_atomic = open_atomic  # type: ignore[method-assign]
        return gate

    yield install
    for gate in events:  # never leave the save thread blocked
        gate.set()


# --------------------------------------------------------------------------- round trips


def test_round_trip_many_steps(any_root: str) -> None:
    steps = list(range(0, 60, 3))
    with Checkpointer(any_root) as ckpt:
        assert ckpt.latest() is None
        assert ckpt.versions() == []
        for i, step in enumerate(steps):
            state = make_state(step)
            handle = ckpt.save(step, state)
            state["w"].zero_()  # the snapshot was taken when save returned
            state["ids"].fill_(-1)
            if i % 4 == 1:  # the writer's own load waits for its pending save
                assert_state(ckpt.load(step=step), step)
            if i % 5 == 2:
                info = handle.result(timeout=60)
                assert info.stats.raw_bytes > 0
                assert ckpt.latest() == step
        ckpt.wait()
        assert ckpt.versions() == steps
        assert ckpt.latest() == steps[-1]
        assert version_file_step(any_root) == steps[-1]
        assert_state(ckpt.load(), steps[-1])
        for step in steps:
            assert_state(ckpt.load(step=step, map_location="cpu"), step)
    assert temp_files(any_root) == set()
    assert step_dirs(any_root) == set(steps)
    # a reader on the same root sees the same thing
    other = reader(any_root)
    assert other.versions() == steps
    assert other.latest() == steps[-1]
    assert_state(other.load(), steps[-1])
    assert_state(other.load(step=steps[3], timeout=5), steps[3])


def test_empty_root(any_root: str) -> None:
    ckpt = reader(any_root)
    assert ckpt.latest() is None
    assert ckpt.versions() == []
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        ckpt.load()
    with pytest.raises(FileNotFoundError):  # a builtin mixin, as for torch.load
        ckpt.load()


@pytest.mark.parametrize("bad", [-1, -100, 1.0, "3", None, True, 2**0.5])
def test_step_must_be_non_negative_int(any_root: str, bad: Any) -> None:
    with Checkpointer(any_root) as ckpt:
        with pytest.raises(ValueError, match="step"):
            ckpt.save(bad, make_state(0))
        ckpt.save(0, make_state(0))
    assert step_dirs(any_root) == {0}
    # a non-writer validates the step too
    with pytest.raises(ValueError, match="step"):
        reader(any_root).save(bad, make_state(0))


def test_steps_strictly_increase_and_committed_steps_conflict(
    any_root: str, gated: Callable[[Checkpointer], threading.Event]
) -> None:
    with Checkpointer(any_root) as ckpt:
        gate = gated(ckpt)
        ckpt.save(5, make_state(5))
        with pytest.raises(ValueError, match="increase"):  # pending, not committed yet
            ckpt.save(5, make_state(5))
        with pytest.raises(ValueError, match="increase"):
            ckpt.save(4, make_state(4))
        gate.set()
        ckpt.wait()
        with pytest.raises(ConflictError, match="already committed"):
            ckpt.save(5, make_state(5))
        with pytest.raises(ValueError, match="increase"):
            ckpt.save(3, make_state(3))
        # a failed validation changes nothing: the next valid step works
        ckpt.save(6, make_state(6))
        ckpt.wait()
        assert ckpt.versions() == [5, 6]
        assert_state(ckpt.load(step=5), 5)
        assert_state(ckpt.load(), 6)


def test_unsupported_state_does_not_consume_the_step(any_root: str) -> None:
    with Checkpointer(any_root) as ckpt:
        with pytest.raises(UnsupportedObjectError):
            ckpt.save(1, {"bad": object()})
        ckpt.save(1, make_state(1))
        ckpt.wait()
        assert ckpt.versions() == [1]


def test_conflict_from_a_new_checkpointer(any_root: str) -> None:
    committed_root(any_root, [1, 2, 4])
    with Checkpointer(any_root) as again:
        for step in (1, 2, 4):
            with pytest.raises(ConflictError, match=f"step {step} is already committed"):
                again.save(step, make_state(99))
        with pytest.raises(ValueError, match="increase"):  # never committed, but older
            again.save(3, make_state(3))
        assert again.latest() == 4
        again.save(7, make_state(7))
        again.wait()
        assert again.versions() == [1, 2, 4, 7]
        for step in (1, 2, 4, 7):
            assert_state(again.load(step=step), step)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_invalid_keep_last(any_root: str, bad: Any) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(any_root, keep_last=bad)


def test_invalid_compression(any_root: str) -> None:
    with pytest.raises(ValueError):
        Checkpointer(any_root, compression="lz77-nope")


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_compression_choices_round_trip(any_root: str, compression: str) -> None:
    with Checkpointer(any_root, compression=compression) as ckpt:
        ckpt.save(3, make_state(3))
        ckpt.wait()
        assert_state(ckpt.load(), 3)


# --------------------------------------------------------------------------- retention


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_last_keeps_exactly_the_newest(any_root: str, keep: int) -> None:
    steps = [2, 3, 5, 8, 13, 21, 34, 55, 89]
    with Checkpointer(any_root, keep_last=keep) as ckpt:
        for i, step in enumerate(steps):
            ckpt.save(step, make_state(step))
            ckpt.wait()
            expected = steps[max(0, i + 1 - keep) : i + 1]
            assert ckpt.versions() == expected
            assert step_dirs(any_root) == set(expected)
            # the version file names the newest, and that one is kept
            assert version_file_step(any_root) == step
            assert ckpt.latest() == step
            for kept in expected:
                assert_state(ckpt.load(step=kept), kept)
        # without waiting between saves, the end state is the same
        more = [100, 101, 102, 103, 104]
        for step in more:
            ckpt.save(step, make_state(step))
        ckpt.wait()
        assert ckpt.versions() == more[-keep:]
        assert step_dirs(any_root) == set(more[-keep:])
    assert temp_files(any_root) == set()


def retention_plan(
    committed: list[int], all_dirs: list[int], keep_last: int | None, pinned: int | None
) -> list[int]:
    """deletion_plan for plain step lists (a directory not in ``committed`` is uncommitted)."""
    done = set(committed)
    entries = [
        StepEntry(s, COMMITTED if s in done else UNCOMMITTED) for s in sorted(done | set(all_dirs))
    ]
    plan = deletion_plan(entries, policy_from({"keep_last": keep_last}), pinned, good=pinned)
    return [e.step for e in plan if e.step in set(all_dirs)]


def test_retention_plan_never_deletes_the_pinned_version_nor_newer() -> None:
    assert retention_plan([1, 2, 3], [1, 2, 3], keep_last=1, pinned=3) == [1, 2]
    # the version file names 2 (e.g. 3 was committed by hand): 2 and 3 survive
    assert retention_plan([1, 2, 3], [1, 2, 3], keep_last=1, pinned=2) == [1]
    # leftovers older than the pinned version go; newer dirs may be a save in progress
    assert retention_plan([1, 3], [0, 1, 2, 3, 4], keep_last=5, pinned=3) == [0, 2]
    assert retention_plan([1, 2], [1, 2], keep_last=None, pinned=2) == []
    assert retention_plan([1, 2], [1, 2, 3], keep_last=1, pinned=None) == []


def test_keep_last_across_reopen(any_root: str) -> None:
    committed_root(any_root, [1, 2, 3, 4])
    with Checkpointer(any_root, keep_last=2) as ckpt:
        assert ckpt.versions() == [1, 2, 3, 4]  # opening deletes no committed version
        ckpt.save(5, make_state(5))
        ckpt.wait()
        assert ckpt.versions() == [4, 5]
        assert step_dirs(any_root) == {4, 5}


# --------------------------------------------------------------------------- leftovers


def test_leftovers_removed_on_reopen(any_root: str) -> None:
    committed_root(any_root, [1, 2, 3])
    put(any_root, "0/r00000-aaaaaaaaaaaa.ackpt", b"partial")  # older, never committed
    put(any_root, "7/r00000-bbbbbbbbbbbb.ackpt", b"partial")  # newer, never committed
    put(any_root, "8/FAILED", record(step=8, error="boom"))  # a failed save
    put(any_root, f"VERSION{TEMP_MARK}0123456789ab", b"half a version file")
    put(any_root, f"4{TEMP_MARK}cdef01234567", b"a stray temp")
    before = files(any_root)
    # a reader never changes storage
    assert reader(any_root).versions() == [1, 2, 3]
    assert files(any_root) == before
    with Checkpointer(any_root) as ckpt:
        assert ckpt.versions() == [1, 2, 3]
        assert ckpt.latest() == 3
        assert files(any_root) == before  # opening a root changes nothing
        ckpt.save(7, make_state(7))  # the old partial step 7 is gone; no mixing
        ckpt.wait()
        # The first save cleaned up what is older than the newest version; a newer
        # uncommitted step (8) may be another writer's save in flight: retention removes it
        # once a newer version is committed.
        assert step_dirs(any_root) == {1, 2, 3, 7, 8}
        assert temp_files(any_root) == set()
        assert "7/r00000-bbbbbbbbbbbb.ackpt" not in files(any_root)  # swept by the commit
        assert len(data_files(any_root, 7)) == 1
        assert_state(ckpt.load(step=7), 7)
        ckpt.save(9, make_state(9))
        ckpt.wait()
        assert step_dirs(any_root) == {1, 2, 3, 7, 9}
    for step in (1, 2, 3):
        assert_state(reader(any_root).load(step=step), step)


def test_temp_files_inside_committed_versions_removed_on_reopen(any_root: str) -> None:
    committed_root(any_root, [1, 2])
    put(any_root, f"2/COMMIT{TEMP_MARK}0123456789ab", b"{}")
    put(any_root, f"1/r00000-cccccccccccc.ackpt{TEMP_MARK}0123456789ab", b"partial")
    with Checkpointer(any_root) as ckpt:
        assert ckpt.versions() == [1, 2]
        assert len(temp_files(any_root)) == 2  # a reader changes nothing
        ckpt.save(3, make_state(3))
        ckpt.wait()
        assert temp_files(any_root) == set()  # the first save cleaned up


def test_leftovers_removed_by_retention(any_root: str) -> None:
    with Checkpointer(any_root) as ckpt:
        ckpt.save(1, make_state(1))
        ckpt.wait()
        # leftovers appearing while the writer runs (e.g. from an interrupted old job)
        put(any_root, "0/r00000-aaaaaaaaaaaa.ackpt", b"partial")
        put(any_root, f"VERSION{TEMP_MARK}0123456789ab", b"{")
        ckpt.save(2, make_state(2))
        ckpt.wait()
        assert step_dirs(any_root) == {1, 2}  # keep_last=None keeps every committed one
        assert temp_files(any_root) == set()
        assert ckpt.versions() == [1, 2]


# --------------------------------------------------------------------------- reopening


def test_reopen_continues_from_state(any_root: str) -> None:
    committed_root(any_root, [10, 20, 30])
    with Checkpointer(any_root) as ckpt:
        assert ckpt.latest() == 30
        assert ckpt.versions() == [10, 20, 30]
        assert_state(ckpt.load(), 30)
        with pytest.raises(ConflictError):
            ckpt.save(30, make_state(30))
        with pytest.raises(ValueError, match="increase"):
            ckpt.save(25, make_state(25))
        ckpt.save(31, make_state(31))
    with Checkpointer(any_root) as ckpt:
        assert ckpt.latest() == 31
        assert ckpt.versions() == [10, 20, 30, 31]
        ckpt.save(40, make_state(40))
        ckpt.wait()
        assert_state(ckpt.load(), 40)


@pytest.mark.parametrize("how", ["rewound", "missing"])
def test_roll_forward_when_version_file_lags(any_root: str, how: str) -> None:
    """A crash after step 3's COMMIT but before the version file moved to it."""
    committed_root(any_root, [1, 2, 3])
    storage, base = storage_of(any_root)
    if how == "rewound":
        write_version_file(storage, base, VersionRecord(2, "crashed-job"))
    else:
        remove(any_root, "VERSION")
    # readers fall back to the newest commit record whose data verifies
    assert reader(any_root).latest() == 3
    assert_state(reader(any_root).load(), 3)
    with Checkpointer(any_root) as ckpt:
        assert ckpt.latest() == 3
        assert_state(ckpt.load(), 3)
        ckpt.save(4, make_state(4))  # the first save rolls the version file forward
        ckpt.wait()
        assert ckpt.versions() == [1, 2, 3, 4]
    assert reader(any_root).latest() == 4


def test_roll_forward_of_a_commit_written_by_hand(any_root: str) -> None:
    committed_root(any_root, [1, 2])
    storage, base = storage_of(any_root)
    name = "r00000-0000deadbeef.ackpt"
    asyncckpt.save(make_state(3), f"{any_root}/3/{name}").result(timeout=60)
    assert reader(any_root).versions() == [1, 2]  # data alone is not a version
    create_commit(storage, base, CommitRecord(3, (name,), "by-hand"))
    assert reader(any_root).versions() == [1, 2, 3]
    assert reader(any_root).latest() == 3  # a newer verified marker than the version file
    with Checkpointer(any_root) as ckpt:
        assert version_file_step(any_root) == 2  # opening changes nothing
        assert ckpt.latest() == 3
        assert_state(ckpt.load(), 3)
        with pytest.raises(ConflictError):
            ckpt.save(3, make_state(3))
        ckpt.save(4, make_state(4))
        ckpt.wait()
        assert_state(ckpt.load(), 4)


DAMAGED_VERSION_FILES: dict[str, bytes | None] = {
    "missing": None,
    "empty": b"",
    "garbage": b"\x00\xff\xfe not json at all",
    "truncated": record(step=3, writer="w")[:12],
    "not-an-object": b"[3]",
    "wrong-protocol": json.dumps({"protocol": 99, "step": 3, "writer": "w"}).encode(),
    "step-not-int": record(step="3", writer="w"),
    "no-writer": record(step=3),
    "names-uncommitted-step": record(step=7, writer="w"),
    "names-missing-step": record(step=99, writer="w"),
    "oversized": record(step=3, writer="w" * (2 << 20)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_VERSION_FILES))
def test_missing_or_damaged_version_file_falls_back(any_root: str, damage: str) -> None:
    committed_root(any_root, [1, 2, 3])
    put(any_root, "7/r00000-aaaaaaaaaaaa.ackpt", b"partial")
    content = DAMAGED_VERSION_FILES[damage]
    if content is None:
        remove(any_root, "VERSION")
    else:
        put(any_root, "VERSION", content)
    other = reader(any_root)
    assert other.latest() == 3
    assert other.versions() == [1, 2, 3]
    assert_state(other.load(), 3)
    assert_state(other.load(step=2, timeout=5), 2)
    before = files(any_root)
    with Checkpointer(any_root) as ckpt:
        assert files(any_root) == before  # opening changes nothing
        if damage not in READABLE_VERSION_FILES:
            # A writer cannot tell what the file meant: it refuses, and changes nothing.
            with pytest.raises(ConflictError, match="refusing to write"):
                ckpt.save(8, make_state(8)).result(timeout=60)
            assert files(any_root) - before <= {"VERSION.lock"}
            return
        ckpt.save(8, make_state(8))  # the first save repairs it
        ckpt.wait()
        assert step_dirs(any_root) == {1, 2, 3, 8}
        assert version_file_step(any_root) == 8
        assert_state(ckpt.load(), 8)


READABLE_VERSION_FILES = {"missing", "names-uncommitted-step", "names-missing-step"}


DAMAGED_COMMITS: dict[str, bytes | None] = {
    "missing": None,
    "empty": b"",
    "garbage": b"\x89PNG\r\n",
    "truncated": record(step=3, files=["r00000-x.ackpt"], writer="w")[:20],
    "wrong-step": b"",  # filled in by the test from the real marker
    "no-files": record(step=3, files=[], writer="w"),
    "path-escape": record(step=3, files=["../2/r00000-x.ackpt"], writer="w"),
    "not-ackpt": record(step=3, files=["VERSION"], writer="w"),
    "no-writer": b"",  # filled in by the test from the real marker
    "wrong-protocol": b"",  # filled in by the test from the real marker
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_COMMITS))
def test_damaged_commit_marker_means_no_version(any_root: str, damage: str) -> None:
    committed_root(any_root, [1, 2, 3])
    real = json.loads(get(any_root, "3/COMMIT"))
    content = DAMAGED_COMMITS[damage]
    if damage == "wrong-step":
        content = json.dumps({**real, "step": 2}).encode()
    elif damage == "no-writer":
        content = json.dumps({k: v for k, v in real.items() if k != "writer"}).encode()
    elif damage == "wrong-protocol":
        content = json.dumps({**real, "protocol": 2}).encode()
    if content is None:
        remove(any_root, "3/COMMIT")
    else:
        put(any_root, "3/COMMIT", content)
    other = reader(any_root)
    assert other.versions() == [1, 2]
    assert other.latest() == 2  # the version file names 3, which does not exist
    assert_state(other.load(), 2)
    with pytest.raises(CheckpointTimeoutError, match=r"\[1, 2\]"):
        other.load(step=3, timeout=0.2)
    before = files(any_root)
    with Checkpointer(any_root) as ckpt:
        if damage != "missing":
            # A marker it cannot understand may be a newer asyncckpt's: touch nothing.
            with pytest.raises(ConflictError, match="refusing to write"):
                ckpt.save(4, make_state(4)).result(timeout=60)
            assert files(any_root) - before <= {"VERSION.lock"}
            return
        ckpt.save(3, make_state(30))  # never written into the old, half-valid version
        ckpt.wait()
        assert len(data_files(any_root, 3)) == 1
        assert_same(ckpt.load(step=3), make_state(30))


def test_damaged_commit_of_an_older_version(any_root: str) -> None:
    committed_root(any_root, [1, 2, 3])
    put(any_root, "2/COMMIT", b"{not json")
    other = reader(any_root)
    assert other.versions() == [1, 3]
    assert other.latest() == 3
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        other.load(step=2, timeout=30)


# --------------------------------------------------------------------------- waiting


def test_load_timeout_says_what_is_committed(any_root: str) -> None:
    other = reader(any_root)
    with pytest.raises(CheckpointTimeoutError, match="none") as empty:
        other.load(step=0, timeout=0.1)
    assert isinstance(empty.value, TimeoutError)
    committed_root(any_root, [1, 2])
    with pytest.raises(CheckpointTimeoutError, match=r"step 5 .*\[1, 2\]"):
        other.load(step=5, timeout=0.2)
    # an older step that was never committed cannot appear any more: no waiting
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        other.load(step=0, timeout=30)


def test_a_wait_gives_up_on_a_frozen_writer_after_the_expiry_its_checkpointer_resolved(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lease_expiry_ms`` is resolved when the Checkpointer is created, like every tunable:
    changing the environment later does not change how long its loads wait for a writer
    that stopped renewing its lease (issue 20: nothing below the entry points reads it)."""
    root = str(tmp_path / "root")
    committed_root(root, [1])  # its writer's lease record stays, never renewed again
    monkeypatch.setenv("ASYNCCKPT_LEASE_EXPIRY_MS", "300")
    other = reader(root)
    monkeypatch.setenv("ASYNCCKPT_LEASE_EXPIRY_MS", "3600000")
    with fake_clock() as clock:
        start = clock.now()
        with pytest.raises(CheckpointTimeoutError, match="has not renewed its lease"):
            other.load(step=2, timeout=60)
        assert clock.now() - start == pytest.approx(0.3), clock.slept  # on the expiry


def test_saves_and_loads_resolve_the_settings_once_at_their_entry_point(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``asyncckpt.save``/``load`` resolve the tunables once per call; a Checkpointer's saves
    and loads use those it resolved when it was created, whatever the environment says by
    then (issue 20: nothing below the entry points reads it)."""
    root = str(tmp_path / "root")
    committed_root(root, [1])
    asyncckpt.save(make_state(2), tmp_path / "two.ackpt").result()
    other = reader(root)
    calls: list[str] = []
    real = Settings.resolve.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Settings], *args: Any, **kwargs: Any) -> Settings:
        calls.append("resolve")
        return real(cls, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(Settings, "resolve", classmethod(counted))
    assert_state(other.load(), 1)
    assert_state(other.load(step=1), 1)
    assert torch.equal(other.open(1)["w"], make_state(1)["w"])
    assert calls == []
    assert_state(asyncckpt.load(tmp_path / "two.ackpt"), 2)
    assert calls == ["resolve"]
    calls.clear()  # the same for saves
    asyncckpt.save(make_state(3), tmp_path / "three.ackpt").result()
    assert calls == ["resolve"]
    with Checkpointer(str(tmp_path / "other")) as ckpt:
        calls.clear()
        ckpt.save(1, make_state(1)).result()
    assert calls == []


def test_load_waits_for_a_step_saved_in_the_background(
    any_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    committed_root(any_root, [1])
    polling = threading.Event()
    real_wait = asyncckpt._versions.reading.wait_for_step

    def wait_for_step(*args: Any, **kwargs: Any) -> None:
        polling.set()
        real_wait(*args, **kwargs)

    monkeypatch.setattr(asyncckpt._versions.reading, "wait_for_step", wait_for_step)
    other = reader(any_root)
    results: list[Any] = []

    def load() -> None:
        try:
            results.append(other.load(step=2, timeout=120))
        except BaseException as exc:
            results.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    assert polling.wait(60)
    assert not results  # step 2 does not exist yet, so the reader is waiting
    with Checkpointer(any_root) as ckpt:
        ckpt.save(2, make_state(2))
    thread.join(120)
    assert not thread.is_alive()
    assert len(results) == 1
    if isinstance(results[0], BaseException):
        raise results[0]
    assert_state(results[0], 2)


def test_wait_timeout_and_load_on_writer_waits_for_its_save(
    any_root: str, gated: Callable[[Checkpointer], threading.Event]
) -> None:
    with Checkpointer(any_root) as ckpt:
        ckpt.save(1, make_state(1))
        ckpt.wait()
        gate = gated(ckpt)
        handle = ckpt.save(2, make_state(2))
        with pytest.raises(CheckpointTimeoutError):
            ckpt.wait(timeout=0.05)
        assert not handle.done()
        assert ckpt.latest() == 1
        with pytest.raises(CheckpointTimeoutError):  # the writer waits on its own save
            ckpt.load(step=2, timeout=0.05)
        assert_state(reader(any_root).load(), 1)  # readers only see committed versions
        gate.set()
        assert_state(ckpt.load(step=2, timeout=60), 2)
        assert_state(ckpt.load(), 2)


def test_writer_load_without_step_gets_its_pending_save(
    any_root: str, gated: Callable[[Checkpointer], threading.Event]
) -> None:
    """Read-your-writes on the writer, as with a group and as ``asyncckpt.load`` does."""
    with Checkpointer(any_root) as ckpt:
        ckpt.save(1, make_state(1))
        ckpt.wait()
        gate = gated(ckpt)
        ckpt.save(2, make_state(2))
        results: list[Any] = []
        thread = threading.Thread(target=lambda: results.append(ckpt.load()), daemon=True)
        thread.start()
        thread.join(0.5)  # not a threshold: only gives a wrong early answer a chance
        gate.set()
        thread.join(60)
        assert len(results) == 1
        assert_state(results[0], 2)


# --------------------------------------------------------------------------- two writers


def test_a_new_writer_takes_over_and_fences_the_old_one(any_root: str) -> None:
    first = Checkpointer(any_root)
    first.save(1, make_state(1))
    first.wait()
    second = Checkpointer(any_root)  # a restarted job, while the old one still lives
    first.save(2, make_state(2))
    first.wait()
    second.save(3, make_state(3)).result(timeout=60)  # its first save takes the lease
    handle = first.save(4, make_state(4))
    with pytest.raises(ConflictError, match=r"took .* over"):
        handle.result(timeout=60)
    first.close()  # observed through the handle: not raised again
    other = reader(any_root)
    assert other.versions() == [1, 2, 3]
    assert version_file_step(any_root) == 3
    assert_state(other.load(), 3)
    assert not any(n.startswith("4/") for n in files(any_root))  # the fenced writer left nothing
    second.save(5, make_state(5))
    second.close()
    assert reader(any_root).versions() == [1, 2, 3, 5]


def test_two_writers_same_step(any_root: str) -> None:
    first = Checkpointer(any_root)
    second = Checkpointer(any_root)
    first.save(5, make_state(5))
    first.wait()
    with pytest.raises(ConflictError, match="already committed"):
        second.save(5, make_state(55))
    second.save(6, make_state(6)).result(timeout=60)  # the newer writer takes over
    with pytest.raises(ConflictError, match=r"took .* over"):
        first.save(7, make_state(7)).result(timeout=60)
    first.close()
    second.close()
    assert reader(any_root).versions() == [5, 6]
    assert_state(reader(any_root).load(), 6)


def test_two_writers_racing_on_one_step(
    any_root: str,
    monkeypatch: pytest.MonkeyPatch,
    gated: Callable[[Checkpointer], threading.Event],
) -> None:
    """Both save step 5 before either commits: the first commits, the second conflicts."""
    first = Checkpointer(any_root)
    second = Checkpointer(any_root)
    gate = gated(first)
    h1 = first.save(5, make_state(5))  # its write is held until second has checked step 5
    real_stage = asyncckpt._api.checkpointer.stage

    def stage(*args: Any, **kwargs: Any) -> Any:
        gate.set()
        return real_stage(*args, **kwargs)

    monkeypatch.setattr(asyncckpt._api.checkpointer, "stage", stage)
    h2 = second.save(5, make_state(55))
    assert h1.exception(timeout=60) is None
    with pytest.raises(ConflictError):
        h2.result(timeout=60)
    second.close()  # the handle reported the failure; it is raised once
    first.close()
    other = reader(any_root)
    assert other.versions() == [5]
    assert_state(other.load(), 5)
    assert_state(other.load(step=5, timeout=5), 5)
    # The loser removed its own data file and left no FAILED record in the winner's version.
    assert sorted(n for n in files(any_root) if n.startswith("5/")) == [
        "5/COMMIT",
        f"5/{data_file_name(0, first._token)}",
    ]


# --------------------------------------------------------------------------- failed writes


class _FailingWriter(AtomicWriter):
    def __init__(self, inner: AtomicWriter, where: str) -> None:
        self.inner, self.where = inner, where

    def write(self, data: bytes | memoryview) -> None:
        if self.where == "write":
            raise OSError(28, "injected: no space left on device")
        self.inner.write(data)

    def commit(self) -> None:
        if self.where == "commit":
            self.inner.abort()
            raise OSError(5, "injected: commit failed")
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


@pytest.mark.parametrize("where", ["open", "write", "commit", "commit-marker"])
def test_failed_save_leaves_previous_version(
    any_root: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    ckpt = Checkpointer(any_root, keep_last=1)
    ckpt.save(1, make_state(1))
    ckpt.wait()
    storage = ckpt._storage
    real_open, real_create = storage.open_atomic, storage.create_exclusive

    def open_atomic(path: str) -> AtomicWriter:
        if not path.endswith(".ackpt"):
            return real_open(path)
        if where == "open":
            raise OSError(13, "injected: permission denied")
        return _FailingWriter(real_open(path), where)

    def create_exclusive(path: str, data: bytes) -> None:
        if where == "commit-marker":
            raise OSError(5, "injected: cannot create the commit record")
        real_create(path, data)

    monkeypatch.setattr(storage, "open_atomic", open_atomic)
    monkeypatch.setattr(storage, "create_exclusive", create_exclusive)
    handle = ckpt.save(2, make_state(2))
    with pytest.raises(OSError, match="injected"):
        handle.result(timeout=60)
    ckpt.wait()  # each failure is raised once: the handle reported it
    assert ckpt.latest() == 1
    assert ckpt.versions() == [1]
    assert version_file_step(any_root) == 1
    assert "2/FAILED" in files(any_root)
    assert "2/COMMIT" not in files(any_root)
    assert_state(ckpt.load(), 1)
    other = reader(any_root)
    assert_state(other.load(), 1)
    # a poller is told at once instead of waiting for the timeout
    with pytest.raises(IncompleteCheckpointError, match="injected"):
        other.load(step=2, timeout=60)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="increase"):  # a step is used once, even if failed
        ckpt.save(2, make_state(2))
    ckpt.save(3, make_state(3))
    ckpt.wait()
    assert ckpt.versions() == [3]
    assert step_dirs(any_root) == {3}  # the failed version was removed by retention
    assert temp_files(any_root) == set()
    assert_state(other.load(), 3)
    ckpt.close()


# --------------------------------------------------------------------------- retention vs loads


def _retire_on_first_call(
    writer: Checkpointer, real: Callable[..., Any], new_step: int
) -> Callable[..., Any]:
    """Wrap ``real`` so that its first call is followed by a save that retires the old one."""
    calls: list[int] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if not calls:
            calls.append(1)
            writer.save(new_step, make_state(new_step))
            writer.wait()  # keep_last=1: the step being loaded is deleted now
        return result

    return wrapped


@pytest.mark.parametrize(
    "when",
    ["before-read", "during-read", "after-latest"],
)
def test_follow_latest_load_moves_to_newest_when_its_version_is_deleted(
    any_root: str, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    writer = Checkpointer(any_root, keep_last=1)
    writer.save(1, make_state(1))
    writer.wait()
    other = reader(any_root)
    if when == "after-latest":
        monkeypatch.setattr(other, "latest", _retire_on_first_call(writer, other.latest, 2))
    elif when == "before-read":  # chosen as latest, deleted before its commit is re-read
        real = asyncckpt._versions.reading.read_commit
        monkeypatch.setattr(
            asyncckpt._versions.reading, "read_commit", _retire_on_first_call(writer, real, 2)
        )
    else:  # the footer and manifest were read, then the file went away
        real = asyncckpt._engine.decode.open_file
        monkeypatch.setattr(
            asyncckpt._engine.decode, "open_file", _retire_on_first_call(writer, real, 2)
        )
    got = other.load()
    assert writer.versions() == [2]  # step 1 really was deleted under the loader
    # A load reads the file it opened to the end (one handle: a descriptor, a snapshot),
    # so once open, step 1 is read whole; before that, the load moves to step 2.
    assert_state(got, 1 if when == "during-read" else 2)
    writer.close()


@pytest.mark.parametrize("when", ["after-wait", "during-read"])
def test_explicit_step_deleted_while_loading_is_an_error(
    any_root: str, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    writer = Checkpointer(any_root, keep_last=1)
    writer.save(1, make_state(1))
    writer.wait()
    other = reader(any_root)
    module = asyncckpt._versions.reading if when == "after-wait" else asyncckpt._engine.decode
    name = "wait_for_step" if when == "after-wait" else "open_file"
    real = getattr(module, name)
    monkeypatch.setattr(module, name, _retire_on_first_call(writer, real, 2))
    if when == "during-read":  # the file was open: the load reads it whole (one handle)
        assert_state(other.load(step=1, timeout=30), 1)
    else:
        with pytest.raises(IncompleteCheckpointError, match="step 1"):
            other.load(step=1, timeout=30)
    assert writer.versions() == [2]
    monkeypatch.undo()
    # an explicit load of a version deleted earlier is an error at once, not a wait
    with pytest.raises(IncompleteCheckpointError, match="step 1"):
        other.load(step=1, timeout=30)
    assert_state(other.load(), 2)
    writer.close()


# --------------------------------------------------------------------------- lifetime, ranks


def test_context_manager_and_close(any_root: str) -> None:
    with Checkpointer(any_root) as ckpt:
        assert isinstance(repr(ckpt), str)
        assert ckpt.root
        ckpt.save(1, make_state(1))  # not waited for: leaving the block commits it
    assert reader(any_root).versions() == [1]
    for call in (
        lambda: ckpt.save(2, make_state(2)),
        lambda: ckpt.load(),
        lambda: ckpt.load(step=1),
    ):
        with pytest.raises(AsyncCkptError, match="closed"):
            call()
    ckpt.close()  # closing again is harmless
    with pytest.raises(KeyError), Checkpointer(any_root) as again:
        again.save(2, make_state(2))
        raise KeyError("user error inside the block")
    assert reader(any_root).versions() == [1, 2]  # the pending save still completed
    assert_state(reader(any_root).load(), 2)


def test_close_raises_a_failed_pending_save(any_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = Checkpointer(any_root)

    def create_exclusive(path: str, data: bytes) -> None:
        raise OSError(5, "injected: commit record")

    monkeypatch.setattr(ckpt._storage, "create_exclusive", create_exclusive)
    ckpt.save(1, make_state(1))
    with pytest.raises(OSError, match="injected"):
        ckpt.close()
    assert reader(any_root).versions() == []


def test_non_writer_save_writes_nothing(any_root: str) -> None:
    committed_root(any_root, [1])
    put(any_root, "5/r00000-aaaaaaaaaaaa.ackpt", b"leftover of a crashed writer")
    before = contents(any_root)
    listing = files(any_root)
    with Checkpointer(any_root, writer_rank=1, keep_last=1) as ckpt:
        assert not ckpt.is_writer
        handle = ckpt.save(7, make_state(7))
        assert handle.done()
        assert not handle.failed()
        info = handle.result(timeout=0)
        assert info.stats.raw_bytes == 0
        assert info.stats.stored_bytes == 0
        ckpt.wait(timeout=0)
        assert ckpt.versions() == [1]
        assert ckpt.latest() == 1
        with pytest.raises(CheckpointTimeoutError):
            ckpt.load(step=7, timeout=0.1)
    assert files(any_root) == listing  # nothing written, nothing cleaned up
    assert contents(any_root) == before


def test_non_writer_on_empty_root_creates_nothing(any_root: str) -> None:
    sub = f"{any_root}/sub"
    with Checkpointer(sub, writer_rank=3) as ckpt:
        assert ckpt.save(0, make_state(0)).done()
        assert ckpt.versions() == []
    assert files(any_root) == set()


# --------------------------------------------------------------------------- pipeline, reserve


def _pieces(step: int) -> dict[str, torch.Tensor]:
    """12 x 256 KiB: many announced copy pieces once ``_COPY_STEP`` is 64 KiB."""
    g = torch.Generator().manual_seed(2000 + step)
    return {f"w{i}": torch.randn(64, 1024, generator=g) for i in range(12)}


def _small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    # The write follows the copy piece by piece on threads (a writer process, the default,
    # is handed the snapshot once the copy has ended).
    monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "0")
    monkeypatch.setattr(staging, "_COPY_STEP", 64 << 10)
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", str(64 << 10))
    # No heartbeat rewrites the lease record while a test compares listings.
    monkeypatch.setenv("ASYNCCKPT_LEASE_RENEW_MS", str(3_600_000))


def _on_data_file_open(ckpt: Checkpointer, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set when ``ckpt`` opens a data file for writing."""
    opened = threading.Event()
    real = ckpt._storage.open_atomic

    def open_atomic(path: str) -> AtomicWriter:
        if path.endswith(".ackpt"):
            opened.set()
        return real(path)

    monkeypatch.setattr(ckpt._storage, "open_atomic", open_atomic)
    return opened


@pytest.mark.timeout(120)
def test_lease_and_write_start_before_the_copy_ends(
    any_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _small_pieces(monkeypatch)
    state = _pieces(1)
    expected = {k: v.clone() for k, v in state.items()}
    ckpt = Checkpointer(any_root)
    events: list[str] = []
    real_acquire = ckpt._writer.acquire

    def acquire() -> None:
        events.append("lease")
        real_acquire()

    monkeypatch.setattr(ckpt._writer, "acquire", acquire)
    opened = _on_data_file_open(ckpt, monkeypatch)
    real_copy = staging.DeviceCopies.copy
    copies = [0]

    def copy(self: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        copies[0] += 1
        if copies[0] == 3 and opened.wait(30):  # hold the copy until the writer is in
            events.append("data file open")
        real_copy(self, dst, src)

    real_stage = asyncckpt._api.checkpointer.stage

    def stage(*args: Any, **kwargs: Any) -> Any:
        snap = real_stage(*args, **kwargs)
        events.append("copied")
        return snap

    monkeypatch.setattr(staging.DeviceCopies, "copy", copy)
    monkeypatch.setattr(asyncckpt._api.checkpointer, "stage", stage)
    handle = ckpt.save(1, state)
    for value in state.values():  # save has returned: the snapshot is complete
        value.fill_(-1.0)
    handle.result(timeout=60)
    assert copies[0] > 3
    assert events == ["lease", "data file open", "copied"]
    assert 0 < handle.stats.blocking_s <= handle.stats.total_s  # type: ignore[operator]
    assert_same(ckpt.load(1), expected)
    ckpt.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["first", "later"])
def test_a_copy_failing_midway_leaves_the_root_as_it_was(
    any_root: str, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    _small_pieces(monkeypatch)
    ckpt = Checkpointer(any_root, keep_last=1)
    if which == "later":
        ckpt.save(1, make_state(1)).result(timeout=60)
    before = files(any_root)
    opened = _on_data_file_open(ckpt, monkeypatch)
    real_copy = staging.DeviceCopies.copy
    calls: list[bool] = []

    def failing_copy(self: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        if len(calls) == 6:
            calls.append(opened.wait(30))  # fail once the writer has its temp file open
            raise RuntimeError("injected: copy failed midway")
        calls.append(False)
        real_copy(self, dst, src)

    monkeypatch.setattr(staging.DeviceCopies, "copy", failing_copy)
    with pytest.raises(RuntimeError, match="copy failed midway"):
        ckpt.save(2, _pieces(2))
    assert calls[-1], "the write had not started when the copy failed"
    ckpt.wait()  # raised by save, once: nothing left to report
    raise_unobserved_failure()
    after = files(any_root)
    if which == "later":
        assert after == before
    steps_left = {n.split("/")[0] for n in after if n.split("/")[0].isdigit()}
    assert steps_left == ({"1"} if which == "later" else set())  # no step 2, no FAILED
    assert temp_files(any_root) == set()
    assert reader(any_root).versions() == ([1] if which == "later" else [])
    monkeypatch.setattr(staging.DeviceCopies, "copy", real_copy)
    # The step was not used up, and the arena was freed (else this would block for ever).
    ckpt.save(2, make_state(2)).result(timeout=60)
    ckpt.close()
    assert reader(any_root).versions() == [2]
    assert_state(reader(any_root).load(), 2)
    assert step_dirs(any_root) == {2}


def test_reserve_then_the_first_save_reuses_the_arena(
    tmp_path: Any, arena_allocations: list[int]
) -> None:
    allocated = arena_allocations
    state = _pieces(1)
    with Checkpointer(tmp_path) as ckpt:
        thread = ckpt.reserve(state)
        assert thread is not None
        thread.join(30)
        assert len(allocated) == 1
        reserved = staging_api.arena_pool(Settings())._free[0].data_ptr()
        assert ckpt.reserve(state) is None  # large enough already
        ckpt.save(1, state).result()  # its arena is back in the pool: the reserved one
        assert [b.data_ptr() for b in staging_api.arena_pool(Settings())._free] == [reserved]
        ckpt.save(2, state)
    assert len(allocated) == 1  # no second arena, for the first save nor the next
    assert reader(str(tmp_path)).versions() == [1, 2]


def test_reserve_only_where_save_copies(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging_api, "_arenas", None)
    state = _pieces(1)
    assert Checkpointer(tmp_path, writer_rank=1).reserve(state) is None  # copies nothing
    assert staging_api.arena_pool(Settings())._free == []
    with pytest.raises(AsyncCkptError, match="read-only"):
        Checkpointer(tmp_path, read_only=True).reserve(state)
    closed = Checkpointer(tmp_path)
    closed.close()
    with pytest.raises(AsyncCkptError, match="closed"):
        closed.reserve(state)
    thread = Checkpointer(tmp_path).reserve(3 << 20)  # a size in bytes
    assert thread is not None
    thread.join(30)
    assert staging_api.arena_pool(Settings())._free[0].numel() >= 3 << 20


@pytest.mark.timeout(120)
def test_reserve_of_a_dtensor_state_on_a_rank_that_writes_no_plain_state(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    monkeypatch.setattr(staging_api, "_arenas", None)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        state = {"w": distribute_tensor(torch.zeros(1 << 20), mesh, [Shard(0)]), "step": 1}
        ckpt = Checkpointer(tmp_path, writer_rank=1)  # sharded saves copy on every rank
        assert not ckpt.is_writer
        thread = ckpt.reserve(state)
        assert thread is not None
        thread.join(30)
        assert staging_api.arena_pool(Settings())._free[0].numel() >= 4 << 20  # this rank's shard
    finally:
        dist.destroy_process_group()


def test_a_step_that_is_not_newer_names_rewind(tmp_path: Any) -> None:
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, {"w": torch.zeros(1)}).result()
        with pytest.raises(ConflictError, match="rewind"):
            ckpt.save(2, {"w": torch.zeros(1)})
        with pytest.raises(ValueError, match="rewind"):
            ckpt.save(1, {"w": torch.zeros(1)})


def test_zero_dim_tensor_metrics_are_kept_as_numbers(tmp_path: Any) -> None:
    """Lightning and hand-written loops log 0-d tensors (``loss.detach()``)."""
    import numpy as np

    metrics = {"loss": torch.tensor(0.25), "step": torch.tensor(3), "acc": np.float32(0.5)}
    with Checkpointer(tmp_path, keep_best=1, best_metric="loss") as ckpt:
        ckpt.save(1, {"w": torch.zeros(1)}, metrics=metrics).result()
        assert ckpt.info(1).metrics == {"loss": 0.25, "step": 3, "acc": 0.5}
        assert type(ckpt.info(1).metrics["step"]) is int
        with pytest.raises(InvalidMetricsError, match=r"'v'.*one number"):
            ckpt.save(2, {"w": torch.zeros(1)}, metrics={"v": torch.ones(2)})


# ------------------------------------------------------------------ the first save


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "root, read_only, started",
    [("file", False, True), ("file", True, False), ("memory", False, False)],
)
def test_the_writer_process_starts_at_construction_not_at_the_first_save(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, root: str, read_only: bool, started: bool
) -> None:
    # Its start-up (an interpreter and its imports) must not sit in the first save's stall;
    # a Checkpointer that will never write through it (read-only, in-memory) starts none.
    from asyncckpt._engine import arena, writer_process

    if not arena.shared_memory_supported():
        pytest.skip("no memfd: no writer process")
    monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "1")
    monkeypatch.setattr(writer_process, "_current", None)
    path = str(tmp_path / "root") if root == "file" else f"memory://first-{read_only}"
    if read_only:
        Checkpointer(path).close()  # a root to read
    monkeypatch.setattr(writer_process, "_current", None)
    ckpt = Checkpointer(path, read_only=read_only)
    try:
        assert (writer_process._current is not None) is started
    finally:
        ckpt.close()
