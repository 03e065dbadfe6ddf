"""The snapshot arena: reuse across saves, bounded saves in flight, flat host memory."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt._api import dropin as api
from asyncckpt._api import staging as staging_api
from asyncckpt._engine import arena as arena_mod
from asyncckpt._engine import snapshot as staging
from asyncckpt._engine import writer_process
from asyncckpt._engine.snapshot import ArenaPool, SnapshotFailedError
from asyncckpt._settings import Settings
from asyncckpt.errors import StorageError


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_arena_is_reused_across_saves(tmp_path: Path) -> None:
    state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    seen = set()
    for i in range(5):
        snap = api.stage(state, api.write_options("none", Settings.resolve()), in_this_process=True)
        seen.add(snap.lease.buffer.data_ptr())
        snap.lease.release()
        asyncckpt.save(state, tmp_path / f"{i}.ackpt").result()
    assert len(seen) == 1


def test_arena_grows_when_the_state_does() -> None:
    pool = ArenaPool(max_inflight=1)
    small = pool.acquire(1 << 10)
    small_size = small.buffer.numel()
    small.release()
    big = pool.acquire(small_size + 1)
    assert big.buffer.numel() > small_size
    big.release()


def test_release_is_idempotent() -> None:
    pool = ArenaPool(max_inflight=1)
    lease = pool.acquire(64)
    lease.release()
    lease.release()
    again = pool.acquire(64)  # would block for ever if the double release leaked a slot
    again.release()


@pytest.mark.timeout(60)
def test_save_waits_for_a_free_arena(tmp_path: Path, monkeypatch: Any) -> None:
    gate = threading.Event()
    real = writer_process.write

    def held(*args: Any, **kwargs: Any) -> int:
        gate.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_process, "write", held)
    state = {"w": torch.randn(1000)}
    first = asyncckpt.save(state, tmp_path / "a.ackpt")
    returned = threading.Event()
    second: list[asyncckpt.SaveHandle] = []

    def save_again() -> None:
        second.append(asyncckpt.save(state, tmp_path / "b.ackpt"))
        returned.set()

    thread = threading.Thread(target=save_again)
    thread.start()
    # max_inflight=1: the second snapshot has no arena until the first write finishes.
    assert not returned.wait(0.5)
    gate.set()
    thread.join(30)
    assert returned.is_set()
    first.result()
    second[0].result()
    assert torch.equal(asyncckpt.load(tmp_path / "b.ackpt")["w"], state["w"])


def test_host_memory_stays_flat_across_50_saves(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB
    path = tmp_path / "x.ackpt"
    for _ in range(5):  # warm up: arena, thread pools, scratch buffers
        asyncckpt.save(state, path).result()
    gc.collect()
    before = _rss_bytes()
    for _ in range(50):
        asyncckpt.save(state, path).result()
    gc.collect()
    growth = _rss_bytes() - before
    # A leak of one copy per save would be 50 x 8 MiB; allow allocator noise only.
    assert growth < 48 << 20, f"host memory grew by {growth >> 20} MiB over 50 saves"


def test_failed_snapshot_releases_the_arena(tmp_path: Path, monkeypatch: Any) -> None:
    def broken(self: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(staging.DeviceCopies, "copy", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        asyncckpt.save({"w": torch.ones(4)}, tmp_path / "x.ackpt")
    assert not (tmp_path / "x.ackpt").exists()
    monkeypatch.undo()
    # Would block for ever if the failed snapshot had kept the only arena.
    asyncckpt.save({"w": torch.ones(4)}, tmp_path / "x.ackpt").result()


def test_overlap_on_cpu_copies_before_returning(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with asyncckpt.Checkpointer(tmp_path / "run", overlap=True) as ckpt:
        ckpt.protect(opt)
        ckpt.save(1, model.state_dict())
        model(torch.ones(4)).sum().backward()
        opt.step()  # mutates the parameters right after save returned
        loaded = ckpt.load(1)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value)


# --------------------------------------------------------------------------- pipelined copy


def _many_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {f"w{i}": torch.randn(64, 1024) for i in range(12)}  # 12 x 256 KiB


def test_write_starts_before_the_copy_ends_and_save_returns_a_full_snapshot(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(staging, "_COPY_STEP", 64 << 10)  # many announced pieces
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", str(64 << 10))
    state = _many_tensors()
    expected = {k: v.clone() for k, v in state.items()}
    writer_started = threading.Event()
    copies_when_writer_started: list[int] = []
    copies_done = [0]
    real_copy = staging.DeviceCopies.copy
    real_write = writer_process.write

    def counting_copy(self: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        if copies_done[0] == 2:  # let the writer in while most of the state is uncopied
            assert writer_started.wait(30), "the writer did not start during the copy"
        real_copy(self, dst, src)
        copies_done[0] += 1

    def watching_write(*args: Any, **kwargs: Any) -> int:
        copies_when_writer_started.append(copies_done[0])
        writer_started.set()
        return real_write(*args, **kwargs)

    # A filled arena: a new one is filled through its memfd (fill), not DeviceCopies.copy.
    asyncckpt.save(state, tmp_path / "warm.ackpt").result(timeout=60)
    monkeypatch.setattr(staging.DeviceCopies, "copy", counting_copy)
    monkeypatch.setattr(writer_process, "write", watching_write)
    handle = asyncckpt.save(state, tmp_path / "x.ackpt")
    total_copies = copies_done[0]
    for value in state.values():  # save has returned: the caller may change everything
        value.fill_(-1.0)
    handle.result()
    assert copies_when_writer_started[0] < total_copies
    assert 0 < handle.stats.blocking_s <= handle.stats.total_s  # type: ignore[operator]
    loaded = asyncckpt.load(tmp_path / "x.ackpt")
    for key, value in expected.items():
        assert torch.equal(loaded[key], value)


@pytest.mark.parametrize("min_cpus, pipelined", [("1", True), ("100000", False)])
def test_chunks_are_encoded_during_the_copy_only_with_enough_cpus(
    tmp_path: Path, monkeypatch: Any, min_cpus: str, pipelined: bool
) -> None:
    from asyncckpt._engine import encode as writer

    monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "0")  # the pipeline runs on threads
    monkeypatch.setenv("ASYNCCKPT_PIPELINE_MIN_CPUS", min_cpus)
    monkeypatch.setattr(staging, "_COPY_STEP", 64 << 10)
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", str(64 << 10))
    copies_done, encoded_at = [0], []
    first_encode = threading.Event()
    real_copy, real_encode = staging.DeviceCopies.copy, writer.encode_chunk

    def counting_copy(self: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        if copies_done[0] == 2:  # most of the state is not copied yet: does an encoder run?
            # Without the pipeline no encoder can start before the copy ends, so the short
            # wait only lets a wrong encoder show; with it, the wait ends at the first encode.
            first_encode.wait(30 if pipelined else 0.5)
        real_copy(self, dst, src)
        copies_done[0] += 1

    def recording_encode(*args: Any, **kwargs: Any) -> Any:
        encoded_at.append(copies_done[0])
        first_encode.set()
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(staging.DeviceCopies, "copy", counting_copy)
    monkeypatch.setattr(writer, "encode_chunk", recording_encode)
    state = _many_tensors()
    handle = asyncckpt.save(state, tmp_path / "x.ackpt")
    total = copies_done[0]
    handle.result()
    assert (min(encoded_at) < total) is pipelined
    assert torch.equal(asyncckpt.load(tmp_path / "x.ackpt")["w0"], state["w0"])


def test_a_copy_failing_midway_leaves_no_file_and_raises_once(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(staging, "_COPY_STEP", 64 << 10)
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", str(64 << 10))
    real_copy = staging.DeviceCopies.copy
    calls = [0]
    wrote = threading.Event()
    real_write = writer_process.write

    def watching_write(*args: Any, **kwargs: Any) -> int:
        wrote.set()
        return real_write(*args, **kwargs)

    def failing_copy(self: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == 10:  # after the writer has had chunks to write
            assert wrote.wait(30)
            raise RuntimeError("copy failed midway")
        real_copy(self, dst, src)

    monkeypatch.setattr(staging.DeviceCopies, "copy", failing_copy)
    monkeypatch.setattr(writer_process, "write", watching_write)
    with pytest.raises(RuntimeError, match="copy failed midway"):
        asyncckpt.save(_many_tensors(), tmp_path / "x.ackpt")
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp file
    asyncckpt.wait()  # the aborted write is not reported a second time
    monkeypatch.undo()
    # Would block for ever if the failed snapshot had kept the only arena.
    asyncckpt.save({"w": torch.ones(4)}, tmp_path / "x.ackpt").result()
    assert torch.equal(asyncckpt.load(tmp_path / "x.ackpt")["w"], torch.ones(4))


def test_writer_waits_for_each_chunk_to_land() -> None:
    progress = staging.CopyProgress([0, 128], 256)
    seen: list[int] = []

    def writer() -> None:
        progress.wait_until(1, 64)  # byte 192 of the arena
        seen.append(progress.position)

    thread = threading.Thread(target=writer)
    thread.start()
    progress.advance(100)
    progress.advance(150)
    assert not seen
    progress.advance(192)
    thread.join(30)
    assert seen == [192]
    progress.fail(RuntimeError("boom"))
    with pytest.raises(SnapshotFailedError, match="boom"):
        progress.wait_until(1, 128)


# --------------------------------------------------------------------------- reserve


def test_reserved_arena_is_the_one_the_first_save_gets() -> None:
    pool = ArenaPool(max_inflight=1)
    thread = pool.reserve(3 << 20)
    assert thread is not None
    thread.join(30)
    assert pool.reserve(1 << 20) is None  # large enough already: nothing to do
    lease = pool.acquire(3 << 20)
    assert lease.buffer.numel() >= 3 << 20
    ptr = lease.buffer.data_ptr()
    lease.release()
    again = pool.acquire(2 << 20)
    assert again.buffer.data_ptr() == ptr
    again.release()


def test_acquire_waits_for_a_reservation_in_progress(monkeypatch: Any) -> None:
    gate = threading.Event()
    real = arena_mod._allocate
    calls: list[int] = []

    def slow(nbytes: int, shared: bool = False, pin: int | None = None) -> torch.Tensor:
        calls.append(nbytes)
        assert gate.wait(30)
        return real(nbytes, shared, pin)

    monkeypatch.setattr(arena_mod, "_allocate", slow)
    pool = ArenaPool(max_inflight=1)
    thread = pool.reserve(2 << 20)
    assert thread is not None
    got: list[Any] = []
    acquirer = threading.Thread(target=lambda: got.append(pool.acquire(1 << 20)))
    acquirer.start()
    acquirer.join(0.2)
    assert not got  # waiting for the reservation, not allocating a second arena
    gate.set()
    acquirer.join(30)
    assert calls == [2 << 20]
    got[0].release()


def test_api_reserve_sizes_the_arena_from_the_state() -> None:
    state = {"a": torch.zeros(1000), "b": torch.zeros(3)}
    assert (
        staging.arena_bytes(asyncckpt._format.tree.flatten(state)) == 4032 + 64
    )  # each storage cache-line aligned
    thread = api.reserve(state)
    if thread is not None:
        thread.join(30)
    snap = api.stage(state, api.write_options("none", Settings.resolve()), in_this_process=True)
    assert snap.lease.buffer.numel() >= 4096
    snap.lease.release()


def test_host_arena_is_writable_and_zeroed() -> None:
    buffer = arena_mod._host_arena(3 << 20)
    assert buffer.numel() == 3 << 20 and buffer.dtype == torch.uint8
    assert int(buffer.sum()) == 0
    buffer[-1] = 7
    assert int(buffer[-1]) == 7


@pytest.mark.timeout(120)
def test_a_failed_write_keeps_the_arena_until_the_copy_ends(
    tmp_path: Path, monkeypatch: Any
) -> None:
    # The copy still writes into the arena: lent to another save, it would tear that one.
    monkeypatch.setattr(staging, "_COPY_STEP", 64 << 10)
    failed, released = threading.Event(), threading.Event()
    copying = [True]
    seen_during_copy: list[bool] = []
    real_release = arena_mod.ArenaLease.release
    real_copy = staging.DeviceCopies.copy

    def failing_write(*args: Any, **kwargs: Any) -> int:
        failed.set()
        raise StorageError("injected: disk full")

    def release(self: Any) -> None:
        if copying[0]:
            released.set()
        real_release(self)

    def copy(self: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not seen_during_copy and failed.wait(30):
            # Bounded, not timed: a release after the failure shows up at once.
            seen_during_copy.append(released.wait(2))
        real_copy(self, dst, src)

    monkeypatch.setattr(writer_process, "write", failing_write)
    monkeypatch.setattr(arena_mod.ArenaLease, "release", release)
    monkeypatch.setattr(staging.DeviceCopies, "copy", copy)
    handle = asyncckpt.save(_many_tensors(), tmp_path / "x.ackpt")
    copying[0] = False
    with pytest.raises(StorageError, match="disk full"):
        handle.result(timeout=60)
    assert seen_during_copy == [False]


def _resident_bytes(buffer: torch.Tensor) -> int:
    """Bytes of the mapping holding ``buffer`` that are in memory (Linux smaps)."""
    address, rss, inside = buffer.data_ptr(), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            rss += int(line.split()[1]) << 10
    return rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("advice", ["populate", "fallback"])
@pytest.mark.parametrize("shared", [False, True])
def test_a_new_arena_is_faulted_in_on_several_threads(
    monkeypatch: Any, advice: str, shared: bool
) -> None:
    if shared and not arena_mod.shared_memory_supported():
        pytest.skip("no memfd")
    if advice == "fallback":  # an advice the kernel refuses: every page is written instead
        monkeypatch.setattr(arena_mod, "_MADV_POPULATE_WRITE", 12345)
    monkeypatch.setattr(arena_mod, "_FAULT_SLICE", 1 << 20)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    ranges: list[tuple[int, int]] = []
    threads: set[threading.Thread] = set()
    real = arena_mod._fault_range

    def recording(region: Any, start: int, length: int) -> None:
        ranges.append((start, length))
        threads.add(threading.current_thread())
        real(region, start, length)

    monkeypatch.setattr(arena_mod, "_fault_range", recording)
    buffer = arena_mod._allocate(6 << 20, shared)
    arena_mod.populate(buffer)  # a shared arena is faulted in when reserved (else filled)
    ranges.sort()
    assert len(ranges) == 3 and len(threads) == 3
    assert ranges[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges))
    assert sum(n for _, n in ranges) == buffer.numel() == 6 << 20
    assert _resident_bytes(buffer) >= buffer.numel()
    assert int(buffer.sum()) == 0


# --------------------------------------------------------------------------- first save


def _needs_memfd() -> None:
    if not arena_mod.shared_memory_supported():
        pytest.skip("no memfd")


def test_a_first_save_fills_its_new_arena_without_faulting_it_in_first(
    tmp_path: Path, arena_allocations: list[int], monkeypatch: Any
) -> None:
    # Faulting a new arena in zeroes every page, and the copy then writes each again: the
    # first save's stall paid for both. Its copy fills the new arena instead.
    _needs_memfd()
    faulted: list[int] = []
    real = arena_mod._fault_in
    monkeypatch.setattr(arena_mod, "_fault_in", lambda region: faulted.append(len(region)))
    state = _many_tensors()
    snap = api.stage(state, api.write_options("none", Settings.resolve()), in_this_process=True)
    try:
        assert faulted == [] and len(arena_allocations) == 1
        assert not arena_mod.unfilled(snap.lease.buffer)
        for entry, (key, value) in zip(snap.tensors, state.items()):
            staged = snap.storages[entry.storage].data
            assert torch.equal(staged[: value.nbytes].view(value.dtype), value.reshape(-1)), key
    finally:
        snap.lease.release()
    monkeypatch.setattr(arena_mod, "_fault_in", real)
    asyncckpt.save(state, tmp_path / "x.ackpt").result(timeout=60)  # the same arena, reused
    assert len(arena_allocations) == 1
    loaded = asyncckpt.load(tmp_path / "x.ackpt")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("follow", [False, True])
def test_fill_writes_every_piece_at_its_offset(monkeypatch: Any, follow: bool) -> None:
    _needs_memfd()
    monkeypatch.setattr(arena_mod, "FILL_STEP", 4096)  # several steps per piece
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    arena = arena_mod._allocate(1 << 20, shared=True)
    assert arena_mod.unfilled(arena)
    pieces = [(0, torch.arange(10_000) % 251), (20_000, torch.arange(70_000) % 13)]
    pieces = [(at, p.to(torch.uint8)) for at, p in pieces]
    seen: list[int] = []
    arena_mod.fill(arena, pieces, seen.append if follow else None)
    for at, data in pieces:
        assert torch.equal(arena[at : at + data.numel()], data)
    assert int(arena[10_000:20_000].sum()) == 0 and not arena_mod.unfilled(arena)
    if follow:  # announced once every step has landed
        assert seen == [90_000]


def test_a_reserved_arena_is_faulted_in_ahead_of_the_save() -> None:
    _needs_memfd()
    pool = ArenaPool(max_inflight=1)
    thread = pool.reserve(3 << 20, shared=True)
    assert thread is not None
    thread.join(30)
    lease = pool.acquire(3 << 20, shared=True)
    try:
        assert not arena_mod.unfilled(lease.buffer)
        assert _resident_bytes(lease.buffer) >= 3 << 20
    finally:
        lease.release()


def test_the_writer_process_starts_after_the_first_copy_not_beside_it(
    tmp_path: Path, monkeypatch: Any
) -> None:
    # A child interpreter starting up during the copy takes CPU from what the caller waits for.
    _needs_memfd()
    with contextlib.suppress(Exception):  # an earlier test's save would start it meanwhile
        asyncckpt.wait()
    monkeypatch.setattr(writer_process, "_current", None)
    order: list[str] = []
    real_start, real_snapshot = writer_process.start, staging_api.snapshot
    caller = threading.current_thread()

    def start(settings: Any) -> Any:
        if threading.current_thread() is caller:  # the save's job starts it after the copy
            order.append("start")
        return real_start(settings)

    def snapshot(*args: Any, **kwargs: Any) -> Any:
        order.append("copy")
        result = real_snapshot(*args, **kwargs)
        order.append("copied")
        return result

    monkeypatch.setattr(writer_process, "start", start)
    monkeypatch.setattr(staging_api, "snapshot", snapshot)
    asyncckpt.save({"w": torch.ones(1000)}, tmp_path / "x.ackpt").result(timeout=120)
    assert order[:3] == ["copy", "copied", "start"]
