"""The job runtime (``asyncckpt._api.jobs``): SaveHandle as a ``concurrent.futures.Future``,
and one tracker of pending saves and unobserved failures, filtered by owner."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
import asyncckpt._engine.writer_process
from asyncckpt import Checkpointer
from asyncckpt._api.jobs import SaveInfo
from asyncckpt.errors import StorageError


@pytest.fixture
def gate(
    monkeypatch: pytest.MonkeyPatch, arena_allocations: list[int]
) -> Iterator[threading.Event]:
    """Hold every background write until the event is set; two arenas, so that a second
    save can be copied while the first one's write is held (its job then waits behind)."""
    monkeypatch.setenv("ASYNCCKPT_MAX_INFLIGHT", "2")
    event = threading.Event()
    real = asyncckpt._engine.writer_process.write

    def gated(*args: Any, **kwargs: Any) -> int:
        assert event.wait(60), "test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(asyncckpt._engine.writer_process, "write", gated)
    yield event
    event.set()
    asyncckpt.wait()


@pytest.mark.timeout(120)
def test_a_queued_save_is_cancelled_and_writes_nothing(
    tmp_path: Path, gate: threading.Event
) -> None:
    first = asyncckpt.save({"w": torch.ones(4)}, tmp_path / "a.ackpt")
    second = asyncckpt.save({"w": torch.zeros(4)}, tmp_path / "b.ackpt")
    assert not second.done() and not second.running()
    assert second.cancel() and second.cancelled() and second.cancel()  # idempotent
    gate.set()
    assert first.result(60).stats.raw_bytes == 16
    with pytest.raises(CancelledError):
        second.result(60)
    assert second.done() and not second.failed()
    assert not first.cancel() and not first.cancelled()  # done: too late
    asyncckpt.wait(60)  # a cancelled save is no failure
    assert not (tmp_path / "b.ackpt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ackpt"]  # nor its marker


@pytest.mark.timeout(120)
def test_a_running_save_is_not_cancelled(tmp_path: Path, gate: threading.Event) -> None:
    handle = asyncckpt.save({"w": torch.ones(4)}, tmp_path / "a.ackpt")
    for _ in range(600):  # until the save thread has picked it up
        if handle.running():
            break
        threading.Event().wait(0.05)
    assert handle.running()
    assert not handle.cancel() and not handle.cancelled()
    gate.set()
    assert handle.result(60).path.endswith("a.ackpt")


@pytest.mark.timeout(120)
def test_a_cancelled_version_is_never_committed(tmp_path: Path, gate: threading.Event) -> None:
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, {"w": torch.ones(4)})
        queued = ckpt.save(2, {"w": torch.zeros(4)})
        assert queued.cancel()
        gate.set()
        ckpt.wait(60)
        assert ckpt.versions() == [1]
        assert ckpt.load()["w"].tolist() == [1.0] * 4
        ckpt.save(3, {"w": torch.full((4,), 3.0)}).result(60)
        assert ckpt.versions() == [1, 3]


@pytest.mark.timeout(120)
def test_done_callbacks_get_the_handle_once_it_has_ended(
    tmp_path: Path, gate: threading.Event
) -> None:
    seen: list[Any] = []
    handle = asyncckpt.save({"w": torch.ones(4)}, tmp_path / "a.ackpt")
    handle.add_done_callback(seen.append)
    assert seen == []
    gate.set()
    handle.result(60)
    for _ in range(600):
        if seen:
            break
        threading.Event().wait(0.05)
    assert seen == [handle]
    handle.add_done_callback(seen.append)  # already done: called at once
    assert seen == [handle, handle]


