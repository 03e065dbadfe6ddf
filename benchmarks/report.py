"""The benchmarks page (``docs/benchmarks.md``), rendered from a table of rows.

Every figure the page holds is one :class:`Row` of :data:`ROWS`: an id, what it measures,
where its value sits in a benchmark's JSON, the target and its direction, and the
incumbents measured in the same run. :func:`evaluate` reads the JSONs into a value and a
verdict for each row (met, not met, no target, not measured); :func:`render` writes the
page. The peers a user would pick instead are :data:`PEER_ROWS` over ``bench_peers.json``.
What the figures mean, and why they are what they are, is prose written by people in
``docs/benchmarks-notes.md``, which nothing here overwrites.

A figure is named by an *expression*: ``"file.json:key.key[name with dots].key"``, or two of
them joined by ``" / "`` (a ratio) or ``" - "`` (a difference). A key in brackets may hold
dots. ``"best_peer(file.json:key)"`` is the lowest ``key`` among the peers of a
``bench_peers`` JSON that snapshot (asyncckpt's own methods left out).
"""

from __future__ import annotations

import datetime
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Units: "x" (ratio), "" (fraction), " GB/s", " s", " ms", "MiB"; "B": bytes in the JSON,
#: shown (and compared with the target) in MiB.
Unit = str


@dataclass(frozen=True)
class Check:
    """One more condition a row must meet (e.g. two methods agreeing within 10 %)."""

    label: str
    expr: str
    op: str
    target: float | str  # a number, or an expression measured in the same run


@dataclass(frozen=True)
class Row:
    """One figure of the page: where it is, what it must reach, what it is compared with."""

    id: str
    text: str
    expr: str
    op: str | None = None  # "<=" or ">=" (the direction of "better"), None: no target
    target: float | None = None
    unit: Unit = "x"
    incumbents: tuple[tuple[str, str], ...] = ()
    checks: tuple[Check, ...] = ()
    spread: str | None = None  # expression of [min, max] over rounds
    issue: str = ""
    note: str = ""


