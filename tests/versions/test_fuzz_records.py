"""Every protocol record a reader parses, fuzzed: COMMIT, VERSION, lease, FAILED, rank
markers, drop-in save markers (``.ackpending``).

Inputs are valid records with fields replaced by arbitrary JSON, records cut or spliced,
and arbitrary bytes (``tests/fuzzing.py``). Readers that document "absent or unreadable"
(``read_commit``, ``read_version_file``, ``current_lease``, ``read_failure``,
``decode_pending``, a reader's ``latest()``/``versions()``) must return, never raise;
strict parsers may raise only asyncckpt errors. All under an address-space limit.
Issue 29 defect 8 (a deeply nested record, a 400-digit number) has its own test below.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import example, given

from asyncckpt import Checkpointer
from asyncckpt._storage import Storage, resolve
from asyncckpt._versions.lease import current_lease, lease_path
from asyncckpt._versions.pending import describe_pending, writer_gone
from asyncckpt._versions.pending_record import decode_pending
from asyncckpt._versions.protocol import (
    read_commit,
    read_commit_strict,
    read_failure,
    read_version_file,
    read_version_tagged,
)
from asyncckpt._versions.rank_records import RankDone
from tests.fuzzing import FUZZ, memory_limited, only_asyncckpt_errors, record_bytes

TIME = "2026-01-01T00:00:00+00:00"
COMMIT = {
    "protocol": 1,
    "step": 2,
    "files": ["r00000-0123456789ab.ackpt"],
    "sizes": [1234],
    "writer": "0123456789ab",
    "epoch": 1,
    "time": TIME,
    "metrics": {"loss": 0.5, "tag": "x"},
}
VERSION = {"protocol": 1, "step": 2, "writer": "0123456789ab", "epoch": 1, "time": TIME}
LEASE = {"protocol": 1, "epoch": 1, "writer": "0123456789ab", "beat": 3, "time": TIME}
FAILED = {"protocol": 1, "step": 2, "error": "boom", "writer": "w", "epoch": 1, "time": TIME}
ATTEMPT = "ab" * 16
RANK = {
    "protocol": 1,
    "kind": "rank-done",
    "step": 2,
    "attempt": ATTEMPT,
    "rank": 1,
    "file": f"r00001-{ATTEMPT}.ackpt",
    "size": 10,
    "pieces": [
        {
            "fqn": "w",
            "path": ["w"],
            "shape": [4],
            "dtype": "float32",
            "offsets": [2],
            "sizes": [2],
            "entry": 0,
            "nbytes": 8,
        }
    ],
    "time": TIME,
}
PENDING = {
    "protocol": 1,
    "kind": "drop-in-save",
    "token": "t",
    "host": "h",
    "pid": 1,
    "pid_ns": None,
    "boot": None,
    "pid_start": None,
    "beat": 0,
    "started": TIME,
    "time": TIME,
}

#: Deeply nested and oversized numbers: issue 29 defect 8.
DEFECT_8 = {
    "nested": b'{"protocol": 1, "step": 2, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "huge-int": json.dumps({**COMMIT, "metrics": {"n": 10**400}}).encode(),
}


@pytest.fixture(scope="module")
def root() -> Iterator[tuple[Storage, str]]:
    """A memory root holding committed step 1; the fuzzed records go to step 2."""
    url = f"memory://fuzz-records-{uuid.uuid4().hex[:8]}"
    with Checkpointer(url, compression="none") as ckpt:
        ckpt.save(1, {"w": torch.arange(4.0)}).result()
    storage, path = resolve(url, None)
    yield storage, path
    storage.delete_tree(path)


def _put(storage: Storage, path: str, raw: bytes) -> None:
    storage.write_bytes(path, raw)


def _commit_checks(storage: Storage, base: str, url: str, raw: bytes) -> None:
    _put(storage, storage.join(base, "2", "COMMIT"), raw)
    try:
        with memory_limited():
            got = read_commit(storage, base, 2)
            assert got is None or got.step == 2
            only_asyncckpt_errors(lambda: read_commit_strict(storage, base, 2))
            reader = Checkpointer(url, read_only=True)
            assert reader.latest() in (1, 2)  # step 1 is whole whatever step 2's marker says
            assert 1 in reader.versions()
    finally:
        storage.delete_tree(storage.join(base, "2"))


@FUZZ
@given(raw=record_bytes(COMMIT))
def test_commit_markers(root: tuple[Storage, str], raw: bytes) -> None:
    storage, base = root
    _commit_checks(storage, base, f"memory://{base.lstrip('/')}", raw)


def _version_checks(storage: Storage, base: str, raw: bytes) -> None:
    path = storage.join(base, "VERSION")
    good = storage.read_bytes(path, 1 << 20)
    _put(storage, path, raw)
    try:
        with memory_limited():
            got = read_version_file(storage, base)
            assert got is None or isinstance(got.writer, str)
            only_asyncckpt_errors(lambda: read_version_tagged(storage, base))
            assert Checkpointer(f"memory://{base.lstrip('/')}", read_only=True).latest() == 1
    finally:
        _put(storage, path, good)


@FUZZ
@given(raw=record_bytes(VERSION))
def test_version_files(root: tuple[Storage, str], raw: bytes) -> None:
    _version_checks(*root, raw)


@FUZZ
@given(raw=record_bytes(LEASE))
def test_lease_records(root: tuple[Storage, str], raw: bytes) -> None:
    storage, base = root
    path = lease_path(storage, base, 99)
    _put(storage, path, raw)
    try:
        with memory_limited():
            got = current_lease(storage, base)
            assert got is None or got.epoch == 99
    finally:
        storage.delete(path)


@FUZZ
@given(raw=record_bytes(FAILED))
def test_failed_markers(root: tuple[Storage, str], raw: bytes) -> None:
    storage, base = root
    path = storage.join(base, "2", "FAILED")
    _put(storage, path, raw)
    try:
        with memory_limited():
            got = read_failure(storage, base, 2)
            assert got is not None and got.step == 2 and isinstance(got.error, str)
    finally:
        storage.delete_tree(storage.join(base, "2"))


_PIECE_WITH_A_LIST_FOR_ITS_DTYPE = (
    b'{"protocol": 1, "kind": "rank-done", "step": 2, "attempt": "%s", "rank": 1, '
    b'"file": "r00001-%s.ackpt", "size": 10, "pieces": [{"fqn": "w", "path": ["w"], '
    b'"shape": [4], "dtype": [], "offsets": [2], "sizes": [2], "entry": 0, "nbytes": 8}]}'
) % (ATTEMPT.encode(), ATTEMPT.encode())


@FUZZ
@given(raw=record_bytes(RANK))
@example(raw=_PIECE_WITH_A_LIST_FOR_ITS_DTYPE)  # found by this test: an unhashable dtype
def test_rank_markers(raw: bytes) -> None:
    with memory_limited():
        only_asyncckpt_errors(lambda: RankDone.decode(raw, "r1.done", 2, ATTEMPT, 1))


@FUZZ
@given(raw=record_bytes(PENDING))
def test_drop_in_save_markers(root: tuple[Storage, str], raw: bytes) -> None:
    storage, base = root
    path = storage.join(base, "model.ckpt")
    with memory_limited():
        record = decode_pending(raw)
        if record is not None:
            gone = writer_gone(record)
            assert gone is None or isinstance(gone, str)
        _put(storage, path + ".ackpending", raw)
        try:
            note = only_asyncckpt_errors(lambda: describe_pending(storage, path))
            assert note is None or isinstance(note, str)
        finally:
            storage.delete(path + ".ackpending")


@pytest.mark.parametrize(
    ("record", "case"),
    [("COMMIT", "nested"), ("COMMIT", "huge-int"), ("VERSION", "nested"), ("ackpending", "nested")],
)
def test_defect_8_nested_and_huge_records(
    root: tuple[Storage, str], record: str, case: str
) -> None:
    storage, base = root
    raw: Any = DEFECT_8[case]
    if record == "COMMIT":
        _commit_checks(storage, base, f"memory://{base.lstrip('/')}", raw)
    elif record == "VERSION":
        _version_checks(storage, base, raw)
    else:
        decode_pending(raw)


def test_the_fuzzed_records_start_valid(root: tuple[Storage, str]) -> None:
    """The seeds parse: mutations start from records the parsers accept (a seed that did
    not would make the fuzzing test only the rejection of one malformed record)."""
    storage, base = root
    _put(storage, storage.join(base, "2", "COMMIT"), json.dumps(COMMIT).encode())
    assert read_commit_strict(storage, base, 2) is not None
    storage.delete_tree(storage.join(base, "2"))
    assert decode_pending(json.dumps(PENDING).encode()) is not None
    marker = RankDone.decode(json.dumps(RANK).encode(), "r1.done", 2, ATTEMPT, 1)
    assert marker.size == 10 and len(marker.pieces) == 1
    _put(storage, lease_path(storage, base, 99), json.dumps(LEASE).encode())
    assert current_lease(storage, base) is not None
    storage.delete(lease_path(storage, base, 99))
