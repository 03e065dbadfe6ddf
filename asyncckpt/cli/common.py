"""What every ``asyncckpt`` subcommand shares: errors and exit codes, common options, output,
and finding what a command is pointed at (a file, a root, a version of a root).

Nothing here imports another module of :mod:`asyncckpt.cli`: the command modules and
:mod:`asyncckpt.cli.main` import this one, never the other way round.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from asyncckpt._format.container import parse_json
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt._versions import paths, pending
from asyncckpt._versions.paths import is_dcp_directory as is_dcp_directory
from asyncckpt._versions.protocol import (
    COMMIT_FILE,
    FAILED_FILE,
    failure_of,
    read_commit_strict,
    step_dir,
)
from asyncckpt.cli.progress import Progress
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    FormatError,
    PathKindError,
)

if TYPE_CHECKING:  # torch-free at import: `asyncckpt --help` must not import torch
    from asyncckpt._engine.decode import OpenedFile

log = logging.getLogger(__name__)


class UsageError(Exception):
    """The command line is wrong (exit status 2)."""


class CommandFailed(Exception):
    """The command ran and its outcome is a failure (exit status 1); output is printed."""


EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

#: Checkpoint formats ``convert`` knows, and the file extensions that select them.
FORMATS: dict[str, tuple[str, ...]] = {
    "torch": (".pt", ".pth", ".bin"),
    "ackpt": (".ackpt",),
    "safetensors": (".safetensors",),
}

#: The type ``ArgumentParser.add_subparsers`` returns (each command module adds to it).
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


# -- the parser -----------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (raised, so ``main`` reports them)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see '{self.prog} --help')")


def add_common_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """Options every command takes, on the top-level parser and each subcommand's. There
    (``suppress``) an option not given is left out of the namespace, so a value given before
    the subcommand is not overwritten by the subcommand's default."""

    group = parser.add_argument_group("common options")
    group.add_argument(
        "--storage-option",
        "-o",
        action="append",
        metavar="KEY=VALUE",
        default=argparse.SUPPRESS if suppress else [],
        help="fsspec storage option, e.g. endpoint_url=http://minio:9000 (repeatable; "
        "values are JSON when they parse, dotted keys nest: client_kwargs.region_name=eu)",
    )
    # The aws CLI's flag, which S3 users type first: the same as -o endpoint_url=URL.
    group.add_argument(
        "--endpoint-url",
        metavar="URL",
        default=argparse.SUPPRESS if suppress else None,
        help="an S3-compatible store's endpoint (as the aws CLI's); -o endpoint_url=URL",
    )
    for flags, text in (
        (("--json",), "machine-readable output"),
        (("-v", "--verbose"), "show the library's INFO log on stderr"),
        (("--debug",), "show DEBUG log and a traceback on errors"),
        (
            ("--no-progress",),
            "never draw a progress bar (it is drawn only when stderr is a terminal)",
        ),
    ):
        default = argparse.SUPPRESS if suppress else False
        group.add_argument(*flags, action="store_true", default=default, help=text)


