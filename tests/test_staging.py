"""The snapshot arena: reuse across saves, bounded saves in flight, flat host memory."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import api, staging
from asyncckpt.staging import ArenaPool


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_arena_is_reused_across_saves(tmp_path: Path) -> None:
    state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    seen = set()
    for i in range(5):
        snap = api.stage(state)
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
    real = api.write_snapshot

    def held(*args: Any, **kwargs: Any) -> int:
        gate.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "write_snapshot", held)
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
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(8)}  # 32 MiB
    path = tmp_path / "x.ackpt"
    for _ in range(5):  # warm up: arena, thread pools, scratch buffers
        asyncckpt.save(state, path).result()
    gc.collect()
    before = _rss_bytes()
    for _ in range(50):
        asyncckpt.save(state, path).result()
    gc.collect()
    growth = _rss_bytes() - before
    # A leak of one copy per save would be 50 x 32 MiB; allow allocator noise only.
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
