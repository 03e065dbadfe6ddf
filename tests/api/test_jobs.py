"""The job runtime (``asyncckpt._api.jobs``): SaveHandle as a ``concurrent.futures.Future``,
and one tracker of pending saves and unobserved failures, filtered by owner."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
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
