"""What ``asyncckpt ls`` shows of a folder or bucket that is not itself a checkpoint root:
the checkpoints below it (``Checkpointer`` roots, ``asyncckpt.dcp`` directories, single
``.ackpt`` files, and asyncckpt files under a torch name such as Lightning's ``.ckpt``),
each with its newest step, size and age, as ``aws s3 ls`` lists prefixes.
"""

from __future__ import annotations

import datetime
from typing import Any

from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt._versions.paths import (
    MAX_DEPTH,
    TORCH_NAMES,
    checkpoints_below,
    is_root,
)
from asyncckpt._versions.protocol import committed_steps, latest_step
from asyncckpt.cli.common import (
    RootRef,
    UsageError,
    dcp_files,
    display,
    is_dcp_directory,
    version_info,
)
from asyncckpt.errors import AsyncCkptError

#: What ``ls`` and ``verify`` of a folder with no checkpoint below say.
NOTHING_HERE = (
    f"nothing asyncckpt wrote is here (no Checkpointer root, asyncckpt.dcp directory or "
    f"asyncckpt file, .ackpt or under a torch name {'/'.join(TORCH_NAMES)}, within "
    f"{MAX_DEPTH} levels)"
)


def need_versions(ref: RootRef, command: str) -> None:
    """Refuse (UsageError) a command that changes versions (``gc``, ``rewind``) on a folder
    that is not a ``Checkpointer`` root (an empty one is), naming what it is instead."""
    storage, path = ref.storage, ref.path
    names = storage.list_dir(path)
    if not names or is_root(storage, path, names):  # empty: a root nothing was saved to yet
        return
    what = f"asyncckpt {command}: {ref.name} is not a Checkpointer root"
    if is_dcp_directory(storage, path):
        raise UsageError(f"{what} (it is an asyncckpt.dcp directory: one checkpoint, no versions)")
    below = [display(storage, p) for p, kind in checkpoints_below(storage, path) if kind == "root"]
    if below:
        shown = ", ".join(below[:3]) + (", ..." if len(below) > 3 else "")
        raise UsageError(f"{what}; the roots below it: {shown} (run it on one of them)")
    raise UsageError(f"{what}: it holds nothing asyncckpt wrote (try 'asyncckpt ls {ref.name}')")


def _file_facts(storage: Storage, path: str) -> tuple[int | None, str | None]:
    """An asyncckpt file's size and creation time (from its manifest), or Nones."""
    from asyncckpt._engine.decode import open_file  # imports torch: only when run

    try:
        with open_file(storage, path) as opened:
            created = opened.manifest.meta.get("created")
            return opened.size, created if isinstance(created, str) else None
    except AsyncCkptError:
        return None, None


def describe(storage: Storage, path: str, layout: str, settings: Settings) -> dict[str, Any]:
    """One checkpoint's row: layout, newest step, committed versions, bytes, time, age
    (``settings``: the command's, to read a DCP directory's metadata)."""
    row: dict[str, Any] = {"path": display(storage, path), "layout": layout}
    row.update(dict.fromkeys(("latest", "versions", "stored_bytes", "time", "problem")))
    try:
        if layout == "root":
            latest = latest_step(storage, path)
            row["latest"], row["versions"] = latest, len(committed_steps(storage, path))
            if latest is not None:
                info = version_info(storage, path, latest, latest)
                row["stored_bytes"], row["time"] = info["stored_bytes"], info["time"]
                row["kind"] = info.get("kind")
        elif layout == "dcp":
            files = dcp_files(RootRef(storage, path), settings)
            facts = [_file_facts(f.storage, f.path) for f in files]
            row["stored_bytes"] = sum(size or 0 for size, _ in facts)
            row["time"] = max((t for _, t in facts if t), default=None)
        else:
            row["stored_bytes"], row["time"] = _file_facts(storage, path)
    except AsyncCkptError as exc:
        row["problem"] = str(exc)
    row["age"] = age(row["time"])
    return row


def age(iso: str | None, now: datetime.datetime | None = None) -> str:
    """How long ago ``iso`` was, roughly: ``42s``, ``5m``, ``3h``, ``12d``; ``-`` if unknown.

    Example:
        >>> now = datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc)
        >>> age("2026-01-01T21:00:00+00:00", now), age(None)
        ('3h', '-')
    """
    if not iso:
        return "-"
    try:
        moment = datetime.datetime.fromisoformat(iso)
    except ValueError:
        return "-"
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    seconds = int(((now or datetime.datetime.now(datetime.timezone.utc)) - moment).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"
