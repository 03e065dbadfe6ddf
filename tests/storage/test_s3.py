"""asyncckpt on S3: real moto and SeaweedFS servers over HTTP, reached through s3fs (no mocks).

Every test that uses ``s3_server`` runs once per store (``[moto]``, ``[seaweedfs]``). On
SeaweedFS, which enforces S3's 5 MiB minimum part size, parts are 5 MiB instead of 256 KiB
and the states grow with them, so that they span as many parts on both stores.

Covers save/load and the Checkpointer on ``s3://bucket/prefix``, multipart uploads (parallel,
bounded, aborted on failure), retries of transient errors and immediate failure on permanent
ones, conditional creates (and the fallback for stores without them), credentials kept out
of messages and logs, and two writer processes racing to commit one step.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt._storage import resolve
from asyncckpt._storage.s3 import S3Storage
from asyncckpt._storage.s3multipart import multipart_etag
from asyncckpt._storage.s3retry import RetryPolicy, classify, redact
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    ConflictError,
    StorageError,
)
from asyncckpt.testing import Fault, FaultPlan
from tests.conftest import (
    S3_BUCKET,
    S3_OTHER_ACCESS_KEY,
    S3_OTHER_SECRET_KEY,
    S3_TEST_PART_BYTES,
)

REPO = Path(__file__).resolve().parents[2]


def test_a_missing_s3fs_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = sys.modules["fsspec.registry"]  # ``fsspec.registry`` is its mapping proxy
    for protocol in ("s3", "s3a"):  # forget the class, as if s3fs had never been imported
        monkeypatch.delitem(registry._registry, protocol, raising=False)
    monkeypatch.setitem(sys.modules, "s3fs", None)  # and make ``import s3fs`` fail
    with pytest.raises(StorageError, match=re.escape("pip install 'asyncckpt[s3]'")) as caught:
        asyncckpt.load("s3://bucket/x.ackpt")
    assert isinstance(caught.value.__cause__, ImportError)


def scale() -> int:
    """The store's part size over the test part size (s3_root sets ASYNCCKPT_PART_BYTES).

    1 on moto, 20 on SeaweedFS; racing child processes inherit the variable.
    """
    part_bytes = int(os.environ.get("ASYNCCKPT_PART_BYTES", S3_TEST_PART_BYTES))
    return max(1, part_bytes // S3_TEST_PART_BYTES)


def state(seed: int, n: int | None = None) -> dict[str, Any]:
    """About 1.5 MB times scale(): several multipart parts at the store's part size."""
    n = 300_000 * scale() if n is None else n
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, generator=g),
        "b": torch.randn(n // 4, generator=g).to(torch.bfloat16),
        "ids": torch.arange(1000) * seed,
        "meta": {"seed": seed, "name": f"s{seed}"},
    }


def assert_state(got: Any, seed: int, n: int | None = None) -> None:
    want = state(seed, n)
    assert got["meta"] == want["meta"]
    for key in ("w", "b", "ids"):
        assert torch.equal(got[key], want[key]), key


def faulty(s3_root: str, s3_server: Any, plan: FaultPlan) -> tuple[str, dict[str, Any]]:
    """URL and options for ``s3_root`` behind a FaultyFileSystem running ``plan``."""
    return f"faulty::{s3_root}", {"faulty": {"plan": plan}, "s3": s3_server.storage_options}


def uploads_under(s3_server: Any, s3_root: str) -> list[tuple[str, str]]:
    prefix = s3_root.removeprefix(f"s3://{S3_BUCKET}/")
    return s3_server.uploads(S3_BUCKET, prefix)


# -- save / load ------------------------------------------------------------------------------


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_save_load_roundtrip(
    s3_root: str, s3_server: Any, s3_part_bytes: int, compression: str
) -> None:
    opts = s3_server.storage_options
    url = f"{s3_root}/model.ackpt"
    info = asyncckpt.save(state(1), url, compression=compression, storage_options=opts).result()
    assert info.path == url
    assert info.stats.stored_bytes is not None
    assert info.stats.stored_bytes > 2 * s3_part_bytes  # a multipart upload
    assert_state(asyncckpt.load(url, storage_options=opts), 1)
    small = f"{s3_root}/small.ackpt"  # one PUT
    asyncckpt.save({"x": torch.arange(3)}, small, storage_options=opts).result()
    assert asyncckpt.load(small, storage_options=opts)["x"].tolist() == [0, 1, 2]
    assert uploads_under(s3_server, s3_root) == []


