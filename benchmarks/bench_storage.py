"""Object-storage benchmark: asyncckpt save/load through S3 (moto), fast and slow links.

Runs a real moto S3 server on 127.0.0.1 and measures, for one state:

* two links: ``moto`` (a real moto S3 server on 127.0.0.1, over HTTP) and ``slow`` (a link
  modelled by :class:`asyncckpt.testing.FaultyFileSystem`, which charges every request a
  latency and limits its bandwidth: by default 20 ms and 100 MB/s per request, as one
  connection to S3 gets). Behind the slow link sits, by default, the in-process S3 API
  (``s3mem://``), so that the figures measure the link and not the local server (moto
  itself moves only some 40-90 MB/s on two cores); ``--slow-backend moto`` puts the link in
  front of the moto server instead;
* compression ``none`` vs ``zstd``;
* ``single`` (one part in flight) vs ``parallel`` (``--parallel`` parts in flight)
  multipart uploads.

Every figure is also a ratio measured in the same run: what compression buys
(``t(none) / t(zstd)``), what parallel parts buy (``t(single) / t(parallel)``), and, on the
slow link, time against the "wire time" of the raw state sent as one stream
(``latency + raw bytes / bandwidth``). Absolute seconds drift between machines; compare
ratios.

Usage::

    python benchmarks/bench_storage.py [--size-mib 256] [--repeats 2] [--quick]
        [--latency-ms 20] [--bandwidth-mbps 100] [--link-mbps N] [--part-mib 8]
        [--parallel 8] [--dtype mixed|fp32|bf16] [--slow-backend memory|moto]
        [--baseline-mib 1024] [--baseline-repeats 3] [--baseline-only] [--no-peers]
        [--out benchmarks/results]

It also compares asyncckpt with boto3's s3transfer (``upload_file``/``download_file``), each
with the defaults a user gets, on the same bytes, on SeaweedFS (when ``weed`` is installed)
at ``--baseline-mib`` sizes (64, 128 and 1024 MiB) and on moto at the smallest, reporting
asyncckpt's throughput as a multiple of s3transfer's (the median of ``--baseline-repeats``
paired rounds, each ratio taken within its round, with every round's figures); beside them
on SeaweedFS, the peers a user would pick for S3: s3torchconnector's DCP writer and reader,
and tensorizer's S3 stream.

Writes ``bench_storage.json`` and ``bench_storage.png`` under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MIB, pyplot, savefig, write_json

import asyncckpt
import tests.s3mem  # noqa: F401  (registers s3mem://)
from asyncckpt._settings import Settings
from asyncckpt._storage import resolve
from asyncckpt.testing import FaultPlan
from tests.servers import MotoServer, fake_aws_environment

BUCKET = "asyncckpt-bench"
LINKS = ("moto", "slow")
COMPRESSIONS = ("none", "zstd")
PARTS = ("single", "parallel")


def make_state(size_bytes: int, dtype: str) -> dict[str, torch.Tensor]:
    """Normal-distributed weights (like trained ones) of about ``size_bytes``."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    if dtype in ("fp32", "mixed"):
        n = (size_bytes // (2 if dtype == "mixed" else 1)) // 4
        out["fp32"] = torch.randn(n, generator=g) * 0.02
    if dtype in ("bf16", "mixed"):
        n = (size_bytes // (2 if dtype == "mixed" else 1)) // 2
        out["bf16"] = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    return out


def raw_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name, value in fake_aws_environment().items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.environ["ASYNCCKPT_PART_BYTES"] = str(int(args.part_mib * MIB))
    state = make_state(int(args.size_mib * MIB), args.dtype)
    nbytes = raw_bytes(state)
    bandwidth = args.bandwidth_mbps * 1e6
    link_bw = args.link_mbps * 1e6 if args.link_mbps else None
    results: dict[str, dict[str, Any]] = {link: {} for link in LINKS}
    errors: dict[str, str] = {}
    if args.baseline_only:
        return _finish(args, nbytes, results, errors, bandwidth)
    with MotoServer(min_part_bytes=min(5 * MIB, int(args.part_mib * MIB))) as server:
        server.create_bucket(BUCKET)
        s3 = server.storage_options
        plan = FaultPlan(
            latency_s=args.latency_ms / 1000, bandwidth=bandwidth, link_bandwidth=link_bw
        )
        slow_url = (
            f"faulty::s3mem://{BUCKET}"
            if args.slow_backend == "memory"
            else (f"faulty::s3://{BUCKET}")
        )
        links = {
            "moto": (f"s3://{BUCKET}", s3),
            "slow": (slow_url, {"faulty": {"plan": plan}, "s3": s3}),
        }
        for link, (prefix, opts) in links.items():
            warm = f"{prefix}/warmup-{uuid.uuid4().hex[:6]}.ackpt"  # connections, codecs
            asyncckpt.save({"w": torch.zeros(1000)}, warm, storage_options=opts).result()
            asyncckpt.load(warm, storage_options=opts)
            for compression in COMPRESSIONS:
                for parts in PARTS:
                    name = f"{compression}/{parts}"
                    concurrency = 1 if parts == "single" else args.parallel
                    os.environ["ASYNCCKPT_PART_CONCURRENCY"] = str(concurrency)
                    try:
                        results[link][name] = measure(
                            state, prefix, opts, compression, args.repeats
                        )
                        print(
                            f"  {link:5s} {name:15s} save {results[link][name]['save_s']:.3f} s"
                            f"  load {results[link][name]['load_s']:.3f} s",
                            flush=True,
                        )
                    except Exception as exc:  # record, keep measuring the rest
                        errors[f"{link}/{name}"] = "".join(traceback.format_exception(exc))[-2000:]
    return _finish(args, nbytes, results, errors, bandwidth)


def _finish(
    args: argparse.Namespace,
    nbytes: int,
    results: dict[str, dict[str, Any]],
    errors: dict[str, str],
    bandwidth: float,
) -> dict[str, Any]:
    """The run's record: the links measured (none with ``--baseline-only``), the baseline."""
    wire_s = args.latency_ms / 1000 + nbytes / bandwidth
    return {
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "config": {
            "quick": args.quick,
            "size_mib": args.size_mib,
            "raw_bytes": nbytes,
            "dtype": args.dtype,
            "repeats": args.repeats,
            "baseline_repeats": args.baseline_repeats,
            "baseline_only": args.baseline_only,
            "latency_ms": args.latency_ms,
            "bandwidth_mbps": args.bandwidth_mbps,
            "link_mbps": args.link_mbps,
            "part_mib": args.part_mib,
            "parallel": args.parallel,
            "slow_backend": args.slow_backend,
            "threads": Settings.resolve().threads,
        },
        "results": results,
        "baseline": baseline(args, errors),
        "wire_time_s": {"slow": wire_s},
        "ratios": ratios(results, wire_s),
        "errors": errors,
    }


@contextlib.contextmanager
def _defaults() -> Iterator[None]:
    """Inside: no ``ASYNCCKPT_*`` tunable that this script set (the defaults a user gets)."""
    saved = {
        k: os.environ.pop(k)
        for k in ("ASYNCCKPT_PART_BYTES", "ASYNCCKPT_PART_CONCURRENCY")
        if k in os.environ
    }
    try:
        yield
    finally:
        os.environ.update(saved)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def s3transfer_pair(client: Any, src: str, dst: str, key: str) -> tuple[float, float]:
    """Seconds of boto3's ``upload_file`` and ``download_file`` with their defaults."""
    up = _timed(lambda: client.upload_file(src, BUCKET, key))
    down = _timed(lambda: client.download_file(BUCKET, key, dst))
    return up, down


def s3torchconnector_pair(
    state: dict[str, torch.Tensor], endpoint: str, key: str
) -> dict[str, Any]:
    """Seconds of ``dcp.save``/``dcp.load`` through s3torchconnector's DCP writer and reader.

    Their S3 client takes no endpoint from the writer's arguments: the writer's client is
    replaced by one for the local server (path-style addressing, as SeaweedFS needs).
    """
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    cfg = S3ClientConfig(force_path_style=True)
    url = f"s3://{BUCKET}/{key}"
    writer = S3StorageWriter("us-east-1", url, s3client_config=cfg)
    writer.fs._client = S3Client("us-east-1", endpoint=endpoint, s3client_config=cfg)
    up = _timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True))
    reader = S3StorageReader("us-east-1", url, s3client_config=cfg)
    reader.fs._client = S3Client("us-east-1", endpoint=endpoint, s3client_config=cfg)
    into = {k: torch.empty_like(v) for k, v in state.items()}
    down = _timed(lambda: dcp.load(into, storage_reader=reader, no_dist=True))
    if not same(into, state):
        raise AssertionError(f"s3torchconnector {url}: loaded data differs")
    return {"save_s": up, "load_s": down}


