"""``Checkpointer`` across ranks: real ``gloo`` process groups on loopback, 2-3 processes.

* the DDP pattern (rank 0 saves, every rank loads, no user barrier) over many steps;
* a non-writer rank loading ``step=N`` while the writer's write of N is still running,
  both non-collectively and collectively;
* non-writer loads racing with retention deletes (``keep_last`` 1 and 2) over many cycles:
  every load is a complete, self-consistent version or an ``IncompleteCheckpointError``;
* ranks that call ``save`` though they are not the writer (also in a sub-group).

Each test spawns its ranks with ``torch.multiprocessing`` (spawn). The parent owns a
``TCPStore`` on 127.0.0.1 (port chosen by the OS) that the ranks use to rendezvous and, in
some tests, to coordinate; the process group and every wait have timeouts, and the parent
kills all ranks as soon as one fails or the deadline passes, then shows every rank's
traceback.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import asyncckpt._api.checkpointer
import asyncckpt._versions.lease
import asyncckpt._versions.reading
from asyncckpt import Checkpointer
from asyncckpt._storage import TEMP_MARK, AtomicWriter, resolve
from asyncckpt._versions.protocol import read_commit, read_version_file
from asyncckpt.errors import (
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    IncompleteCheckpointError,
    StorageError,
)
from tests import ranks

pytestmark = pytest.mark.slow

_WAIT = timedelta(seconds=120)  # every store wait and collective in a rank

# --------------------------------------------------------------------------- harness


def run_ranks(
    name: str,
    world: int,
    workdir: Path,
    *args: Any,
    timeout: float = 150,
    killed: tuple[int, ...] = (),
) -> None:
    """Run ``name(rank, world, store, workdir, *args)`` of this module on ``world`` ranks.

    Ranks in ``killed`` must end by SIGKILL (they kill themselves on purpose).
    """
    ranks.run(
        __name__, name, world, workdir, *args, timeout=timeout, killed=killed, with_store=True
    )


def _store_wait(store: Any, key: str) -> None:
    store.wait([key], _WAIT)


def _signal(workdir: Path, name: str) -> None:
    """Raise a flag other ranks (and threads: a TCPStore client is not thread-safe) can see."""
    (workdir / f"flag-{name}").touch()


def _await(workdir: Path, name: str) -> None:
    deadline = time.monotonic() + _WAIT.total_seconds()
    while not (workdir / f"flag-{name}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"flag {name} never raised")
        time.sleep(0.005)


# --------------------------------------------------------------------------- (a) DDP pattern


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.register_buffer("marker", torch.full((1,), -1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.detach().reshape(-1).to(torch.float32) for v in state.values()])


def _ddp_pattern(rank: int, world: int, store: Any, workdir: Path, steps: int) -> None:
    torch.manual_seed(1234)
    net = _Net()
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)
    ckpt = Checkpointer(workdir / "ckpt", keep_last=1)
    for step in range(1, steps + 1):
        loss = model(torch.randn(8, 6, generator=data)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected = None
        if rank == 0:
            net.marker.fill_(step)
            expected = _flat(model.state_dict()).clone()
            ckpt.save(step, model.state_dict())
        # Change every value on every rank (on rank 0 while its write may still run): the
        # load must overwrite all of them with exactly what rank 0 saved at ``step``.
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1000.0 + rank)
            net.marker.fill_(-1.0 - rank)
        model.load_state_dict(ckpt.load())
        assert net.marker.item() == step, f"rank {rank} loaded step {net.marker.item()}"
        mine = _flat(model.state_dict())
        ref = expected if expected is not None else torch.empty_like(mine)
        dist.broadcast(ref, src=0)  # verification only, after the load
        assert torch.equal(mine.view(torch.int32), ref.view(torch.int32)), (
            f"rank {rank}: step {step} loaded values differ from what rank 0 saved"
        )
    ckpt.close()
    if rank == 0:
        assert ckpt.versions() == [steps]
    dist.barrier()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_pattern_over_many_steps(tmp_path: Path, world: int) -> None:
    run_ranks("_ddp_pattern", world, tmp_path, 25)


# --------------------------------------------------------------------------- (b) load during write


def _big_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "weights": torch.randn(6 << 20, generator=g),  # 24 MiB
        "ids": torch.arange(1 << 16, dtype=torch.int64) * step,
    }


def _assert_big(got: Any, step: int) -> None:
    want = _big_state(step)
    assert got["step"] == step, f"got step {got['step']}, wanted {step}"
    for key in ("weights", "ids"):
        assert got[key].dtype == want[key].dtype
        assert torch.equal(got[key], want[key]), f"{key} of step {step} differs"


class _HeldWriter(AtomicWriter):
    """Holds the first write of a data file until the test releases it."""

    def __init__(self, inner: AtomicWriter, workdir: Path, step: int) -> None:
        self.inner, self.workdir, self.step, self.held = inner, workdir, step, False

    def write(self, data: bytes | memoryview) -> None:
        if not self.held:
            self.held = True
            _signal(self.workdir, f"writing-{self.step}")
            _await(self.workdir, f"release-{self.step}")
        self.inner.write(data)

    def commit(self) -> None:
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


def _load_during_write(rank: int, world: int, store: Any, workdir: Path) -> None:
    os.environ["ASYNCCKPT_CHUNK_BYTES"] = str(1 << 20)
    root = workdir / "ckpt"
    ckpt = Checkpointer(root)
    assert ckpt.is_writer == (rank == 0)
    if rank == 0:
        storage = ckpt._storage
        real_open = storage.open_atomic

        def open_atomic(path: str) -> AtomicWriter:
            inner = real_open(path)
            if not path.endswith(".ackpt"):
                return inner
            step = int(Path(path).parent.name)
            return _HeldWriter(inner, workdir, step) if step >= 2 else inner

        storage.open_atomic = open_atomic  # type: ignore[method-assign]
        ckpt.save(1, _big_state(1))
        ckpt.wait()
        _signal(workdir, "committed-1")

        # non-collective: rank 1 asks for step 2 while it is being written
        handle = ckpt.save(2, _big_state(2))
        _await(workdir, "polling-2")
        assert not handle.done()
        assert ckpt.latest() == 1
        _signal(workdir, "release-2")
        handle.result(timeout=120)

        # collective: both ranks call load() while step 3 is being written
        handle = ckpt.save(3, _big_state(3))

        def release() -> None:
            _await(workdir, "polling-3")
            _signal(workdir, "release-3")

        releaser = threading.Thread(target=release, daemon=True)
        releaser.start()
        _assert_big(ckpt.load(), 3)
        releaser.join(120)
        assert handle.done()
    else:
        real_wait = asyncckpt._versions.reading.wait_for_step

        def wait_for_step(storage: Any, base: str, step: int, timeout: Any, **kw: Any) -> None:
            # entering the poll: the step must not be committed yet (the write is held)
            assert read_commit(storage, base, step) is None, f"step {step} already committed"
            _signal(workdir, f"polling-{step}")
            real_wait(storage, base, step, timeout, **kw)

        asyncckpt._versions.reading.wait_for_step = wait_for_step  # type: ignore[assignment]
        _await(workdir, "committed-1")
        _await(workdir, "writing-2")
        assert ckpt.versions() == [1]
        _assert_big(ckpt.load(step=2, collective=False, timeout=120), 2)

        _await(workdir, "writing-3")
        assert 3 not in ckpt.versions()
        _assert_big(ckpt.load(), 3)
    ckpt.close()
    dist.barrier()
    assert ckpt.versions() == [1, 2, 3]


@pytest.mark.timeout(180)
def test_non_writer_loads_a_step_whose_write_is_running(tmp_path: Path) -> None:
    run_ranks("_load_during_write", 2, tmp_path)


# --------------------------------------------------------------------------- (c) loads vs retention

_MIN_STEPS = 60
_MIN_LOADS = 40


def _cycle_state(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "a": torch.arange(1 << 15, dtype=torch.float32) * 0.25 + step,
        "b": torch.arange(1 << 12, dtype=torch.int64) - step,
        "c": {"half": torch.full((513,), step % 97, dtype=torch.bfloat16), "tag": f"s{step}"},
    }


def _assert_cycle(got: Any) -> int:
    step = got["step"]
    want = _cycle_state(step)
    assert torch.equal(got["a"], want["a"]), f"'a' of step {step} differs"
    assert torch.equal(got["b"], want["b"]), f"'b' of step {step} differs"
    assert torch.equal(got["c"]["half"], want["c"]["half"]), f"'half' of step {step} differs"
    assert got["c"]["tag"] == want["c"]["tag"]
    return int(step)


def _loads_vs_retention(rank: int, world: int, store: Any, workdir: Path) -> None:
    os.environ["ASYNCCKPT_CHUNK_BYTES"] = str(16 << 10)  # many chunks: many reads per load
    readers = range(1, world)
    for keep in (1, 2):
        root = workdir / f"keep{keep}"
        ckpt = Checkpointer(root, keep_last=keep)
        if rank == 0:
            for r in readers:
                _store_wait(store, f"ready-{keep}-{r}")
            step = 0
            while True:
                ckpt.save(step, _cycle_state(step))
                step += 1
                if step >= _MIN_STEPS and step % 5 == 0:
                    loads = [int(store.get(f"loads-{keep}-{r}")) for r in readers]
                    if min(loads) >= _MIN_LOADS:
                        break
                assert step < 20_000, "readers made no progress"
            ckpt.wait()
            last = step - 1
            assert ckpt.versions() == list(range(last - keep + 1, last + 1))
            store.set(f"done-{keep}", str(last))
            print(f"keep_last={keep}: writer saved {step} versions", flush=True)
        else:
            store.set(f"loads-{keep}-{rank}", "0")
            store.set(f"ready-{keep}-{rank}", "1")
            ok = incomplete = not_yet = 0
            newest_seen = -1
            i = 0
            while not store.check([f"done-{keep}"]):
                i += 1
                follow = i % 2 == 1
                try:
                    if follow:
                        got = ckpt.load(collective=False)
                    else:
                        versions = ckpt.versions()
                        if not versions:
                            continue
                        want = versions[0]  # the oldest: the next to be deleted
                        got = ckpt.load(step=want, collective=False, timeout=60)
                        assert got["step"] == want, f"asked for {want}, got {got['step']}"
                except IncompleteCheckpointError:
                    incomplete += 1
                    continue
                except CheckpointNotFoundError:
                    assert ok == 0, "nothing committed, after a version was loaded"
                    not_yet += 1
                    continue
                step = _assert_cycle(got)
                if follow:
                    assert step >= newest_seen, f"load() went back from {newest_seen} to {step}"
                    newest_seen = step
                ok += 1
                store.set(f"loads-{keep}-{rank}", str(ok))
            last = int(store.get(f"done-{keep}"))
            assert _assert_cycle(ckpt.load(collective=False)) == last
            assert _assert_cycle(ckpt.load(step=last, collective=False, timeout=60)) == last
            print(
                f"keep_last={keep} rank {rank}: {ok} complete loads, {incomplete} "
                f"IncompleteCheckpointError, {not_yet} before the first commit",
                flush=True,
            )
        ckpt.close()
        dist.barrier()
    if rank == 0:
        for keep in (1, 2):
            leftovers = [p for p in (workdir / f"keep{keep}").rglob("*") if TEMP_MARK in p.name]
            assert leftovers == []


@pytest.mark.timeout(180)
def test_loads_during_retention_deletes(tmp_path: Path) -> None:
    run_ranks("_loads_vs_retention", 3, tmp_path)


# --------------------------------------------------------------------------- keep_last=1, no sync


def _save_load_loop_keep_one(rank: int, world: int, store: Any, workdir: Path) -> None:
    """The DDP pattern with nothing between two iterations that syncs the ranks.

    Rank 1 reads step s slowly: only once the save of step s+1 (which rank 0 starts right
    after its own load of s) has finished, retention included. Every rank asked for exactly
    step s, so s must still be readable then.
    """
    steps = 4
    ckpt = Checkpointer(workdir / "ckpt", keep_last=1)
    if rank == 1:
        real_wait = asyncckpt._versions.reading.wait_for_step

        def wait_for_step(st: Any, root: str, step: int, timeout: Any, **kw: Any) -> None:
            real_wait(st, root, step, timeout, **kw)
            if step + 1 < steps:
                _await(workdir, f"saved-{step + 1}")

        asyncckpt._versions.reading.wait_for_step = wait_for_step  # type: ignore[assignment]
    for step in range(steps):
        if rank == 0:
            handle = ckpt.save(step, _rank_state(0, step))

            def announce(handle: Any = handle, step: int = step) -> None:
                handle.exception(timeout=120)
                _signal(workdir, f"saved-{step}")

            threading.Thread(target=announce, daemon=True).start()
        got = ckpt.load()
        assert got["step"] == step, f"rank {rank} asked for {step}, got {got['step']}"
    ckpt.close()
    dist.barrier()


@pytest.mark.timeout(180)
def test_ddp_pattern_keep_last_one_without_other_sync(tmp_path: Path) -> None:
    run_ranks("_save_load_loop_keep_one", 2, tmp_path)


def _resume_then_train(rank: int, world: int, store: Any, workdir: Path) -> None:
    """A DDP job resumes from step 2 (a collective load), trains (the ranks sync), saves."""
    root = workdir / "ckpt"
    if rank == 0:
        with Checkpointer(root) as first_job:
            for step in (1, 2):
                first_job.save(step, _rank_state(0, step))
    dist.barrier()
    ckpt = Checkpointer(root, keep_last=1)
    assert ckpt.load()["step"] == 2  # the resume: every rank reads step 2
    dist.barrier()  # a training step's all-reduce: every rank has finished reading it
    if rank == 0:
        for step in (3, 4, 5):
            ckpt.save(step, _rank_state(0, step)).result(timeout=60)
        # No rank can still be reading step 2: retention deletes it like any other.
        assert ckpt.versions() == [5], ckpt.versions()
    ckpt.close()
    dist.barrier()


@pytest.mark.timeout(180)
def test_a_resumed_version_is_not_pinned_once_every_rank_has_read_it(tmp_path: Path) -> None:
    run_ranks("_resume_then_train", 2, tmp_path)


# --------------------------------------------------------------------------- (d) non-writer saves


def _rank_state(rank: int, step: int) -> dict[str, Any]:
    return {"step": step, "rank": rank, "w": torch.full((4096,), 100.0 * rank + step)}


def _non_writer_saves(rank: int, world: int, store: Any, workdir: Path) -> None:
    writer = world - 1  # not rank 0, to check the writer-rank mapping
    root = workdir / "ckpt"
    ckpt = Checkpointer(root, writer_rank=writer)
    assert ckpt.is_writer == (rank == writer)
    for step in range(4):
        handle = ckpt.save(step, _rank_state(rank, step))
        if rank != writer:
            assert handle.done()
            assert handle.result(timeout=0).stats.raw_bytes == 0
        got = ckpt.load()  # collective: every rank gets the writer's state of this step
        assert got["rank"] == writer, f"rank {rank} loaded rank {got['rank']}'s state"
        assert got["step"] == step
        assert torch.equal(got["w"], _rank_state(writer, step)["w"])
    ckpt.wait()
    tokens = [None] * world
    dist.all_gather_object(tokens, ckpt._token)
    if rank == 0:
        storage, base = resolve(root, None)
        assert read_version_file(storage, base).writer == tokens[writer]  # type: ignore[union-attr]
        names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        expected = ["VERSION", "VERSION.lock", "_lease/000000000001"] + [
            f"{s}/{n}"
            for s in range(4)
            for n in ("COMMIT", f"r{writer:05d}-{tokens[writer]}.ackpt")
        ]
        assert names == sorted(expected), names
        for step in range(4):
            commit = read_commit(storage, base, step)
            assert commit is not None and commit.writer == tokens[writer]
    # a Checkpointer over a sub-group: its rank 0 (global rank 1) writes
    group = dist.new_group([1, 2])
    if rank in (1, 2):
        sub = Checkpointer(workdir / "sub", process_group=group, writer_rank=0)
        assert sub.is_writer == (rank == 1)
        handle = sub.save(7, _rank_state(rank, 7))
        if rank == 2:
            assert handle.done() and handle.result(timeout=0).stats.raw_bytes == 0
        got = sub.load()
        assert (got["rank"], got["step"]) == (1, 7)
        sub.close()
        data = sorted(p.name for p in (workdir / "sub" / "7").glob("*.ackpt"))
        assert len(data) == 1 and data[0].startswith("r00000-"), data
    dist.barrier()


@pytest.mark.timeout(180)
def test_save_on_a_non_writer_rank_writes_nothing(tmp_path: Path) -> None:
    run_ranks("_non_writer_saves", 3, tmp_path)


# --------------------------------------------------------------------------- loads that cannot hang


def _collective_errors(rank: int, world: int, store: Any, workdir: Path) -> None:
    ckpt = Checkpointer(workdir / "ckpt")
    if rank == 0:
        ckpt.save(1, {"w": torch.ones(4)}).result(timeout=120)
    dist.barrier()
    if rank == 0:

        def broken() -> int | None:
            raise StorageError("injected: listing the root failed")

        ckpt._newest_expected = broken  # type: ignore[method-assign]
    # The writer fails before the exchange: every rank raises the same kind of error.
    with pytest.raises(StorageError):
        ckpt.load(timeout=60)
    # Ranks asking for different steps all raise, not only the non-writers.
    with pytest.raises(ValueError, match="different steps"):
        ckpt.load(step=rank + 1, timeout=60)
    with pytest.raises(ValueError, match="different steps"):
        ckpt.load(step=1 if rank == 0 else None, timeout=60)
    assert torch.equal(ckpt.load(step=1, timeout=60)["w"], torch.ones(4))  # still in step
    ckpt.close()


@pytest.mark.timeout(180)
def test_collective_load_errors_reach_every_rank(tmp_path: Path) -> None:
    run_ranks("_collective_errors", 2, tmp_path)


class _StuckWriter(AtomicWriter):
    """A data file write that never finishes (the writer is killed while it hangs)."""

    def __init__(self, inner: AtomicWriter, workdir: Path) -> None:
        self.inner, self.workdir = inner, workdir

    def write(self, data: bytes | memoryview) -> None:
        _signal(self.workdir, "writing-2")
        time.sleep(3600)

    def commit(self) -> None:
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


def _writer_killed_during_collective_load(rank: int, world: int, store: Any, workdir: Path) -> None:
    os.environ["ASYNCCKPT_LEASE_RENEW_MS"] = "100"
    os.environ["ASYNCCKPT_LEASE_EXPIRY_MS"] = "2000"
    ckpt = Checkpointer(workdir / "ckpt")
    if rank == 0:
        ckpt.save(1, {"w": torch.ones(4)}).result(timeout=120)
        storage = ckpt._storage
        real_open = storage.open_atomic

        def open_atomic(path: str) -> AtomicWriter:
            inner = real_open(path)
            return _StuckWriter(inner, workdir) if "/2/" in path else inner

        storage.open_atomic = open_atomic  # type: ignore[method-assign]
        ckpt.save(2, {"w": torch.full((4,), 2.0)})
        _await(workdir, "writing-2")
        dist.barrier()

        def die() -> None:
            _await(workdir, "polling-2")
            os.kill(os.getpid(), signal.SIGKILL)  # mid-save, inside a collective load

        threading.Thread(target=die, daemon=True).start()
        ckpt.load()  # agrees on its pending step 2, then waits for its own save
        raise AssertionError("the writer should have been killed")
    real_wait = asyncckpt._versions.reading.wait_for_step

    def wait_for_step(storage: Any, base: str, step: int, timeout: Any, **kw: Any) -> None:
        _signal(workdir, f"polling-{step}")
        real_wait(storage, base, step, timeout, **kw)

    asyncckpt._versions.reading.wait_for_step = wait_for_step  # type: ignore[assignment]
    dist.barrier()
    # The default timeout is the group's (120 s); the message shows the dead writer's lease
    # ended the wait, not the timeout.
    with pytest.raises(CheckpointTimeoutError, match=r"step 2 .*not renewed its lease"):
        ckpt.load()
    Path(workdir, "rank1.done").touch()
    os._exit(0)  # the group's peer is dead: skip its orderly teardown


@pytest.mark.timeout(180)
def test_collective_load_gives_up_when_the_writer_is_killed_mid_save(tmp_path: Path) -> None:
    run_ranks("_writer_killed_during_collective_load", 2, tmp_path, killed=(0,))
    assert (tmp_path / "rank1.done").exists()


# --------------------------------------------------------------------------- FAILED per attempt


def _collective_load_beside_an_earlier_jobs_failure(
    rank: int, world: int, store: Any, workdir: Path
) -> None:
    """A restarted job saves step 2 again and loads it collectively, while the FAILED record
    of the earlier job's save of step 2 is still in the step directory."""
    import asyncckpt._versions.protocol

    ckpt = Checkpointer(workdir / "ckpt")
    if rank == 0:
        real_recover = ckpt._writer._recover

        def recover() -> None:  # the lease is taken; the earlier job's FAILED is still there
            _await(workdir, "rank1-polled")
            real_recover()

        ckpt._writer._recover = recover  # type: ignore[method-assign]
    else:
        real_read = asyncckpt._versions.lease.read_version_file

        def read_version_file(*args: Any) -> Any:
            _signal(workdir, "rank1-polled")  # this rank's poll went past its FAILED check
            return real_read(*args)

        asyncckpt._versions.lease.read_version_file = read_version_file  # type: ignore[assignment]
    ckpt.save(2, _rank_state(0, 2))
    got = ckpt.load()  # every rank gets step 2, or every rank raises
    assert (got["rank"], got["step"]) == (0, 2), got
    ckpt.close()
    dist.barrier()


