"""The versioned-root protocol: records, the version file, the writer lease, retention.

The layout of a root and its guarantees: ``docs/PROTOCOL.md`` §1-§3. A version exists for
readers once its ``COMMIT`` marker does (an exclusive create after every data file is
durable); the version file then moves forward by a compare-and-swap
(:meth:`Storage.replace_if`), so a writer that lost the lease can never move it.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from asyncckpt._format.container import FOOTER_SIZE, decode_footer, parse_json

# The file names of a version are defined once, in _format.names; imported from here too.
from asyncckpt._format.names import METADATA_SUFFIX as METADATA_SUFFIX
from asyncckpt._format.names import data_file_name as data_file_name
from asyncckpt._format.names import is_metadata_name
from asyncckpt._format.names import metadata_file_name as metadata_file_name
from asyncckpt._storage import Storage, is_temp_name
from asyncckpt._versions.metrics import check_metrics
from asyncckpt.errors import (
    CheckpointNotFoundError,
    FormatError,
    InvalidMetricsError,
    UnreadableRecordError,
)

log = logging.getLogger(__name__)

VERSION_FILE = "VERSION"
COMMIT_FILE = "COMMIT"
FAILED_FILE = "FAILED"
LEASE_DIR = "_lease"
PROTOCOL_VERSION = 1
#: Kinds of version a ``COMMIT`` can describe: one writer's single data file, or one file
#: per rank plus the version's metadata (see :mod:`asyncckpt._api.sharded_save`).
SINGLE = "single"
SHARDED = "sharded"
_MAX_RECORD_BYTES = 1 << 20
# Canonical decimal steps only: "007", "²" or "١٢" are not steps (and never alias one).
_STEP_NAME = re.compile(r"0|[1-9][0-9]{0,18}")
_MAX_STEP = (1 << 63) - 1
# What a file name in a record must never hold: control characters (NUL included), path
# separators, a parent-directory part, or lone surrogates (no file system can encode them).
_BAD_NAME = re.compile(r"[\x00-\x1f\x7f-\x9f/\\\ud800-\udfff]|\.\.")


@dataclass(frozen=True)
class CommitRecord:
    """The content of a version's ``COMMIT`` marker.

    Attributes:
        step: the version's step.
        files: data file names, relative to the step directory.
        writer: the token of the writer that created the marker.
        sizes: each file's size in bytes (empty in markers written by hand).
        epoch: the writer's lease epoch (0 when unknown).
        kind: :data:`SINGLE` (one data file) or :data:`SHARDED` (one data file per rank,
            then its metadata, :func:`metadata_file_name`).
        metrics: the small JSON metadata saved with the version
            (:func:`~asyncckpt._versions.metrics.check_metrics`; empty in older markers).
        time: when the marker was written (ISO 8601, UTC), as read; None when writing one
            (:func:`encode_record` stamps it) or when an older marker has none.
    """

    step: int
    files: tuple[str, ...]
    writer: str
    sizes: tuple[int, ...] = ()
    epoch: int = 0
    kind: str = SINGLE
    metrics: Mapping[str, float | int | str] = field(default_factory=dict)
    time: str | None = None

    @property
    def timestamp(self) -> float | None:
        """:attr:`time` as seconds since the epoch (None when unknown or not a time).

        Example:
            >>> CommitRecord(1, ("a.ackpt",), "w", time="1970-01-01T00:01:00+00:00").timestamp
            60.0
        """
        if self.time is None:
            return None
        try:
            stamp = datetime.datetime.fromisoformat(self.time)
        except ValueError:
            return None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=datetime.timezone.utc)
        return stamp.timestamp()

    @property
    def metadata_file(self) -> str | None:
        """The name of a sharded version's metadata (None for a single-file version).

        Example:
            >>> CommitRecord(1, ("r00000-a.ackpt", ".metadata"), "w", kind=SHARDED).metadata_file
            '.metadata'
        """
        if self.kind != SHARDED:
            return None
        return next((f for f in self.files if is_metadata_name(f)), None)


@dataclass(frozen=True)
class VersionRecord:
    """The content of the root's version file.

    Attributes:
        step: the newest published step, or None before the first commit.
        writer: the token of the writer that wrote it.
        epoch: that writer's lease epoch (0 in files written before leases).
    """

    step: int | None
    writer: str
    epoch: int = 0


@dataclass(frozen=True)
class LeaseRecord:
    """The content of ``_lease/<epoch>``: who holds the epoch and how often it renewed."""

    epoch: int
    writer: str
    beat: int


def step_dir(storage: Storage, root: str, step: int) -> str:
    """The directory (prefix) of version ``step``."""
    return storage.join(root, str(step))


def parse_step(name: str) -> int | None:
    """The step a directory name stands for, or None if it is not a canonical step.

    Example:
        >>> [parse_step(n) for n in ("0", "12", "007", "²", "-1", "_lease")]
        [0, 12, None, None, None, None]
    """
    if not _STEP_NAME.fullmatch(name):
        return None
    step = int(name)
    return step if step <= _MAX_STEP else None


def bad_file_name(name: str) -> str | None:
    """Why ``name`` cannot be a file name in a step directory, or None if it can.

    Example:
        >>> bad_file_name("r00000-a.ackpt") is None, bad_file_name("../VERSION")
        (True, 'it holds a control character, a path separator, ".." or a lone surrogate')
    """
    if not name:
        return "it is empty"
    if _BAD_NAME.search(name):
        return 'it holds a control character, a path separator, ".." or a lone surrogate'
    return None


def decode_record(raw: bytes, where: str) -> dict[str, Any]:
    """Parse a protocol record's JSON.

    Raises:
        UnreadableRecordError: not JSON (nested too deeply included), not an object, or a
            protocol this code does not know.
    """
    try:  # the one strict parser: deep nesting is a FormatError there, not a RecursionError
        doc = parse_json(raw, where)
    except FormatError as exc:
        raise UnreadableRecordError(str(exc)) from exc
    if not isinstance(doc, dict):
        raise UnreadableRecordError(f"{where}: not an asyncckpt protocol record")
    version = doc.get("protocol")
    if type(version) is int and version > PROTOCOL_VERSION:
        raise UnreadableRecordError(
            f"{where}: written by a newer asyncckpt (protocol {version}; this one knows "
            f"{PROTOCOL_VERSION}); upgrade asyncckpt to use this root"
        )
    if version != PROTOCOL_VERSION:
        raise UnreadableRecordError(f"{where}: not an asyncckpt protocol record")
    return doc


def read_record(storage: Storage, path: str) -> dict[str, Any] | None:
    try:
        raw = storage.read_bytes(path, _MAX_RECORD_BYTES)
    except CheckpointNotFoundError:
        return None
    return decode_record(raw, storage.describe(path))


def encode_record(doc: dict[str, Any]) -> bytes:
    """A protocol record's bytes; the time stamp also makes every write's bytes unique."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    return json.dumps({"protocol": PROTOCOL_VERSION, **doc, "time": now}).encode()


