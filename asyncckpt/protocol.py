"""The versioned-root protocol: versions, commit markers, the version file, retention.

Layout of a checkpoint root (specified, with its guarantees, in ``docs/PROTOCOL.md``)::

    ROOT/VERSION                       the version file: newest committed step (JSON)
    ROOT/<step>/r00000-<token>.ackpt   data files, one per writing rank, unique per attempt
    ROOT/<step>/COMMIT                 commit marker: names the data files (JSON)
    ROOT/<step>/FAILED                 written (best effort) when a save of <step> failed

A version exists for readers only once its ``COMMIT`` marker does; the marker is created
with an exclusive create after every data file is durable, and the version file is moved
forward after that. Everything here is a function of a :class:`Storage` and a root path.
"""

from __future__ import annotations

import datetime
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from .errors import (
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    ConflictError,
    FormatError,
    IncompleteCheckpointError,
)
from .storage import Storage, is_temp_name

log = logging.getLogger("asyncckpt")

VERSION_FILE = "VERSION"
COMMIT_FILE = "COMMIT"
FAILED_FILE = "FAILED"
PROTOCOL_VERSION = 1
_MAX_RECORD_BYTES = 1 << 20


@dataclass(frozen=True)
class CommitRecord:
    """The content of a version's ``COMMIT`` marker."""

    step: int
    files: tuple[str, ...]
    writer: str


@dataclass(frozen=True)
class VersionRecord:
    """The content of the root's version file."""

    step: int
    writer: str


def step_dir(storage: Storage, root: str, step: int) -> str:
    """The directory (prefix) of version ``step``."""
    return storage.join(root, str(step))