#: The page's target table (issue numbers say where each target comes from).
ROWS: tuple[Row, ...] = (
    # --- issue 22: measured with the defaults a user gets -------------------------------
    Row(
        "train_extra_wall",
        "CPU training loop (8 × 1536² MLP + Adam, model + optimizer saved every 8 steps): "
        "extra wall time per save with `Checkpointer` (defaults) ÷ `torch.save`+fsync's, "
        "paired blocks",
        "bench_train.json:ratios.asyncckpt_extra_wall_x_torch_save_extra_wall",
        "<=",
        0.75,
        incumbents=(
            (
                "uncompressed",
                "bench_train.json:ratios.asyncckpt_none_extra_wall_x_torch_save_extra_wall",
            ),
            (
                "whole rounds",
                "bench_train.json:ratios.asyncckpt_extra_wall_rounds_x_torch_save_extra_wall",
            ),
        ),
        spread="bench_train.json:ratios.asyncckpt_extra_wall_x_torch_save_extra_wall_spread",
        issue="22",
    ),
    Row(
        "python_speed_default",
        "pure-Python thread's speed while a 512 MiB `asyncckpt.save` (defaults) writes ÷ idle",
        "bench_save.json:python_speed.asyncckpt_default_x_idle",
        ">=",
        0.95,
        incumbents=(
            ("torch.save in a thread", "bench_save.json:python_speed.torch_save_thread_x_idle"),
            ("DCP async_save", "bench_save.json:python_speed.dcp_async_save_x_idle"),
            ("zstd, threads", "bench_save.json:python_speed.asyncckpt_zstd_x_idle"),
            ("zstd, writer process", "bench_save.json:python_speed.asyncckpt_zstd_process_x_idle"),
        ),
        checks=(
            Check(
                "≥ torch.save in a thread, same run",
                "bench_save.json:python_speed.asyncckpt_default_x_idle",
                ">=",
                "bench_save.json:python_speed.torch_save_thread_x_idle",
            ),
        ),
        spread="bench_save.json:python_speed.asyncckpt_default_x_idle_spread",
        issue="22",
    ),
    Row(
        "first_save_plain",
        "first save of a fresh process, no `reserve`, no warm-up: `asyncckpt.save`'s stall ÷ "
        "copy floor (median over fresh processes; also `Checkpointer.save`, built just before)",
        "bench_save.json:first_save.plain_x_copy",
        "<=",
        3.0,
        incumbents=(
            ("Checkpointer.save", "bench_save.json:first_save.checkpointer_x_copy"),
            ("after reserve", "bench_save.json:first_save.reserve_x_copy"),
        ),
        checks=(
            Check(
                "Checkpointer.save ≤ 3.0×",
                "bench_save.json:first_save.checkpointer_x_copy",
                "<=",
                3.0,
            ),
        ),
        spread="bench_save.json:first_save.plain_x_copy_spread",
        issue="32",
    ),
    Row(
        "stall_defaults",
        "warm save with the defaults (`asyncckpt.save`; N(0,1) fp32, 1 GiB, `bench_peers.py`, "
        "a fresh process): stall ÷ copy floor",
        "bench_peers.json:methods.asyncckpt.stall_x_copy",
        "<=",
        1.5,
        incumbents=(("best peer that snapshots", "best_peer(bench_peers.json:stall_x_copy)"),),
        spread="bench_peers.json:methods.asyncckpt.stall_x_copy_spread",
        issue="32",
    ),
    *(
        Row(
            f"durable_vs_peers_{state}",
            "time to durable with the defaults (`asyncckpt.save`) ÷ the best peer's that "
            f"snapshots, each ÷ `torch.save`+fsync in its own fresh process; {what}, 1 GiB "
            "(`bench_peers.py`; spread: asyncckpt's rounds)",
            f"{name}:methods.asyncckpt.durable_x_torch_save / "
            f"best_peer({name}:durable_x_torch_save)",
            "<=",
            1.0,
            incumbents=(
                ("asyncckpt.save ÷ torch.save", f"{name}:methods.asyncckpt.durable_x_torch_save"),
                ("best peer ÷ torch.save", f"best_peer({name}:durable_x_torch_save)"),
            ),
            spread=f"{name}:methods.asyncckpt.durable_x_torch_save_spread / "
            f"best_peer({name}:durable_x_torch_save)",
            issue="32",
        )
        for state, name, what in (
            ("normal", "bench_peers.json", "N(0,1) fp32"),
            ("weights", "bench_peers_weights.json", "MiniLM weights + Adam moments"),
        )
    ),
    Row(
        "auto_large",
        'durable at 1 GiB, `compression="auto"` ÷ the better of zstd and none (each ÷ '
        "`torch.save`+fsync, paired rounds, writer threads)",
        "bench_save.json:durable_paired.auto_x_best",
        "<=",
        1.10,
        spread="bench_save.json:durable_paired.auto_x_best_spread",
        issue="32",
    ),
    Row(
        "load_defaults",
        "load of what `asyncckpt.save` wrote with the defaults ÷ `torch.load(weights_only=True)`"
        " (N(0,1) fp32, 1 GiB, `bench_peers.py`, paired rounds)",
        "bench_peers.json:methods.asyncckpt.load_x_torch_load",
        "<=",
        0.8,
        incumbents=(("best peer that snapshots", "best_peer(bench_peers.json:load_x_torch_load)"),),
        spread="bench_peers.json:methods.asyncckpt.load_x_torch_load_spread",
        issue="32",
    ),
    Row(
        "durable_paired_zstd",
        "durable ÷ `torch.save`+fsync, zstd, N(0,1) fp32, 1 GiB, settled disk, paired rounds "
        "(asyncckpt.save; Checkpointer.save the second method)",
        "bench_save.json:durable_paired.save_zstd_x_torch_save",
        "<=",
        0.90,
        incumbents=(
            ("Checkpointer.save", "bench_save.json:durable_paired.checkpointer_zstd_x_torch_save"),
            ('compression="auto"', "bench_save.json:durable_paired.save_auto_x_torch_save"),
            (
                "writeback_mib=0",
                "bench_save.json:durable_paired.save_zstd_no_writeback_x_torch_save",
            ),
        ),
        checks=(
            Check(
                "the two methods agree within 10 %",
                "bench_save.json:durable_paired.agreement_zstd",
                "<=",
                0.10,
            ),
        ),
        spread="bench_save.json:durable_paired.save_zstd_x_torch_save_spread",
        issue="22",
    ),
    Row(
        "dcp_load",
        "FSDP2, 2 gloo ranks: `dcp.load` through asyncckpt.dcp.Reader ÷ FileSystemReader "
        "(slowest rank; checksums verified)",
        "bench_sharded.json:fsdp.methods[dcp.save via asyncckpt.dcp].load_s_max / "
        "bench_sharded.json:fsdp.methods[dcp.save via FileSystemWriter].load_s_max",
        "<=",
        1.3,
        issue="22",
    ),
    *(
        Row(
            f"s3_load_fresh_{mib}",
            f"S3 load on SeaweedFS, {mib} MiB, what a restart waits on: `asyncckpt.load` in a "
            "fresh process (torch imported) ÷ `import boto3` + client + download_file in one",
            f"bench_storage.json:baseline.servers.seaweedfs.sizes[{mib}].fresh_load_vs_s3transfer",
            ">=",
            target,
            spread=f"bench_storage.json:baseline.servers.seaweedfs.sizes[{mib}]"
            ".fresh_load_vs_s3transfer_spread",
            issue="32",
        )
        for mib, target in ((128, 1.0), (1024, 1.5))
    ),
    *(
        Row(
            f"s3_load_{mib}",
            f"S3 load on SeaweedFS, {mib} MiB, warm process (client, connections and imports "
            "of the save before): throughput ÷ boto3 s3transfer download_file (defaults)",
            f"bench_storage.json:baseline.servers.seaweedfs.sizes[{mib}].load_vs_s3transfer",
            ">=" if target else None,
            target,
            spread=f"bench_storage.json:baseline.servers.seaweedfs.sizes[{mib}]"
            ".load_vs_s3transfer_spread",
            incumbents=(
                (
                    "s3torchconnector DCP",
                    f"bench_storage.json:baseline.servers.seaweedfs.sizes[{mib}]"
                    ".peers[s3torchconnector DCP].load_vs_s3transfer",
                ),
                (
                    "tensorizer S3 stream",
                    f"bench_storage.json:baseline.servers.seaweedfs.sizes[{mib}]"
                    ".peers[tensorizer S3 stream].load_vs_s3transfer",
                ),
            ),
            issue="32",
        )
        for mib, target in ((64, None), (128, 1.0), (1024, 1.5))
    ),
    *(
        Row(
            f"s3_save_{mib}",
            f"S3 save on SeaweedFS, {mib} MiB: throughput ÷ boto3 s3transfer upload_file "
            "(defaults on both sides)",
            f"bench_storage.json:baseline.servers.seaweedfs.sizes[{mib}].save_vs_s3transfer",
            None,
            None,
            incumbents=(
                (
                    "s3torchconnector DCP",
                    f"bench_storage.json:baseline.servers.seaweedfs.sizes[{mib}]"
                    ".peers[s3torchconnector DCP].save_vs_s3transfer",
                ),
                (
                    "tensorizer S3 stream",
                    f"bench_storage.json:baseline.servers.seaweedfs.sizes[{mib}]"
                    ".peers[tensorizer S3 stream].save_vs_s3transfer",
                ),
            ),
            issue="22",
        )
        for mib in (64, 128, 1024)
    ),
    Row(
        "auto_small",
        'durable at 128 MiB, `compression="auto"` ÷ the better of zstd and none (each ÷ '
        "`torch.save`+fsync, paired rounds)",
        "bench_save.json:auto_small.auto_x_best",
        "<=",
        1.10,
        incumbents=(
            ("auto ÷ torch.save", "bench_save.json:auto_small.save_auto_x_torch_save"),
            ("zstd ÷ torch.save", "bench_save.json:auto_small.save_zstd_x_torch_save"),
            ("none ÷ torch.save", "bench_save.json:auto_small.save_none_x_torch_save"),
        ),
        spread="bench_save.json:auto_small.auto_x_best_spread",
        issue="22",
    ),
    Row(
        "dropin_marker_stall",
        "the drop-in save marker's stall on local disk (`benchmarks/bench_dropin.py`)",
        "bench_dropin.json:targets.local.stall_added_ms",
        "<=",
        1.0,
        unit=" ms",
        incumbents=(("SeaweedFS", "bench_dropin.json:targets.seaweedfs.stall_added_ms"),),
        issue="22",
    ),
    # --- issue 21: loading only what you need -----------------------------------------
    Row(
        "partial_load_bytes",
        'model-only load (`keys=["model"]`) of a model+Adam checkpoint: bytes read ÷ a full '
        "load's (`benchmarks/bench_partial.py`; the first incumbent is the model's share of "
        "the tensor bytes, what reading only its chunks comes to)",
        "bench_partial.json:ratios.bytes_read_fraction",
        unit="",
        incumbents=(
            ("model's share", "bench_partial.json:model_share"),
            ("time ÷ full load's", "bench_partial.json:ratios.time_fraction"),
        ),
        issue="21",
    ),
    # --- issue 5: stall, durable, load, compression, memory ----------------------------
    *(
        Row(
            f"stall_{c}",
            f"time `save` blocks the caller ÷ copy into preallocated buffers (compression {c}, "
            "warm arena)",
            f"bench_save.json:save.asyncckpt_{c}.blocked_x_copy",
            "<=",
            1.5,
            incumbents=(
                ("DCP async_save", "bench_save.json:save.dcp_async_save.blocked_x_copy"),
                (
                    "DCP async_save, reused stager",
                    "bench_save.json:save.dcp_async_save_reused_stager.blocked_x_copy",
                ),
                ("torch.save", "bench_save.json:save.torch_save.blocked_x_copy"),
            ),
            issue="5",
        )
        for c in ("zstd", "none")
    ),
    *(
        Row(
            f"durable_{label}",
            f"async save until durable ÷ `torch.save`+fsync, {label} (in-round medians)",
            f"bench_save.json:save.asyncckpt_{c}.durable_s / "
            "bench_save.json:save.torch_save.durable_s",
            "<=",
            target,
            incumbents=(
                (
                    "DCP async_save",
                    "bench_save.json:save.dcp_async_save.durable_s / "
                    "bench_save.json:save.torch_save.durable_s",
                ),
            ),
            issue="5",
        )
        for c, label, target in (("none", "uncompressed", 1.0), ("zstd", "compressed", 1.2))
    ),
    *(
        Row(
            f"load_{label}",
            f"`load` with checksums ÷ `torch.load(weights_only=True)`, {label}",
            f"bench_save.json:load.asyncckpt_load_{c}.load_x_torch_load",
            "<=",
            target,
            incumbents=(("DCP load", "bench_save.json:load.dcp_load.load_x_torch_load"),),
            issue="5",
        )
        for c, label, target in (("none", "uncompressed", 1.0), ("zstd", "compressed", 1.5))
    ),
    *(
        Row(
            f"stored_{dt}",
            f'stored ÷ raw, all-MiniLM-L6-v2 weights, {dt}, compression="zstd"',
            f"bench_codec.json:results.{dt}.asyncckpt_file_fraction",
            "<=",
            target,
            unit="",
            incumbents=(
                ("zstd-1, one stream", f"bench_codec.json:results.{dt}.zstd1_stream_fraction"),
                ("zstd-1, same chunks", f"bench_codec.json:results.{dt}.zstd1_chunked_fraction"),
                ("ZipNN", f"bench_codec.json:results.{dt}.zipnn_fraction"),
            ),
            issue="5",
        )
        for dt, target in (("fp32", 0.83), ("bf16", 0.69))
    ),
    Row(
        "compression_gb_s",
        "compression throughput on 2 threads (MiniLM fp32, GB/s of raw data)",
        "bench_codec.json:results.fp32.throughput_gb_s.asyncckpt_encode",
        ">=",
        0.7,
        unit=" GB/s",
        incumbents=(
            ("zstd-1, same pool", "bench_codec.json:results.fp32.throughput_gb_s.zstd1_pool"),
            (
                "zstd-1, own threads",
                "bench_codec.json:results.fp32.throughput_gb_s.zstd1_native_mt",
            ),
        ),
        issue="5",
    ),
    Row(
        "memory_extra_peak",
        "extra peak host memory during an async save (defaults), above the state (MiB)",
        "bench_memory.json:results.asyncckpt.extra_peak_minus_state_bytes",
        "<=",
        256.0,
        unit="B",
        incumbents=(
            (
                "DCP async_save, extra peak",
                "bench_memory.json:results.dcp_async_save.extra_peak_bytes",
            ),
            ("torch.save, extra peak", "bench_memory.json:results.torch_save.extra_peak_bytes"),
        ),
        issue="5",
    ),
    # --- issue 12 -----------------------------------------------------------------------
    Row(
        "durable_paired_none",
        "durable ÷ `torch.save`+fsync, uncompressed, 1 GiB, settled disk, paired rounds",
        "bench_save.json:durable_paired.save_none_x_torch_save",
        "<=",
        0.85,
        incumbents=(
            ("Checkpointer.save", "bench_save.json:durable_paired.checkpointer_none_x_torch_save"),
            (
                "writeback_mib=0",
                "bench_save.json:durable_paired.save_none_no_writeback_x_torch_save",
            ),
        ),
        spread="bench_save.json:durable_paired.save_none_x_torch_save_spread",
        issue="12",
    ),
    Row(
        "durable_real_state",
        "durable ÷ `torch.save`+fsync, zstd, MiniLM weights + Adam moments tiled to ≥ 1 GiB, "
        "paired rounds",
        "bench_save.json:real_state.save_zstd_x_torch_save",
        "<=",
        0.90,
        incumbents=(
            ("writeback_mib=0", "bench_save.json:real_state.save_zstd_no_writeback_x_torch_save"),
        ),
        spread="bench_save.json:real_state.save_zstd_x_torch_save_spread",
        issue="12",
    ),
    Row(
        "first_save_reserve",
        "first save of a fresh process after `asyncckpt.reserve(state)`: stall ÷ copy floor",
        "bench_save.json:first_save.reserve_x_copy",
        "<=",
        1.5,
        spread="bench_save.json:first_save.reserve_x_copy_spread",
        issue="12",
    ),
    Row(
        "train_overlapped",
        "CPU training loop: median step while a write is in flight ÷ median step without "
        "checkpointing",
        "bench_train.json:ratios.asyncckpt_overlapped_median_x_none",
        "<=",
        1.5,
        incumbents=(
            ("uncompressed", "bench_train.json:ratios.asyncckpt_none_overlapped_median_x_none"),
        ),
        issue="12",
    ),
    Row(
        "train_mean_overhead",
        "CPU training loop: (mean step ÷ none − 1) of `Checkpointer` over torch.save+fsync's",
        "bench_train.json:ratios.asyncckpt_overhead_x_torch_save_overhead",
        issue="12",
        note="no target since issue 22 (the wall-time row above replaces it)",
    ),
    Row(
        "train_cpu_per_save",
        "CPU seconds of one durable `Checkpointer.save` (defaults) of the training state, this "
        "process and the writer process, nothing else running ÷ `torch.save`+fsync's",
        "bench_train.json:ratios.asyncckpt_cpu_per_save_x_torch_save",
        incumbents=(
            ("uncompressed", "bench_train.json:ratios.asyncckpt_none_cpu_per_save_x_torch_save"),
        ),
        issue="20",
        note="no target: on a CPU the loop keeps busy, a background write costs training at "
        "least this; it hardly moves with the machine, so it compares code before and after",
    ),
    # --- issue 11: sharded ---------------------------------------------------------------
    Row(
        "sharded_stall",
        "FSDP2, 2 gloo ranks: time `Checkpointer.save` blocks a rank ÷ that rank's copy of its "
        "own shards (slowest rank, warm arena)",
        "bench_sharded.json:fsdp.stall_over_copy_max",
        "<=",
        1.5,
        issue="11",
    ),
    Row(
        "sharded_memory",
        "FSDP2, 2 gloo ranks: extra peak host memory of a rank during `Checkpointer.save`, "
        "above its own shards (MiB; worst rank)",
        "bench_sharded.json:fsdp.extra_rss_over_own_mib_max",
        "<=",
        256.0,
        unit="MiB",
        issue="11",
    ),
    Row(
        "sharded_scaling",
        "throttled-link simulation: aggregate write throughput, 8 ranks ÷ 1 rank",
        "bench_sharded.json:sim.throughput_8_over_1",
        ">=",
        6.0,
        issue="11",
    ),
    Row(
        "dcp_stored",
        "FSDP2: bytes stored by `dcp.save` via asyncckpt.dcp ÷ via FileSystemWriter",
        "bench_sharded.json:fsdp.methods[dcp.save via asyncckpt.dcp].stored_bytes / "
        "bench_sharded.json:fsdp.methods[dcp.save via FileSystemWriter].stored_bytes",
        issue="11",
    ),
    # --- tunables and extras (no targets) -------------------------------------------------
    Row(
        "s3_save_seaweedfs",
        "S3 save on SeaweedFS (smallest size): throughput ÷ boto3 s3transfer upload_file",
        "bench_storage.json:baseline.servers.seaweedfs.save_vs_s3transfer",
        ">=",
        1.0,
        issue="12",
    ),
    Row(
        "memory_growth",
        "host memory growth over 50 consecutive saves (MiB; flat means no leak)",
        "bench_memory.json:results[asyncckpt_x50].growth_after_first_save_bytes",
        unit="B",
    ),
)