@pytest.mark.timeout(180)
def test_a_collective_load_is_not_ended_by_an_earlier_jobs_failed_marker(tmp_path: Path) -> None:
    old = Checkpointer(tmp_path / "ckpt")  # the earlier job: step 1, a failed save of step 2
    old.save(1, _rank_state(0, 1)).result(timeout=120)
    real_open = old._storage.open_atomic

    def failing_open(path: str) -> AtomicWriter:
        if path.endswith(".ackpt"):
            raise OSError(28, "injected: the old job's disk is full")
        return real_open(path)

    old._storage.open_atomic = failing_open  # type: ignore[method-assign]
    with pytest.raises(OSError, match="injected"):
        old.save(2, _rank_state(0, 2)).result(timeout=120)
    old.close()
    assert (tmp_path / "ckpt" / "2" / "FAILED").exists()
    run_ranks("_collective_load_beside_an_earlier_jobs_failure", 2, tmp_path)


def _writer_fails_to_choose_with_any_error(
    rank: int, world: int, store: Any, workdir: Path
) -> None:
    from asyncckpt.errors import AsyncCkptError

    ckpt = Checkpointer(workdir / "ckpt")
    if rank == 0:

        def choose() -> int | None:  # not an AsyncCkptError: a bug, a KeyError, a torch error
            raise KeyError("injected: the writer's choice failed")

        ckpt._newest_expected = choose  # type: ignore[method-assign]
        with pytest.raises(KeyError, match="injected"):
            ckpt.load()
    else:
        with pytest.raises(AsyncCkptError, match=r"writer rank \(0\) failed to choose"):
            ckpt.load()
    ckpt.close()
    dist.barrier()


@pytest.mark.timeout(180)
def test_every_rank_hears_of_any_failure_of_the_writers_choice(tmp_path: Path) -> None:
    # Before: the other ranks waited in all_gather for the group's timeout (120 s here).
    run_ranks("_writer_fails_to_choose_with_any_error", 3, tmp_path, timeout=60)