def tensorizer_pair(state: dict[str, torch.Tensor], endpoint: str, key: str) -> dict[str, Any]:
    """Seconds of tensorizer's S3 stream: ``TensorSerializer`` into ``open_stream(..., "wb")``
    (a temporary file uploaded on close) and ``TensorDeserializer`` from a read stream."""
    from tensorizer import TensorDeserializer, TensorSerializer, stream_io

    kw = {
        "s3_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
        "s3_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
        "s3_endpoint": endpoint.removeprefix("http://"),
        "force_http": True,
    }
    url = f"s3://{BUCKET}/{key}.tensors"

    def save() -> None:
        serializer = TensorSerializer(stream_io.open_stream(url, "wb", **kw))
        serializer.write_state_dict(state)
        serializer.close()

    got: dict[str, torch.Tensor] = {}

    def load() -> None:
        reader = TensorDeserializer(stream_io.open_stream(url, "rb", **kw), device="cpu")
        got.update({k: v.clone() for k, v in reader.items()})
        reader.close()

    up, down = _timed(save), _timed(load)
    if not same(got, state):
        raise AssertionError(f"tensorizer {url}: loaded data differs")
    return {"save_s": up, "load_s": down}


def baseline(args: argparse.Namespace, errors: dict[str, str]) -> dict[str, Any]:
    """asyncckpt vs boto3's s3transfer (and, on SeaweedFS, the S3 peers) on the same bytes.

    Everything runs with the defaults a user gets: ``asyncckpt.save``/``load`` without
    arguments or ``ASYNCCKPT_*`` tunables, s3transfer's default ``TransferConfig``, the
    peers' default configuration. s3transfer moves the raw tensor bytes as one file.
    Reported per server and size: seconds, and each method's throughput as a multiple of
    s3transfer's (``t(s3transfer) / t(method)``; above 1 is faster).
    """
    import tempfile

    import boto3

    from tests.servers import MotoServer, SeaweedServer, find_weed

    sizes = sorted(args.baseline_mib)
    servers: dict[str, tuple[Any, list[float]]] = {"moto": (MotoServer, sizes[:1])}
    if find_weed() is not None:
        servers["seaweedfs"] = (SeaweedServer, sizes)
    else:
        print("  baseline: no `weed` binary; SeaweedFS skipped", flush=True)
    out: dict[str, Any] = {"sizes_mib": sizes, "servers": {}}
    for name, (factory, server_sizes) in servers.items():
        try:
            with factory() as server, tempfile.TemporaryDirectory() as tmp, _defaults():
                server.create_bucket(BUCKET)
                client = boto3.client(
                    "s3", endpoint_url=server.endpoint_url, region_name="us-east-1"
                )
                per_size: dict[str, Any] = {}
                for mib in server_sizes:
                    per_size[f"{mib:g}"] = _one_size(
                        server, client, tmp, mib, name == "seaweedfs", args, errors
                    )
                # the figures at the smallest size, kept under their old names
                out["servers"][name] = {**per_size[f"{server_sizes[0]:g}"], "sizes": per_size}
        except Exception as exc:  # record, keep measuring the rest
            errors[f"baseline/{name}"] = "".join(traceback.format_exception(exc))[-2000:]
    return out


