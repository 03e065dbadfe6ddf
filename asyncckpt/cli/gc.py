"""``asyncckpt gc ROOT --keep-last N``: retention, as the Checkpointer applies it.

What goes is decided by :func:`asyncckpt._versions.retention.deletion_plan`, the rule the writer's
retention and recovery use, from the same listing (:func:`asyncckpt._versions.protocol.list_steps`).
"""

from __future__ import annotations

import argparse
from typing import Any

from asyncckpt._progress import format_bytes
from asyncckpt._storage import Storage, is_temp_name
from asyncckpt._versions.protocol import (
    UNREADABLE,
    StepEntry,
    delete_version,
    list_steps,
    read_version_file,
)
from asyncckpt._versions.retention import RetentionPolicy, deletion_plan
from asyncckpt.cli.common import (
    EXIT_OK,
    Subparsers,
    emit,
    locate,
    need_root,
    new_command,
    version_info,
)
from asyncckpt.errors import UsageError


def add_parser(sub: Subparsers) -> None:
    """Add the ``gc`` subcommand to ``sub``.

    ``--keep-last`` is the Checkpointer's ``keep_last``; ``--keep`` is its old spelling,
    still accepted and left out of ``--help``.
    """
    p = new_command(
        sub,
        "gc",
        "delete old versions as the Checkpointer's retention would",
        "Apply the Checkpointer's retention rules (its keep_last): keep the newest N committed "
        "versions and the one the version file names, delete older committed versions and "
        "leftovers of interrupted saves older than it. Never touches anything newer than the "
        "version file's step (a save in progress), nor a step whose COMMIT this asyncckpt "
        "cannot read (damaged, or from a newer asyncckpt).",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument(
        "--keep-last",
        dest="keep_last",
        type=int,
        metavar="N",
        help="committed versions to keep, newest first (required; the Checkpointer's keep_last)",
    )
    p.add_argument("--keep", dest="keep_last", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="print what would go; delete nothing")
    p.add_argument(
        "--remove-temp",
        action="store_true",
        help="also delete temp files of interrupted writes directly under ROOT (only when no "
        "job is writing to ROOT: a running save's temp file looks the same)",
    )
    p.set_defaults(run=cmd_gc)


def _delete_versions(
    storage: Storage, root: str, plan: list[StepEntry], dry_run: bool, lines: list[str]
) -> list[dict[str, Any]]:
    goes = []
    verb = "would delete" if dry_run else "deleted"
    for entry in plan:
        info = version_info(storage, root, entry.step, None)
        goes.append(
            {"step": entry.step, "state": info["state"], "stored_bytes": info["stored_bytes"]}
        )
    for g in goes:
        size = "" if g["stored_bytes"] is None else f", {format_bytes(g['stored_bytes'])}"
        lines.append(f"{verb} step {g['step']} ({g['state']}{size})")
        if not dry_run:
            delete_version(storage, root, g["step"])
    return goes


def _delete_temps(
    storage: Storage, root: str, args: argparse.Namespace, lines: list[str]
) -> list[str]:
    temps = [n for n in storage.list_dir(root) if is_temp_name(n)]
    if temps and not args.remove_temp:
        lines.append(
            f"left {len(temps)} temp file(s) under the root; --remove-temp deletes them when no "
            "job is writing to it"
        )
        return []
    for name in temps:
        lines.append(f"{'would delete' if args.dry_run else 'deleted'} temp file {name}")
        if not args.dry_run:
            storage.delete(storage.join(root, name))
    return temps


def cmd_gc(args: argparse.Namespace) -> int:
    """``asyncckpt gc ROOT --keep-last N [--dry-run] [--remove-temp]``.

    Returns:
        The exit status (0).

    Raises:
        UsageError: ``N`` is missing or below 1, or ROOT is not a root.
    """
    if args.keep_last is None:  # not required=True: the hidden --keep may give it instead
        raise UsageError("asyncckpt gc: the following arguments are required: --keep-last N")
    if args.keep_last < 1:
        raise UsageError(f"asyncckpt gc: --keep-last must be at least 1, got {args.keep_last}")
    ref = need_root(locate(args.root, args.options), args.root)
    storage, root = ref.storage, ref.path
    record = read_version_file(storage, root)
    entries = list_steps(storage, root)
    pinned = record.step if record is not None else None
    plan = deletion_plan(entries, RetentionPolicy(keep_last=args.keep_last), pinned)
    lines = []
    if pinned is None:
        lines.append(
            f"the version file under {ref.name} is missing or damaged: nothing is deleted "
            "(open the root with a Checkpointer, or let the next save, rewrite it)"
        )
    unreadable = [e for e in entries if e.state == UNREADABLE]
    lines += [f"kept step {e.step}: its COMMIT cannot be read ({e.problem})" for e in unreadable]
    goes = _delete_versions(storage, root, plan, args.dry_run, lines)
    removed_temps = _delete_temps(storage, root, args, lines)
    doomed = {e.step for e in plan}
    kept = [e.step for e in entries if e.step not in doomed]
    freed = sum(g["stored_bytes"] or 0 for g in goes)
    lines.append(
        f"{'would free' if args.dry_run else 'freed'} {format_bytes(freed)}; kept step(s) "
        f"{', '.join(map(str, kept)) or 'none'}"
        + (f" (version file: step {pinned})" if pinned is not None else "")
    )
    doc = {
        "root": ref.name,
        "keep_last": args.keep_last,
        "keep": args.keep_last,  # the old name of the same field, for existing scripts
        "dry_run": args.dry_run,
        "version_file_step": pinned,
        "delete": goes,
        "temp_files": removed_temps,
        "kept": kept,
        "unreadable": [e.step for e in unreadable],
        "freed_bytes": freed,
    }
    emit(args, doc, lines)
    return EXIT_OK