# -- commit records ---------------------------------------------------------------------------


def commit_from(doc: dict[str, Any], step: int, where: str) -> CommitRecord:
    """Validate a decoded ``COMMIT`` document.

    Raises:
        UnreadableRecordError: a field is missing or malformed.
    """
    files, writer, sizes = doc.get("files"), doc.get("writer"), doc.get("sizes", [])
    epoch, kind = doc.get("epoch", 0), doc.get("kind", SINGLE)
    if isinstance(files, list):
        _check_file_names(files, step, where)
    valid = (
        doc.get("step") == step
        and kind in (SINGLE, SHARDED)
        and isinstance(files, list)
        and files
        # data files or a sharded version's metadata (their names were checked above)
        and all(f.endswith(".ackpt") or (kind == SHARDED and is_metadata_name(f)) for f in files)
        and (kind != SHARDED or sum(is_metadata_name(f) for f in files) == 1)
        and isinstance(writer, str)
        and isinstance(sizes, list)
        and all(type(v) is int and v >= 0 for v in sizes)
        and (not sizes or len(sizes) == len(files))
        and type(epoch) is int
    )
    if not valid:
        raise UnreadableRecordError(f"{where}: malformed commit record")
    try:
        metrics = check_metrics(doc.get("metrics", {}), f"{where}: metrics")
    except InvalidMetricsError as exc:
        raise UnreadableRecordError(str(exc)) from None
    stamp = doc.get("time")
    return CommitRecord(
        step,
        tuple(files),  # type: ignore[arg-type]
        writer,  # type: ignore[arg-type]
        tuple(sizes),
        epoch,
        kind,
        metrics,
        stamp if isinstance(stamp, str) else None,
    )


