"""``asyncckpt ls ROOT``: the versions under a checkpoint root."""

from __future__ import annotations

import argparse
from typing import Any

from asyncckpt._format.container import MAGIC
from asyncckpt._storage import is_temp_name
from asyncckpt._versions.paths import checkpoints_below, is_root
from asyncckpt._versions.protocol import latest_step, read_version_file, step_dirs
from asyncckpt.cli.common import (
    EXIT_OK,
    CommandFailed,
    FileRef,
    RootRef,
    Subparsers,
    UsageError,
    chosen_step,
    emit,
    is_dcp_directory,
    locate,
    new_command,
    short_time,
    version_info,
)
from asyncckpt.cli.listing import NOTHING_HERE, describe
from asyncckpt.cli.progress import format_bytes
from asyncckpt.cli.terminal import table


def add_parser(sub: Subparsers) -> None:
    p = new_command(
        sub,
        "ls",
        "list the versions under a checkpoint root",
        "List the versions under a Checkpointer root: step, committed or not, time, raw and "
        "stored size, metrics (save(..., metrics=...)), and which one the version file names.",
        cmd_ls,
    )
    p.add_argument(
        "root",
        metavar="ROOT[@STEP]|FILE|FOLDER",
        help="checkpoint root (directory or URL; ROOT@STEP: that version only), an asyncckpt "
        "file, or a folder or bucket above checkpoints (each is listed)",
    )


def _version_note(record_step: int | None, committed: list[int], latest: int | None) -> str:
    if record_step is None:
        return "missing or damaged" + (
            f"; readers use the newest committed step, {latest}" if latest is not None else ""
        )
    if record_step not in committed:
        return f"names step {record_step}, which is not committed" + (
            f"; readers use step {latest}" if latest is not None else ""
        )
    return f"step {record_step}"


def _row(v: dict[str, Any], record_step: int | None) -> list[str]:
    raw, stored = v["raw_bytes"], v["stored_bytes"]
    state = v["state"] + (" (damaged)" if v["problem"] and v["state"] == "committed" else "")
    return [
        str(v["step"]),
        state,
        short_time(v["time"]),
        "-" if raw is None else format_bytes(raw),
        "-" if stored is None else format_bytes(stored),
        "-" if v["ratio"] is None else f"{100 * v['ratio']:.1f}%",
        _metrics_text(v["metrics"]),
        "<- version file" if v["step"] == record_step else "",
    ]


def _metrics_text(metrics: dict[str, Any], width: int = 40) -> str:
    """``name=value`` pairs, cut to ``width`` characters (``--json`` has them whole).

    Example:
        >>> _metrics_text({"eval_loss": 0.31, "tag": "warmup"})
        'eval_loss=0.31 tag=warmup'
    """
    if not metrics:
        return "-"
    text = " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
    )
    return text if len(text) <= width else text[: width - 3] + "..."


def cmd_ls(args: argparse.Namespace) -> int:
    """``asyncckpt ls ROOT[@STEP]``; of a file, its row; of a folder or bucket above
    roots, the checkpoints below."""
    ref = locate(args.root, args.options, settings=args.settings)
    if isinstance(ref, FileRef):
        if ref.storage.read_range(ref.path, 0, len(MAGIC)) != MAGIC:
            raise UsageError(
                f"asyncckpt: {args.root} is not an asyncckpt file; ls lists asyncckpt "
                f"checkpoints (try 'asyncckpt inspect {args.root}')"
            )
        return _ls_rows(args, ref, [describe(ref.storage, ref.path, "file", args.settings)])
    storage, root = ref.storage, ref.path
    if not is_root(storage, root):
        return _ls_below(args, ref)
    record = read_version_file(storage, root)
    record_step = None if record is None else record.step
    latest = latest_step(storage, root)
    steps = step_dirs(storage, root) if ref.step is None else [chosen_step(ref)]
    versions = [version_info(storage, root, s, latest) for s in steps]
    temps = [n for n in storage.list_dir(root) if is_temp_name(n)]
    committed = [v["step"] for v in versions if v["state"] == "committed"]
    doc = {
        "root": ref.name,
        "version_file": None if record is None else {"step": record.step, "writer": record.writer},
        "latest": latest,
        "versions": versions,
        "temp_files": temps,
    }
    lines = [
        f"{ref.name}: {len(committed)} committed of {len(versions)} versions; "
        f"version file: {_version_note(record_step, committed, latest)}"
    ]
    if versions:
        rows = [_row(v, record_step) for v in versions]
        lines += table(
            ["STEP", "STATE", "TIME (UTC)", "RAW", "STORED", "RATIO", "METRICS", ""], rows, ">"
        )
    if temps:
        lines.append(f"{len(temps)} temp file(s) of unfinished writes under the root")
    lines += [f"step {v['step']}: {v['problem']}" for v in versions if v["problem"]]
    emit(args, doc, lines)
    return EXIT_OK


def _ls_below(args: argparse.Namespace, ref: RootRef) -> int:
    """``ls`` of a folder that is no root: the checkpoints below it, one line each."""
    if is_dcp_directory(ref.storage, ref.path):
        found = [describe(ref.storage, ref.path, "dcp", args.settings)]
    else:
        below = checkpoints_below(ref.storage, ref.path)
        found = [describe(ref.storage, path, layout, args.settings) for path, layout in below]
    if not found:
        raise CommandFailed(
            f"ls: {ref.name}: {NOTHING_HERE}; give a checkpoint root or a folder or bucket "
            "above roots"
        )
    return _ls_rows(args, ref, found)


def _ls_rows(args: argparse.Namespace, ref: FileRef | RootRef, found: list[dict[str, Any]]) -> int:
    """One line per checkpoint found (a folder's, or one file's)."""
    rows = [
        [
            r["path"],
            r["layout"] if r.get("kind") != "sharded" else "root (sharded)",
            "-" if r["latest"] is None else str(r["latest"]),
            "-" if r["versions"] is None else str(r["versions"]),
            "-" if r["stored_bytes"] is None else format_bytes(r["stored_bytes"]),
            short_time(r["time"]),
            r["age"],
        ]
        for r in found
    ]
    below = "" if isinstance(ref, FileRef) else " below"
    lines = [f"{ref.name}: {len(found)} checkpoint(s){below}"]
    lines += table(["PATH", "LAYOUT", "NEWEST", "VERSIONS", "SIZE", "TIME (UTC)", "AGE"], rows)
    lines += [f"{r['path']}: {r['problem']}" for r in found if r["problem"]]
    emit(args, {"path": ref.name, "roots": found}, lines)
    return EXIT_OK