def data_file_name(rank: int, token: str) -> str:
    """Name of rank ``rank``'s data file, unique to one writer attempt."""
    return f"r{rank:05d}-{token}.ackpt"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _record(storage: Storage, path: str) -> dict[str, Any] | None:
    """A small JSON record, or None if missing; FormatError if unreadable."""
    try:
        raw = storage.read_bytes(path, _MAX_RECORD_BYTES)
    except CheckpointNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise FormatError(f"{storage.describe(path)}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("protocol") != PROTOCOL_VERSION:
        raise FormatError(f"{storage.describe(path)}: not an asyncckpt protocol record")
    return doc


def _encode(doc: dict[str, Any]) -> bytes:
    return json.dumps({"protocol": PROTOCOL_VERSION, **doc, "time": _now()}).encode()


def read_commit(storage: Storage, root: str, step: int) -> CommitRecord | None:
    """The commit marker of ``step`` if it exists and is well formed, else None."""
    path = storage.join(step_dir(storage, root, step), COMMIT_FILE)
    try:
        doc = _record(storage, path)
    except FormatError as exc:
        log.warning("ignoring damaged commit marker: %s", exc)
        return None
    if doc is None:
        return None
    files, writer = doc.get("files"), doc.get("writer")
    valid = (
        doc.get("step") == step
        and isinstance(files, list)
        and files
        and all(isinstance(f, str) and "/" not in f and f.endswith(".ackpt") for f in files)
        and isinstance(writer, str)
    )
    if not valid:
        log.warning("ignoring malformed commit marker %s", storage.describe(path))
        return None
    return CommitRecord(step, tuple(files), writer)  # type: ignore[arg-type]


def create_commit(storage: Storage, root: str, record: CommitRecord) -> None:
    """Create ``step``'s commit marker; the version exists for readers from then on.

    Raises:
        ConflictError: the step was already committed (by this or another writer).
    """
    path = storage.join(step_dir(storage, root, record.step), COMMIT_FILE)
    doc = {"step": record.step, "files": list(record.files), "writer": record.writer}
    try:
        storage.create_exclusive(path, _encode(doc))
    except ConflictError:
        raise ConflictError(
            f"step {record.step} is already committed under {storage.describe(root)}; "
            "steps must be unique and increasing (are two jobs writing to this root?)"
        ) from None


def mark_failed(storage: Storage, root: str, step: int, error: BaseException) -> None:
    """Tell pollers that the save of ``step`` failed (best effort; never raises)."""
    path = storage.join(step_dir(storage, root, step), FAILED_FILE)
    try:
        storage.write_bytes(path, _encode({"step": step, "error": str(error)[:2000]}))
    except Exception as exc:  # best effort: the original error is what matters
        log.warning("could not record the failure of step %d: %s", step, exc)


def failure_of(storage: Storage, root: str, step: int) -> str | None:
    """The recorded error of a failed save of ``step``, if any."""
    try:
        doc = _record(storage, storage.join(step_dir(storage, root, step), FAILED_FILE))
    except FormatError:
        return "unknown error (damaged FAILED marker)"
    return None if doc is None else str(doc.get("error", "unknown error"))


def read_version_file(storage: Storage, root: str) -> VersionRecord | None:
    """The version file's record, or None if it is missing or damaged."""
    try:
        doc = _record(storage, storage.join(root, VERSION_FILE))
    except FormatError as exc:
        log.warning("ignoring damaged version file: %s", exc)
        return None
    if doc is None or type(doc.get("step")) is not int or not isinstance(doc.get("writer"), str):
        return None
    return VersionRecord(doc["step"], doc["writer"])


def write_version_file(storage: Storage, root: str, record: VersionRecord) -> None:
    """Atomically replace the version file (callers ensure it never moves backwards)."""
    doc = {"step": record.step, "writer": record.writer}
    storage.write_bytes(storage.join(root, VERSION_FILE), _encode(doc))


def step_dirs(storage: Storage, root: str) -> list[int]:
    """Every step that has a directory under ``root`` (committed or not), ascending."""
    return sorted(int(n) for n in storage.list_dir(root) if n.isdigit() and len(n) < 20)


def committed_steps(storage: Storage, root: str) -> list[int]:
    """Steps with a valid commit marker, ascending."""
    return [s for s in step_dirs(storage, root) if read_commit(storage, root, s) is not None]


def latest_step(storage: Storage, root: str) -> int | None:
    """The step the version file names, if committed; else the newest committed step."""
    record = read_version_file(storage, root)
    if record is not None and read_commit(storage, root, record.step) is not None:
        return record.step
    steps = committed_steps(storage, root)
    return steps[-1] if steps else None


def delete_version(storage: Storage, root: str, step: int) -> None:
    """Remove a version: the commit marker first, so readers stop seeing it at once."""
    directory = step_dir(storage, root, step)
    storage.delete(storage.join(directory, COMMIT_FILE))
    storage.delete_tree(directory)


def retention_plan(
    committed: list[int], all_dirs: list[int], keep_last: int | None, pinned: int | None
) -> list[int]:
    """Which steps to delete: beyond the newest ``keep_last`` committed, and leftovers.

    Never the ``pinned`` step (the version file's) nor anything newer than it, so a save in
    progress is never touched. Pure function, shared by ``Checkpointer`` and the CLI.

    Example:
        >>> retention_plan([1, 2, 3], [1, 2, 3, 4], keep_last=2, pinned=3)
        [1]
    """
    if pinned is None:
        return []
    keep = set(committed if keep_last is None else committed[-keep_last:]) | {pinned}
    return [s for s in all_dirs if s < pinned and s not in keep]


def remove_temp_files(storage: Storage, root: str) -> None:
    """Delete temp files that interrupted writes left directly under ``root`` (a root or a
    step directory)."""
    for name in storage.list_dir(root):
        if is_temp_name(name):
            storage.delete(storage.join(root, name))


def wait_for_step(storage: Storage, root: str, step: int, timeout: float | None) -> None:
    """Poll, with exponential backoff and jitter, until ``step`` is committed.

    Raises:
        IncompleteCheckpointError: the writer recorded that the save of ``step`` failed.
        CheckpointTimeoutError: not committed within ``timeout`` seconds; says what is.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    delay, next_log = 0.02, time.monotonic() + 60
    while read_commit(storage, root, step) is None:
        failure = failure_of(storage, root, step)
        if failure is not None:
            raise IncompleteCheckpointError(
                f"the save of step {step} under {storage.describe(root)} failed: {failure}"
            )
        newer = read_version_file(storage, root)
        if newer is not None and newer.step > step and read_commit(storage, root, step) is None:
            # Steps only increase, so a step passed over by the version file never commits.
            raise IncompleteCheckpointError(
                f"step {step} under {storage.describe(root)} was never committed (or was "
                f"deleted); step {newer.step} is the newest"
            )
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise CheckpointTimeoutError(
                f"step {step} was not committed under {storage.describe(root)} within "
                f"{timeout} s; committed steps: {committed_steps(storage, root) or 'none'}"
            )
        if now >= next_log:
            log.info("still waiting for step %d under %s", step, storage.describe(root))
            next_log = now + 60
        pause = delay * (0.5 + random.random())
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - now)))
        delay = min(delay * 2, 2.0)