def _check_file_names(files: list[Any], step: int, where: str) -> None:
    """Raise, naming the step and the file, if a name in ``files`` cannot be a file name.

    Such a name would otherwise reach the operating system (a NUL byte makes it raise a
    bare ``ValueError``) or point outside the step directory.
    """
    for name in files:
        problem = bad_file_name(name) if isinstance(name, str) else "not a string"
        if problem is not None:
            raise UnreadableRecordError(
                f"{where}: the commit record of step {step} names the file {name!r}, which "
                f"is not a valid file name ({problem})"
            )


def read_commit_strict(storage: Storage, root: str, step: int) -> CommitRecord | None:
    """The commit record of ``step``, or None if there is none.

    Raises:
        UnreadableRecordError: a marker exists but cannot be understood.
    """
    path = storage.join(step_dir(storage, root, step), COMMIT_FILE)
    doc = read_record(storage, path)
    return None if doc is None else commit_from(doc, step, storage.describe(path))


def read_commit(storage: Storage, root: str, step: int) -> CommitRecord | None:
    """The commit record of ``step`` if it exists and is understood, else None (readers)."""
    try:
        return read_commit_strict(storage, root, step)
    except FormatError as exc:  # unreadable, or oversized
        log.warning("ignoring commit record: %s", exc)
        return None


def create_commit(storage: Storage, root: str, record: CommitRecord) -> None:
    """Create ``step``'s commit record; the version exists for readers from then on.

    Raises:
        ConflictError: a marker already exists (this writer's own, or another's).
    """
    path = storage.join(step_dir(storage, root, record.step), COMMIT_FILE)
    doc = {
        "step": record.step,
        "files": list(record.files),
        "sizes": list(record.sizes),
        "writer": record.writer,
        "epoch": record.epoch,
    }
    if record.kind != SINGLE:  # single-file markers keep the bytes older readers know
        doc["kind"] = record.kind
    if record.metrics:  # older readers ignore the field; without metrics, it is left out
        doc["metrics"] = dict(record.metrics)
    storage.create_exclusive(path, encode_record(doc))


def verify_commit(storage: Storage, root: str, record: CommitRecord) -> str | None:
    """Check that every data file a marker names is there, whole: None if so, else why.

    Each file must exist, have the size the marker records (when it records one) and, if it
    is a data file, end in a valid asyncckpt footer (a sharded version's metadata is JSON:
    its size is checked). A marker that fails this is never published as the latest.
    """
    directory = step_dir(storage, root, record.step)
    for i, name in enumerate(record.files):
        path = storage.join(directory, name)
        try:
            size = storage.size(path)
            if record.sizes and size != record.sizes[i]:
                return (
                    f"{storage.describe(path)} is {size} bytes, the marker says {record.sizes[i]}"
                )
            if not name.endswith(".ackpt"):
                continue
            tail = storage.read_range(path, max(0, size - FOOTER_SIZE), FOOTER_SIZE)
            decode_footer(tail, size, storage.describe(path))
        except (CheckpointNotFoundError, FormatError) as exc:
            return str(exc)
    return None


# -- failure records --------------------------------------------------------------------------


@dataclass(frozen=True)
class FailureRecord:
    """The content of a step's ``FAILED`` marker: which save attempt failed, and how.

    Attributes:
        step: the step whose save failed.
        error: the error, as text.
        writer: the token of the writer whose attempt failed ("" when unknown: a marker
            written by an older asyncckpt, or damaged).
        epoch: that writer's lease epoch (0 when unknown).
    """

    step: int
    error: str
    writer: str = ""
    epoch: int = 0


