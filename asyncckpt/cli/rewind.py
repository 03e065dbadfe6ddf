"""``asyncckpt rewind ROOT STEP --yes``: discard every version newer than STEP.

The CLI side of ``Checkpointer.rewind``: after a loss spike, go back to STEP so the job
resumes from it and saves STEP + 1 next. It takes the root's writer lease, which fences a
job still writing to the root (its next commit fails), so stop the job first.
"""

from __future__ import annotations

import argparse
import uuid

from asyncckpt._versions.protocol import read_commit, step_dirs
from asyncckpt._versions.rewind import rewind
from asyncckpt._versions.writing import RootWriter
from asyncckpt.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    CommandFailed,
    Subparsers,
    UsageError,
    emit,
    locate,
    need_root,
    new_command,
)
from asyncckpt.cli.listing import need_versions


def add_parser(sub: Subparsers) -> None:
    p = new_command(
        sub,
        "rewind",
        "delete every version newer than STEP, so training resumes from STEP",
        "Go back to committed version STEP: delete every newer version (committed or not) and "
        "point the version file at STEP, as Checkpointer.rewind does. It takes the root's "
        "writer lease: a job still writing to ROOT is fenced (stop it first). Without --yes, "
        "print what would be deleted and delete nothing.",
        cmd_rewind,
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("step", metavar="STEP", type=int, help="the committed step to go back to")
    p.add_argument("--yes", action="store_true", help="really delete the newer versions")


def cmd_rewind(args: argparse.Namespace) -> int:
    """``asyncckpt rewind ROOT STEP [--yes]``: exit status 0 once rewound, 1 without
    ``--yes`` (nothing deleted)."""
    if args.step < 0:
        raise UsageError(f"asyncckpt rewind: STEP must be a non-negative int, got {args.step}")
    ref = need_root(locate(args.root, args.options, settings=args.settings), args.root)
    need_versions(ref, "rewind")
    storage, root = ref.storage, ref.path
    if read_commit(storage, root, args.step) is None:
        raise CommandFailed(f"step {args.step} under {ref.name} is not committed: nothing deleted")
    newer = [s for s in reversed(step_dirs(storage, root)) if s > args.step]
    doc = {"root": ref.name, "step": args.step, "delete": newer, "done": False}
    if not args.yes:
        would = ", ".join(map(str, newer)) or "none"
        emit(args, doc, [f"would delete step(s) {would}; nothing deleted: pass --yes to rewind"])
        return EXIT_FAILURE
    writer = RootWriter(storage, root, uuid.uuid4().hex[:12], args.settings)
    try:
        doc["delete"] = rewind(writer, args.step)
    finally:
        writer.release()
    doc["done"] = True
    deleted = ", ".join(map(str, doc["delete"])) or "none"
    emit(args, doc, [f"rewound {ref.name} to step {args.step}; deleted step(s) {deleted}"])
    return EXIT_OK