def test_overwrite_is_whole_and_leaves_no_extra_objects(s3_root: str, s3_server: Any) -> None:
    opts = s3_server.storage_options
    url = f"{s3_root}/model.ackpt"
    asyncckpt.save(state(1), url, storage_options=opts).result()
    asyncckpt.save(state(2), url, storage_options=opts).result()
    assert_state(asyncckpt.load(url, storage_options=opts), 2)
    storage, root = resolve(s3_root, opts)
    assert storage.list_dir(root) == ["model.ackpt"]  # no temp objects, no renames
    assert uploads_under(s3_server, s3_root) == []


def test_load_missing_object_and_bucket(s3_root: str, s3_server: Any) -> None:
    opts = s3_server.storage_options
    with pytest.raises(CheckpointNotFoundError, match=r"nothing\.ackpt"):
        asyncckpt.load(f"{s3_root}/nothing.ackpt", storage_options=opts)
    with pytest.raises(StorageError, match=r"no-such-bucket-4321.*does not exist"):
        asyncckpt.load("s3://no-such-bucket-4321/x.ackpt", storage_options=opts)


def test_checkpointer_on_s3(s3_root: str, s3_server: Any) -> None:
    opts = s3_server.storage_options
    with Checkpointer(s3_root, keep_last=2, storage_options=opts) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, state(step))
        ckpt.wait()
        assert ckpt.versions() == [20, 30]
        assert ckpt.latest() == 30
        assert_state(ckpt.load(), 30)
        assert_state(ckpt.load(20), 20)
    storage, root = resolve(s3_root, opts)
    assert storage.list_dir(root) == ["20", "30", "VERSION", "_lease"]
    assert sorted(storage.list_dir(storage.join(root, "30")))[0] == "COMMIT"
    reader = Checkpointer(s3_root, storage_options=opts, writer_rank=1)  # loads only
    assert reader.latest() == 30
    assert_state(reader.load(), 30)
    assert uploads_under(s3_server, s3_root) == []


@pytest.mark.parametrize("segment", ["//", "/./", "/../"], ids=["empty", "dot", "dotdot"])
def test_a_root_with_an_ambiguous_path_segment_is_refused(
    s3_root: str, s3_server: Any, segment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """SeaweedFS stores ``runs//exp1`` as ``runs/exp1`` but lists it as given: every step
    would be invisible (no versions, no retention, no recovery, no gc). Refused instead."""
    from asyncckpt.cli import main

    opts = s3_server.storage_options
    url = f"{s3_root}/runs{segment}exp1"
    with pytest.raises(StorageError, match="segment"):
        Checkpointer(url, keep_last=1, storage_options=opts)
    with pytest.raises(StorageError, match="segment"):
        asyncckpt.save(state(1), f"{url}/one.ackpt", storage_options=opts)
    endpoint = f"endpoint_url={opts['endpoint_url']}"
    assert main(["ls", url, "-o", endpoint]) == 1
    assert "segment" in capsys.readouterr().err
    storage, base = resolve(s3_root, opts)
    assert storage.list_dir(base) == []  # nothing was written anywhere


def test_a_trailing_slash_names_the_same_root(s3_root: str, s3_server: Any) -> None:
    opts = s3_server.storage_options
    with Checkpointer(f"{s3_root}/runs/exp1/", keep_last=1, storage_options=opts) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state(step))
    reader = Checkpointer(f"{s3_root}/runs/exp1", storage_options=opts, read_only=True)
    assert reader.versions() == [2]  # retention saw step 1: one root, listed as written
    assert_state(reader.load(), 2)


# -- multipart ----------------------------------------------------------------------------------