def mark_failed(
    storage: Storage, root: str, step: int, error: BaseException, writer: str = "", epoch: int = 0
) -> None:
    """Tell pollers that the save of ``step`` by ``writer`` (epoch ``epoch``) failed (best
    effort; never raises).

    Only for steps with no ``COMMIT``: a committed step is never marked failed. A writer
    calls it through :meth:`asyncckpt._versions.writing.RootWriter.mark_failed`, which first
    checks that it still holds the lease.
    """
    path = storage.join(step_dir(storage, root, step), FAILED_FILE)
    try:
        if read_commit(storage, root, step) is not None:
            return
        doc = {"step": step, "error": str(error)[:2000], "writer": writer, "epoch": epoch}
        storage.write_bytes(path, encode_record(doc))
    except Exception as exc:  # best effort: the original error is what matters
        log.warning("could not record the failure of step %d: %s", step, exc)


def read_failure(storage: Storage, root: str, step: int) -> FailureRecord | None:
    """The ``FAILED`` marker of ``step``, or None if there is none.

    A marker that cannot be understood is returned with an unknown writer and epoch 0.
    """
    try:
        doc = read_record(storage, storage.join(step_dir(storage, root, step), FAILED_FILE))
    except FormatError:
        return FailureRecord(step, "unknown error (damaged FAILED record)")
    if doc is None:
        return None
    writer, epoch = doc.get("writer", ""), doc.get("epoch", 0)
    return FailureRecord(
        step,
        str(doc.get("error", "unknown error")),
        writer if isinstance(writer, str) else "",
        epoch if type(epoch) is int and epoch >= 0 else 0,
    )


def failure_of(storage: Storage, root: str, step: int) -> str | None:
    """The recorded error of a failed save of ``step``, if any (whichever attempt)."""
    failure = read_failure(storage, root, step)
    return None if failure is None else failure.error


# -- the version file -------------------------------------------------------------------------


def version_from(doc: dict[str, Any], where: str) -> VersionRecord:
    """Validate a decoded version file.

    Raises:
        UnreadableRecordError: a field is missing or malformed.
    """
    step, writer, epoch = doc.get("step"), doc.get("writer"), doc.get("epoch", 0)
    if (step is not None and type(step) is not int) or not isinstance(writer, str):
        raise UnreadableRecordError(f"{where}: malformed version file")
    if type(epoch) is not int or epoch < 0 or (step is not None and step < 0):
        raise UnreadableRecordError(f"{where}: malformed version file")
    return VersionRecord(step, writer, epoch)


def read_version_tagged(storage: Storage, root: str) -> tuple[VersionRecord | None, str | None]:
    """The version file's record and its tag (for :meth:`Storage.replace_if`);
    ``(None, None)`` when there is no version file.

    Raises:
        UnreadableRecordError: the file exists but cannot be understood.
    """
    path = storage.join(root, VERSION_FILE)
    found = storage.read_tagged(path, _MAX_RECORD_BYTES)
    if found is None:
        return None, None
    raw, tag = found
    where = storage.describe(path)
    return version_from(decode_record(raw, where), where), tag


def read_version_file(storage: Storage, root: str) -> VersionRecord | None:
    """The version file's record, or None if it is missing or cannot be understood."""
    try:
        doc = read_record(storage, storage.join(root, VERSION_FILE))
        return None if doc is None else version_from(doc, root)
    except FormatError as exc:  # unreadable, or oversized
        log.warning("ignoring version file: %s", exc)
        return None


def publish_version(storage: Storage, root: str, record: VersionRecord, tag: str | None) -> str:
    """Replace the version file with ``record`` if it still has ``tag``; return the new tag.

    Raises:
        ConflictError: the file changed since ``tag`` was read (another writer moved it).
    """
    return storage.replace_if(storage.join(root, VERSION_FILE), encode_record(asdict(record)), tag)


def write_version_file(storage: Storage, root: str, record: VersionRecord) -> None:
    """Replace the version file unconditionally (tests and repair tools only)."""
    storage.write_bytes(storage.join(root, VERSION_FILE), encode_record(asdict(record)))


# -- listing, latest, retention ---------------------------------------------------------------


def step_dirs(storage: Storage, root: str) -> list[int]:
    """Every step that has a directory under ``root`` (committed or not), ascending."""
    steps = (parse_step(n) for n in storage.list_dir(root))
    return sorted(s for s in steps if s is not None)


