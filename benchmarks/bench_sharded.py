"""Sharded checkpoints: the scale simulation and the FSDP2 benchmark (issue 11).

Two parts, one JSON (``bench_sharded.json``) and one figure (``bench_sharded.png``):

* ``sim`` — N simulated ranks (threads; N = 1, 8, 64, 512) write one sharded version of
  a fixed-size model (strong scaling: each rank holds 1/N of every tensor) on the
  fault-injection filesystem (``faulty::memory://``), each through its *own* link: a
  :class:`~asyncckpt.testing.FaultPlan` per rank adds a per-request latency and limits
  the rank's bandwidth. The code is asyncckpt's own, called without a process group:
  every rank runs :meth:`asyncckpt._versions.ranks.RankJob.write` (heartbeat, atomic file write,
  completion record), and rank 0 runs :func:`asyncckpt._versions.publish.write_and_commit` on a
  real :class:`~asyncckpt.Checkpointer` (its own file, polling for every marker, building
  ``.metadata``, the lease-fenced ``COMMIT``). Only the staging (``stage``) and the
  attempt token (normally broadcast once) are done by the script. Reported per rank
  count: storage requests per rank per save (by kind), the coordinator's requests, each
  rank's time to durable, the time from the last rank's durable write to the commit, and
  aggregate write throughput; target: 8 ranks >= 6x the throughput of 1 rank.
  Compression is off (``none``) so that the two shared CPU cores are not what is
  measured: the links are.
* ``fsdp`` — FSDP2 (``fully_shard``) on 2 gloo CPU ranks (spawned processes meeting on
  127.0.0.1), model + Adam state >= 1 GiB in total (``--quick``: a few MiB), measured side
  by side in one run on every rank:

  - the baseline: copying the rank's own shards into preallocated buffers;
  - ``Checkpointer.save``: how long it blocks the rank (median of the saves after the
    first, which allocates the arena), and time to durable (the writer rank's: to the
    commit); the copy baseline is a median too;
  - DCP ``async_save`` with ``FileSystemWriter``: stall and time to durable (second call);
  - ``dcp.save`` / ``dcp.load`` through ``asyncckpt.dcp`` vs ``FileSystemWriter`` /
    ``FileSystemReader``: bytes stored, time to durable, load time (checksums verified);
  - memory: each rank's peak RSS above its RSS before its first ``Checkpointer.save``
    (sampled every 2 ms), against its own shards + 256 MiB.

Usage::

    python benchmarks/bench_sharded.py [--quick] [--part sim|fsdp|all] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import torch

from asyncckpt import Checkpointer
from asyncckpt._api.dropin import write_options
from asyncckpt._engine.snapshot import ArenaPool, snapshot
from asyncckpt._format.tree import flatten
from asyncckpt._settings import Settings
from asyncckpt._storage import resolve
from asyncckpt._versions.protocol import read_commit
from asyncckpt._versions.publish import write_and_commit
from asyncckpt._versions.rank_records import Piece
from asyncckpt._versions.ranks import RankJob
from asyncckpt.testing import FaultPlan

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import MIB, pyplot, rss_bytes, savefig, write_json  # noqa: E402

STEP = 1


# ----------------------------------------------------------------------------- simulation


def _kind(path: str) -> str:
    """Which part of the protocol a request belongs to, from the path it names (temp
    files of atomic writes carry the target's name)."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    for part, kind in (
        (".beat", "heartbeat"),
        (".done", "marker"),
        (".failed", "failed"),
        (".ackpt", "data"),
        (".metadata", "metadata"),
        ("COMMIT", "commit"),
        ("VERSION", "commit"),
        ("FAILED", "commit"),
    ):
        if part in name:
            return kind
    return "directory/lease"


class _Link:
    """One rank's throttled link: a FaultPlan, and its requests counted by kind."""

    def __init__(self, latency_s: float, bandwidth: float) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self.plan = FaultPlan(latency_s=latency_s, link_bandwidth=bandwidth, on_call=self._seen)
        self.counting = False

    def _seen(self, op: str, path: str, call: int) -> None:
        if self.counting:
            with self._lock:
                self.counts[f"{_kind(path)}:{op}"] += 1

    def storage_options(self) -> dict[str, Any]:
        return {"faulty": {"plan": self.plan}}

    def requests(self) -> int:
        return sum(self.counts.values())


