"""A save's device copies through the fake CUDA: their order, their errors, the arenas.

The fake runs no kernels, so these tests check what the engine asks of CUDA and when (see
``tests/fake_cuda.py``); ``tests/engine/test_cuda.py`` checks the same on a real GPU.
"""

from __future__ import annotations

import errno
import gc
import io
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import _threads as workers
from asyncckpt._api import staging as staging_api
from asyncckpt._engine import arena as arena_mod
from asyncckpt._engine import snapshot as snapshot_mod
from asyncckpt._engine.arena import ArenaPool
from asyncckpt._settings import Settings
from asyncckpt._storage.local import LocalStorage
from asyncckpt.cli import formats
from asyncckpt.errors import DeviceCopyError
from tests.fake_cuda import FakeCuda, FakeStream

MIB = 1 << 20


def _state(fake: FakeCuda, nbytes: int = 64 << 10, device: int = 0) -> dict[str, torch.Tensor]:
    return {"w": fake.put(torch.randn(nbytes // 4), device), "step": torch.tensor(3)}


def _index(names: list[str], name: str, start: int = 0) -> int:
    return names.index(name, start)


def test_the_copy_waits_for_the_compute_stream_and_lands_before_save_returns(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    state = _state(fake_cuda)
    handle = asyncckpt.save(state, tmp_path / "x.ackpt")
    fake_cuda.mark("save returned")
    handle.result()
    calls = fake_cuda.calls
    names = fake_cuda.names()
    wait, copy = _index(names, "wait_stream"), _index(names, "copy_async")
    assert wait < copy
    copy_stream, producer = calls[wait][1], calls[wait][2]
    assert producer == fake_cuda.current_stream(0) and copy_stream != producer
    assert calls[copy][1] == copy_stream  # the copy runs on the stream that waited
    record = _index(names, "record_stream", copy)
    assert calls[record][1] == copy_stream  # the source is kept from reuse until it ran
    event = _index(names, "record_event", record)
    assert _index(names, "synchronize_event", event) < _index(names, "mark:save returned")
    assert torch.equal(asyncckpt.load(tmp_path / "x.ackpt", map_location="cpu")["w"], state["w"])


def test_one_copy_stream_per_device_for_every_save(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    fake_cuda.devices = 2
    for i in range(3):
        state = {"a": fake_cuda.put(torch.ones(16), 0), "b": fake_cuda.put(torch.ones(16), 1)}
        asyncckpt.save(state, tmp_path / f"{i}.ackpt").result()
    made = [c[1] for c in fake_cuda.calls if c[0] == "new_stream"]
    assert sorted(stream.device for stream in made) == [0, 1]
    # ...and every save's copies still wait for the caller's queued work first.
    assert fake_cuda.names().count("wait_stream") == 6


def test_the_overlap_guard_waits_on_the_device_not_the_host(
    fake_cuda: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Linear(8, 8)
    for p in model.parameters():
        fake_cuda.put(p, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    released = threading.Event()
    real_give_back = ArenaPool._give_back

    def give_back(pool: ArenaPool, buffer: torch.Tensor) -> None:
        fake_cuda.mark("arena released")
        real_give_back(pool, buffer)
        released.set()

    monkeypatch.setattr(ArenaPool, "_give_back", give_back)
    # The fake's copies land at once: a writer that waited for them before the step would
    # leave the guard nothing to wait on (rightly), so the writer's wait is held until then.
    stepped = threading.Event()
    real_synchronize = fake_cuda.synchronize_event

    def synchronize_event(event: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            assert stepped.wait(60)
        real_synchronize(event)

    monkeypatch.setattr(fake_cuda, "synchronize_event", synchronize_event)
    with asyncckpt.Checkpointer(tmp_path / "run", overlap=True) as ckpt:
        ckpt.protect(opt)
        handle = ckpt.save(1, model.state_dict())
        fake_cuda.mark("save returned")
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        fake_cuda.mark("step done")
        stepped.set()
        handle.result()
        released.wait()
    names = fake_cuda.names()
    returned, done = _index(names, "mark:save returned"), _index(names, "mark:step done")
    hook = fake_cuda.calls[returned:done]
    waits = [c for c in hook if c[0] == "stream_wait_event"]
    assert waits and waits[0][1] == fake_cuda.current_stream(0)  # the optimizer's stream
    event = waits[0][2]
    assert event.stream != fake_cuda.current_stream(0)  # the copy stream's event
    # The host waits for that event before the arena is lent again, never in the hook.
    host_waits = [i for i, c in enumerate(fake_cuda.calls) if c[0] == "synchronize_event"]
    assert host_waits and host_waits[0] < _index(names, "mark:arena released")
    assert all(
        fake_cuda.calls[i][2] != threading.main_thread().name
        for i in host_waits
        if returned < i < done
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["copy_async", "record_event", "synchronize_event"])
@pytest.mark.parametrize("api", ["save", "checkpointer"])
def test_a_sticky_cuda_error_ends_the_save_with_an_error_and_frees_everything(
    fake_cuda: FakeCuda, tmp_path: Path, where: str, api: str
) -> None:
    fake_cuda.fail[where] = RuntimeError("CUDA error: an illegal memory access was encountered")
    fake_cuda.sticky = True
    path = tmp_path / "x.ackpt"
    outcome: list[BaseException | None] = []

    def save() -> None:
        try:
            if api == "save":
                asyncckpt.save(_state(fake_cuda), path).result()
            else:
                with asyncckpt.Checkpointer(tmp_path / "run") as ckpt:
                    ckpt.save(1, _state(fake_cuda)).result()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=save, daemon=True)
    thread.start()
    thread.join(60)  # a hard bound: today's failure mode is a save that never returns
    assert not thread.is_alive(), "save hung after a CUDA error"
    error = outcome[0]
    assert isinstance(error, DeviceCopyError), error
    assert "cuda:0" in str(error) and "illegal memory access" in str(error)
    pool = staging_api.arena_pool(Settings())
    assert pool._leased == 0  # the arena is free again
    assert not (tmp_path / "x.ackpt.ackpending").exists()  # other processes' loads go on
    fake_cuda.fail.clear()
    fake_cuda._broken = None  # a new context: saves work again
    asyncckpt.save(_state(fake_cuda), tmp_path / "y.ackpt").result()


class _HeldRegistration:
    """Holds the fake's ``register`` (page-locking) until ``release``: what the save's caller
    must not wait for on a first save with room on the device."""

    def __init__(self, fake: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        real = fake.register

        def register(address: int, size: int) -> bool:
            self.entered.set()
            assert self.released.wait(60), "the test never released the registration"
            return real(address, size)

        monkeypatch.setattr(fake, "register", register)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("api", ["save", "checkpointer"])
def test_a_first_save_returns_before_its_new_arena_is_page_locked(
    fake_cuda: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, api: str
) -> None:
    fake_cuda.devices = 2
    fake_cuda.set_device(1)
    state = _state(fake_cuda, 256 << 10, device=1)
    fake_cuda.free_bytes = 2 * state["w"].nbytes  # room for a copy of it, and as much again
    held = _HeldRegistration(fake_cuda, monkeypatch)
    expected = state["w"].clone()
    ckpt = asyncckpt.Checkpointer(tmp_path / "run") if api == "checkpointer" else None
    handle = ckpt.save(1, state) if ckpt else asyncckpt.save(state, tmp_path / "x.ackpt")
    fake_cuda.mark("save returned")  # with the page-locking still held
    assert held.entered.wait(30)  # ... and started, off the caller's thread
    state["w"].add_(1)  # the caller's tensors are free: the snapshot holds a copy
    held.released.set()
    handle.result()
    names = fake_cuda.names()
    clone, returned = _index(names, "clone_async"), _index(names, "mark:save returned")
    assert _index(names, "wait_stream") < clone  # after the caller's queued work
    assert _index(names, "synchronize_event", clone) < returned  # the copy was made
    assert _index(names, "register") > returned
    assert [c[1] for c in fake_cuda.calls if c[0] == "register"] == [1]  # the save's device
    assert _index(names, "copy_async") > _index(names, "register")  # into locked memory
    loaded = ckpt.load(1, map_location="cpu") if ckpt else asyncckpt.load(tmp_path / "x.ackpt")
    assert torch.equal(loaded["w"], expected)
    # The next save reuses the now page-locked arena: copied straight in, nothing locked.
    fake_cuda.calls.clear()
    handle = ckpt.save(2, state) if ckpt else asyncckpt.save(state, tmp_path / "y.ackpt")
    handle.result()
    assert not {"clone_async", "register", "free_memory"} & set(fake_cuda.names())
    if ckpt:
        ckpt.close()


class _DiskFullStream(io.BytesIO):
    """A stream whose first write fails: the write fails before it reads the arena."""

    def write(self, data: Any) -> int:
        return _disk_full()


def _disk_full(*args: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["stream", "convert", "overlap"])
def test_a_failed_write_gives_a_first_saves_arena_back_only_once_its_copies_landed(
    fake_cuda: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # The landing thread writes into the arena after the write failed: an arena given back
    # before it ends may be handed to the next save and overwritten under it.
    state = _state(fake_cuda, 256 << 10)
    fake_cuda.free_bytes = 1 << 30
    held = _HeldRegistration(fake_cuda, monkeypatch)
    # ``decided``: the failed write gave the arena back, or waits for the landing to end.
    landed, decided = threading.Event(), threading.Event()
    landed_at_release: list[bool] = []
    land, release = snapshot_mod.DeviceCopies._land, arena_mod.ArenaLease.release

    def land_then_say(copies: snapshot_mod.DeviceCopies) -> None:
        landing = copies._landing
        assert landing is not None
        join = landing.join

        def join_and_say(timeout: float | None = None) -> None:
            decided.set()
            join(timeout)

        landing.join = join_and_say  # type: ignore[method-assign]
        land(copies)
        landed.set()

    def release_and_say(lease: arena_mod.ArenaLease) -> None:
        landed_at_release.append(landed.is_set())
        decided.set()
        release(lease)

    monkeypatch.setattr(snapshot_mod.DeviceCopies, "_land", land_then_say)
    monkeypatch.setattr(arena_mod.ArenaLease, "release", release_and_say)
    storage = LocalStorage(str(tmp_path))
    monkeypatch.setattr(storage, "open_atomic", _disk_full)
    errors: list[BaseException] = []

    if path == "overlap":  # the writer's wait for the device fails, with the landing going on
        fake_cuda.fail["synchronize_event"] = RuntimeError("CUDA error: unspecified launch failure")

    def failing_write() -> None:
        try:
            if path == "stream":
                asyncckpt.save(state, _DiskFullStream())
            elif path == "convert":
                formats.save_ackpt(state, storage, "x.ackpt")
            else:
                with asyncckpt.Checkpointer(tmp_path / "run", overlap=True) as ckpt:
                    ckpt.save(1, state).result()
        except (OSError, DeviceCopyError) as exc:  # StorageError, from the stream
            errors.append(exc)

    writer = threading.Thread(target=failing_write, daemon=True)
    writer.start()
    assert held.entered.wait(30)  # the landing thread is page-locking the arena
    assert decided.wait(30)  # without the fix, the failed write gives the arena back here
    held.released.set()
    writer.join(60)
    assert len(errors) == 1
    assert ("launch failure" if path == "overlap" else "No space left on device") in str(errors[0])
    assert landed_at_release == [True]
    assert staging_api.arena_pool(Settings())._leased == 0


def test_without_room_on_the_device_the_arena_is_locked_before_the_copy(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    state = _state(fake_cuda, 256 << 10)
    fake_cuda.free_bytes = 2 * state["w"].nbytes - 1  # a copy would take over half of it
    asyncckpt.save(state, tmp_path / "x.ackpt").result()
    names = fake_cuda.names()
    assert "clone_async" not in names
    assert _index(names, "register") < _index(names, "copy_async")


@pytest.mark.timeout(120)
def test_a_cuda_error_moving_a_first_save_to_host_memory_fails_the_save(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    fake_cuda.free_bytes = 1 << 30
    fake_cuda.fail["copy_async"] = RuntimeError("CUDA error: an illegal memory access")
    handle = asyncckpt.save(_state(fake_cuda), tmp_path / "x.ackpt")  # the copy was made
    with pytest.raises(DeviceCopyError, match=r"cuda:0.*illegal memory access"):
        handle.result()
    assert not (tmp_path / "x.ackpt").exists()
    assert not (tmp_path / "x.ackpt.ackpending").exists()
    assert workers.wait_idle(30)
    assert staging_api.arena_pool(Settings())._leased == 0  # the arena is free again
    fake_cuda.fail.clear()
    state = _state(fake_cuda)
    asyncckpt.save(state, tmp_path / "y.ackpt").result()
    assert torch.equal(asyncckpt.load(tmp_path / "y.ackpt")["w"], state["w"])


def test_a_refused_late_page_lock_leaves_a_correct_save_and_locks_later_arenas_at_once(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    fake_cuda.free_bytes = 1 << 30
    fake_cuda.register_fails = True
    state = _state(fake_cuda)
    asyncckpt.save(state, tmp_path / "x.ackpt").result()  # copied into pageable memory
    assert torch.equal(asyncckpt.load(tmp_path / "x.ackpt")["w"], state["w"])
    assert not arena_mod._lock_later_works
    fake_cuda.calls.clear()
    asyncckpt.save(_state(fake_cuda, 1 << 20), tmp_path / "y.ackpt").result()  # a larger one
    names = fake_cuda.names()
    assert "clone_async" not in names and "pinned_empty" in names  # locked as allocated


def test_arenas_are_registered_exactly_under_the_callers_device(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    fake_cuda.devices = 4
    fake_cuda.set_device(2)
    state = _state(fake_cuda, 5 * MIB + 4096, device=2)
    thread = asyncckpt.reserve(state)  # registers on the reserve thread, whose device is 0
    assert thread is not None
    thread.join()
    asyncckpt.save(state, tmp_path / "x.ackpt").result()
    registers = [c for c in fake_cuda.calls if c[0] == "register"]
    assert len(registers) == 1  # the save used the reserved arena
    _, device, size = registers[0]
    assert device == 2
    assert 5 * MIB + 4096 <= size < 6 * MIB  # exact (page-rounded), not a power of two
    fake_cuda.set_device(0)  # the pool drops the arena from a thread on another device
    staging_api._arenas = None
    assert workers.wait_idle(30)  # the save thread has dropped its views of the arena
    gc.collect()
    assert [c[1] for c in fake_cuda.calls if c[0] == "unregister"] == [2]


def test_a_failed_registration_clears_the_cuda_error_and_the_save_goes_on(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    fake_cuda.register_fails = True
    state = _state(fake_cuda)
    asyncckpt.save(state, tmp_path / "x.ackpt").result()
    names = fake_cuda.names()
    assert _index(names, "clear_error") == _index(names, "register") + 1
    assert "pinned_empty" in names  # the fallback: torch's pinned memory
    assert torch.equal(asyncckpt.load(tmp_path / "x.ackpt", map_location="cpu")["w"], state["w"])


def test_replaced_arenas_are_not_kept_alive(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    handles = []
    with asyncckpt.Checkpointer(tmp_path / "run") as ckpt:
        for step, mib in enumerate([1, 3, 5, 7], start=1):
            handles.append(ckpt.save(step, _state(fake_cuda, mib * MIB)))
            handles[-1].result()
        assert workers.wait_idle(30)  # the save thread has dropped its task's references
        gc.collect()
        alive = len(fake_cuda.registered)
    assert alive == 1  # max_inflight=1: the 7 MiB arena only, handles kept or not
    assert [c[0] for c in fake_cuda.calls].count("unregister") == 3


def test_arenas_grow_geometrically(tmp_path: Path, arena_allocations: list[int]) -> None:
    nbytes = 8 * MIB
    for i in range(5):  # a state 10 % larger at each save
        asyncckpt.save({"w": torch.zeros(nbytes // 4)}, tmp_path / f"{i}.ackpt").result()
        nbytes = nbytes * 11 // 10
    assert len(arena_allocations) == 2


@pytest.mark.timeout(60)
def test_a_failed_arena_allocation_blocks_no_later_save(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArenaPool(max_inflight=1)
    real = arena_mod._allocate
    failures = [OSError(24, "Too many open files")]

    def allocate(*args: Any) -> torch.Tensor:
        if failures:
            raise failures.pop()
        return real(*args)

    monkeypatch.setattr(arena_mod, "_allocate", allocate)
    with pytest.raises(OSError, match="Too many open files"):
        pool.acquire(4096)
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(pool.acquire(4096)), daemon=True)
    thread.start()
    thread.join(30)
    assert got, "the failed allocation's lease was never returned: acquire blocks for ever"
    got[0].release()


def test_load_into_device_tensors_copies_host_straight_into_them(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    state = _state(fake_cuda, 4096)
    asyncckpt.save(state, tmp_path / "x.ackpt").result()
    target = {"w": fake_cuda.put(torch.zeros(1024), 0), "step": torch.tensor(0)}
    del fake_cuda.calls[:]
    asyncckpt.load(tmp_path / "x.ackpt", into=target)
    names = fake_cuda.names()
    assert "to_device" not in names  # no second copy of the state on the GPU
    assert names.count("copy_into") == 1
    assert torch.equal(target["w"], state["w"]) and int(target["step"]) == 3


def test_fake_streams_are_distinct() -> None:
    assert FakeStream(0, 1) != FakeStream(0, 0)


def test_pinned_load_buffers_are_registered_exactly_and_freed_after_the_load(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    state = _state(fake_cuda, 2 * MIB + 4096)
    asyncckpt.save(state, tmp_path / "x.ackpt", compression="none").result()
    staging_api._arenas = None  # drop the save's arena: only the load's memory is left
    gc.collect()
    del fake_cuda.calls[:]
    loaded = asyncckpt.load(tmp_path / "x.ackpt")
    registers = [c for c in fake_cuda.calls if c[0] == "register"]
    assert [size for _, _, size in registers] == [2 * MIB + 4096]  # not 4 MiB
    assert torch.equal(loaded["w"], state["w"])
    del loaded
    assert workers.wait_idle(30)  # the read threads have dropped their chunk views
    gc.collect()
    assert not fake_cuda.registered  # unregistered once the load's buffers are gone


def test_wait_for_snapshot_returns_once_the_last_saves_copies_have_landed(
    fake_cuda: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncckpt._engine.snapshot import DeviceCopies

    # Only the caller may wait for the copies until it has: the save's own threads are held,
    # so what wait_for_snapshot returns after is its own wait, not theirs.
    real_wait, caller_done = DeviceCopies.wait, threading.Event()

    def wait(copies: DeviceCopies) -> None:
        if threading.current_thread() is not threading.main_thread():
            caller_done.wait(60)
        real_wait(copies)

    monkeypatch.setattr(DeviceCopies, "wait", wait)
    with asyncckpt.Checkpointer(tmp_path / "run", overlap=True) as ckpt:
        ckpt.wait_for_snapshot()  # no save yet: nothing to wait for
        handle = ckpt.save(1, _state(fake_cuda))
        fake_cuda.mark("waiting")
        ckpt.wait_for_snapshot()
        fake_cuda.mark("waited")
        caller_done.set()
        handle.result()
    names = fake_cuda.names()
    start, end = _index(names, "mark:waiting"), _index(names, "mark:waited")
    queued = names[:start].count("record_event")
    synced = {c[1] for c in fake_cuda.calls[start:end] if c[0] == "synchronize_event"}
    assert queued > 0 and len(synced) == queued


def test_the_host_waits_for_the_copies_before_handing_the_arena_to_the_writer_process(
    fake_cuda: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncckpt._engine import writer_process

    real_job = writer_process.WriteJob

    def job(*args: Any) -> Any:
        fake_cuda.mark("handed to the writer process")
        return real_job(*args)

    monkeypatch.setattr(writer_process, "WriteJob", job)
    with asyncckpt.Checkpointer(tmp_path / "run", overlap=True) as ckpt:
        ckpt.save(1, _state(fake_cuda)).result()
    names = fake_cuda.names()
    handed = _index(names, "mark:handed to the writer process")
    assert _index(names, "synchronize_event") < handed


def test_a_cuda_load_streams_through_a_bounded_reused_pinned_window(
    fake_cuda: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"w{i}": fake_cuda.put(torch.randn(75 << 10), 0) for i in range(6)}  # 300 KiB each
    asyncckpt.save(state, tmp_path / "x.ackpt", compression="none").result()
    staging_api._arenas = None
    gc.collect()
    monkeypatch.setenv("ASYNCCKPT_PIN_BUDGET_BYTES", str(1 << 20))  # halves of 512 KiB
    del fake_cuda.calls[:]
    loaded = asyncckpt.load(tmp_path / "x.ackpt")
    for key, value in state.items():
        assert torch.equal(loaded[key], value) and fake_cuda.device_of(loaded[key]).index == 0
    calls = fake_cuda.calls
    assert [c[0] for c in calls].count("pinned_empty") == 2  # the window, reused: not 6
    copies = [i for i, c in enumerate(calls) if c[0] == "to_device"]
    recorded = [i for i, c in enumerate(calls) if c[0] == "record_event"]
    assert len(copies) == len(recorded) == 6  # one storage per half, an event after each
    waited = {c[1] for c in calls if c[0] == "synchronize_event"}
    for k in range(2, 6):  # a half is refilled only after the event of its last copies
        event_index = recorded[k - 2]
        waits = [
            i
            for i, c in enumerate(calls)
            if c[0] == "synchronize_event" and event_index < i < copies[k]
        ]
        assert waits, f"batch {k} reused its half before its earlier copy had landed"
    assert len(waited) == 6  # and every copy landed before the load returned


def _mapping_of(address: int) -> str:
    """The permissions of this process's mapping that holds ``address`` ("" if none)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return perms
    return ""


@pytest.mark.timeout(120)
def test_a_forked_child_does_not_inherit_page_locked_arenas(fake_cuda: FakeCuda) -> None:
    """A DataLoader worker forked after a save must not get a copy of the parent's
    page-locked arenas (the kernel copies DMA-pinned private pages into a child at fork):
    they are MADV_DONTFORK, with an inaccessible placeholder in the child at the same
    address, so the child's objects that still name the arena unmap only the placeholder."""
    pinned = arena_mod._allocate(4 << 20, pin=0)
    pageable = arena_mod._allocate(4 << 20)
    assert _mapping_of(pinned.data_ptr()).startswith("rw")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it sees, free its views of both, exit cleanly
        try:
            seen = f"{_mapping_of(pinned.data_ptr())} {_mapping_of(pageable.data_ptr())}"
            os.write(write, seen.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child_pinned, child_pageable = pipe.read().split()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert child_pinned.startswith("---"), f"the child maps the pinned arena {child_pinned}"
    assert child_pageable.startswith("rw"), child_pageable  # pageable ones are shared COW
    assert _mapping_of(pinned.data_ptr()).startswith("rw")  # the parent's is untouched
    pinned.fill_(7)
    assert int(pinned[-1]) == 7