@pytest.mark.timeout(120)
def test_a_checkpointer_raises_only_its_own_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: Any, **kwargs: Any) -> int:
        raise StorageError("disk on fire")

    monkeypatch.setattr(asyncckpt._engine.writer_process, "write", fail)
    ckpt = Checkpointer(tmp_path / "ckpt")
    own = ckpt.save(1, {"w": torch.ones(2)})
    other = asyncckpt.save({"w": torch.ones(2)}, tmp_path / "a.ackpt")
    for handle in (own, other):
        while not handle.done():
            threading.Event().wait(0.05)
    with pytest.raises(StorageError, match="disk on fire"):
        ckpt.wait(60)  # its own failure
    assert own.observed and not other.observed
    ckpt.wait(60)  # the module-level save's failure is not this Checkpointer's
    assert not other.observed
    with pytest.raises(StorageError, match="disk on fire"):
        asyncckpt.wait(60)  # the module-level API sees every owner's
    assert other.observed
    asyncckpt.wait(60)  # each failure once
    monkeypatch.undo()
    ckpt.close()


@pytest.mark.timeout(120)
def test_concurrent_futures_wait_and_as_completed_take_handles(
    tmp_path: Path, gate: threading.Event
) -> None:
    first = asyncckpt.save({"w": torch.ones(4)}, tmp_path / "a.ackpt")
    second = asyncckpt.save({"w": torch.zeros(4)}, tmp_path / "b.ackpt")
    assert isinstance(first, concurrent.futures.Future)
    assert second.cancel()
    # The cancelled one counts as done at once, not when the save thread reaches it.
    done, not_done = concurrent.futures.wait([first, second], timeout=0)
    assert done == {second} and not_done == {first}
    gate.set()
    done, not_done = concurrent.futures.wait([first, second], timeout=60)
    assert done == {first, second} and not not_done
    third = asyncckpt.save({"w": torch.ones(4)}, tmp_path / "c.ackpt")
    finished = list(concurrent.futures.as_completed([first, second, third], timeout=60))
    assert set(finished) == {first, second, third}
    assert first.result().path.endswith("a.ackpt") and third.result().stats.stored_bytes


@pytest.mark.timeout(120)
def test_asyncio_awaits_a_handle_and_observes_its_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> SaveInfo:
        handle = asyncckpt.save({"w": torch.ones(4)}, tmp_path / "a.ackpt")
        return await asyncio.wrap_future(handle)

    info = asyncio.run(main())
    assert info.path.endswith("a.ackpt") and info.stats.stored_bytes

    def fail(*args: Any, **kwargs: Any) -> int:
        raise StorageError("disk on fire")

    monkeypatch.setattr(asyncckpt._engine.writer_process, "write", fail)
    failing = asyncckpt.save({"w": torch.ones(4)}, tmp_path / "b.ackpt")

    async def await_failure() -> None:
        await asyncio.wrap_future(failing)

    with pytest.raises(StorageError, match="disk on fire"):
        asyncio.run(await_failure())
    assert failing.observed
    asyncckpt.wait(60)  # raised once, by the await: not again here


@pytest.fixture
def held_save(
    monkeypatch: pytest.MonkeyPatch, arena_allocations: list[int]
) -> Iterator[dict[str, threading.Event]]:
    """Hold a Checkpointer's first save after its first written chunk (``first_chunk``
    until ``go_write``) and at its commit (``at_commit`` until ``go_commit``)."""
    from asyncckpt._versions.writing import RootWriter

    monkeypatch.setenv("ASYNCCKPT_MAX_INFLIGHT", "2")
    events = {name: threading.Event() for name in ("first_chunk", "go_write", "at_commit")}
    events["go_commit"] = threading.Event()
    real_write = asyncckpt._engine.writer_process.write
    real_commit = RootWriter.commit

    def write(
        snap: Any, storage: Any, path: str, options: Any, progress: Any = None, *a: Any
    ) -> int:
        def held(nbytes: int) -> None:
            progress(nbytes)
            if not events["first_chunk"].is_set():
                events["first_chunk"].set()
                assert events["go_write"].wait(60), "test never let the write go on"

        return real_write(snap, storage, path, options, held if progress else None, *a)

    def commit(self: Any, *args: Any, **kwargs: Any) -> None:
        events["at_commit"].set()
        assert events["go_commit"].wait(60), "test never let the commit go on"
        real_commit(self, *args, **kwargs)

    monkeypatch.setattr(asyncckpt._engine.writer_process, "write", write)
    monkeypatch.setattr(RootWriter, "commit", commit)
    yield events
    for event in events.values():
        event.set()
    asyncckpt.wait()