def _shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """FSDP-style row sharding: ``ceil(rows / world)`` rows per rank, the last ones short."""
    per = -(-rows // world)
    start = min(rows, rank * per)
    return start, min(rows, start + per) - start


def _rank_state(
    tensors: int, rows: int, cols: int, world: int, rank: int
) -> tuple[Any, list[Piece]]:
    """This rank's plain state (its shards) and the pieces that describe them."""
    shards: dict[str, torch.Tensor] = {}
    pieces: list[tuple[str, int, int]] = []
    g = torch.Generator().manual_seed(rank)
    for i in range(tensors):
        start, n = _shard_rows(rows, world, rank)
        if n == 0:
            continue
        shards[f"w{i}"] = torch.randn(n, cols, generator=g)
        pieces.append((f"w{i}", start, n))
    plain = {"model": shards, "rank": rank}
    table = {id(t): k for k, (t, _) in enumerate(flatten(plain).tensors)}
    out = [
        Piece(
            fqn=f"model.{name}",
            path=("model", name),
            shape=(rows, cols),
            dtype="float32",
            offsets=(start, 0),
            sizes=(n, cols),
            entry=table[id(shards[name])],
            nbytes=n * cols * 4,
        )
        for name, start, n in pieces
    ]
    return plain, out


def simulate(
    world: int,
    total_bytes: int,
    tensors: int,
    latency_s: float,
    bandwidth: float,
    tag: str,
) -> dict[str, Any]:
    """One sharded save by ``world`` simulated ranks; the figures of that save."""
    cols = 1024
    rows = max(world, total_bytes // (tensors * cols * 4))
    root = f"faulty::memory://bench-sharded/{tag}-{world}-{uuid.uuid4().hex[:8]}"
    links = [_Link(latency_s, bandwidth) for _ in range(world)]
    ckpt = Checkpointer(root, storage_options=links[0].storage_options(), keep_last=None)
    ckpt._writer.acquire()  # the first save's lease set-up, not part of a steady-state save
    options = write_options("none", Settings.resolve())  # this benchmark's entry point
    attempt = uuid.uuid4().hex  # normally derived from a token broadcast once per job
    jobs = []
    for rank in range(world):
        storage, path = (ckpt._storage, ckpt._root) if rank == 0 else (None, None)
        if storage is None:
            storage, path = resolve(root, links[rank].storage_options())
        assert path is not None
        plain, pieces = _rank_state(tensors, rows, cols, world, rank)
        snap = snapshot(
            flatten(plain), ArenaPool(1), settings=options.settings
        )  # what Checkpointer.save stages
        job = RankJob(
            storage, path, STEP, attempt, rank, world, snap, pieces, options, options.settings
        )
        jobs.append(job)
        del plain
    durable = [0.0] * world
    commit_at = [0.0]
    errors: list[BaseException] = []
    real_commit = ckpt._writer.commit

    def commit(*args: Any, **kwargs: Any) -> Any:
        result = real_commit(*args, **kwargs)
        commit_at[0] = time.perf_counter()
        return result

    ckpt._writer.commit = commit  # type: ignore[method-assign]
    for job in jobs:
        real_write = job.write

        def timed_write(snap: Any = None, rank: int = job.rank, real: Any = real_write) -> int:
            size: int = real(snap)
            durable[rank] = time.perf_counter()  # file and completion record written
            return size

        job.write = timed_write  # type: ignore[method-assign]
    start = threading.Barrier(world + 1)

    def run(rank: int) -> None:
        start.wait()
        try:
            if rank == 0:
                jobs[0].timeout = 600.0
                write_and_commit(ckpt._writer, jobs[0], jobs[0].snap, None, lambda: None)
            else:
                jobs[rank].write()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for link in links:
        link.counting = True
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    commit = read_commit(ckpt._storage, ckpt._root, STEP)
    assert commit is not None and len(commit.files) == world + 1, commit
    raw = sum(p.nbytes for job in jobs for p in job.pieces)
    writes = [d - t0 for d in durable]
    last = max(durable)
    per_rank = [link.requests() for link in links[1:]] or [0]
    kinds: collections.Counter[str] = collections.Counter()
    for link in links[1:]:
        kinds.update(link.counts)
    fsspec.filesystem("memory").rm(root.removeprefix("faulty::memory://"), recursive=True)
    return {
        "ranks": world,
        "raw_bytes": raw,
        "bytes_per_rank": raw // world,
        "requests_per_rank": {
            "min": min(per_rank),
            "max": max(per_rank),
            "mean": round(sum(per_rank) / len(per_rank), 2),
            "by_kind": {k: round(v / max(1, world - 1), 2) for k, v in sorted(kinds.items())},
        },
        "coordinator_requests": links[0].requests(),
        "coordinator_by_kind": dict(sorted(links[0].counts.items())),
        "slowest_rank_write_s": round(max(writes), 4),
        "fastest_rank_write_s": round(min(writes), 4),
        "commit_after_last_durable_s": round(commit_at[0] - last, 4),
        "total_s": round(commit_at[0] - t0, 4),
        "throughput_mib_s": round(raw / MIB / (last - t0), 2),
        "throughput_to_commit_mib_s": round(raw / MIB / (commit_at[0] - t0), 2),
    }


def sim_part(args: argparse.Namespace) -> dict[str, Any]:
    """The simulation at every rank count, and the 8-vs-1 throughput ratio."""
    ranks = [1, 8, 64] if args.quick else [1, 8, 64, 512]
    total = int((4 if args.quick else 256) * MIB)
    bandwidth = float((16 if args.quick else 32) * MIB)
    latency = 0.002 if args.quick else 0.005
    tensors = 8
    results = []
    for world in ranks:
        res = simulate(world, total, tensors, latency, bandwidth, "q" if args.quick else "f")
        print(
            f"sim {world:4d} ranks: {res['raw_bytes'] / MIB:.1f} MiB, slowest rank "
            f"{res['slowest_rank_write_s']:.3f} s, commit +{res['commit_after_last_durable_s']:.3f}"
            f" s after the last durable write, {res['requests_per_rank']['mean']} requests/rank,"
            f" coordinator {res['coordinator_requests']}, {res['throughput_mib_s']} MiB/s",
            flush=True,
        )
        results.append(res)
    by = {r["ranks"]: r for r in results}
    return {
        "settings": {
            "total_bytes": total,
            "tensors": tensors,
            "per_rank_link_bytes_s": bandwidth,
            "latency_s": latency,
            "compression": "none",
            "lease_renew_ms": Settings.resolve().lease_renew_ms,
            "filesystem": "faulty::memory:// (asyncckpt.testing.FaultPlan per rank)",
        },
        "results": results,
        "throughput_8_over_1": round(by[8]["throughput_mib_s"] / by[1]["throughput_mib_s"], 2),
    }


# ----------------------------------------------------------------------------- FSDP2


class _PeakRss:
    """Samples this process's RSS every 2 ms on a thread; keeps the peak."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_bytes())


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fsdp_model(layers: int, width: int, world: int) -> tuple[Any, Any]:
    import torch.distributed as dist  # noqa: F401  (initialised by the caller)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()  # one step: Adam's state exists
    optim.step()
    optim.zero_grad()
    return model, optim


def _fsdp_rank(
    rank: int, world: int, port: int, workdir: str, layers: int, width: int, repeats: int
) -> None:
    """One rank of the FSDP2 benchmark; writes ``rank<r>.json`` into ``workdir``."""
    import warnings
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    import asyncckpt.dcp

    warnings.filterwarnings("ignore")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    wait = timedelta(seconds=900)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=wait)
    work = Path(workdir)
    rec: dict[str, Any] = {"rank": rank}
    model, optim = _fsdp_model(layers, width, world)

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, optim)
        return {"model": msd, "optim": osd, "step": 0}

    shards = [
        v.to_local() for v in _leaves(state()) if isinstance(v, DTensor) and v.to_local().numel()
    ]
    own = sum(t.numel() * t.element_size() for t in shards)
    rec["own_shard_bytes"] = own
    # Baseline: copy this rank's shards into buffers allocated (and touched) beforehand.
    buffers = [torch.empty_like(t) for t in shards]
    for b, t in zip(buffers, shards):
        b.copy_(t)  # touches every page once: the buffers are ready, as an arena is
    copies = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b, t in zip(buffers, shards):
            b.copy_(t)
        copies.append(time.perf_counter() - t0)
    rec["copy_own_shards_s"] = statistics.median(copies)
    del buffers
    dist.barrier()

    # Checkpointer.save: memory from before its first save; the second save is timed.
    base = rss_bytes()
    sampler = _PeakRss()
    ckpt = Checkpointer(work / "ckpt", keep_last=1)
    timings = []
    for step in range(1, repeats + 2):
        current = state()  # get_state_dict is the caller's, not the save's
        dist.barrier()
        t0 = time.perf_counter()
        handle = ckpt.save(step, current)
        stall = time.perf_counter() - t0
        handle.result(timeout=900)
        timings.append({"stall_s": stall, "durable_s": time.perf_counter() - t0})
        del current
    ckpt.close()
    rec["checkpointer_save1"] = timings[0]  # allocates the arena
    rec["checkpointer_save2"] = {  # medians of the later saves (warm arena)
        key: statistics.median(t[key] for t in timings[1:]) for key in ("stall_s", "durable_s")
    }
    rec["extra_rss_bytes"] = sampler.stop() - base
    dist.barrier()

    # DCP async_save (FileSystemWriter), on a group of its own as DCP recommends.
    group = dist.new_group(backend="gloo")
    for i in (1, 2):
        current = state()
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(
            current,
            storage_writer=dcp.FileSystemWriter(str(work / f"dcp-async-{i}")),
            process_group=group,
        )
        stall = time.perf_counter() - t0
        future.result()
        rec[f"dcp_async_save{i}"] = {"stall_s": stall, "durable_s": time.perf_counter() - t0}
    dist.barrier()

    # dcp.save / dcp.load: asyncckpt.dcp vs FileSystemWriter/Reader on the same state.
    for name, make_writer, make_reader in (
        ("asyncckpt.dcp", asyncckpt.dcp.Writer, asyncckpt.dcp.Reader),
        ("FileSystemWriter", dcp.FileSystemWriter, dcp.FileSystemReader),
    ):
        path = str(work / f"sync-{name}")
        current = state()
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(current, storage_writer=make_writer(path))
        saved = time.perf_counter() - t0
        dist.barrier()
        into = state()
        t0 = time.perf_counter()
        dcp.load(into, storage_reader=make_reader(path))
        loaded = time.perf_counter() - t0
        rec[f"dcp_save_load[{name}]"] = {"durable_s": saved, "load_s": loaded}
        dist.barrier()
        if rank == 0:
            rec[f"dcp_save_load[{name}]"]["stored_bytes"] = _dir_bytes(Path(path))
    dist.barrier()
    (work / f"rank{rank}.json").write_text(json.dumps(rec))
    dist.destroy_process_group()


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


def fsdp_part(args: argparse.Namespace) -> dict[str, Any]:
    """Run the FSDP2 benchmark on 2 spawned gloo ranks; aggregate their records."""
    import shutil
    import tempfile
    from datetime import timedelta

    import torch.distributed as dist
    import torch.multiprocessing as mp

    world = 2
    size_mib = args.fsdp_size_mib or (8 if args.quick else 1152)
    width = 256 if args.quick else 2048
    # model + Adam (exp_avg, exp_avg_sq) = 3 copies of the parameters, float32
    layers = max(1, round(size_mib * MIB / (3 * 4 * (width * width + width))))
    workdir = Path(tempfile.mkdtemp(prefix="bench_sharded_fsdp-", dir=args.tmp_dir))
    store = dist.TCPStore(
        "127.0.0.1", 0, world + 1, True, timedelta(seconds=900), wait_for_workers=False
    )
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_fsdp_rank,
            args=(r, world, store.port, str(workdir), layers, width, 2 if args.quick else 3),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 1800
    try:
        while any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"FSDP ranks failed: exit codes {[p.exitcode for p in procs]}")
            time.sleep(0.1)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"FSDP ranks failed: exit codes {[p.exitcode for p in procs]}")
        recs = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
        shutil.rmtree(workdir, ignore_errors=True)
    return _fsdp_summary(recs, layers, width)


def _fsdp_summary(recs: list[dict[str, Any]], layers: int, width: int) -> dict[str, Any]:
    params = layers * (width * width + width)
    methods: dict[str, dict[str, Any]] = {}
    for label, key in (
        ("Checkpointer.save", "checkpointer_save2"),
        ("DCP async_save (FileSystemWriter)", "dcp_async_save2"),
        ("dcp.save via asyncckpt.dcp", "dcp_save_load[asyncckpt.dcp]"),
        ("dcp.save via FileSystemWriter", "dcp_save_load[FileSystemWriter]"),
    ):
        per = [r[key] for r in recs]
        methods[label] = {
            "stall_s": [round(p.get("stall_s", p["durable_s"]), 4) for p in per],
            "stall_s_max": round(max(p.get("stall_s", p["durable_s"]) for p in per), 4),
            "durable_s": [round(p["durable_s"], 4) for p in per],
            "durable_s_max": round(max(p["durable_s"] for p in per), 4),
        }
        if "load_s" in per[0]:
            methods[label]["load_s_max"] = round(max(p["load_s"] for p in per), 4)
            methods[label]["stored_bytes"] = recs[0][key].get("stored_bytes")
    ratios = [r["checkpointer_save2"]["stall_s"] / max(r["copy_own_shards_s"], 1e-9) for r in recs]
    extra = [r["extra_rss_bytes"] - r["own_shard_bytes"] for r in recs]
    return {
        "world": len(recs),
        "layers": layers,
        "width": width,
        "parameters": params,
        "state_bytes": 3 * 4 * params,
        "own_shard_bytes": [r["own_shard_bytes"] for r in recs],
        "copy_own_shards_s": [round(r["copy_own_shards_s"], 4) for r in recs],
        "first_save": [r["checkpointer_save1"] for r in recs],
        "dcp_async_first": [r["dcp_async_save1"] for r in recs],
        "methods": methods,
        "stall_over_copy": [round(x, 3) for x in ratios],
        "stall_over_copy_max": round(max(ratios), 3),
        "extra_rss_bytes": [r["extra_rss_bytes"] for r in recs],
        "extra_rss_over_own_mib_max": round(max(extra) / MIB, 1),
    }


# ----------------------------------------------------------------------------- output


def plot(res: dict[str, Any], path: Path) -> None:
    """Requests per rank and commit latency against rank count (sim); FSDP stalls."""
    plt = pyplot()

    sim = res.get("sim")
    fsdp = res.get("fsdp")
    panels = (2 if sim else 0) + (1 if fsdp else 0)
    fig, axes = plt.subplots(1, max(1, panels), figsize=(5.5 * max(1, panels), 4.4))
    axes = list(axes) if panels > 1 else [axes]
    i = 0
    if sim:
        rows = sim["results"]
        n = [r["ranks"] for r in rows]
        ax = axes[i]
        ax.plot(n, [r["requests_per_rank"]["mean"] for r in rows], "o-", label="per rank")
        ax.plot(n, [r["coordinator_requests"] for r in rows], "s--", label="coordinator")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated ranks")
        ax.set_ylabel("storage requests per save")
        ax.set_title("requests (throttled-link simulation)")
        ax.legend()
        ax = axes[i + 1]
        ax.plot(n, [r["slowest_rank_write_s"] for r in rows], "o-", label="slowest rank's write")
        ax.plot(
            n, [r["commit_after_last_durable_s"] for r in rows], "s-", label="last durable→COMMIT"
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("simulated ranks")
        ax.set_ylabel("seconds")
        ax.set_title(f"same model, 1/N per rank (8 vs 1: {sim['throughput_8_over_1']}x)")
        ax.legend()
        i += 2
    if fsdp:
        ax = axes[i]
        labels, stall, durable = [], [], []
        for name, rec in fsdp.get("methods", {}).items():
            labels.append(name)
            stall.append(rec.get("stall_s_max") or 0.0)
            durable.append(rec.get("durable_s_max") or 0.0)
        x = range(len(labels))
        ax.bar([v - 0.2 for v in x], stall, 0.4, label="stall (slowest rank)")
        ax.bar([v + 0.2 for v in x], durable, 0.4, label="to durable")
        # each label on short lines: four long method names side by side never collide
        wrapped = [n.replace(" (", "\n(").replace(" via ", "\nvia ") for n in labels]
        ax.set_xticks(list(x), wrapped, fontsize=8)
        ax.set_ylabel("seconds")
        ax.set_title(f"FSDP2, {fsdp['world']} gloo ranks, {fsdp['state_bytes'] / MIB:.0f} MiB")
        ax.legend()
    fig.tight_layout()
    savefig(fig, path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes; 1, 8 and 64 ranks")
    ap.add_argument("--part", choices=["sim", "fsdp", "all"], default="all")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--fsdp-size-mib", type=int, default=None, help="FSDP2 model+Adam MiB")
    ap.add_argument("--tmp-dir", default=None, help="where the FSDP2 checkpoints go")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"benchmark": "sharded", "quick": args.quick}
    status = 0
    if args.part in ("sim", "all"):
        res["sim"] = sim_part(args)
    if args.part in ("fsdp", "all"):
        try:
            res["fsdp"] = fsdp_part(args)
        except Exception as exc:  # the simulation's figures are still worth writing
            print(f"fsdp part failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            res["fsdp_error"] = f"{type(exc).__name__}: {exc}"
            status = 1
    write_json(res, out / "bench_sharded.json")
    plot(res, out / "bench_sharded.png")
    print(f"wrote {out / 'bench_sharded.json'} and {out / 'bench_sharded.png'}")
    return status


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