# ----------------------------------------------------------------------------- evaluation


_KEY = re.compile(r"\[([^\]]+)\]|([^.\[\]]+)")


def lookup(data: dict[str, Any], ref: str) -> float | list[float] | None:
    """The number (or ``[min, max]`` pair) at ``"file.json:key.key[key.with.dots]"``.

    Example:
        >>> lookup({"a.json": {"x": {"y.z": [1, 2]}}}, "a.json:x[y.z]")
        [1.0, 2.0]
        >>> lookup({"a.json": {"x": 2}}, "a.json:missing") is None
        True
    """
    name, _, path = ref.strip().partition(":")
    node: Any = data.get(name)
    for bracketed, plain in _KEY.findall(path):
        key = bracketed or plain
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    if isinstance(node, bool):
        return None
    if isinstance(node, (int, float)):
        return float(node) if math.isfinite(node) else None
    if isinstance(node, list) and len(node) == 2 and all(isinstance(x, (int, float)) for x in node):
        return [float(x) for x in node]
    return None


def value_of(data: dict[str, Any], expr: str) -> float | None:
    """A number from an expression: one reference, or two joined by " / " or " - "."""
    for op in (" / ", " - "):
        if op in expr:
            a, b = (value_of(data, part) for part in expr.split(op, 1))
            if a is None or b is None or (op == " / " and b == 0):
                return None
            return a / b if op == " / " else a - b
    peer = _BEST_PEER.fullmatch(expr.strip())
    if peer is not None:
        best = best_peer(data.get(peer["file"]) or {}, peer["key"])
        return None if best is None else best[1]
    found = lookup(data, expr)
    return found if isinstance(found, float) else None