@pytest.mark.timeout(120)
def test_in_flight_lists_each_save_with_its_phase_and_bytes(
    tmp_path: Path, held_save: dict[str, threading.Event]
) -> None:
    state = {"w": torch.arange(16384, dtype=torch.float32)}  # 64 KiB, 16 chunks
    with Checkpointer(tmp_path, compression="none", settings={"chunk_bytes": 4096}) as ckpt:
        before = time.time()
        handle = ckpt.save(1, state)
        assert held_save["first_chunk"].wait(60)
        [now] = ckpt.in_flight()
        assert (now.step, now.phase, now.raw_bytes) == (1, "writing", 65536)
        assert 0 < now.bytes_written < now.raw_bytes
        assert now.target == handle.path and before - 1 <= now.started <= time.time()
        second = ckpt.save(2, state)  # copied into the second arena; waits behind the first
        assert [(r.step, r.phase, r.bytes_written) for r in ckpt.in_flight()] == [
            (1, "writing", now.bytes_written),
            (2, "queued", 0),
        ]
        held_save["go_write"].set()
        assert held_save["at_commit"].wait(60)
        # The data is durable: the version file is being written.
        first = ckpt.in_flight()[0]
        assert (first.step, first.phase, first.bytes_written) == (1, "committing", 65536)
        assert [r.step for r in asyncckpt.in_flight()] == [1, 2]  # every owner's, here one
        held_save["go_commit"].set()
        second.result(60)
        assert ckpt.in_flight() == [] and asyncckpt.in_flight() == []
        assert ckpt.versions() == [1, 2]


@pytest.mark.timeout(120)
def test_a_drop_in_save_in_flight_has_no_step(tmp_path: Path, gate: threading.Event) -> None:
    handle = asyncckpt.save({"w": torch.ones(4)}, tmp_path / "a.ackpt")
    while not handle.running():  # the save thread picks the job up (the gate holds it)
        time.sleep(0.01)
    [now] = asyncckpt.in_flight()
    assert (now.target, now.step, now.phase, now.raw_bytes) == (handle.path, None, "writing", 16)
    gate.set()
    handle.result(60)
    assert asyncckpt.in_flight() == []


@pytest.mark.timeout(120)
def test_a_done_callback_of_a_version_runs_once_it_is_committed(tmp_path: Path) -> None:
    """The commit callback loggers use: ``handle.add_done_callback`` on a Checkpointer save."""
    seen: list[tuple[int, bool]] = []
    called = threading.Event()

    def on_commit(handle: asyncckpt.SaveHandle) -> None:
        seen.append((5, 5 in ckpt.versions()))
        called.set()

    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, {"w": torch.ones(2)}).add_done_callback(on_commit)
        assert called.wait(60)  # from the save thread, after the waiters of result()
    assert seen == [(5, True)]


@pytest.mark.timeout(120)
def test_a_save_is_copying_until_save_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job starts once the arena is leased, while the caller still copies: that save
    is "copying" (not "writing") until the copy has ended."""
    import asyncckpt._api.checkpointer as checkpointer_module

    seen: list[list[str]] = []
    real = checkpointer_module.stage

    def stage(obj: Any, options: Any, overlap: bool, on_layout: Any) -> Any:
        def layout(snap: Any) -> None:
            on_layout(snap)  # the job is submitted here; the copy starts after
            seen.append([r.phase for r in asyncckpt.in_flight()])

        return real(obj, options, overlap, layout)

    monkeypatch.setattr(checkpointer_module, "stage", stage)
    with Checkpointer(tmp_path) as ckpt:
        handle = ckpt.save(1, {"w": torch.ones(1024)})
        assert seen == [["copying"]]
        after = [r.phase for r in ckpt.in_flight()]
        assert after in ([], ["queued"], ["writing"], ["committing"])  # no longer copying
        handle.result(60)