def test_parts_go_in_parallel_and_are_bounded(
    s3_root: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_PART_CONCURRENCY", "3")
    second_part = threading.Event()

    def on_call(op: str, path: str, call: int) -> None:
        if op == "upload_part" and call == 2:
            second_part.set()
        if op == "upload_part" and call == 1:  # part 1 waits until part 2 is on its way
            second_part.wait(30)

    plan = FaultPlan(on_call=on_call)
    url, opts = faulty(s3_root, s3_server, plan)
    asyncckpt.save(state(3), f"{url}/m.ackpt", compression="none", storage_options=opts).result()
    assert second_part.is_set(), "part 2 was not sent while part 1 was in flight"
    assert plan.counts["upload_part"] >= 5
    assert 2 <= plan.max_active["upload_part"] <= 3
    assert_state(asyncckpt.load(f"{url}/m.ackpt", storage_options=opts), 3)


def test_one_part_file_is_a_single_put(s3_root: str, s3_server: Any, s3_part_bytes: int) -> None:
    plan = FaultPlan()
    url, opts = faulty(s3_root, s3_server, plan)
    storage, root = resolve(url, opts)
    path = storage.join(root, "exact")
    storage.write_bytes(path, b"x" * s3_part_bytes)
    assert plan.counts["put_object"] == 1
    assert plan.counts["create_multipart_upload"] == 0
    assert storage.size(path) == s3_part_bytes


def test_permanent_failure_aborts_upload_and_names_bucket_and_key(
    s3_root: str, s3_server: Any
) -> None:
    opts = s3_server.storage_options
    asyncckpt.save(state(1), f"{s3_root}/m.ackpt", storage_options=opts).result()
    plan = FaultPlan([Fault("upload_part", nth=3, kind="denied")])
    url, fopts = faulty(s3_root, s3_server, plan)
    handle = asyncckpt.save(state(2), f"{url}/m.ackpt", storage_options=fopts)
    with pytest.raises(StorageError) as info:
        handle.result()
    message = str(info.value)
    assert S3_BUCKET in message and "m.ackpt" in message and "AccessDenied" in message
    assert plan.counts["abort_multipart_upload"] == 1
    assert uploads_under(s3_server, s3_root) == []
    assert_state(asyncckpt.load(f"{s3_root}/m.ackpt", storage_options=opts), 1)


def test_delete_tree_and_recovery_abort_orphaned_uploads(
    s3_root: str, s3_server: Any, s3_part_bytes: int
) -> None:
    opts = s3_server.storage_options
    storage, root = resolve(s3_root, opts)
    assert isinstance(storage, S3Storage)
    writer = storage.open_atomic(storage.join(root, "7", "r00000-dead.ackpt"))
    writer.write(b"x" * (3 * s3_part_bytes))  # two parts sent, never completed
    assert len(uploads_under(s3_server, s3_root)) == 1
    ckpt = Checkpointer(s3_root, storage_options=opts)
    assert len(uploads_under(s3_server, s3_root)) == 1  # opening a root changes nothing
    ckpt.save(8, state(8)).result()  # the first save's recovery drops the uncommitted step 7
    assert uploads_under(s3_server, s3_root) == []
    ckpt.close()
    assert storage.list_dir(root) == ["8", "VERSION", "_lease"]  # step 7 is gone
    writer.abort()  # the upload is gone already: abort is quiet


@pytest.mark.parametrize("when", ["parts", "complete"])
def test_an_upload_another_writer_of_the_key_aborted_fails_with_conflict(
    s3_root: str, s3_server: Any, s3_part_bytes: int, when: str
) -> None:
    """Two processes saving one key: the first to finish aborts the other uploads of that
    key (``abort_strays``); the other's save fails with ConflictError, the key holds the
    first's file whole."""
    storage, root = resolve(s3_root, s3_server.storage_options)
    assert isinstance(storage, S3Storage)
    path = storage.join(root, "m.ackpt")
    writer = storage.open_atomic(path)
    writer.write(b"x" * (3 * s3_part_bytes))  # an upload started, two parts sent
    writer._wait_parts()  # type: ignore[attr-defined]
    storage.put(path, b"the other writer's file")
    storage.abort_unfinished(path, exact=True)  # what the other writer does after writing
    with pytest.raises(ConflictError, match=r"m\.ackpt.*another") as caught:
        if when == "parts":
            writer.write(b"y" * (2 * s3_part_bytes))
            writer.write(b"y" * (2 * s3_part_bytes))  # a part is sent once more data comes
        writer.commit()
    assert "aborted" in str(caught.value)
    assert storage.read_bytes(path, 1 << 20) == b"the other writer's file"
    assert uploads_under(s3_server, s3_root) == []


# -- retries --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "faults",
    [
        [Fault("upload_part", nth=2, kind="slowdown", times=2)],
        [Fault("create_multipart_upload", kind="server-error")],
        [Fault("complete_multipart_upload", kind="lost-response")],
        [Fault("complete_multipart_upload", kind="reset"), Fault("put_object", kind="timeout")],
        [Fault("upload_part", nth=1, kind="truncate"), Fault("upload_part", nth=4, kind="reset")],
        [Fault("cat_file", nth=2, kind="reset"), Fault("head_object", kind="slowdown")],
    ],
    ids=["slowdown", "5xx", "lost-complete", "reset-timeout", "truncate", "reads"],
)
def test_transient_errors_are_retried(s3_root: str, s3_server: Any, faults: list[Fault]) -> None:
    plan = FaultPlan(faults)
    url, opts = faulty(s3_root, s3_server, plan)
    asyncckpt.save(state(4), f"{url}/m.ackpt", storage_options=opts).result()
    asyncckpt.save({"tiny": 1}, f"{url}/tiny.ackpt", storage_options=opts).result()
    assert_state(asyncckpt.load(f"{url}/m.ackpt", storage_options=opts), 4)
    assert plan.events, "no fault fired"
    assert uploads_under(s3_server, s3_root) == []


