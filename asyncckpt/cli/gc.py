"""``asyncckpt gc ROOT --keep-last N ...``: retention, as the Checkpointer applies it.

One flag per rule of :data:`asyncckpt._versions.retention.RULES`, built by
:func:`~asyncckpt._versions.retention.policy_from` as the Checkpointer's keywords are, and
combined as there: a version stays if any rule keeps it.

What goes is decided by :func:`asyncckpt._versions.retention.deletion_plan`, the rule the writer's
retention and recovery use, from the same listing (:func:`asyncckpt._versions.protocol.list_steps`).
"""

from __future__ import annotations

import argparse
from typing import Any

from asyncckpt._storage import Storage, is_temp_name
from asyncckpt._versions.protocol import (
    UNREADABLE,
    StepEntry,
    delete_version,
    list_steps,
    newest_good,
    read_version_file,
)
from asyncckpt._versions.retention import (
    BEST_MODES,
    RULES,
    KeepFor,
    RetentionPolicy,
    deletion_plan,
    policy_from,
)
from asyncckpt.cli.common import (
    EXIT_OK,
    Subparsers,
    UsageError,
    emit,
    locate,
    need_root,
    new_command,
    version_info,
)
from asyncckpt.cli.listing import need_versions
from asyncckpt.cli.progress import format_bytes
from asyncckpt.errors import UnknownMetricError


def add_parser(sub: Subparsers) -> None:
    p = new_command(
        sub,
        "gc",
        "delete old versions as the Checkpointer's retention would",
        "Apply the Checkpointer's retention rules (keep_last, keep_best, keep_every, keep_for; "
        "a version stays if any rule keeps it) and keep the one the version file names and the "
        "newest one that verifies; delete "
        "older committed versions no rule keeps and leftovers of interrupted saves older than "
        "it. Never touches anything newer than the "
        "version file's step (a save in progress), nor a step whose COMMIT this asyncckpt "
        "cannot read (damaged, or from a newer asyncckpt).",
        cmd_gc,
    )
    p.add_argument("root", metavar="ROOT")
    for rule in RULES:  # one flag per rule, as the Checkpointer's keyword is named
        p.add_argument(flag(rule.keyword), dest=rule.keyword, metavar=rule.metavar, help=rule.help)
    p.add_argument("--keep", dest="keep_last", help=argparse.SUPPRESS)  # the old spelling
    p.add_argument("--best-metric", metavar="NAME", help="the metric --keep-best ranks by")
    p.add_argument(
        "--best-mode",
        choices=BEST_MODES,
        default="min",
        help="min: lower is better (default); max: higher is better",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would go; delete nothing")
    p.add_argument(
        "--remove-temp",
        action="store_true",
        help="also delete temp files of interrupted writes directly under ROOT (only when no "
        "job is writing to ROOT: a running save's temp file looks the same)",
    )


def _delete_versions(
    storage: Storage, root: str, plan: list[StepEntry], dry_run: bool, lines: list[str]
) -> list[dict[str, Any]]:
    verb = "would delete" if dry_run else "deleted"
    infos = [version_info(storage, root, entry.step, None) for entry in plan]  # before any goes
    goes = [{k: info[k] for k in ("step", "state", "stored_bytes")} for info in infos]
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


def flag(keyword: str) -> str:
    """The ``gc`` flag of a retention keyword.

    Example:
        >>> flag("keep_last")
        '--keep-last'
    """
    return "--" + keyword.replace("_", "-")


def policy_of(args: argparse.Namespace) -> RetentionPolicy:
    """The :class:`RetentionPolicy` the flags describe, built as the Checkpointer's keywords
    are (:func:`~asyncckpt._versions.retention.policy_from`).

    Raises:
        UsageError: no rule is given, or a rule's value is invalid (naming its flag).
    """
    texts = {rule: getattr(args, rule.keyword) for rule in RULES}
    if all(text is None for text in texts.values()):  # not required: the hidden --keep may
        raise UsageError(
            "asyncckpt gc: the following arguments are required: --keep-last N (or another "
            "rule: " + ", ".join(f"{flag(r.keyword)} {r.metavar}" for r in RULES[1:]) + ")"
        )
    keywords: dict[str, Any] = {"best_metric": args.best_metric, "best_mode": args.best_mode}
    for rule, text in texts.items():
        try:
            keywords[rule.keyword] = None if text is None else rule.parse(text)
        except ValueError as exc:
            raise UsageError(f"asyncckpt gc: {flag(rule.keyword)} {_reason(exc, text)}") from None
    try:
        return policy_from(keywords, spell=flag)
    except ValueError as exc:
        raise UsageError(f"asyncckpt gc: {exc}") from None


def _reason(exc: ValueError, text: str) -> str:
    """Why a flag's text is not a value: the parser's words, or "takes an integer"."""
    words = str(exc)
    return words if words.startswith("takes") else f"takes an integer, got {text!r}"


def _plan(
    ref_name: str,
    policy: RetentionPolicy,
    entries: list[StepEntry],
    pinned: int | None,
    good: int | None,
) -> list[StepEntry]:
    """:func:`deletion_plan`, with a metric no version has as a usage error."""
    try:
        return deletion_plan(entries, policy, pinned, good=good)
    except UnknownMetricError as exc:
        names = ", ".join(repr(n) for n in exc.known)
        raise UsageError(
            f"asyncckpt gc: --best-metric {exc.metric!r}: no version under {ref_name} has it; "
            f"the metrics there are: {names}"
        ) from None


def cmd_gc(args: argparse.Namespace) -> int:
    """``asyncckpt gc ROOT --keep-last N ... [--dry-run] [--remove-temp]``."""
    policy = policy_of(args)
    ref = need_root(locate(args.root, args.options, settings=args.settings), args.root)
    need_versions(ref, "gc")
    storage, root = ref.storage, ref.path
    record = read_version_file(storage, root)
    entries = list_steps(storage, root)
    pinned = record.step if record is not None else None
    plan = _plan(ref.name, policy, entries, pinned, newest_good(storage, root, entries))
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
        **{rule.keyword: policy.keyword(rule.keyword) for rule in RULES if rule is not KeepFor},
        "keep": policy.keyword("keep_last"),  # the old name of keep_last, for existing scripts
        "best_metric": policy.keyword("best_metric"),
        "best_mode": policy.keyword("best_mode"),
        "keep_for_s": policy.keyword("keep_for"),
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
