"""``asyncckpt verify PATH | ROOT[@STEP|--all]``: read everything, check every checksum."""

from __future__ import annotations

import argparse
import contextlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from asyncckpt._engine.decode import Budget, OpenedFile, read_file
from asyncckpt._format.codec import checksum, decode_chunk
from asyncckpt._settings import Settings, SettingsArg
from asyncckpt._storage import Storage
from asyncckpt._versions.paths import checkpoints_below, is_root
from asyncckpt._versions.protocol import committed_steps, read_version_file, step_dirs
from asyncckpt.cli.common import (
    EXIT_OK,
    CommandFailed,
    FileRef,
    RootRef,
    UsageError,
    chosen_step,
    dcp_files,
    display,
    emit,
    files_of,
    is_dcp_directory,
    locate,
    manifest_tree,
    pending_note,
    plural,
    progress,
)
from asyncckpt.cli.formats import reject_other_format
from asyncckpt.cli.listing import NOTHING_HERE
from asyncckpt.cli.progress import format_bytes
from asyncckpt.cli.terminal import paint
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    FileReplacedError,
    FormatError,
    MemoryBudgetError,
)

#: How many bytes of chunks ``verify_file`` holds at once, at most (or one chunk if larger).
_VERIFY_BUDGET = 512 << 20


@dataclass
class BadChunk:
    """One chunk that failed verification."""

    chunk: int
    keys: list[str]
    detail: str


@dataclass
class FileReport:
    """What verifying one file found."""

    file: str
    step: int | None = None
    size: int | None = None
    chunks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    bad_chunks: list[BadChunk] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Loading it would need more memory than ``--max-bytes`` (its chunks were not read).
    too_large: bool = False

    @property
    def ok(self) -> bool:
        return not self.bad_chunks and not self.errors

    def as_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        return {"file": fields.pop("file"), "step": fields.pop("step"), "ok": self.ok, **fields}


class _ChunkChecker:
    """Checks the chunks of one opened file and knows which keys each chunk holds."""

    def __init__(self, opened: OpenedFile, progress: Callable[[int], None]) -> None:
        self.handle, self.manifest, self.progress = opened.handle, opened.manifest, progress
        manifest = opened.manifest
        self.keys: dict[int, list[str]] = {}
        for item in manifest.tensors + manifest.arrays:
            self.keys.setdefault(item.storage, []).append(item.key)
        self.owner: dict[int, int] = {}
        for sid, entry in enumerate(manifest.storages):
            for index in range(entry.first_chunk, entry.first_chunk + entry.num_chunks):
                self.owner.setdefault(index, sid)

    def keys_of(self, index: int) -> list[str]:
        return self.keys.get(self.owner.get(index, -1), [])

    def cost(self, index: int) -> int:
        """Bytes checking the chunk holds: stored, plus decoded unless raw."""
        chunk = self.manifest.chunks[index]
        return chunk.stored_len + (chunk.raw_len if chunk.codec != "raw" else 0)

    def check(self, index: int) -> str | None:
        """What is wrong with chunk ``index``, or None."""
        chunk = self.manifest.chunks[index]
        sid = self.owner.get(index)
        itemsize = self.manifest.storages[sid].itemsize if sid is not None else 1
        try:
            stored = self.handle.read_range(chunk.offset, chunk.stored_len)
        except FileReplacedError:
            raise  # not this chunk's fault: the whole file is verified again
        except AsyncCkptError as exc:
            return f"read failed: {exc}"
        finally:
            self.progress(chunk.stored_len)
        if len(stored) != chunk.stored_len:
            return f"only {len(stored)} of {chunk.stored_len} bytes could be read"
        actual = checksum(stored)
        if actual != chunk.crc32:
            return f"checksum mismatch: crc32 {actual:#010x}, recorded {chunk.crc32:#010x}"
        if chunk.codec != "raw":
            try:
                decode_chunk(stored, chunk.codec, itemsize, memoryview(bytearray(chunk.raw_len)))
            except FormatError as exc:
                return (
                    f"does not decode although its checksum matches ({exc}); the file was "
                    "written by an incompatible asyncckpt, or crafted"
                )
        return None