def test_retries_are_bounded_by_attempts(
    s3_root: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_RETRY_ATTEMPTS", "3")
    plan = FaultPlan([Fault("put_object", kind="slowdown", times=100)])
    url, opts = faulty(s3_root, s3_server, plan)
    storage, root = resolve(url, opts)
    with pytest.raises(StorageError, match=r"after 3 attempts.*SlowDown"):
        storage.write_bytes(storage.join(root, "x"), b"data")
    assert plan.counts["put_object"] == 3


def test_retries_are_bounded_by_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline, driven by a fake clock: no real waiting, no timing in the assertion."""
    from asyncckpt._storage import s3

    now = [0.0]
    monkeypatch.setattr(s3, "_clock", lambda: now[0])
    monkeypatch.setattr(s3, "_sleep", lambda s: now.__setitem__(0, now[0] + s))

    class Fs:
        calls = 0

        def call_s3(self, method: str, **kwargs: Any) -> Any:
            Fs.calls += 1
            raise ConnectionResetError(104, "reset")

    storage = S3Storage(Fs(), retry_attempts=1000, retry_deadline_s=30, retry_backoff_ms=1000)
    with pytest.raises(StorageError, match="ConnectionResetError"):
        storage.size("bucket/key")
    assert now[0] <= 30
    assert 4 <= Fs.calls < 20  # backoff doubles from 1 s (capped at 10 s) within 30 s


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    import random

    policy = RetryPolicy(attempts=10, deadline_s=100, backoff_s=0.1)
    rng = random.Random(0)
    for retry in range(1, 12):
        cap = min(10.0, 0.1 * 2 ** (retry - 1))
        assert cap / 2 <= policy.delay(retry, rng) <= cap


@pytest.mark.parametrize(
    ("kind", "op", "expect"),
    [
        ("denied", "put_object", "AccessDenied"),
        ("no-bucket", "put_object", "does not exist"),
    ],
)
def test_permanent_errors_fail_at_once(
    s3_root: str, s3_server: Any, kind: str, op: str, expect: str
) -> None:
    plan = FaultPlan([Fault(op, kind=kind)])
    url, opts = faulty(s3_root, s3_server, plan)
    storage, root = resolve(url, opts)
    with pytest.raises(StorageError, match=expect) as info:
        storage.write_bytes(storage.join(root, "x.bin"), b"data")
    assert S3_BUCKET in str(info.value) and "x.bin" in str(info.value)
    assert plan.counts[op] == 1


def test_missing_bucket_fails_at_once_on_save(s3_server: Any) -> None:
    plan = FaultPlan()
    opts = {"faulty": {"plan": plan}, "s3": s3_server.storage_options}
    handle = asyncckpt.save(
        {"x": torch.zeros(3)}, "faulty::s3://no-such-bucket-1234/run/x.ackpt", storage_options=opts
    )
    with pytest.raises(StorageError, match=r"bucket 'no-such-bucket-1234' does not exist"):
        handle.result()
    assert plan.counts["put_object"] == 1


def test_classify() -> None:
    assert classify(TimeoutError()).kind == "retry"
    assert classify(ConnectionResetError()).kind == "retry"
    assert classify(PermissionError()).kind == "fatal"
    assert classify(ValueError()).kind == "fatal"
    assert multipart_etag(["not-an-md5"]) is None


# -- conditional create ---------------------------------------------------------------------


def test_store_honours_conditional_writes(s3_root: str, s3_server: Any) -> None:
    storage, root = resolve(s3_root, s3_server.storage_options)
    assert isinstance(storage, S3Storage)
    storage.create_exclusive(storage.join(root, "1", "COMMIT"), b"a")
    assert storage.conditional_writes is True
    with pytest.raises(ConflictError):
        storage.create_exclusive(storage.join(root, "1", "COMMIT"), b"b")
    assert storage.list_dir(storage.join(root, "1")) == ["COMMIT"]  # the probe is gone


def test_lost_response_on_create_is_recognised_as_ours(s3_root: str, s3_server: Any) -> None:
    plan = FaultPlan()
    url, opts = faulty(s3_root, s3_server, plan)
    storage, root = resolve(url, opts)
    path = storage.join(root, "COMMIT")
    storage.create_exclusive(storage.join(root, "warmup"), b"")  # the probe happens here
    plan.faults.append(Fault("put_object", nth=plan.counts["put_object"] + 1, kind="lost-response"))
    storage.create_exclusive(path, b"mine")
    assert [e.kind for e in plan.events] == ["lost-response"]
    with pytest.raises(ConflictError):
        storage.create_exclusive(path, b"someone else")
    assert storage.read_bytes(path, 10) == b"mine"


def test_store_without_conditional_writes_is_refused_unless_opted_in(
    s3_root: str, s3_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    plan = FaultPlan(ignore_conditional=True)
    url, opts = faulty(s3_root, s3_server, plan)
    storage, root = resolve(url, opts)
    assert isinstance(storage, S3Storage)
    with pytest.raises(StorageError, match="unsafe_unconditional_writes"):  # no silent downgrade
        storage.create_exclusive(storage.join(root, "COMMIT"), b"first")
    assert not storage.exists(storage.join(root, "COMMIT"))
    storage, root = resolve(url, {**opts, "unsafe_unconditional_writes": True})
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        storage.create_exclusive(storage.join(root, "COMMIT"), b"first")
    assert storage.conditional_writes is False  # type: ignore[attr-defined]
    assert "If-None-Match: ignored" in caplog.text
    with pytest.raises(ConflictError):
        storage.create_exclusive(storage.join(root, "COMMIT"), b"second")
    assert storage.read_bytes(storage.join(root, "COMMIT"), 10) == b"first"


def test_a_store_that_once_ignores_a_condition_is_not_refused_for_it(
    s3_root: str, s3_server: Any
) -> None:
    # Six racing writer processes on SeaweedFS, under load: one concluded from its probe
    # that the store ignores conditional writes, and refused to write for its whole life.
    plan = FaultPlan(ignore_conditional=1)  # the probe's first conditional put only
    url, opts = faulty(s3_root, s3_server, plan)
    storage, root = resolve(url, opts)
    storage.create_exclusive(storage.join(root, "COMMIT"), b"first")
    assert storage.conditional_writes is True  # type: ignore[attr-defined]
    with pytest.raises(ConflictError):
        storage.create_exclusive(storage.join(root, "COMMIT"), b"second")


def test_the_refusal_of_a_store_without_conditional_writes_says_what_the_probe_saw(
    s3_root: str, s3_server: Any
) -> None:
    url, opts = faulty(s3_root, s3_server, FaultPlan(ignore_conditional=True))
    storage, root = resolve(url, opts)
    with pytest.raises(StorageError, match="If-None-Match: ignored, If-Match: ignored"):
        storage.create_exclusive(storage.join(root, "COMMIT"), b"first")


# -- credentials ------------------------------------------------------------------------------

SECRET = S3_OTHER_SECRET_KEY  # the stores accept them
ACCESS_KEY = S3_OTHER_ACCESS_KEY


def test_credentials_never_appear_in_errors_or_logs(
    s3_root: str, s3_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    s3_opts = {**s3_server.storage_options, "key": ACCESS_KEY, "secret": SECRET}
    echo = PermissionError(  # a backend error that echoes the credentials back
        f"denied for Credential={ACCESS_KEY}/20260101/us-east-1/s3 secret={SECRET}"
    )
    plan = FaultPlan(
        [
            Fault("upload_part", nth=2, kind="reset"),
            Fault("upload_part", nth=3, error=echo),
        ]
    )
    opts = {"faulty": {"plan": plan}, "s3": s3_opts}
    caplog.set_level(logging.DEBUG, logger="asyncckpt")
    handle = asyncckpt.save(state(5), f"faulty::{s3_root}/m.ackpt", storage_options=opts)
    with pytest.raises(StorageError) as info:
        handle.result()
    assert plan.fired(kind="reset") and len(plan.events) == 2
    texts = [
        str(info.value),
        repr(info.value),
        "".join(traceback.format_exception(info.value)),
        caplog.text,
    ]
    for text in texts:
        assert SECRET not in text
        assert ACCESS_KEY not in text
    assert "m.ackpt" in str(info.value) and "****" in str(info.value)
    storage, _ = resolve(f"faulty::{s3_root}", opts)
    assert SECRET not in repr(storage) and SECRET not in storage.describe("b/k")
    assert redact(f"x {SECRET} y", (SECRET,)) == "x **** y"


# -- two writers ------------------------------------------------------------------------------

_RACER = (
    "import sys; from tests.storage.test_s3 import racer_main; "
    "racer_main(sys.argv[1], sys.argv[2], sys.argv[3])"
)


def racer_main(root: str, endpoint: str, name: str) -> None:
    """One of two writer processes: both stop just before creating the commit record.

    Its part size (``ASYNCCKPT_PART_BYTES``) is inherited from the test, which set it for
    the store.
    """

    def on_call(op: str, path: str, call: int) -> None:
        if op == "put_object" and path.endswith("/5/COMMIT"):
            print("AT-COMMIT", flush=True)
            assert sys.stdin.readline().strip() == "go"

    s3_opts = {
        "endpoint_url": endpoint,
        "key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"region_name": "us-east-1"},
    }
    plan = FaultPlan(on_call=on_call)
    opts = {"faulty": {"plan": plan}, "s3": s3_opts}
    ckpt = Checkpointer(f"faulty::{root}", storage_options=opts)
    print("READY", flush=True)
    assert sys.stdin.readline().strip() == "go"
    try:
        ckpt.save(5, state(50 + len(name))).result()
    except ConflictError as exc:
        print(f"CONFLICT {exc}", flush=True)
        return
    except AsyncCkptError as exc:
        print(f"ERROR {type(exc).__name__} {exc}", flush=True)
        return
    print("WON", flush=True)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_checkpointers_one_step_exactly_one_wins(s3_root: str, s3_server: Any) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, s3_root, s3_server.endpoint_url, name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for name in ("a", "bb")
    ]
    try:

        def expect(proc: subprocess.Popen[str], word: str) -> None:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith(word), f"expected {word}, got {line!r}"

        for p in procs:  # both are constructed before either saves
            expect(p, "READY")
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        # A racer either reaches its COMMIT (both may, if neither had taken the lease
        # from the other when it checked it) or is fenced before it by the other's lease.
        early: dict[int, str] = {}
        for i, p in enumerate(procs):
            line = p.stdout.readline().strip()  # type: ignore[union-attr]
            if line == "AT-COMMIT":
                p.stdin.write("go\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            else:
                early[i] = line
        finished = [p.communicate(timeout=120)[0].strip() for p in procs]
        outcomes = [early.get(i) or out for i, out in enumerate(finished)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sorted(o.split()[0] for o in outcomes) == ["CONFLICT", "WON"], outcomes
    codes = [p.wait(60) for p in procs]
    assert codes == [0, 0], (codes, outcomes)
    winner = outcomes.index("WON")
    ckpt = Checkpointer(s3_root, storage_options=s3_server.storage_options, writer_rank=1)
    assert ckpt.versions() == [5] and ckpt.latest() == 5
    assert_state(ckpt.load(), 50 + len(("a", "bb")[winner]))