def new_command(
    sub: Subparsers,
    name: str,
    help: str,
    description: str,
    run: Callable[[argparse.Namespace], int] | None = None,
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` with the common options; ``run`` runs it (default:
    :func:`lazy_command`, which imports the command's module when it runs)."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description)
    add_common_options(parser, suppress=True)
    parser.set_defaults(run=run or lazy_command(name))
    return parser


def lazy_command(name: str) -> Callable[[argparse.Namespace], int]:
    """Command ``name``'s ``run``: ``asyncckpt.cli.NAME.cmd_NAME``, imported only when the
    command runs, so that building the parser (``--help``) imports no torch.

    Example:
        >>> run = lazy_command("ls")
        >>> callable(run)
        True
    """

    def run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(f"asyncckpt.cli.{name}"), f"cmd_{name}")(args))

    return run


def parse_storage_options(pairs: Sequence[str], endpoint_url: str | None = None) -> dict[str, Any]:
    """``["endpoint_url=http://x", "client_kwargs.region_name=eu"]`` -> nested options;
    ``endpoint_url`` (``--endpoint-url``) is one more, ``endpoint_url=URL``.

    Values that parse as JSON (numbers, true/false/null, objects, lists) are taken as such;
    anything else is a string. A later key wins.

    Raises:
        UsageError: a pair without ``=``, a dotted key below a key that is not a mapping,
            or ``--endpoint-url`` and ``-o endpoint_url=`` naming two endpoints.

    Example:
        >>> parse_storage_options(["anon=true", "client_kwargs.region_name=eu-west-1"])
        {'anon': True, 'client_kwargs': {'region_name': 'eu-west-1'}}
        >>> parse_storage_options([], endpoint_url="http://127.0.0.1:9000")
        {'endpoint_url': 'http://127.0.0.1:9000'}
    """
    options = _parse_pairs(pairs)
    if endpoint_url is not None:
        given = options.setdefault("endpoint_url", endpoint_url)
        if given != endpoint_url:
            raise UsageError(
                f"asyncckpt: --endpoint-url {endpoint_url} and -o endpoint_url={given} name "
                "two endpoints; give one"
            )
    return options


def _parse_pairs(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"asyncckpt: --storage-option expects KEY=VALUE, got {pair!r}")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        *parents, leaf = key.strip().split(".")
        node = options
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UsageError(f"asyncckpt: --storage-option {key}: {part} is not a mapping")
            node = child
        node[leaf] = value
    return options


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """A size as a user writes it: ``4096``, ``64MiB``, ``1.5G``; ``KiB``/``MiB``/``GiB``
    and a bare ``K``/``M``/``G`` are binary, ``KB``/``MB``/``GB`` decimal (``5GB`` is
    5·10⁹ bytes, as Hugging Face counts ``max_shard_size``).

    Raises:
        argparse.ArgumentTypeError: not a size (the parser reports a usage error).

    Example:
        >>> parse_bytes("64MiB"), parse_bytes("1.5g"), parse_bytes("4096"), parse_bytes("5GB")
        (67108864, 1610612736, 4096, 5000000000)
    """
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b)?", text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes such as 4096, 512MiB or 8GiB, got {text!r}"
        )
    number, unit, suffix = match.groups()
    if suffix == "b" and unit:  # KB, MB, GB, TB: decimal
        return int(float(number) * 1000 ** "kmgt".index(unit) * 1000)
    return int(float(number) * _UNITS[unit])


def add_max_bytes(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--max-bytes`` (the memory budget of a load, as ``asyncckpt.load`` takes it)."""
    parser.add_argument(
        "--max-bytes",
        type=parse_bytes,
        metavar="SIZE",
        help=f"{what} a file whose decoded data needs more memory than SIZE (e.g. 8GiB), "
        "before allocating any of it",
    )


# -- output ---------------------------------------------------------------------------------


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an ``s`` unless ``n`` is 1.

    Example:
        >>> plural(1, "chunk"), plural(2, "chunk")
        ('1 chunk', '2 chunks')
    """
    return f"{n} {word}{'' if n == 1 else 's'}"


def emit(args: argparse.Namespace, doc: Any, text: str | Sequence[str]) -> None:
    """Print ``doc`` as JSON under ``--json``, else ``text`` (one string or lines)."""
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    elif isinstance(text, str):
        print(text)
    else:
        for line in text:
            print(line)


def progress(args: argparse.Namespace, total: int | None, label: str) -> Progress:
    """A progress bar on stderr, off under ``--no-progress`` (and when it is no terminal)."""
    return Progress(total, label, enabled=False if args.no_progress else None)


def short_time(iso: str | None) -> str:
    """An ISO time as ``YYYY-MM-DD HH:MM:SS`` in UTC, ``-`` when there is none.

    Example:
        >>> short_time("2026-01-02T03:04:05+01:00"), short_time(None)
        ('2026-01-02 02:04:05', '-')
    """
    if not iso:
        return "-"
    try:
        moment = datetime.datetime.fromisoformat(iso)
    except ValueError:
        return iso[:19]
    if moment.tzinfo is not None:
        moment = moment.astimezone(datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


# -- finding what a command is pointed at ----------------------------------------------------


def display(storage: Storage, path: str) -> str:
    """A path as the user would write it: relative to the working directory when local
    and below it, else as the storage describes it (a URL)."""
    if storage.local_paths:
        with contextlib.suppress(ValueError):
            relative = os.path.relpath(path)
            if not relative.startswith(os.pardir):
                return relative
    return storage.describe(path)


@dataclass(frozen=True)
class _Located:
    storage: Storage
    path: str
    step: int | None = None

    @property
    def name(self) -> str:
        return display(self.storage, self.path)


@dataclass(frozen=True)
class FileRef(_Located):
    """One ``.ackpt`` (or other) file."""


@dataclass(frozen=True)
class RootRef(_Located):
    """A checkpoint root, optionally with a step chosen by ``ROOT@STEP``."""


def locate(
    spec: str, options: dict[str, Any], *, one: bool = False, settings: Settings | None = None
) -> FileRef | RootRef:
    """What ``spec`` names, as :func:`asyncckpt._versions.paths.find` reads it (the path
    model ``asyncckpt.load`` uses too): a :class:`FileRef` for a file, a :class:`RootRef`
    for a root (``ROOT``, ``ROOT@STEP``, a Hugging Face run's ``output_dir`` or
    ``checkpoint-N``), an ``asyncckpt.dcp`` directory or a folder. With ``one`` (commands
    that read one checkpoint), a folder stands for the one checkpoint below it. The storage
    is built with ``settings`` (a command's; None: its constructor resolves them).

    Raises:
        CheckpointNotFoundError: nothing is there (or, with ``one``, below the folder).
        UsageError: ``@STEP`` after something that is not a root, ``NAME@STEP`` naming both
            a path and a version, or (with ``one``) a folder of several checkpoints.

    Example:
        >>> isinstance(locate(".", {}), RootRef)
        True
    """
    try:
        target = paths.find(spec, options, settings)
        if one and target.kind == paths.FOLDER:
            target = paths.one_checkpoint(target)
    except PathKindError as exc:
        raise UsageError(f"asyncckpt: {exc}") from exc
    storage, path = target.storage, target.path
    if target.kind == paths.FILE:
        return FileRef(storage, path)
    if target.kind != paths.MISSING:
        return RootRef(storage, path, target.step)
    note = pending_note(storage, path)
    raise CheckpointNotFoundError(
        f"{display(storage, path)}: no such file or checkpoint root"
        + (f" yet ({note})" if note else "")
    )


def pending_note(storage: Storage, path: str) -> str | None:
    """A line about a drop-in save of file ``path`` in flight (its marker), if there is one.

    Example:
        >>> from asyncckpt._storage import LocalStorage
        >>> pending_note(LocalStorage(), "/nonexistent/model.ackpt") is None
        True
    """
    with contextlib.suppress(AsyncCkptError):
        return pending.describe_pending(storage, path)
    return None


def files_of(root: RootRef, step: int) -> list[FileRef]:
    """The data files of committed version ``step`` (raises as
    :func:`~asyncckpt._versions.paths.version_of` when it is not committed)."""
    storage = root.storage
    _, commit = paths.version_of(paths.Target(storage, root.path, paths.ROOT, step))
    directory = step_dir(storage, root.path, step)
    # A sharded version also names its DCP metadata (JSON), which is not an asyncckpt file.
    names = [name for name in commit.files if name.endswith(".ackpt")]
    return [FileRef(storage, storage.join(directory, name), step) for name in names]


def chosen_step(root: RootRef) -> int:
    """``ROOT@STEP``'s step, else the latest committed one (CheckpointNotFoundError: none)."""
    return paths.version_of(paths.Target(root.storage, root.path, paths.ROOT, root.step))[0]


def single_file(ref: FileRef | RootRef) -> FileRef:
    """The one data file a PATH or ROOT[@STEP] stands for."""
    if isinstance(ref, FileRef):
        return ref
    files = files_of(ref, chosen_step(ref))
    if len(files) != 1:
        raise FormatError(
            f"step {files[0].step} under {ref.name} has {len(files)} data files; this "
            "asyncckpt reads single-writer versions only"
        )
    return files[0]


def need_root(ref: FileRef | RootRef, spec: str) -> RootRef:
    """``ref`` as a root without ``@STEP``, or a usage error naming ``spec``."""
    if isinstance(ref, FileRef):
        raise UsageError(
            f"asyncckpt: {spec} is a file, not a checkpoint root (try 'asyncckpt inspect {spec}')"
        )
    if ref.step is not None:
        raise UsageError(f"asyncckpt: {spec}: this command takes a ROOT without @STEP")
    return ref


# -- what a version and a file hold (ls, gc, inspect, verify) ----------------------------------


def record_time(storage: Storage, path: str) -> str | None:
    """The informational ``time`` field of a protocol record (COMMIT, FAILED)."""
    try:
        doc = parse_json(storage.read_bytes(path, 1 << 20), storage.describe(path))
    except AsyncCkptError:  # FormatError included: deep nesting is one, not a RecursionError
        return None
    value = doc.get("time") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else None


def _incomplete_info(storage: Storage, root: str, step: int, info: dict[str, Any]) -> None:
    directory = step_dir(storage, root, step)
    names = [n for n in storage.list_dir(directory) if n not in (COMMIT_FILE, FAILED_FILE)]
    info["files"] = names
    partial = 0
    for name in names:
        with contextlib.suppress(AsyncCkptError):
            partial += storage.size(storage.join(directory, name))
    info["stored_bytes"] = partial
    failure = failure_of(storage, root, step)
    if failure is not None:
        info["state"] = "failed"
        info["problem"] = failure
        info["time"] = record_time(storage, storage.join(directory, FAILED_FILE))


def _committed_sizes(
    storage: Storage, directory: str, files: Sequence[str], info: dict[str, Any]
) -> None:
    from asyncckpt._engine.decode import open_file  # imports torch: only when run

    raw: int | None = 0
    stored: int | None = 0
    for name in files:
        path = storage.join(directory, name)
        try:
            with open_file(storage, path) as opened:
                manifest = opened.manifest
        except AsyncCkptError as exc:
            info["problem"] = str(exc)
            raw = None
            try:
                stored = None if stored is None else stored + storage.size(path)
            except AsyncCkptError:
                stored = None
            continue
        raw = None if raw is None else raw + sum(s.nbytes for s in manifest.storages)
        stored = None if stored is None else stored + opened.size
    info["raw_bytes"] = raw
    info["stored_bytes"] = stored
    info["ratio"] = stored / raw if raw and stored is not None else None


def version_info(storage: Storage, root: str, step: int, latest: int | None) -> dict[str, Any]:
    """What ``ls`` shows of one version: state, time, files, raw and stored bytes, problem.

    The state is ``committed``, ``incomplete`` (no ``COMMIT``) or ``unreadable`` (a
    ``COMMIT`` this asyncckpt cannot understand: readers skip it, nothing deletes it).
    """
    try:
        commit = read_commit_strict(storage, root, step)
    except FormatError as exc:  # damaged, oversized, or from a newer protocol
        return {**_empty_info(step, "unreadable"), "problem": str(exc)}
    info = _empty_info(step, "committed" if commit is not None else "incomplete")
    info["latest"] = step == latest
    if commit is None:
        _incomplete_info(storage, root, step, info)
        return info
    directory = step_dir(storage, root, step)
    info["time"] = record_time(storage, storage.join(directory, COMMIT_FILE))
    info["files"] = list(commit.files)
    info["kind"] = commit.kind
    info["metrics"] = dict(commit.metrics)
    _committed_sizes(storage, directory, [n for n in commit.files if n.endswith(".ackpt")], info)
    return info


def _empty_info(step: int, state: str) -> dict[str, Any]:
    return {
        "step": step,
        "state": state,
        "latest": False,
        "time": None,
        "files": [],
        "raw_bytes": None,
        "stored_bytes": None,
        "ratio": None,
        "metrics": {},
        "problem": None,
    }


@dataclass(frozen=True)
class DataRef:
    """Stands for a tensor or array while walking a manifest's tree without its data."""

    table: str
    index: int


def manifest_tree(opened: OpenedFile) -> Any:
    """The saved object with :class:`DataRef` placeholders in place of tensors and arrays
    (FormatError: the manifest's tree is not valid)."""
    from asyncckpt._format.tree import unflatten  # imports torch: only when run

    manifest = opened.manifest
    tensors: list[Any] = [DataRef("tensor", i) for i in range(len(manifest.tensors))]
    arrays: list[Any] = [DataRef("array", i) for i in range(len(manifest.arrays))]
    return unflatten(manifest.root, tensors, arrays, opened.name)


# -- the layouts: Checkpointer roots (plain, sharded), asyncckpt.dcp directories ---------------


def dcp_files(ref: RootRef, settings: Settings) -> list[FileRef]:
    """The data files an ``asyncckpt.dcp`` directory's metadata names, in name order
    (raises as :meth:`Reader.read_metadata`: no metadata yet, or a malformed one)."""
    from asyncckpt._versions.dcp_reader import Reader  # imports torch: only when run

    if ref.step is not None:
        raise UsageError(f"asyncckpt: {ref.name} is an asyncckpt.dcp directory; it has no @STEP")
    metadata = Reader.at(ref.storage, ref.path, settings).read_metadata()
    names = sorted({loc.file for loc in metadata.storage_data.values()})
    return [FileRef(ref.storage, ref.storage.join(ref.path, name)) for name in names]