def _one_size(
    server: Any,
    client: Any,
    tmp: str,
    mib: float,
    peers: bool,
    args: argparse.Namespace,
    errors: dict[str, str],
) -> dict[str, Any]:
    """Every method at one size on one server."""
    state = make_state(int(mib * MIB), args.dtype)
    src, dst = os.path.join(tmp, "raw.bin"), os.path.join(tmp, "back.bin")
    with open(src, "wb") as f:
        for t in state.values():
            f.write(t.view(torch.uint8).numpy().tobytes())
    key = f"baseline-{uuid.uuid4().hex[:6]}"
    # Paired rounds: s3transfer, then asyncckpt, on the same bytes, round after round, so a
    # busy moment of the machine falls on both; each ratio is taken within its round.
    ups, downs, saves, loads, stored = [], [], [], [], 0
    for _ in range(args.baseline_repeats):
        up, down = s3transfer_pair(client, src, dst, f"{key}.bin")
        ours = measure(state, f"s3://{BUCKET}", server.storage_options, None, 1)
        ups.append(up)
        downs.append(down)
        saves.append(ours["save_s"])
        loads.append(ours["load_s"])
        stored = ours["stored_bytes"]
    up, down = statistics.median(ups), statistics.median(downs)
    save_ratios = [u / s for u, s in zip(ups, saves)]
    load_ratios = [d / t for d, t in zip(downs, loads)]
    fresh = fresh_loads(server, key, f"{key}.bin", state, args.baseline_repeats)
    entry: dict[str, Any] = {
        "fresh": fresh,
        "fresh_load_vs_s3transfer": fresh["load_vs_s3transfer"],
        "fresh_load_vs_s3transfer_spread": fresh["load_vs_s3transfer_spread"],
        "load_vs_s3transfer_spread": [min(load_ratios), max(load_ratios)],
        "raw_bytes": raw_bytes(state),
        "s3transfer_upload_s": up,
        "s3transfer_download_s": down,
        "save_s": statistics.median(saves),
        "load_s": statistics.median(loads),
        "stored_bytes": stored,
        "save_vs_s3transfer": statistics.median(save_ratios),
        "load_vs_s3transfer": statistics.median(load_ratios),
        "rounds": {
            "s3transfer_upload_s": ups,
            "s3transfer_download_s": downs,
            "save_s": saves,
            "load_s": loads,
            "save_vs_s3transfer": save_ratios,
            "load_vs_s3transfer": load_ratios,
        },
        "peers": {},
    }
    print(
        f"  {mib:6g} MiB fresh process: s3transfer {fresh['s3transfer_s']:.3f} s, asyncckpt.load"
        f" {fresh['load_s']:.3f} s ({fresh['load_vs_s3transfer']:.2f}x, rounds "
        f"{fresh['load_vs_s3transfer_spread'][0]:.2f}-{fresh['load_vs_s3transfer_spread'][1]:.2f}x)",
        flush=True,
    )
    print(
        f"  {mib:6g} MiB s3transfer up {up:.3f} s down {down:.3f} s | asyncckpt save "
        f"{entry['save_s']:.3f} s ({entry['save_vs_s3transfer']:.2f}x) load "
        f"{entry['load_s']:.3f} s ({entry['load_vs_s3transfer']:.2f}x, rounds "
        f"{min(load_ratios):.2f}-{max(load_ratios):.2f}x)",
        flush=True,
    )
    if peers and not args.no_peers:
        for peer, fn in (
            ("s3torchconnector DCP", s3torchconnector_pair),
            ("tensorizer S3 stream", tensorizer_pair),
        ):
            try:
                got = fn(state, server.endpoint_url, f"{key}-{peer.split()[0]}")
                got["save_vs_s3transfer"] = up / got["save_s"]
                got["load_vs_s3transfer"] = down / got["load_s"]
                entry["peers"][peer] = got
                print(
                    f"  {mib:6g} MiB {peer}: save {got['save_s']:.3f} s, load {got['load_s']:.3f}"
                    " s",
                    flush=True,
                )
            except ImportError as exc:  # the bench extra is not installed: a row, not a failure
                entry["peers"][peer] = {"not_installed": f"{type(exc).__name__}: {exc}"[:500]}
            except Exception as exc:  # a peer that does not run here is a row that says so
                entry["peers"][peer] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                errors.setdefault(f"peer/{peer}", entry["peers"][peer]["error"])
    return entry