def spread_of(data: dict[str, Any], expr: str) -> list[float] | None:
    """The ``[min, max]`` pair at ``expr``, or such a pair ÷ a number (``"pair / number"``).

    Example:
        >>> spread_of({"a.json": {"s": [1, 2], "n": 4}}, "a.json:s / a.json:n")
        [0.25, 0.5]
    """
    pair_expr, _, divisor = expr.partition(" / ")
    pair = lookup(data, pair_expr)
    if not isinstance(pair, list):
        return None
    if not divisor:
        return pair
    by = value_of(data, divisor)
    return None if not by else [pair[0] / by, pair[1] / by]


_BEST_PEER = re.compile(r"best_peer\((?P<file>[^:()]+):(?P<key>\w+)\)")


def best_peer(peers: dict[str, Any], key: str) -> tuple[str, float] | None:
    """The peer with the lowest ``key`` among those of ``peers`` (a ``bench_peers`` JSON)
    that ran and snapshot, asyncckpt's own methods left out: its label and value.

    Example:
        >>> methods = {
        ...     "asyncckpt": {"family": "asyncckpt", "durable": 0.5, "snapshot": True},
        ...     "a": {"label": "A", "family": "a", "durable": 1.2, "snapshot": True},
        ...     "b": {"label": "B", "family": "b", "durable": 0.9, "snapshot": False},
        ... }
        >>> best_peer({"methods": methods}, "durable")
        ('A', 1.2)
    """
    found = [
        (r.get("label", m), float(r[key]))
        for m, r in (peers.get("methods") or {}).items()
        if not str(r.get("family", m)).startswith("asyncckpt")
        and "error" not in r
        and r.get("snapshot") is True
        and isinstance(r.get(key), (int, float))
    ]
    return min(found, key=lambda f: f[1], default=None)