def committed_steps(storage: Storage, root: str) -> list[int]:
    """Steps with an understood commit record, ascending."""
    return [s for s in step_dirs(storage, root) if read_commit(storage, root, s) is not None]


def latest_step(storage: Storage, root: str) -> int | None:
    """The newest step a reader may load.

    The version file's step, unless a newer commit record exists whose files verify (a
    writer that crashed, or whose version-file write failed, after its ``COMMIT``): then that
    one. None when nothing is committed.
    """
    record = read_version_file(storage, root)
    named = record.step if record is not None else None
    if named is not None and read_commit(storage, root, named) is None:
        named = None
    for step in reversed(step_dirs(storage, root)):
        if named is not None and step <= named:
            break
        commit = read_commit(storage, root, step)
        if commit is not None and verify_commit(storage, root, commit) is None:
            return step
    return named


#: States of a step directory, as :func:`list_steps` finds it.
COMMITTED = "committed"
UNCOMMITTED = "uncommitted"
UNREADABLE = "unreadable"


@dataclass(frozen=True)
class StepEntry:
    """One step directory under a root, as :func:`list_steps` found it.

    Attributes:
        step: the step.
        state: :data:`COMMITTED` (a commit record this asyncckpt understands),
            :data:`UNCOMMITTED` (none: a save in progress, failed or interrupted) or
            :data:`UNREADABLE` (a marker it cannot understand: damaged, or from a newer
            protocol; it may be a version, so nothing ever deletes it).
        link: the directory is a symbolic link (local disk): deleting the step removes the
            link and never touches what it points to.
        commit: the commit record, when committed.
        problem: why the marker cannot be understood, when unreadable.
    """

    step: int
    state: str
    link: bool = False
    commit: CommitRecord | None = None
    problem: str | None = None


def list_steps(storage: Storage, root: str) -> list[StepEntry]:
    """Every step directory under ``root``, ascending, with its state: the one listing
    that every decision to delete is made from
    (:func:`~asyncckpt._versions.retention.deletion_plan`).

    Raises:
        StorageError: listing or reading a marker failed.
    """
    entries = []
    for step in step_dirs(storage, root):
        link = storage.is_link(step_dir(storage, root, step))
        try:
            commit = read_commit_strict(storage, root, step)
        except FormatError as exc:  # damaged, oversized, or from a newer protocol
            entries.append(StepEntry(step, UNREADABLE, link, None, str(exc)))
            continue
        state = UNCOMMITTED if commit is None else COMMITTED
        entries.append(StepEntry(step, state, link, commit))
    return entries


def newest_good(storage: Storage, root: str, entries: list[StepEntry]) -> int | None:
    """The newest committed step of ``entries`` (a :func:`list_steps` listing) whose files
    verify: the version a reader loads when the version file names a step that is gone or
    damaged (:func:`latest_step`'s fallback). Nothing ever deletes it
    (:func:`~asyncckpt._versions.retention.deletion_plan`), whatever the version file says.
    None when no committed step verifies.

    Raises:
        StorageError: reading a file failed.
    """
    for entry in reversed(entries):
        if entry.commit is not None and verify_commit(storage, root, entry.commit) is None:
            return entry.step
    return None


def delete_version(storage: Storage, root: str, step: int) -> None:
    """Remove a version: the commit record first, so readers stop seeing it at once.

    A step directory that is a symbolic link is removed as a link (which makes it vanish for
    readers at once too): never what it points to, which may be another run's version.
    """
    directory = step_dir(storage, root, step)
    if storage.is_link(directory):
        log.warning(
            "step %d under %s is a symbolic link: removing the link, not what it points to",
            step,
            storage.describe(root),
        )
    else:
        storage.delete(storage.join(directory, COMMIT_FILE))
    storage.delete_tree(directory)


def temp_files(storage: Storage, directory: str) -> list[str]:
    """Names of the temp files of writes directly under ``directory`` (a root or a step
    directory): interrupted ones, or in progress."""
    return [name for name in storage.list_dir(directory) if is_temp_name(name)]