#: A restart's load, in a fresh interpreter that has imported torch (a training script has):
#: the seconds of ``import asyncckpt`` + ``asyncckpt.load`` (which imports s3fs, creates its
#: client, checks the pending-save marker, opens and reads the file), printed as JSON.
_FRESH_ASYNCCKPT = """
import json, sys, time
import torch
t = time.perf_counter()
import asyncckpt
got = asyncckpt.load(sys.argv[1], storage_options=json.loads(sys.argv[2]))
print(json.dumps({"s": time.perf_counter() - t}))
"""
#: The same for boto3: ``import boto3``, a client, ``download_file`` with its defaults.
_FRESH_S3TRANSFER = """
import json, sys, time
import torch
t = time.perf_counter()
import boto3
client = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1")
client.download_file(sys.argv[2], sys.argv[3], sys.argv[4])
print(json.dumps({"s": time.perf_counter() - t}))
"""


def fresh_loads(
    server: Any, key: str, raw_key: str, state: dict[str, torch.Tensor], rounds: int
) -> dict[str, Any]:
    """What a restart waits on: ``asyncckpt.load`` of an S3 URL in a fresh process against
    s3transfer's ``download_file`` of the same raw bytes (``raw_key``, uploaded by the paired
    rounds) in a fresh process, alternating, ``rounds`` times; each ratio within its round.

    The paired rounds of :func:`_one_size` load in the process that saved, so their client,
    connections and imports are warm; here nothing is.
    """
    import subprocess
    import tempfile

    url = f"s3://{BUCKET}/{key}-fresh.ackpt"
    asyncckpt.save(state, url, storage_options=server.storage_options).result()
    opts = json.dumps(server.storage_options)
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        dst = os.path.join(tmp, "back.bin")
        for _ in range(rounds):
            cmd = [sys.executable, "-c", _FRESH_S3TRANSFER, server.endpoint_url, BUCKET, raw_key]
            theirs.append(_child_seconds([*cmd, dst], subprocess))
            ours.append(
                _child_seconds([sys.executable, "-c", _FRESH_ASYNCCKPT, url, opts], subprocess)
            )
    ratios = [t / o for t, o in zip(theirs, ours)]
    return {
        "s3transfer_s": statistics.median(theirs),
        "load_s": statistics.median(ours),
        "load_vs_s3transfer": statistics.median(ratios),
        "load_vs_s3transfer_spread": [min(ratios), max(ratios)],
        "rounds": {"s3transfer_s": theirs, "load_s": ours, "load_vs_s3transfer": ratios},
    }