def _check_all(checker: _ChunkChecker, workers: int, report: FileReport) -> None:
    """Check every chunk on ``workers`` threads, holding at most ``_VERIFY_BUDGET`` bytes."""
    with ThreadPoolExecutor(workers, thread_name_prefix="asyncckpt-verify") as pool:
        window: deque[tuple[int, Future[str | None]]] = deque()
        inflight = 0

        def settle() -> None:
            nonlocal inflight
            index, future = window.popleft()
            inflight -= checker.cost(index)
            detail = future.result()
            if detail is not None:
                report.bad_chunks.append(BadChunk(index, checker.keys_of(index), detail))

        for index in range(len(checker.manifest.chunks)):
            while window and (
                len(window) >= 2 * workers or inflight + checker.cost(index) > _VERIFY_BUDGET
            ):
                settle()
            inflight += checker.cost(index)
            window.append((index, pool.submit(checker.check, index)))
        while window:
            settle()


def verify_file(
    storage: Storage,
    path: str,
    *,
    threads: int | None = None,
    progress: Callable[[int], None] | None = None,
    step: int | None = None,
    max_bytes: int | None = None,
    settings: SettingsArg = None,
) -> FileReport:
    """Read a whole file and check everything, collecting *every* problem.

    Unlike a load, which stops at the first damaged chunk, this reads and checks every
    chunk (checksum over the stored bytes, then a full decode) and validates the object
    tree, so a report names each bad chunk and the keys whose data it holds. ``threads``
    chunk readers (default: the ``threads`` tunable of ``settings``, which this public
    function resolves as ``asyncckpt.load`` does: it is an entry point) report the bytes
    read to ``progress``; ``step`` is the file's version, for the report. A file whose load
    would need more than ``max_bytes`` for its decoded data is reported ``too_large``, its
    chunks not read. ``report.ok`` is True only when nothing is wrong.

    Example:
        >>> import torch, asyncckpt
        >>> from asyncckpt._storage import resolve
        >>> _ = asyncckpt.save({"w": torch.ones(3)}, "memory://v/one.ackpt").result()
        >>> verify_file(*resolve("memory://v/one.ackpt", None)).ok
        True
    """
    name = display(storage, path)
    workers = max(1, threads or Settings.of(settings).threads)
    meter = progress or (lambda n: None)
    try:
        return read_file(
            storage, path, lambda opened: _verify(opened, name, step, meter, workers, max_bytes)
        )
    except AsyncCkptError as exc:
        report = FileReport(name, step)
        report.errors.append(str(exc))
        return report


def _verify(
    opened: OpenedFile,
    name: str,
    step: int | None,
    meter: Callable[[int], None],
    workers: int,
    max_bytes: int | None,
) -> FileReport:
    """:func:`verify_file` of a file opened (one attempt at it)."""
    report = FileReport(name, step)
    manifest = opened.manifest
    report.size = opened.size
    report.chunks = len(manifest.chunks)
    report.raw_bytes = sum(s.nbytes for s in manifest.storages)
    report.stored_bytes = sum(c.stored_len for c in manifest.chunks)
    meter(max(0, opened.size - report.stored_bytes))
    try:
        Budget(max_bytes).charge(report.file, report.raw_bytes, "its storages")
    except MemoryBudgetError as exc:
        report.errors.append(str(exc))
        report.too_large = True
        return report
    try:
        manifest_tree(opened)
    except FormatError as exc:
        report.errors.append(str(exc))
    _check_all(_ChunkChecker(opened, meter), workers, report)
    return report


def _show_keys(keys: list[str]) -> str:
    if not keys:
        return "(no keys: the chunk belongs to no storage)"
    return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def _root_files(
    ref: RootRef, every: bool, warnings: list[str], settings: Settings
) -> list[FileRef]:
    """The files to verify under a root, noting what a reader of the root would see."""
    if every and ref.step is not None:
        raise UsageError("asyncckpt: give either ROOT@STEP or --all, not both")
    storage, root = ref.storage, ref.path
    if is_dcp_directory(storage, root):
        if every:
            raise UsageError(f"asyncckpt: {ref.name} is an asyncckpt.dcp directory; no --all")
        return dcp_files(ref, settings)
    if ref.step is None and not is_root(storage, root) and storage.list_dir(root):
        return _files_below(ref, every, warnings, settings)
    committed = committed_steps(storage, root)
    if every and not committed:
        raise CheckpointNotFoundError(f"no committed checkpoint under {ref.name}")
    steps = committed if every else [chosen_step(ref)]
    files = [f for s in steps for f in files_of(ref, s)]
    record = read_version_file(storage, root)
    if record is None and committed:
        warnings.append(
            f"the version file under {ref.name} is missing or damaged (readers fall back "
            f"to step {committed[-1]}; a Checkpointer opened on the root rewrites it)"
        )
    elif record is not None and record.step not in committed:
        warnings.append(
            f"the version file names step {record.step}, which is not committed (readers "
            "fall back to the newest committed step)"
        )
    pending = [s for s in step_dirs(storage, root) if s not in committed]
    if pending:
        warnings.append(
            "not committed (in progress, failed or interrupted; readers never see them): "
            f"step {', '.join(map(str, pending))}"
        )
    return files