def compare(value: float | None, op: str | None, target: float | None) -> bool | None:
    """Whether ``value`` meets ``op target``; None if either is unknown."""
    if value is None or op is None or target is None:
        return None
    return value <= target if op == "<=" else value >= target


def evaluate(row: Row, data: dict[str, Any]) -> dict[str, Any]:
    """A row's value, its checks and verdict: "met", "not met", "no target", "not measured"."""
    scale = 1.0 / (1 << 20) if row.unit == "B" else 1.0  # bytes, shown in MiB

    def number(expr: str) -> float | None:
        v = value_of(data, expr)
        return None if v is None else v * scale

    value = number(row.expr)
    met = compare(value, row.op, row.target)
    checks = []
    for check in row.checks:
        got = value_of(data, check.expr)
        target = (
            float(check.target)
            if isinstance(check.target, (int, float))
            else value_of(data, check.target)
        )
        ok = compare(got, check.op, target)
        checks.append({"label": check.label, "value": got, "target": target, "met": ok})
        if met is not None:
            met = None if ok is None else (met and ok)
    if row.op is None:
        verdict = "no target" if value is not None else "not measured"
    elif met is None:
        verdict = "not measured"
    else:
        verdict = "met" if met else "not met"
    spread = spread_of(data, row.spread) if row.spread else None
    return {
        "id": row.id,
        "text": row.text,
        "issue": row.issue,
        "source": row.expr,
        "value": value,
        "op": row.op,
        "target": row.target,
        "unit": "MiB" if row.unit == "B" else row.unit,
        "met": met,
        "verdict": verdict,
        "checks": checks,
        "spread": spread if isinstance(spread, list) else None,
        "incumbents": [{"label": label, "value": number(expr)} for label, expr in row.incumbents],
        "note": row.note,
    }


