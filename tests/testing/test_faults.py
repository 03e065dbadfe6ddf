"""Faults on purpose: random fault schedules on S3, SIGKILL mid-upload, the fault wrapper.

Under every seeded fault schedule, each save either succeeds with correct data or fails with
a clear AsyncCkptError; ``latest()`` never moves backwards and always names a version that
loads bit for bit; no multipart upload is left behind. A writer process killed with SIGKILL
in the middle of a multipart upload leaves the previous version loadable, and the next
writer's recovery removes the orphaned upload.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt._storage import FsspecStorage, resolve
from asyncckpt._storage.s3 import S3Storage
from asyncckpt.errors import AsyncCkptError, CheckpointTimeoutError, StorageError
from asyncckpt.testing import (
    FAULT_KINDS,
    S3_OPERATIONS,
    TRANSIENT_KINDS,
    Fault,
    FaultPlan,
    FaultyFileSystem,
    random_faults,
)
from tests.conftest import S3_BUCKET, S3_TEST_PART_BYTES

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = 24
ATTEMPTS = 2  # few, so that fault schedules also exhaust retries
STEPS = (1, 2, 3)


def scale() -> int:
    """The store's part size over the test part size (s3_root sets ASYNCCKPT_PART_BYTES).

    1 on moto, 20 on SeaweedFS (which needs 5 MiB parts); child processes inherit it.
    """
    part_bytes = int(os.environ.get("ASYNCCKPT_PART_BYTES", S3_TEST_PART_BYTES))
    return max(1, part_bytes // S3_TEST_PART_BYTES)


def state(seed: int) -> dict[str, Any]:
    """About 0.7 MB times scale() (three parts at the store's part size), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(150_000 * scale(), generator=g),
        "h": torch.randn(20_000 * scale(), generator=g).to(torch.float16),
        "meta": {"seed": seed},
    }


def assert_state(got: Any, seed: int) -> None:
    want = state(seed)
    assert got["meta"] == want["meta"]
    for key in ("w", "h"):
        assert torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), key


def uploads_under(s3_server: Any, s3_root: str) -> list[tuple[str, str]]:
    return s3_server.uploads(S3_BUCKET, s3_root.removeprefix(f"s3://{S3_BUCKET}/"))