def _child_seconds(cmd: list[str], subprocess: Any) -> float:
    # This checkout's asyncckpt, whatever the environment's editable install points at.
    here = os.path.dirname(os.path.dirname(os.path.abspath(asyncckpt.__file__)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode:
        raise RuntimeError(f"{cmd[3:5]} failed: {done.stderr[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["s"])


def measure(
    state: dict[str, torch.Tensor],
    prefix: str,
    opts: dict[str, Any],
    compression: str | None,
    repeats: int,
) -> dict[str, Any]:
    """Median seconds to save (durable) and to load ``state`` at ``prefix``; ``compression``
    None: the default."""
    saves, loads, stored = [], [], 0
    codec = {} if compression is None else {"compression": compression}
    for _ in range(repeats):
        url = f"{prefix}/{compression or 'default'}-{uuid.uuid4().hex[:8]}.ackpt"
        t0 = time.perf_counter()
        info = asyncckpt.save(state, url, storage_options=opts, **codec).result()
        saves.append(time.perf_counter() - t0)
        stored = info.stats.stored_bytes or 0
        t0 = time.perf_counter()
        got = asyncckpt.load(url, storage_options=opts)
        loads.append(time.perf_counter() - t0)
        if not same(got, state):
            raise AssertionError(f"{url}: loaded data differs from the saved state")
        del got
        storage, path = resolve(url, opts)
        storage.delete(path)  # keep the server's memory bounded
    return {
        "save_s": statistics.median(saves),
        "load_s": statistics.median(loads),
        "save_runs": saves,
        "load_runs": loads,
        "stored_bytes": stored,
        "ratio": stored / raw_bytes(state),
    }


def ratios(results: dict[str, dict[str, Any]], wire_s: float) -> dict[str, Any]:
    """Speed-ups (> 1 is faster) computed from figures of this run only."""
    out: dict[str, Any] = {}
    for link, res in results.items():
        r: dict[str, Any] = {}
        for parts in PARTS:
            a, b = res.get(f"none/{parts}"), res.get(f"zstd/{parts}")
            if a and b:
                r[f"compression_save_speedup_{parts}"] = a["save_s"] / b["save_s"]
                r[f"compression_load_speedup_{parts}"] = a["load_s"] / b["load_s"]
        for compression in COMPRESSIONS:
            a, b = res.get(f"{compression}/single"), res.get(f"{compression}/parallel")
            if a and b:
                r[f"parallel_save_speedup_{compression}"] = a["save_s"] / b["save_s"]
        if link == "slow":
            for name, entry in res.items():
                r[f"save_vs_wire_{name.replace('/', '_')}"] = entry["save_s"] / wire_s
                r[f"load_vs_wire_{name.replace('/', '_')}"] = entry["load_s"] / wire_s
        out[link] = r
    if results.get("moto") and results.get("slow"):
        out["slow_vs_moto_save"] = {
            name: results["slow"][name]["save_s"] / results["moto"][name]["save_s"]
            for name in results["slow"]
            if name in results["moto"]
        }
    return out


def closing_note(res: dict[str, Any]) -> str:
    """What compression and parallel parts buy on the slow link, in this run's figures."""
    cfg, slow = res["config"], res["ratios"].get("slow", {})
    zstd = res["results"].get("slow", {}).get("zstd/parallel")
    if not slow or not zstd or "parallel_save_speedup_none" not in slow:
        return "(no slow-link figures)"
    best = min(v for k, v in slow.items() if k.startswith("save_vs_wire"))
    note = (
        f"On a link of {cfg['latency_ms']:g} ms and {cfg['bandwidth_mbps']:g} MB/s per "
        f"request, {cfg['parallel']} parts in flight make saves "
        f"{slow['parallel_save_speedup_none']:.1f}x (uncompressed) and "
        f"{slow['parallel_save_speedup_zstd']:.1f}x (zstd) faster than one part at a time; "
        f"the fastest save takes {best:.2f}x the time of sending the raw state as one stream. "
        f"zstd stores {100 * zstd['ratio']:.0f}% of the bytes, which makes saves "
        f"{slow['compression_save_speedup_single']:.2f}x faster with one part in flight, "
        f"{slow['compression_save_speedup_parallel']:.2f}x with {cfg['parallel']}, and loads "
        f"{slow['compression_load_speedup_parallel']:.2f}x faster."
    )
    if slow["compression_save_speedup_parallel"] < 1.1:
        note += (
            f" With {cfg['parallel']} parts in flight the link is no longer the bottleneck: "
            f"compression ({cfg['threads']} threads) is, so it pays only when the link is."
        )
    return note


def print_table(res: dict[str, Any]) -> None:
    cfg = res["config"]
    print(
        f"\nstate: {cfg['raw_bytes'] / MIB:.0f} MiB {cfg['dtype']}, parts {cfg['part_mib']:g} MiB, "
        f"parallel = {cfg['parallel']}, slow link = {cfg['latency_ms']:g} ms + "
        f"{cfg['bandwidth_mbps']:g} MB/s per request, median of {cfg['repeats']}"
    )
    print(f"{'link':6s} {'config':16s} {'save s':>8s} {'load s':>8s} {'stored':>7s}")
    for link, entries in res["results"].items():
        for name, e in entries.items():
            print(
                f"{link:6s} {name:16s} {e['save_s']:8.3f} {e['load_s']:8.3f} "
                f"{100 * e['ratio']:6.1f}%"
            )
    print("\nspeed-ups (> 1 is faster), measured in this run:")
    for link, r in res["ratios"].items():
        for key, value in r.items():
            print(f"  {link:18s} {key:36s} {value:6.2f}")
    print("\n" + closing_note(res))


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, link in zip(axes, LINKS):
        entries = res["results"].get(link, {})
        names = list(entries)
        x = range(len(names))
        saves = [entries[n]["save_s"] for n in names]
        loads = [entries[n]["load_s"] for n in names]
        ax.bar([i - 0.2 for i in x], saves, width=0.4, label="save (until durable)")
        ax.bar([i + 0.2 for i in x], loads, width=0.4, label="load")
        ax.set_xticks(list(x), names, rotation=15)
        ax.set_ylabel("seconds")
        cfg = res["config"]
        backend = "in-process S3" if cfg["slow_backend"] == "memory" else "moto S3"
        title = (
            "moto S3 server, direct"
            if link == "moto"
            else f"{backend} behind {cfg['latency_ms']:g} ms + "
            f"{cfg['bandwidth_mbps']:g} MB/s per request"
        )
        ax.set_title(title)
        if link == "slow":
            wire = res["wire_time_s"]["slow"]
            ax.axhline(wire, color="gray", ls="--", lw=1, label="raw state as one stream")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"asyncckpt on S3: {res['config']['raw_bytes'] / MIB:.0f} MiB {res['config']['dtype']}, "
        f"{res['config']['part_mib']:g} MiB parts, single vs {res['config']['parallel']} in flight"
    )
    fig.tight_layout()
    savefig(fig, path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=256.0, help="state size (default 256)")
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds (default 2)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 24 MiB, 1 round")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="slow link: per request")
    ap.add_argument("--bandwidth-mbps", type=float, default=100.0, help="slow link: MB/s/request")
    ap.add_argument("--link-mbps", type=float, default=None, help="slow link: shared MB/s cap")
    ap.add_argument("--part-mib", type=float, default=8.0, help="multipart part size")
    ap.add_argument("--parallel", type=int, default=8, help="parts in flight when parallel")
    ap.add_argument("--dtype", choices=["mixed", "fp32", "bf16"], default="mixed")
    ap.add_argument(
        "--slow-backend",
        choices=["memory", "moto"],
        default="memory",
        help="what the slow link leads to: the in-process S3 API (default) or moto",
    )
    ap.add_argument(
        "--baseline-mib",
        type=float,
        nargs="+",
        default=[64.0, 128.0, 1024.0],
        help="sizes for the s3transfer comparison on SeaweedFS (moto: the smallest)",
    )
    ap.add_argument(
        "--baseline-repeats",
        type=int,
        default=3,
        help="paired rounds (s3transfer, then asyncckpt) per baseline size (default 3)",
    )
    ap.add_argument(
        "--baseline-only",
        action="store_true",
        help="only the comparison with s3transfer (and the peers), not the two links",
    )
    ap.add_argument("--no-peers", action="store_true", help="baseline without the S3 peers")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mib, args.repeats, args.part_mib = 24.0, 1, 5.0
        args.baseline_mib, args.baseline_repeats = [8.0, 16.0], 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench_storage.json")
    png_path = os.path.join(args.out, "bench_storage.png")
    res["note"] = closing_note(res)
    write_json(res, json_path)
    print_table(res)
    if res["results"].get("moto") or res["results"].get("slow"):
        plot(res, png_path)
    if res["errors"]:
        print("\nerrors:", json.dumps(res["errors"], indent=1))
    print(f"\nwrote {json_path} and {png_path}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