def evaluate_all(data: dict[str, Any], rows: tuple[Row, ...] = ROWS) -> list[dict[str, Any]]:
    """Every row of the table, evaluated against the benchmarks' JSONs."""
    return [evaluate(row, data) for row in rows]


# ----------------------------------------------------------------------------- formatting


def fmt(v: float | None, unit: Unit) -> str:
    """A value in its unit: "1.23×", "0.8218", "2.20 GB/s", "+13.4 MiB", "0.40 ms".

    Example:
        >>> fmt(1.234, "x"), fmt(100.0, "MiB"), fmt(None, "x")
        ('1.23×', '+100.0 MiB', '–')
    """
    if v is None:
        return "–"
    if unit == "x":
        return f"{v:.2f}×"
    if unit == "":
        return f"{v:.4f}"
    if unit == "MiB":
        return f"{v:+.1f} MiB"
    return f"{v:.2f}{unit}"


def target_text(r: dict[str, Any]) -> str:
    if r["op"] is None:
        return "–"
    op = "≤" if r["op"] == "<=" else "≥"
    if r["unit"] == "MiB":
        return f"{op} +{r['target']:.0f} MiB"
    return f"{op} {fmt(r['target'], r['unit'])}"


def verdict_text(r: dict[str, Any]) -> str:
    """**yes** / **no** with the margin, or the verdict's words."""
    if r["verdict"] not in ("met", "not met"):
        return r["verdict"]
    value, target = r["value"], r["target"]
    pct = 100 * abs(value - target) / abs(target) if target else 0.0
    margin = f"{pct:.2f} %" if pct < 1 else f"{pct:.1f} %"
    if r["verdict"] == "met":
        return f"**yes** (by {margin})"
    failed = [c["label"] for c in r["checks"] if c["met"] is False]
    main_ok = compare(r["value"], r["op"], r["target"])
    return "**no** (" + (f"off by {margin}" if not main_ok else "; ".join(failed)) + ")"


def _row_line(r: dict[str, Any]) -> str:
    notes = []
    if r["spread"]:
        notes.append(f"spread {fmt(r['spread'][0], r['unit'])}–{fmt(r['spread'][1], r['unit'])}")
    for c in r["checks"]:
        mark = {True: "yes", False: "no", None: "not measured"}[c["met"]]
        notes.append(f"{c['label']}: {mark}")
    if r["note"]:
        notes.append(r["note"])
    inc = "; ".join(
        f"{i['label']} {fmt(i['value'], r['unit'])}"
        for i in r["incumbents"]
        if i["value"] is not None
    )
    note = f" ({'; '.join(notes)})" if notes else ""
    issue = r["issue"] or "–"
    return (
        f"| {r['text']}{note} | {issue} | {fmt(r['value'], r['unit'])} | {target_text(r)} | "
        f"{verdict_text(r)} | {inc or '–'} |"
    )


# ----------------------------------------------------------------------------- peers


#: The peers' rows: (id, what, key in bench_peers.json's per-method record, unit, better).
PEER_ROWS: tuple[tuple[str, str, str, Unit, str], ...] = (
    ("stall", "stall ÷ copy floor (warm)", "stall_x_copy", "x", "low"),
    ("durable", "durable ÷ torch.save+fsync", "durable_x_torch_save", "x", "low"),
    ("load", "load ÷ torch.load", "load_x_torch_load", "x", "low"),
    ("stored", "stored ÷ raw", "stored_fraction", "", "low"),
    ("memory", "peak extra memory (process tree, PSS) ÷ state", "extra_peak_x_state", "x", "low"),
    (
        "python_speed",
        "pure-Python speed during the write ÷ idle",
        "python_speed_x_idle",
        "x",
        "high",
    ),
    (
        "train",
        "training-loop extra wall time ÷ torch.save+fsync's",
        "train_extra_x_torch_save",
        "x",
        "low",
    ),
    (
        "first_save",
        "first save of a fresh process: stall ÷ copy floor",
        "first_save_x_copy",
        "x",
        "low",
    ),
)