# -- random fault schedules on S3 ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(SCHEDULES))
def test_random_fault_schedule(
    seed: int, s3_root: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_RETRY_ATTEMPTS", str(ATTEMPTS))
    kinds = [*TRANSIENT_KINDS, "denied", "no-bucket"]
    writes = ["put_object", "create_multipart_upload", "upload_part", "complete_multipart_upload"]
    ops = [*S3_OPERATIONS, *writes, "upload_part", "abort_multipart_upload"]
    faults = random_faults(seed, count=4, ops=ops, kinds=kinds, max_nth=6, max_times=3)
    plan = FaultPlan(faults)
    plan.disarm()
    opts = {"faulty": {"plan": plan}, "s3": s3_server.storage_options}
    writer = Checkpointer(f"faulty::{s3_root}", keep_last=2, storage_options=opts)
    reader = Checkpointer(s3_root, storage_options=s3_server.storage_options, writer_rank=1)
    plan.arm()
    seeds = {step: 1000 * seed + step for step in STEPS}
    outcomes, previous = [], None
    for step in STEPS:
        try:
            writer.save(step, state(seeds[step])).result()
            outcomes.append("ok")
        except AsyncCkptError as exc:  # anything else fails the test
            assert str(exc), "an error without a message"
            outcomes.append(type(exc).__name__)
        latest = reader.latest()
        assert previous is None or (latest is not None and latest >= previous), (latest, faults)
        if latest is not None:
            assert_state(reader.load(latest), seeds[latest])
        if outcomes[-1] == "ok":
            assert latest == step  # a successful save is the newest version at once
            assert_state(reader.load(step), seeds[step])
        previous = latest
        if not plan.fired(op="abort_multipart_upload"):
            assert uploads_under(s3_server, s3_root) == [], (step, faults, plan.events)
    plan.disarm()
    for step in reader.versions():  # every committed version is complete
        assert_state(reader.load(step), seeds[step])
    Checkpointer(s3_root, storage_options=s3_server.storage_options)  # recovery
    assert uploads_under(s3_server, s3_root) == []
    if plan.events and not any(e.kind in ("denied", "no-bucket") for e in plan.events):
        transient_only = all(f.kind in TRANSIENT_KINDS for f in faults)
        if transient_only and all(f.times < ATTEMPTS for f in faults) and len(faults) == 1:
            assert outcomes == ["ok"] * len(STEPS), (outcomes, faults, plan.events)


# -- SIGKILL in the middle of an upload ---------------------------------------------------

_KILLED = (
    "import sys; from tests.testing.test_faults import killed_writer_main; "
    "killed_writer_main(sys.argv[1], sys.argv[2], sys.argv[3])"
)


def killed_writer_main(mode: str, root: str, endpoint: str) -> None:
    """Save version 1, then start saving version 2 and hang in its third part upload.

    Its part size (``ASYNCCKPT_PART_BYTES``) is inherited from the test, set for the store.
    """

    def on_call(op: str, path: str, call: int) -> None:
        if op == "upload_part" and call == 3 and plan.armed:
            print("MID-UPLOAD", flush=True)

    plan = FaultPlan([Fault("upload_part", nth=3, kind="hang")], on_call=on_call)
    plan.disarm()
    s3_opts = {
        "endpoint_url": endpoint,
        "key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"region_name": "us-east-1"},
    }
    opts = {"faulty": {"plan": plan}, "s3": s3_opts}
    if mode == "checkpointer":
        ckpt = Checkpointer(f"faulty::{root}", storage_options=opts)
        ckpt.save(1, state(1)).result()
        plan.arm()
        ckpt.save(2, state(2)).result()
    else:
        asyncckpt.save(state(1), f"faulty::{root}/m.ackpt", storage_options=opts).result()
        plan.arm()
        asyncckpt.save(state(2), f"faulty::{root}/m.ackpt", storage_options=opts).result()
    print("NOT KILLED", flush=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["checkpointer", "save"])
def test_sigkill_during_s3_save_keeps_previous_version(
    mode: str, s3_root: str, s3_server: Any
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, mode, s3_root, s3_server.endpoint_url],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "MID-UPLOAD", line
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    opts = s3_server.storage_options
    assert len(uploads_under(s3_server, s3_root)) == 1  # the killed upload
    if mode == "checkpointer":
        reader = Checkpointer(s3_root, storage_options=opts, writer_rank=1)
        assert reader.latest() == 1 and reader.versions() == [1]
        assert_state(reader.load(), 1)
        with Checkpointer(s3_root, storage_options=opts) as writer:  # recovery, then go on
            assert len(uploads_under(s3_server, s3_root)) == 1  # opening changes nothing
            writer.save(2, state(22)).result()  # the first save's recovery aborts it
            assert uploads_under(s3_server, s3_root) == []
        assert_state(reader.load(), 22)
    else:
        # The killed save's marker is left: a load gives up at once (its writer ran on this
        # machine and is gone) instead of returning what is now an older file.
        url = f"{s3_root}/m.ackpt"
        with pytest.raises(CheckpointTimeoutError, match=rf"pid {proc.pid} .*m\.ackpt\.ackpending"):
            asyncckpt.load(url, storage_options=opts)
        storage, root = resolve(s3_root, opts)
        storage.delete(storage.join(root, "m.ackpt.ackpending"))  # as the error says
        assert_state(asyncckpt.load(url, storage_options=opts), 1)
        assert isinstance(storage, S3Storage)
        assert storage.abort_uploads(root) == 1
    assert uploads_under(s3_server, s3_root) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_saving_a_key_again_aborts_the_upload_a_killed_save_left(
    s3_root: str, s3_server: Any
) -> None:
    """A drop-in save SIGKILLed mid-multipart leaves its upload; the next save of that key
    (here a single PUT) aborts it, and only it: uploads of other keys under the prefix, one
    of them a longer key that starts with this one, stay."""
    opts = s3_server.storage_options
    storage, root = resolve(s3_root, opts)
    assert isinstance(storage, S3Storage)
    others = [storage.join(root, name) for name in ("m.ackpt2", "sub/m.ackpt")]
    for path in others:
        storage.call("start upload", path, "create_multipart_upload", Key=None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, "save", s3_root, s3_server.endpoint_url],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "MID-UPLOAD", line
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    prefix = root.removeprefix(f"{S3_BUCKET}/")
    keys = sorted(k.removeprefix(f"{prefix}/") for k, _ in uploads_under(s3_server, s3_root))
    assert keys == ["m.ackpt", "m.ackpt2", "sub/m.ackpt"]  # the killed save's, and the others
    asyncckpt.save({"tiny": 1}, f"{s3_root}/m.ackpt", storage_options=opts).result()
    keys = sorted(k.removeprefix(f"{prefix}/") for k, _ in uploads_under(s3_server, s3_root))
    assert keys == ["m.ackpt2", "sub/m.ackpt"]
    assert asyncckpt.load(f"{s3_root}/m.ackpt", storage_options=opts) == {"tiny": 1}
    assert storage.abort_uploads(root) == 2


# -- the fault wrapper itself -------------------------------------------------------------


def test_fault_matching() -> None:
    fault = Fault("upload_part", nth=2, times=2)
    assert [fault.matches("upload_part", n) for n in (1, 2, 3, 4)] == [False, True, True, False]
    assert not fault.matches("put_object", 2)
    assert Fault("*", nth=1).matches("anything", 1)
    with pytest.raises(ValueError, match="unknown fault kind"):
        Fault("x", kind="gremlins")
    schedule = random_faults(3, count=4)
    assert schedule == random_faults(3, count=4) and 1 <= len(schedule) <= 4
    assert set(TRANSIENT_KINDS) < set(FAULT_KINDS)


def test_latency_and_bandwidth_are_charged_per_request(memory_root: str) -> None:
    waits: list[float] = []
    plan = FaultPlan(latency_s=0.02, bandwidth=1e6, sleep=waits.append)
    storage, root = resolve(f"faulty::{memory_root}", {"faulty": {"plan": plan}})
    fs = storage.fs  # type: ignore[attr-defined]
    fs.pipe_file(f"{root}/x", b"x" * 500_000)
    assert waits == [pytest.approx(0.02 + 0.5)]
    waits.clear()
    assert fs.cat_file(f"{root}/x", start=0, end=250_000) == b"x" * 250_000
    assert waits == [pytest.approx(0.02), pytest.approx(0.25)]
    assert plan.bytes_up == 500_000 and plan.bytes_down == 250_000


def test_shared_link_bandwidth_queues_transfers(memory_root: str) -> None:
    waits: list[float] = []
    plan = FaultPlan(link_bandwidth=1e9, sleep=waits.append, clock=lambda: 0.0)
    fs = FaultyFileSystem(resolve(memory_root, None)[0].fs, plan)  # type: ignore[attr-defined]
    for i in range(3):  # all at "time 0": each transfer queues behind the previous ones
        fs.pipe_file(f"{memory_root}/f{i}", b"x" * 10_000_000)
    assert waits == [pytest.approx(0.01), pytest.approx(0.02), pytest.approx(0.03)]


def test_faults_fire_at_the_nth_call(memory_root: str) -> None:
    plan = FaultPlan([Fault("cat_file", nth=2, kind="timeout", times=2)])
    fs = FaultyFileSystem(resolve(memory_root, None)[0].fs, plan)  # type: ignore[attr-defined]
    fs.pipe_file(f"{memory_root}/x", b"abc")
    results = []
    for _ in range(4):
        try:
            results.append(fs.cat_file(f"{memory_root}/x"))
        except TimeoutError:
            results.append("timeout")
    assert results == [b"abc", "timeout", "timeout", b"abc"]
    assert [(e.op, e.call, e.kind) for e in plan.events] == [
        ("cat_file", 2, "timeout"),
        ("cat_file", 3, "timeout"),
    ]


def test_truncated_write_never_becomes_the_file(memory_root: str) -> None:
    plan = FaultPlan()
    url, opts = f"faulty::{memory_root}/m.ackpt", {"faulty": {"plan": plan}}
    asyncckpt.save(state(1), url, storage_options=opts).result()
    plan.faults.append(Fault("write", nth=plan.counts["write"] + 2, kind="truncate"))
    with pytest.raises(StorageError, match=r"m\.ackpt"):
        asyncckpt.save(state(2), url, storage_options=opts).result()
    assert plan.fired(kind="truncate")
    assert_state(asyncckpt.load(url, storage_options=opts), 1)
    storage, _ = resolve(memory_root, None)
    assert isinstance(storage, FsspecStorage)
    assert storage.list_dir(storage.fs._strip_protocol(memory_root)) == ["m.ackpt"]


@pytest.mark.parametrize("kind", [k for k in FAULT_KINDS if k != "hang"])
def test_every_fault_kind_is_a_clear_error_or_harmless(memory_root: str, kind: str) -> None:
    plan = FaultPlan()
    url, opts = f"faulty::{memory_root}/m.ackpt", {"faulty": {"plan": plan}}
    asyncckpt.save(state(1), url, storage_options=opts).result()
    calls = sum(plan.counts.values())
    plan.arm()
    plan.faults.extend(Fault("*", nth=n, kind=kind) for n in range(1, calls + 1, 3))
    try:
        asyncckpt.save(state(2), url, storage_options=opts).result()
    except AsyncCkptError as exc:
        assert "m.ackpt" in str(exc)
    plan.disarm()
    got = asyncckpt.load(url, storage_options=opts)
    assert_state(got, got["meta"]["seed"])  # whole: the old version or the new one


def test_hang_blocks_until_released(memory_root: str) -> None:
    plan = FaultPlan([Fault("cat_file", kind="hang")])
    fs = FaultyFileSystem(resolve(memory_root, None)[0].fs, plan)  # type: ignore[attr-defined]
    fs.pipe_file(f"{memory_root}/x", b"abc")
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            fs.cat_file(f"{memory_root}/x")
        except ConnectionResetError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(0.2)
    assert thread.is_alive() and not outcome  # still hanging
    plan.release()
    thread.join(30)
    assert len(outcome) == 1 and "injected hang" in str(outcome[0])


def test_lost_completion_is_recognised_by_its_etag(monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 may answer a retried CompleteMultipartUpload with NoSuchUpload (the in-process S3
    API always does): the writer then checks the object's size and multipart ETag."""
    monkeypatch.setenv("ASYNCCKPT_PART_BYTES", str(64 << 10))
    monkeypatch.setenv("ASYNCCKPT_RETRY_BACKOFF_MS", "1")
    plan = FaultPlan([Fault("complete_multipart_upload", kind="lost-response")])
    url = f"faulty::s3mem://bench/{os.getpid()}-{threading.get_ident()}/m.ackpt"
    opts = {"faulty": {"plan": plan}}
    asyncckpt.save(state(9), url, storage_options=opts).result()
    assert plan.counts["complete_multipart_upload"] == 2 and plan.fired(kind="lost-response")
    assert_state(asyncckpt.load(url, storage_options=opts), 9)
    storage, path = resolve(url, opts)
    assert isinstance(storage, S3Storage)
    other = storage.open_atomic(path)  # a different upload to the same key: not ours
    other.write(b"y" * (200 << 10))
    other.size += 1  # pretend it wrote one byte more than the object will hold
    plan.faults.append(Fault("complete_multipart_upload", nth=3, kind="lost-response"))
    with pytest.raises(StorageError, match="upload no longer exists"):
        other.commit()