def _files_below(
    ref: RootRef, every: bool, warnings: list[str], settings: Settings
) -> list[FileRef]:
    """A folder that is no checkpoint: the files of every checkpoint below it, as ``ls``
    lists them (asyncckpt files under Lightning's ``.ckpt`` names included)."""
    found = checkpoints_below(ref.storage, ref.path)
    if not found:
        raise CommandFailed(f"verify: {ref.name}: {NOTHING_HERE}")
    files: list[FileRef] = []
    for path, layout in found:
        if layout == "file":
            files.append(FileRef(ref.storage, path))
        else:
            files += _root_files(RootRef(ref.storage, path), every, warnings, settings)
    return files


def _report_lines(
    reports: list[FileReport],
    warnings: list[str],
    damaged: list[FileReport],
    large: list[FileReport],
    chunks: int,
) -> list[str]:
    lines = []
    for r in reports:
        where = r.file + (f" (step {r.step})" if r.step is not None else "")
        if r.ok:
            lines.append(
                f"{paint('OK', 'green')}   {where}: {plural(r.chunks, 'chunk')}, "
                f"{format_bytes(r.raw_bytes)} raw, "
                f"{format_bytes(r.stored_bytes)} stored, every checksum matches"
            )
            continue
        lines.append(f"{paint('BAD', 'red')}  {where}")
        lines += [f"     {e}" for e in r.errors]
        for b in r.bad_chunks:
            lines.append(f"     chunk {b.chunk}: {b.detail}; keys: {_show_keys(b.keys)}")
    lines += [f"note: {w}" for w in warnings]
    lines.append(
        f"{len(reports) - len(damaged) - len(large)} of {plural(len(reports), 'file')} sound"
        + (f"; {len(damaged)} damaged ({plural(chunks, 'bad chunk')})" if damaged else "")
        + (f"; {len(large)} too large for --max-bytes, not read" if large else "")
    )
    return lines


def cmd_verify(args: argparse.Namespace) -> int:
    """``asyncckpt verify PATH | ROOT[@STEP|--all]``: exit status 0 when everything is
    sound, else CommandFailed after the report is printed."""
    ref = locate(args.target, args.options, settings=args.settings)
    warnings: list[str] = []
    if isinstance(ref, FileRef):
        if args.all:
            raise UsageError(f"asyncckpt: --all needs a checkpoint root; {args.target} is a file")
        reject_other_format(ref)
        files = [ref]
        note = pending_note(ref.storage, ref.path)
        if note:
            warnings.append(f"{note}; this checks the file as it was before that save")
    else:
        files = _root_files(ref, args.all, warnings, args.settings)
    total = 0
    for f in files:
        with contextlib.suppress(AsyncCkptError):
            total += f.storage.size(f.path)
    with progress(args, total, "verify") as bar:
        reports = [
            verify_file(
                f.storage,
                f.path,
                progress=bar.update,
                step=f.step,
                max_bytes=args.max_bytes,
                settings=args.settings,
            )
            for f in files
        ]
    damaged = [r for r in reports if not r.ok and not r.too_large]
    large = [r for r in reports if r.too_large]  # not ok either: its error says why
    chunks = sum(len(r.bad_chunks) for r in damaged)
    ok = not damaged and not large
    doc = {"ok": ok, "files": [r.as_dict() for r in reports], "warnings": warnings}
    emit(args, doc, _report_lines(reports, warnings, damaged, large, chunks))
    if damaged:
        raise CommandFailed(
            f"verify: {len(damaged)} of {plural(len(reports), 'file')} damaged "
            f"({plural(chunks, 'bad chunk')}); load an older version or restore these files"
        )
    if large:
        raise CommandFailed(
            f"verify: {len(large)} of {plural(len(reports), 'file')} would need more memory "
            f"than --max-bytes {args.max_bytes:,} to load; not read"
        )
    return EXIT_OK