#: How each method writes, the reason a row's winner wins (written by people).
PEER_MECHANISM: dict[str, str] = {
    "asyncckpt": "copies into a reused shared arena; a long-lived writer process encodes and "
    "writes, outside the caller's GIL (the default)",
    "asyncckpt_threads": "copies into a reused arena, then encodes and writes on niced "
    "threads of the calling process (writer_processes=0)",
    # Results from before the extra row measured threads: the default set explicitly.
    "asyncckpt_process": "measures the defaults again (a writer process), a second sample",
    "dcp_async_save": "stages into a reused shared-memory stager, a checkpoint process writes",
    "torchsnapshot": "copies in its own pipeline (large CPU tensors are not copied), writes "
    "on threads",
    "nvrx": "hands the tensors to a persistent worker process (CPU tensors move to shared "
    "memory, not copied), which runs torch.save",
    "tensorizer": "serializes synchronously in the caller (no background write)",
    "torch_save_thread": "runs torch.save + fsync on a plain thread (no copy)",
}


def peer_winners(peers: dict[str, Any]) -> list[dict[str, Any]]:
    """Per peers row: every method's value, the winner among the methods that snapshot."""
    methods = peers.get("methods") or {}
    out = []
    for rid, text, key, unit, better in PEER_ROWS:
        values = {m: r.get(key) for m, r in methods.items() if "error" not in r}
        valid = {
            m: v
            for m, v in values.items()
            if isinstance(v, (int, float)) and methods[m].get("snapshot") is not False
        }
        ranked = sorted(valid, key=lambda m: valid[m], reverse=better == "high")
        out.append(
            {
                "id": rid,
                "text": text,
                "key": key,
                "unit": unit,
                "better": better,
                "values": values,
                "winner": ranked[0] if ranked else None,
                "runner_up": ranked[1] if len(ranked) > 1 else None,
            }
        )
    return out


def _peer_section(peers: dict[str, Any] | None) -> list[str]:
    lines = ["", "## Peers a user would pick instead (issue 22)", ""]
    if not peers:
        return [*lines, "Not measured in this run (`benchmarks/bench_peers.py`).", ""]
    methods = peers.get("methods") or {}
    cfg = peers.get("config") or {}
    lines += [
        f"`bench_peers.py`: a {cfg.get('state_mib', '?')} MiB N(0,1) fp32 state, each method in "
        f"a fresh process, timed saves: {cfg.get('repeats', '?')}, on local disk (fsynced); "
        "the training row runs the 8 × 1536² MLP loop of the target table. *snapshot*: a state "
        "changed right after the call did not reach the file. Winners are picked among the "
        "methods that snapshot.",
        "",
        "| method | version | snapshot | " + " | ".join(t for _, t, _, _, _ in PEER_ROWS) + " |",
        "|---|---|---|" + "---|" * len(PEER_ROWS),
    ]
    for name, r in methods.items():
        if "error" in r:
            lines.append(
                f"| {r.get('label', name)} | {r.get('version', '–')} | – | does not run here: "
                f"`{str(r['error'])[:160]}` |" + " |" * (len(PEER_ROWS) - 1)
            )
            continue
        snap = {True: "yes", False: "**no**", None: "–"}[r.get("snapshot")]
        cells = [fmt(r.get(key), unit) for _, _, key, unit, _ in PEER_ROWS]
        lines.append(
            f"| {r.get('label', name)} | {r.get('version', '–')} | {snap} | "
            + " | ".join(cells)
            + " |"
        )
    lines += ["", "Who wins each row, and why:", ""]
    for w in peer_winners(peers):
        if w["winner"] is None:
            lines.append(f"- {w['text']}: not measured.")
            continue
        m, second = w["winner"], w["runner_up"]
        label = methods[m].get("label", m)
        ahead = (
            f", ahead of {methods[second].get('label', second)} "
            f"({fmt(w['values'][second], w['unit'])})"
            if second
            else ""
        )
        lines.append(
            f"- {w['text']}: **{label}** ({fmt(w['values'][m], w['unit'])}{ahead}): it "
            f"{PEER_MECHANISM.get(methods[m].get('family', m), 'is measured here')}."
        )
    torn = [methods[m].get("label", m) for m in methods if methods[m].get("snapshot") is False]
    if torn:
        lines += [
            "",
            "Not snapshots (a change right after the call reached the file): "
            + ", ".join(torn)
            + ". Their stall and memory figures are not comparable: they skip the copy.",
        ]
    return [*lines, ""]


# ----------------------------------------------------------------------------- the page


def _machine_lines(machine: dict[str, Any], fs: str | None) -> list[str]:
    mem = machine.get("memory_bytes")
    return [
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {machine.get('cpu')}, {machine.get('cpu_count')} cores |",
        f"| memory | {mem / (1 << 30):.1f} GiB |" if mem else "| memory | unknown |",
        f"| GPU | {machine.get('gpu', 'none')} |",
        f"| OS | {machine.get('platform')} |",
        f"| software | Python {machine.get('python')}, torch {machine.get('torch')}, numpy "
        f"{machine.get('numpy')}, zstandard {machine.get('zstandard')}, zlib-ng "
        f"{machine.get('zlib_ng')}, asyncckpt {machine.get('asyncckpt')} |",
        f"| checkpoint files | {fs or '?'} (temp dir), fsynced |",
        f"| `ASYNCCKPT_*` set | {machine.get('asyncckpt_env') or 'none'} |",
        "",
    ]


def _runs_lines(runs: list[dict[str, Any]]) -> list[str]:
    def la(v: list[float] | None) -> str:
        return " / ".join(f"{x:.2f}" for x in v) if v else "–"

    lines = [
        "| benchmark | wall s | load average before (1/5/15 min) | after | status |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['name']} | {r.get('wall_s', '–')} | {la(r.get('loadavg_before'))} | "
            f"{la(r.get('loadavg_after'))} | {r['status']} |"
        )
    return lines


def _gpu_lines(gpu: dict[str, Any] | None, image_dir: str) -> list[str]:
    lines = ["", "## GPU", ""]
    if not gpu or (gpu.get("config") or {}).get("device") == "cpu":
        return [
            *lines,
            "Not measured in this run (no CUDA device here). `bash scripts/gpu_check.sh` on a "
            "GPU machine writes `bench_gpu.json` and `.png`; put them beside the other results "
            "and run `python benchmarks/run_all.py --skip ...` to show them here.",
        ]
    summary = gpu.get("summary") or {}
    lines += [
        f"`bench_gpu.py` on {(gpu.get('machine') or {}).get('gpu', '?')} "
        f"(measured {(gpu.get('config') or {}).get('date', '?')}).",
        "",
        "| figure | value | target | met? |",
        "|---|---|---|---|",
    ]
    for key, item in summary.items():
        r = {
            "value": item.get("value"),
            "op": item.get("op"),
            "target": item.get("target"),
            "unit": item.get("unit", "x"),
            "checks": [],
        }
        r["met"] = compare(r["value"], r["op"], r["target"])
        r["verdict"] = (
            ("no target" if r["value"] is not None else "not measured")
            if r["op"] is None
            else ("not measured" if r["met"] is None else ("met" if r["met"] else "not met"))
        )
        lines.append(
            f"| {item.get('text', key)} | {fmt(r['value'], r['unit'])} | {target_text(r)} | "
            f"{verdict_text(r)} |"
        )
    return [*lines, "", f"![gpu]({image_dir}/bench_gpu.png)"]


def render(
    rows: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    data: dict[str, Any],
    machine: dict[str, Any],
    *,
    quick: bool,
    image_dir: str,
    plots: list[tuple[str, str]],
) -> str:
    """The benchmarks page: machine, runs, the target table, the peers, the GPU, the plots."""
    now = machine.get("measured_at") or datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC"
    )
    code = machine.get("code_at_start", "?")
    if machine.get("code_at_end") and machine["code_at_end"] != code:
        code += f"` (the code changed during the run: `{machine['code_at_end']}` at the end)"
    else:
        code += "`"
    counts = {v: sum(1 for r in rows if r["verdict"] == v) for v in ("met", "not met")}
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by benchmarks/run_all.py (`make bench`) from the rows in "
        "benchmarks/report.py; edits here are overwritten. What the figures mean: "
        "benchmarks-notes.md. -->",
        "",
        f"Measured {now} on commit `{code} by `make bench` "
        f"(`benchmarks/run_all.py{' --quick' if quick else ''}`). "
        f"{counts['met']} of {counts['met'] + counts['not met']} measured targets met. "
        "What the figures mean, how they are measured and why they are what they are: "
        "[benchmarks-notes.md](benchmarks-notes.md).",
        "",
    ]
    reused = [r["name"] for r in runs if r.get("status") == "reused"]
    if reused:
        lines += [
            f"**Reused from an earlier run, not measured on the commit above: "
            f"{', '.join(reused)}.**",
            "",
        ]
    if quick:
        lines += [
            "**Quick mode: small states and single repeats, a smoke test. These figures are "
            "not the ones to compare against the targets.**",
            "",
        ]
    fs = (data.get("bench_save.json") or {}).get("machine", {}).get("temp_dir_filesystem")
    lines += _machine_lines(machine, fs)
    lines += _runs_lines(runs)
    lines += [
        "",
        "## Targets",
        "",
        "Ratios measured against baselines in the same run; lower is better unless the "
        "target says ≥. *Issue*: where the target comes from.",
        "",
        "| figure | issue | asyncckpt | target | met? | incumbents, same run |",
        "|---|---|---|---|---|---|",
        *(_row_line(r) for r in rows),
    ]
    lines += _peer_section(data.get("bench_peers.json"))
    lines += _gpu_lines(data.get("bench_gpu.json"), image_dir)
    lines += ["", "## Plots", ""]
    for png, title in plots:
        lines += [f"### {title}", "", f"![{png}]({image_dir}/{png})", ""]
    lines += [
        "JSON with every raw timing sits beside each plot; `run_all.json` holds the rows "
        "above, each with the JSON path it was read from.",
        "",
    ]
    return "\n".join(lines)


def load_results(out: Path, names: list[str]) -> dict[str, Any]:
    """``{file name: parsed JSON}`` for every result file under ``out`` that parses."""
    data: dict[str, Any] = {}
    for name in names:
        try:
            data[name] = json.loads((out / name).read_text())
        except (OSError, ValueError):
            continue
    return data
