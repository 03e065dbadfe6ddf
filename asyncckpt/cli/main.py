"""The ``asyncckpt`` command: look into, check, clean and convert checkpoints.

Subcommands (``asyncckpt COMMAND --help`` for each)::

    asyncckpt ls ROOT                          versions under a Checkpointer root
    asyncckpt inspect PATH | ROOT[@STEP]       keys, dtypes, shapes, sizes, devices, codecs
    asyncckpt verify PATH | ROOT[@STEP|--all]  read everything, check every checksum
    asyncckpt gc ROOT --keep N [--dry-run]     retention, as the Checkpointer applies it
    asyncckpt convert SRC DST                  torch.save <-> asyncckpt <-> safetensors
    asyncckpt bench URL                        sync vs async save and load on your storage

Every command takes local paths or fsspec URLs, ``--storage-option key=value`` (repeatable;
values are parsed as JSON when they can be, dotted keys nest), ``--json`` for
machine-readable output, ``-v`` for the library's log and ``--debug`` for tracebacks.

Exit status: 0 when the command did what was asked (and, for ``verify``, everything is
sound); 1 when it failed or found damage; 2 for a usage error. Errors are one line on
stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import logging
import math
import os
import pickle
import re
import statistics
import struct
import sys
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any, NoReturn, cast

import numpy as np
import torch

from . import config
from ._version import __version__
from .api import stage, write_options
from .codec import checksum, decode_chunk
from .errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    FormatError,
    IncompleteCheckpointError,
)
from .format import DTYPE_ITEMSIZE, FORMAT_VERSION, MAGIC, Manifest
from .placement import Placement
from .progress import Progress, format_bytes
from .protocol import (
    COMMIT_FILE,
    FAILED_FILE,
    committed_steps,
    delete_version,
    failure_of,
    latest_step,
    read_commit,
    read_version_file,
    retention_plan,
    step_dir,
    step_dirs,
)
from .reader import OpenedFile, materialize, open_file
from .storage import AtomicWriter, LocalStorage, Storage, is_temp_name, resolve
from .tree import child_path, unflatten
from .writer import write_snapshot

log = logging.getLogger("asyncckpt")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

#: Checkpoint formats ``convert`` knows, and the file extensions that select them.
FORMATS: dict[str, tuple[str, ...]] = {
    "torch": (".pt", ".pth", ".bin"),
    "ackpt": (".ackpt",),
    "safetensors": (".safetensors",),
}


class UsageError(Exception):
    """The command line is wrong (exit status 2)."""


class CommandFailed(Exception):
    """The command ran and its outcome is a failure (exit status 1); output is printed."""


# -- the parser -----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (raised, so ``main`` reports them)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see '{self.prog} --help')")


def _common(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """Options every command takes; on subcommands they default to 'not given'."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("common options")
    group.add_argument(
        "--storage-option",
        "-o",
        action="append",
        metavar="KEY=VALUE",
        default=default([]),
        help="fsspec storage option, e.g. endpoint_url=http://minio:9000 (repeatable; "
        "values are JSON when they parse, dotted keys nest: client_kwargs.region_name=eu)",
    )
    group.add_argument(
        "--json", action="store_true", default=default(False), help="machine-readable output"
    )
    group.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default(False),
        help="show the library's INFO log on stderr",
    )
    group.add_argument(
        "--debug",
        action="store_true",
        default=default(False),
        help="show DEBUG log and a traceback on errors",
    )
    group.add_argument(
        "--no-progress",
        action="store_true",
        default=default(False),
        help="never draw a progress bar (it is drawn only when stderr is a terminal)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``asyncckpt`` argument parser."""
    parser = _Parser(
        prog="asyncckpt",
        description="Look into, check, clean and convert asyncckpt checkpoints.",
        epilog="Exit status: 0 success, 1 failure or damage found, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"asyncckpt {__version__}")
    _common(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=description)
        _common(p, suppress=True)
        return p

    p = command(
        "ls",
        "list the versions under a checkpoint root",
        "List the versions under a Checkpointer root: step, committed or not, time, raw and "
        "stored size, and which one the version file names.",
    )
    p.add_argument("root", metavar="ROOT", help="checkpoint root (directory or URL)")
    p.set_defaults(run=cmd_ls)

    p = command(
        "inspect",
        "show the keys, dtypes, shapes, sizes and codecs of a checkpoint",
        "Show what a checkpoint holds without reading its data: the key tree with dtypes, "
        "shapes, sizes, saved devices and codecs. ROOT alone means its latest version.",
    )
    p.add_argument("target", metavar="PATH|ROOT[@STEP]")
    p.set_defaults(run=cmd_inspect)

    p = command(
        "verify",
        "read a checkpoint and check every checksum",
        "Read every byte of a checkpoint and check every chunk's checksum and the whole "
        "structure. Exit status 0 only when everything is sound; each bad chunk is named "
        "with the keys it holds. ROOT alone means its latest version.",
    )
    p.add_argument("target", metavar="PATH|ROOT[@STEP]")
    p.add_argument("--all", action="store_true", help="verify every committed version of ROOT")
    p.set_defaults(run=cmd_verify)

    p = command(
        "gc",
        "delete old versions as the Checkpointer's retention would",
        "Apply the Checkpointer's retention rules: keep the newest N committed versions and "
        "the one the version file names, delete older committed versions and leftovers of "
        "interrupted saves older than it. Never touches anything newer than the version "
        "file's step (a save in progress).",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--keep", type=int, required=True, metavar="N", help="versions to keep")
    p.add_argument("--dry-run", action="store_true", help="print what would go; delete nothing")
    p.add_argument(
        "--remove-temp",
        action="store_true",
        help="also delete temp files of interrupted writes directly under ROOT (only when no "
        "job is writing to ROOT: a running save's temp file looks the same)",
    )
    p.set_defaults(run=cmd_gc)

    p = command(
        "convert",
        "convert between torch.save, asyncckpt and safetensors files",
        "Convert a checkpoint between torch.save (.pt/.pth/.bin; read with "
        "weights_only=True), asyncckpt (.ackpt, or ROOT[@STEP]) and safetensors "
        "(.safetensors; a flat dict of tensors). The same tensors come out.",
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--from", dest="src_format", choices=sorted(FORMATS), help="format of SRC")
    p.add_argument("--to", dest="dst_format", choices=sorted(FORMATS), help="format of DST")
    p.add_argument(
        "--key",
        metavar="A/B",
        help="convert only this part of the state, e.g. --key model (a /-separated path)",
    )
    p.add_argument(
        "--compression",
        choices=["zstd", "none"],
        default="zstd",
        help="for an asyncckpt DST (default zstd)",
    )
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.set_defaults(run=cmd_convert)

    p = command(
        "bench",
        "measure sync vs async save and load on your storage",
        "Save and load a random state with torch.save/torch.load and asyncckpt on URL (a "
        "directory or fsspec URL; a temporary folder is created in it and removed), print "
        "medians as ratios to a plain in-memory copy, and plot them.",
    )
    p.add_argument("url", metavar="URL")
    p.add_argument("--size-mib", type=float, default=256.0, help="state size (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement (default 3)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of the state's tensors (default float32)",
    )
    p.add_argument(
        "--plot",
        default="asyncckpt-bench.png",
        metavar="PNG",
        help="where to write the plot (default ./asyncckpt-bench.png; needs matplotlib)",
    )
    p.add_argument("--no-plot", action="store_true", help="do not write a plot")
    p.add_argument("--keep", action="store_true", help="keep the files written on URL")
    p.set_defaults(run=cmd_bench)
    return parser


# -- entry point ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    json_out = "--json" in args_list
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormatter())
    saved = (log.level, log.propagate)
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.DEBUG if debug else logging.WARNING)
    try:
        try:
            args = build_parser().parse_args(args_list)
        except SystemExit as exc:  # --help and --version print, then "exit"
            return exc.code if isinstance(exc.code, int) else EXIT_OK
        if args.verbose and not args.debug:
            log.setLevel(logging.INFO)
        args.options = parse_storage_options(args.storage_option)
        code: int = args.run(args)
        return code
    except UsageError as exc:
        return _fail(str(exc), EXIT_USAGE, debug, json_out)
    except CommandFailed as exc:
        return _fail(f"asyncckpt: {exc}", EXIT_FAILURE, debug, json_out, report=False)
    except BrokenPipeError:  # e.g. `asyncckpt inspect ROOT | head`: stop quietly
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return _fail("asyncckpt: interrupted", 130, debug, json_out)
    except AsyncCkptError as exc:
        return _fail(f"asyncckpt: error: {exc}", EXIT_FAILURE, debug, json_out)
    except Exception as exc:
        return _fail(f"asyncckpt: error: {_describe(exc)}", EXIT_FAILURE, debug, json_out)
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


class _LogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"asyncckpt: {record.levelname.lower()}: {record.getMessage()}"


def _describe(exc: BaseException) -> str:
    """One line for an exception that is not an asyncckpt error."""
    if isinstance(exc, pickle.UnpicklingError):
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        marker = "WeightsUnpickler error:"
        at = next((i for i, ln in enumerate(lines) if marker in ln), len(lines) - 1)
        detail = lines[at].split(marker)[-1].strip() if lines else ""
        if not detail and at + 1 < len(lines):
            detail = lines[at + 1]
        return (
            f"torch.load(weights_only=True) refused the file: {detail} (if you trust the file, "
            "load it in Python with full unpickling allowed and save plain data)"
        )
    text = " ".join(str(exc).split()) or "(no message)"
    if isinstance(exc, (OSError, ValueError, TypeError, KeyError, RuntimeError)):
        return f"{text} ({type(exc).__name__})"
    return f"{type(exc).__name__}: {text} (a bug? rerun with --debug and report it)"


def _fail(message: str, code: int, debug: bool, json_out: bool, report: bool = True) -> int:
    if debug and code != EXIT_USAGE:
        import traceback

        traceback.print_exc(file=sys.stderr)
    if json_out and report:
        print(json.dumps({"ok": False, "error": message, "exit_status": code}))
    print(message.replace("\n", " "), file=sys.stderr)
    return code


def parse_storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["endpoint_url=http://x", "client_kwargs.region_name=eu"]`` -> nested options.

    Values that parse as JSON (numbers, true/false/null, objects, lists) are taken as such;
    anything else is a string.

    Example:
        >>> parse_storage_options(["anon=true", "client_kwargs.region_name=eu-west-1"])
        {'anon': True, 'client_kwargs': {'region_name': 'eu-west-1'}}
    """
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


def plural(n: int, word: str) -> str:
    """``plural(1, "chunk")`` -> ``"1 chunk"``, ``plural(2, "chunk")`` -> ``"2 chunks"``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def _emit(args: argparse.Namespace, doc: Any, text: str | Sequence[str]) -> None:
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    elif isinstance(text, str):
        print(text)
    else:
        for line in text:
            print(line)


def _progress(args: argparse.Namespace, total: int | None, label: str) -> Progress:
    return Progress(total, label, enabled=False if args.no_progress else None)


def _threads() -> int:
    return config.tunable("threads", None)


# -- finding what a command is pointed at ----------------------------------------------------


def display(storage: Storage, path: str) -> str:
    """A path as the user would write it: relative to the working directory when local
    and below it, else as the storage describes it (a URL)."""
    if isinstance(storage, LocalStorage):
        with contextlib.suppress(ValueError):
            relative = os.path.relpath(path)
            if not relative.startswith(os.pardir):
                return relative
    return storage.describe(path)


@dataclass(frozen=True)
class FileRef:
    """One ``.ackpt`` (or other) file."""

    storage: Storage
    path: str
    step: int | None = None

    @property
    def name(self) -> str:
        return display(self.storage, self.path)


@dataclass(frozen=True)
class RootRef:
    """A checkpoint root, optionally with a step chosen by ``ROOT@STEP``."""

    storage: Storage
    path: str
    step: int | None = None

    @property
    def name(self) -> str:
        return display(self.storage, self.path)


def _kind(storage: Storage, path: str) -> str:
    """``"root"`` (a directory / prefix), ``"file"`` or ``"missing"``."""
    if isinstance(storage, LocalStorage):
        return "root" if os.path.isdir(path) else "file" if os.path.isfile(path) else "missing"
    if storage.list_dir(path):
        return "root"
    try:
        storage.size(path)
    except CheckpointNotFoundError:
        return "missing"
    return "file"


def locate(spec: str, options: dict[str, Any]) -> FileRef | RootRef:
    """Resolve ``PATH``, ``ROOT`` or ``ROOT@STEP``.

    Raises:
        CheckpointNotFoundError: nothing is there.
        UsageError: ``@STEP`` after something that is not a root.
    """
    storage, path = resolve(spec, options)
    kind = _kind(storage, path)
    if kind == "file":
        return FileRef(storage, path)
    if kind == "root":
        return RootRef(storage, path)
    match = re.fullmatch(r"(.+)@(\d{1,18})", spec)
    if match:
        storage, path = resolve(match.group(1), options)
        kind = _kind(storage, path)
        if kind == "root":
            return RootRef(storage, path, int(match.group(2)))
        if kind == "file":
            raise UsageError(
                f"asyncckpt: {match.group(1)} is a file; @STEP selects a version of a "
                "checkpoint root"
            )
    raise CheckpointNotFoundError(f"{display(storage, path)}: no such file or checkpoint root")


def files_of(root: RootRef, step: int) -> list[FileRef]:
    """The data files of committed version ``step``.

    Raises:
        IncompleteCheckpointError: ``step`` is not committed under the root.
    """
    storage = root.storage
    commit = read_commit(storage, root.path, step)
    if commit is None:
        committed = committed_steps(storage, root.path)
        raise IncompleteCheckpointError(
            f"step {step} is not committed under {root.name}; committed steps: "
            f"{', '.join(map(str, committed)) or 'none'}"
        )
    directory = step_dir(storage, root.path, step)
    return [FileRef(storage, storage.join(directory, name), step) for name in commit.files]


def chosen_step(root: RootRef) -> int:
    """``ROOT@STEP``'s step, else the latest committed one."""
    if root.step is not None:
        return root.step
    step = latest_step(root.storage, root.path)
    if step is None:
        raise CheckpointNotFoundError(f"no committed checkpoint under {root.name}")
    return step


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


def _need_root(ref: FileRef | RootRef, spec: str) -> RootRef:
    if isinstance(ref, FileRef):
        raise UsageError(
            f"asyncckpt: {spec} is a file, not a checkpoint root (try 'asyncckpt inspect {spec}')"
        )
    if ref.step is not None:
        raise UsageError(f"asyncckpt: {spec}: this command takes a ROOT without @STEP")
    return ref


# -- ls -------------------------------------------------------------------------------------


def _record_time(storage: Storage, path: str) -> str | None:
    """The informational ``time`` field of a protocol record (COMMIT, FAILED)."""
    try:
        doc = json.loads(storage.read_bytes(path, 1 << 20))
    except (AsyncCkptError, ValueError):
        return None
    value = doc.get("time") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else None


def _short_time(iso: str | None) -> str:
    if not iso:
        return "-"
    try:
        moment = datetime.datetime.fromisoformat(iso)
    except ValueError:
        return iso[:19]
    if moment.tzinfo is not None:
        moment = moment.astimezone(datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _version_info(storage: Storage, root: str, step: int, latest: int | None) -> dict[str, Any]:
    directory = step_dir(storage, root, step)
    commit = read_commit(storage, root, step)
    info: dict[str, Any] = {
        "step": step,
        "state": "committed" if commit is not None else "incomplete",
        "latest": step == latest,
        "time": None,
        "files": [],
        "raw_bytes": None,
        "stored_bytes": None,
        "ratio": None,
        "problem": None,
    }
    if commit is None:
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
            info["time"] = _record_time(storage, storage.join(directory, FAILED_FILE))
        return info
    info["time"] = _record_time(storage, storage.join(directory, COMMIT_FILE))
    info["files"] = list(commit.files)
    raw: int | None = 0
    stored: int | None = 0
    for name in commit.files:
        path = storage.join(directory, name)
        try:
            opened = open_file(storage, path)
        except AsyncCkptError as exc:
            info["problem"] = str(exc)
            raw = None
            try:
                stored = None if stored is None else stored + storage.size(path)
            except AsyncCkptError:
                stored = None
            continue
        raw = None if raw is None else raw + sum(s.nbytes for s in opened.manifest.storages)
        stored = None if stored is None else stored + opened.size
    info["raw_bytes"] = raw
    info["stored_bytes"] = stored
    info["ratio"] = stored / raw if raw and stored is not None else None
    return info


def cmd_ls(args: argparse.Namespace) -> int:
    """``asyncckpt ls ROOT``."""
    ref = _need_root(locate(args.root, args.options), args.root)
    storage, root = ref.storage, ref.path
    record = read_version_file(storage, root)
    latest = latest_step(storage, root)
    versions = [_version_info(storage, root, s, latest) for s in step_dirs(storage, root)]
    temps = [n for n in storage.list_dir(root) if is_temp_name(n)]
    committed = [v["step"] for v in versions if v["state"] == "committed"]
    if record is None:
        version_note = "missing or damaged" + (
            f"; readers use the newest committed step, {latest}" if latest is not None else ""
        )
    elif record.step not in committed:
        version_note = f"names step {record.step}, which is not committed" + (
            f"; readers use step {latest}" if latest is not None else ""
        )
    else:
        version_note = f"step {record.step}"
    doc = {
        "root": ref.name,
        "version_file": None if record is None else {"step": record.step, "writer": record.writer},
        "latest": latest,
        "versions": versions,
        "temp_files": temps,
    }
    lines = [f"{ref.name}: {len(committed)} committed of {len(versions)} versions; "]
    lines[0] += f"version file: {version_note}"
    if versions:
        rows = []
        for v in versions:
            raw, stored = v["raw_bytes"], v["stored_bytes"]
            state = v["state"] + (
                " (damaged)" if v["problem"] and v["state"] == "committed" else ""
            )
            rows.append(
                [
                    str(v["step"]),
                    state,
                    _short_time(v["time"]),
                    "-" if raw is None else format_bytes(raw),
                    "-" if stored is None else format_bytes(stored),
                    "-" if v["ratio"] is None else f"{100 * v['ratio']:.1f}%",
                    "<- version file" if record is not None and v["step"] == record.step else "",
                ]
            )
        lines += _table(["STEP", "STATE", "TIME (UTC)", "RAW", "STORED", "RATIO", ""], rows, ">")
    if temps:
        lines.append(f"{len(temps)} temp file(s) of unfinished writes under the root")
    for v in versions:
        if v["problem"]:
            lines.append(f"step {v['step']}: {v['problem']}")
    _emit(args, doc, lines)
    return EXIT_OK


def _table(headers: list[str], rows: list[list[str]], first_align: str = "<") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = [
            c.rjust(w) if i == 0 and first_align == ">" else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(out).rstrip()

    return [line(headers), *(line(r) for r in rows)]


# -- inspect --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ref:
    """Stands for a tensor or array while walking a manifest's tree without its data."""

    table: str
    index: int


def _tree(opened: OpenedFile) -> Any:
    """The saved object with ``_Ref`` markers in place of tensors and arrays (validated)."""
    manifest = opened.manifest
    tensors: list[Any] = [_Ref("tensor", i) for i in range(len(manifest.tensors))]
    arrays: list[Any] = [_Ref("array", i) for i in range(len(manifest.arrays))]
    return unflatten(manifest.root, tensors, arrays, opened.name)


def _codecs(manifest: Manifest, sid: int) -> tuple[list[str], int]:
    entry = manifest.storages[sid]
    chunks = manifest.chunks[entry.first_chunk : entry.first_chunk + entry.num_chunks]
    return sorted({c.codec for c in chunks}), sum(c.stored_len for c in chunks)


def _entries(manifest: Manifest, obj: Any) -> list[dict[str, Any]]:
    """One row per node of the tree: key path, depth, kind and details."""
    rows: list[dict[str, Any]] = []
    seen: dict[int, str] = {}

    def leaf(value: Any) -> dict[str, Any]:
        if isinstance(value, _Ref) and value.table == "tensor":
            t = manifest.tensors[value.index]
            entry = manifest.storages[t.storage]
            codecs, stored = _codecs(manifest, t.storage)
            numel = math.prod(t.shape)
            out = {
                "kind": "parameter" if t.parameter else "tensor",
                "dtype": t.dtype,
                "shape": list(t.shape),
                "nbytes": numel * DTYPE_ITEMSIZE.get(t.dtype, 1),
                "device": entry.device,
                "codecs": codecs,
                "storage": t.storage,
                "storage_bytes": entry.nbytes,
                "stored_bytes": stored,
                "requires_grad": t.requires_grad,
            }
            if t.storage in seen:
                out["shares_storage_with"] = seen[t.storage]
            else:
                seen[t.storage] = t.key
            return out
        if isinstance(value, _Ref):
            a = manifest.arrays[value.index]
            codecs, stored = _codecs(manifest, a.storage)
            return {
                "kind": "ndarray",
                "dtype": a.dtype,
                "shape": list(a.shape),
                "nbytes": manifest.storages[a.storage].nbytes,
                "device": "cpu",
                "codecs": codecs,
                "stored_bytes": stored,
            }
        text = repr(value)
        return {
            "kind": type(value).__name__,
            "value": text if len(text) <= 60 else text[:57] + "...",
        }

    def walk(value: Any, path: str, depth: int) -> None:
        if isinstance(value, dict):
            kind = "OrderedDict" if isinstance(value, OrderedDict) else "dict"
            rows.append({"key": path, "depth": depth, "kind": kind, "length": len(value)})
            for k, v in value.items():
                walk(v, child_path(path, k), depth + 1)
        elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
            rows.append(
                {"key": path, "depth": depth, "kind": type(value).__name__, "length": len(value)}
            )
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]", depth + 1)
        else:
            rows.append({"key": path, "depth": depth, **leaf(value)})

    walk(obj, "state", 0)
    return rows


def _label(row: dict[str, Any], parent: str | None) -> str:
    key: str = row["key"]
    if parent is not None and key.startswith(parent):
        key = key[len(parent) :]
    return "  " * int(row["depth"]) + key


def _open_ackpt(ref: FileRef) -> OpenedFile:
    """``open_file``, saying so when the file is a torch.save or safetensors file."""
    try:
        return open_file(ref.storage, ref.path)
    except FormatError:
        _reject_other_format(ref)
        raise


def _reject_other_format(ref: FileRef) -> None:
    """Raise a clear error if ``ref`` is a torch.save or safetensors file."""
    other = None
    with contextlib.suppress(UsageError, AsyncCkptError):
        other = _sniff(ref)
    if other is not None and other != "ackpt":
        raise FormatError(
            f"{ref.name} is a {other} file, not an asyncckpt file; convert it first: "
            f"asyncckpt convert {ref.name} OUT.ackpt"
        )


def cmd_inspect(args: argparse.Namespace) -> int:
    """``asyncckpt inspect PATH | ROOT[@STEP]``."""
    ref = single_file(locate(args.target, args.options))
    opened = _open_ackpt(ref)
    manifest = opened.manifest
    rows = _entries(manifest, _tree(opened))
    raw = sum(s.nbytes for s in manifest.storages)
    stored = sum(c.stored_len for c in manifest.chunks)
    codec_counts: dict[str, int] = {}
    for c in manifest.chunks:
        codec_counts[c.codec] = codec_counts.get(c.codec, 0) + 1
    doc = {
        "file": ref.name,
        "step": ref.step,
        "size": opened.size,
        "format_version": FORMAT_VERSION,
        "meta": manifest.meta,
        "raw_bytes": raw,
        "stored_bytes": stored,
        "ratio": stored / raw if raw else None,
        "tensors": len(manifest.tensors),
        "arrays": len(manifest.arrays),
        "storages": len(manifest.storages),
        "chunks": len(manifest.chunks),
        "codecs": codec_counts,
        "entries": rows,
    }
    meta = manifest.meta
    lines = [
        f"{ref.name}" + (f" (step {ref.step})" if ref.step is not None else ""),
        f"  format {FORMAT_VERSION}, written by {meta.get('library', '?')} with torch "
        f"{meta.get('torch', '?')} at {_short_time(meta.get('created'))} UTC",
        f"  {plural(len(manifest.tensors), 'tensor')}, {plural(len(manifest.arrays), 'array')} in "
        f"{plural(len(manifest.storages), 'storage')}, {plural(len(manifest.chunks), 'chunk')} ("
        + ", ".join(f"{n} {c}" for c, n in sorted(codec_counts.items()))
        + ")",
        f"  {format_bytes(raw)} raw, {format_bytes(stored)} stored"
        + (f" ({100 * stored / raw:.1f}%)" if raw else "")
        + f", file {format_bytes(opened.size)}",
        "",
    ]
    table: list[list[str]] = []
    parents: list[str] = []
    for row in rows:
        del parents[row["depth"] :]
        label = _label(row, parents[-1] if parents else None)
        kind = row["kind"]
        if "length" in row:
            parents.append(row["key"])
            n = row["length"]
            table.append([label, kind, f"{n} item{'' if n == 1 else 's'}", "", "", ""])
        elif "dtype" in row:
            detail = f"{row['dtype']} {list(row['shape'])}"
            codecs = ",".join(row["codecs"]) or "-"
            if "shares_storage_with" in row:
                codecs = f"shares storage with {row['shares_storage_with']}"
            table.append([label, kind, detail, format_bytes(row["nbytes"]), row["device"], codecs])
        else:
            table.append([label, kind, row["value"], "", "", ""])
    lines += _table(["KEY", "TYPE", "DTYPE/SHAPE/VALUE", "SIZE", "DEVICE", "CODEC"], table)
    _emit(args, doc, lines)
    return EXIT_OK


# -- verify ---------------------------------------------------------------------------------


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

    @property
    def ok(self) -> bool:
        return not self.bad_chunks and not self.errors

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "step": self.step,
            "ok": self.ok,
            "size": self.size,
            "chunks": self.chunks,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "bad_chunks": [b.__dict__ for b in self.bad_chunks],
            "errors": self.errors,
        }


def verify_file(
    storage: Storage,
    path: str,
    *,
    threads: int | None = None,
    progress: Callable[[int], None] | None = None,
    step: int | None = None,
) -> FileReport:
    """Read a whole file and check everything, collecting *every* problem.

    Unlike a load, which stops at the first damaged chunk, this reads and checks every
    chunk (checksum over the stored bytes, then a full decode) and validates the object
    tree, so a report names each bad chunk and the keys whose data it holds.

    Args:
        storage: where the file is.
        path: the file.
        threads: parallel chunk readers (default: the ``threads`` tunable).
        progress: called with the number of bytes read, as they are read.
        step: the version the file belongs to, for the report.

    Returns:
        The report; ``report.ok`` is True only when nothing is wrong.
    """
    report = FileReport(display(storage, path), step)
    try:
        opened = open_file(storage, path)
    except AsyncCkptError as exc:
        report.errors.append(str(exc))
        return report
    manifest = opened.manifest
    report.size = opened.size
    report.chunks = len(manifest.chunks)
    report.raw_bytes = sum(s.nbytes for s in manifest.storages)
    report.stored_bytes = sum(c.stored_len for c in manifest.chunks)
    if progress is not None:
        progress(max(0, opened.size - report.stored_bytes))
    try:
        _tree(opened)
    except FormatError as exc:
        report.errors.append(str(exc))
    keys: dict[int, list[str]] = {}
    for t in manifest.tensors:
        keys.setdefault(t.storage, []).append(t.key)
    for a in manifest.arrays:
        keys.setdefault(a.storage, []).append(a.key)
    owner: dict[int, int] = {}
    for sid, entry in enumerate(manifest.storages):
        for index in range(entry.first_chunk, entry.first_chunk + entry.num_chunks):
            owner.setdefault(index, sid)

    def check(index: int) -> str | None:
        chunk = manifest.chunks[index]
        sid = owner.get(index)
        itemsize = manifest.storages[sid].itemsize if sid is not None else 1
        try:
            stored = storage.read_range(path, chunk.offset, chunk.stored_len)
        except AsyncCkptError as exc:
            return f"read failed: {exc}"
        finally:
            if progress is not None:
                progress(chunk.stored_len)
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

    workers = max(1, threads or _threads())
    budget = _VERIFY_BUDGET  # bytes of chunks being checked at once (at least one chunk)
    with ThreadPoolExecutor(workers, thread_name_prefix="asyncckpt-verify") as pool:
        window: deque[tuple[int, Future[str | None]]] = deque()
        inflight = 0

        def cost(index: int) -> int:
            chunk = manifest.chunks[index]
            return chunk.stored_len + (chunk.raw_len if chunk.codec != "raw" else 0)

        def settle() -> None:
            nonlocal inflight
            index, future = window.popleft()
            inflight -= cost(index)
            detail = future.result()
            if detail is not None:
                sid = owner.get(index)
                owned = keys.get(sid, []) if sid is not None else []
                report.bad_chunks.append(BadChunk(index, owned, detail))

        for index in range(len(manifest.chunks)):
            while window and (len(window) >= 2 * workers or inflight + cost(index) > budget):
                settle()
            inflight += cost(index)
            window.append((index, pool.submit(check, index)))
        while window:
            settle()
    return report


#: How many bytes of chunks ``verify_file`` holds at once, at most (or one chunk if larger).
_VERIFY_BUDGET = 512 << 20


def _show_keys(keys: list[str]) -> str:
    if not keys:
        return "(no keys: the chunk belongs to no storage)"
    return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def cmd_verify(args: argparse.Namespace) -> int:
    """``asyncckpt verify PATH | ROOT[@STEP|--all]``."""
    ref = locate(args.target, args.options)
    warnings: list[str] = []
    if isinstance(ref, FileRef):
        if args.all:
            raise UsageError(f"asyncckpt: --all needs a checkpoint root; {args.target} is a file")
        _reject_other_format(ref)
        files = [ref]
    else:
        if args.all and ref.step is not None:
            raise UsageError("asyncckpt: give either ROOT@STEP or --all, not both")
        storage, root = ref.storage, ref.path
        committed = committed_steps(storage, root)
        if args.all:
            if not committed:
                raise CheckpointNotFoundError(f"no committed checkpoint under {ref.name}")
            steps = committed
        else:
            steps = [chosen_step(ref)]
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
    total = 0
    for f in files:
        with contextlib.suppress(AsyncCkptError):
            total += f.storage.size(f.path)
    reports = []
    with _progress(args, total, "verify") as bar:
        for f in files:
            reports.append(verify_file(f.storage, f.path, progress=bar.update, step=f.step))
    bad = [r for r in reports if not r.ok]
    doc = {
        "ok": not bad,
        "files": [r.as_dict() for r in reports],
        "warnings": warnings,
    }
    lines = []
    for r in reports:
        where = r.file + (f" (step {r.step})" if r.step is not None else "")
        if r.ok:
            lines.append(
                f"OK   {where}: {plural(r.chunks, 'chunk')}, {format_bytes(r.raw_bytes)} raw, "
                f"{format_bytes(r.stored_bytes)} stored, every checksum matches"
            )
            continue
        lines.append(f"BAD  {where}")
        lines += [f"     {e}" for e in r.errors]
        for b in r.bad_chunks:
            lines.append(f"     chunk {b.chunk}: {b.detail}; keys: {_show_keys(b.keys)}")
    lines += [f"note: {w}" for w in warnings]
    chunks = sum(len(r.bad_chunks) for r in bad)
    lines.append(
        f"{len(reports) - len(bad)} of {plural(len(reports), 'file')} sound"
        + (f"; {len(bad)} damaged ({plural(chunks, 'bad chunk')})" if bad else "")
    )
    _emit(args, doc, lines)
    if bad:
        raise CommandFailed(
            f"verify: {len(bad)} of {plural(len(reports), 'file')} damaged "
            f"({plural(chunks, 'bad chunk')}); load an older version or restore these files"
        )
    return EXIT_OK


# -- gc -------------------------------------------------------------------------------------


def cmd_gc(args: argparse.Namespace) -> int:
    """``asyncckpt gc ROOT --keep N [--dry-run]``."""
    if args.keep < 1:
        raise UsageError(f"asyncckpt gc: --keep must be at least 1, got {args.keep}")
    ref = _need_root(locate(args.root, args.options), args.root)
    storage, root = ref.storage, ref.path
    record = read_version_file(storage, root)
    committed = committed_steps(storage, root)
    dirs = step_dirs(storage, root)
    pinned = record.step if record is not None else None
    plan = retention_plan(committed, dirs, args.keep, pinned)
    temps = [n for n in storage.list_dir(root) if is_temp_name(n)]
    goes = []
    for step in plan:
        info = _version_info(storage, root, step, None)
        goes.append({"step": step, "state": info["state"], "stored_bytes": info["stored_bytes"]})
    lines = []
    if pinned is None:
        lines.append(
            f"the version file under {ref.name} is missing or damaged: nothing is deleted "
            "(open the root with a Checkpointer, or let the next save, rewrite it)"
        )
    verb = "would delete" if args.dry_run else "deleted"
    for g in goes:
        size = "" if g["stored_bytes"] is None else f", {format_bytes(g['stored_bytes'])}"
        lines.append(f"{verb} step {g['step']} ({g['state']}{size})")
        if not args.dry_run:
            delete_version(storage, root, g["step"])
    removed_temps: list[str] = []
    if temps and args.remove_temp:
        for name in temps:
            lines.append(f"{verb} temp file {name}")
            if not args.dry_run:
                storage.delete(storage.join(root, name))
            removed_temps.append(name)
    elif temps:
        lines.append(
            f"left {len(temps)} temp file(s) under the root; --remove-temp deletes them when no "
            "job is writing to it"
        )
    kept = [s for s in dirs if s not in plan]
    freed = sum(g["stored_bytes"] or 0 for g in goes)
    lines.append(
        f"{'would free' if args.dry_run else 'freed'} {format_bytes(freed)}; kept step(s) "
        f"{', '.join(map(str, kept)) or 'none'}"
        + (f" (version file: step {pinned})" if pinned is not None else "")
    )
    doc = {
        "root": ref.name,
        "keep": args.keep,
        "dry_run": args.dry_run,
        "version_file_step": pinned,
        "delete": goes,
        "temp_files": removed_temps,
        "kept": kept,
        "freed_bytes": freed,
    }
    _emit(args, doc, lines)
    return EXIT_OK


# -- convert --------------------------------------------------------------------------------


def format_of(spec: str, explicit: str | None, role: str) -> str | None:
    """The format named by ``--from/--to`` or by the extension of ``spec``."""
    if explicit:
        return explicit
    base = re.sub(r"@\d+$", "", spec).rstrip("/").lower()
    for name, extensions in FORMATS.items():
        if base.endswith(extensions):
            return name
    if role == "DST":
        raise UsageError(
            f"asyncckpt convert: cannot tell the format of {spec} from its extension "
            "(.pt/.pth/.bin, .ackpt, .safetensors); pass --to torch|ackpt|safetensors"
        )
    return None


def _sniff(ref: FileRef) -> str:
    head = ref.storage.read_range(ref.path, 0, 16)
    if head.startswith(MAGIC):
        return "ackpt"
    if head.startswith((b"PK\x03\x04", b"\x80")):
        return "torch"
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    raise UsageError(
        f"asyncckpt convert: cannot tell the format of {ref.name}; pass --from "
        "torch|ackpt|safetensors"
    )


class _Metered(Storage):
    """A storage that reports every byte read to a progress callback."""

    def __init__(self, inner: Storage, progress: Callable[[int], None]) -> None:
        self.inner = inner
        self.progress = progress
        self.label = inner.label

    def describe(self, path: str) -> str:
        return self.inner.describe(path)

    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)

    def open_atomic(self, path: str) -> AtomicWriter:
        return self.inner.open_atomic(path)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        data = self.inner.read_range(path, start, length)
        self.progress(len(data))
        return data

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        n = self.inner.read_into(path, start, out)
        self.progress(n)
        return n

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.inner.create_exclusive(path, data)

    def list_dir(self, path: str) -> list[str]:
        return self.inner.list_dir(path)

    def delete_tree(self, path: str) -> None:
        self.inner.delete_tree(path)


class _CountingWriter:
    """A write-only file object over an AtomicWriter (torch.save streams into it)."""

    def __init__(self, out: AtomicWriter, progress: Callable[[int], None]) -> None:
        self.out = out
        self.progress = progress
        self.written = 0

    def write(self, data: bytes | memoryview) -> int:
        n = len(memoryview(data).cast("B"))
        self.out.write(data)
        self.written += n
        self.progress(n)
        return n

    def flush(self) -> None:
        pass


def load_ackpt(ref: FileRef, progress: Callable[[int], None] | None = None) -> Any:
    """Load an asyncckpt file on the CPU, reporting bytes read."""
    storage = ref.storage if progress is None else _Metered(ref.storage, progress)
    return materialize(open_file(storage, ref.path), Placement("cpu"), _threads())


def _numpy_globals() -> list[Any]:
    """What unpickling plain numpy arrays and scalars needs (no object arrays: they hold
    pickles of their own, which the weights-only unpickler still refuses)."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray  # type: ignore[no-redef]
    dtypes = {type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDG"}
    return [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtypes]


def load_torch(
    ref: FileRef, progress: Callable[[int], None] | None = None, *, mmap: bool = True
) -> Any:
    """``torch.load(..., weights_only=True, map_location="cpu")`` of a local or remote file.

    Plain numpy arrays and scalars (e.g. ``np.random.get_state()``) are allowed on top of
    torch's weights-only defaults, as torch's documentation suggests for them.
    """
    with torch.serialization.safe_globals(_numpy_globals()):
        return _load_torch(ref, progress, mmap)


def _load_torch(ref: FileRef, progress: Callable[[int], None] | None, mmap: bool) -> Any:
    if isinstance(ref.storage, LocalStorage):
        try:
            obj = torch.load(ref.path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError as exc:
            if not mmap or "mmap" not in str(exc):
                raise
            obj = torch.load(ref.path, map_location="cpu", weights_only=True)
        if progress is not None:
            progress(ref.storage.size(ref.path))
        return obj
    size = ref.storage.size(ref.path)
    buf = bytearray()
    step = 64 << 20
    for start in range(0, size, step):
        piece = ref.storage.read_range(ref.path, start, min(step, size - start))
        buf += piece
        if progress is not None:
            progress(len(piece))
    return torch.load(io.BytesIO(bytes(buf)), map_location="cpu", weights_only=True)


def save_torch(
    obj: Any, storage: Storage, path: str, progress: Callable[[int], None] | None = None
) -> int:
    """``torch.save`` streamed into an atomic write; returns the bytes written."""
    with storage.atomic_write(path) as out:
        writer = _CountingWriter(out, progress or (lambda n: None))
        torch.save(obj, cast(IO[bytes], writer))
    return writer.written


def save_ackpt(
    obj: Any,
    storage: Storage,
    path: str,
    compression: str = "zstd",
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write an asyncckpt file synchronously; returns its size."""
    options = write_options(compression)
    snap = stage(obj)
    try:
        return write_snapshot(snap, storage, path, options, progress)
    finally:
        snap.lease.release()


# safetensors: https://github.com/huggingface/safetensors#format — an 8-byte little-endian
# header length N, N bytes of JSON ({name: {dtype, shape, data_offsets}, "__metadata__":
# {str: str}}), then the byte buffer; offsets are relative to the buffer, which the tensors
# cover exactly, without holes or overlaps.
_ST_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_ST_MAX_HEADER = 100_000_000


class SafetensorsError(AsyncCkptError, ValueError):
    """A file is not valid safetensors, or a state cannot be written as safetensors."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate keys")
    return out


def read_safetensors(
    storage: Storage, path: str, progress: Callable[[int], None] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse a safetensors file into ``(tensors, metadata)``, validating every field."""
    name = storage.describe(path)

    def bad(what: str) -> SafetensorsError:
        return SafetensorsError(f"{name}: not a valid safetensors file: {what}")

    size = storage.size(path)
    if size < 8:
        raise bad(f"{size} bytes is too short")
    (n,) = struct.unpack("<Q", storage.read_range(path, 0, 8))
    if n > min(_ST_MAX_HEADER, size - 8):
        raise bad(f"header length {n} exceeds the file or the 100 MB limit")
    try:
        header = json.loads(
            storage.read_range(path, 8, n).decode("utf-8"), object_pairs_hook=_unique_keys
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise bad("__metadata__ is not a map of strings")
    base, buffer_len = 8 + n, size - 8 - n
    spans = []
    for key, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"entry {key!r} does not have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        torch_name = _ST_DTYPES.get(dtype) if isinstance(dtype, str) else None
        torch_type = getattr(torch, torch_name, None) if torch_name else None
        if not isinstance(torch_type, torch.dtype):
            raise bad(f"entry {key!r} has unsupported dtype {dtype!r}")
        if not (
            isinstance(shape, list)
            and len(shape) <= 64
            and all(type(d) is int and d >= 0 for d in shape)
        ):
            raise bad(f"entry {key!r} has a bad shape {shape!r}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= buffer_len
        ):
            raise bad(f"entry {key!r} has data_offsets {offsets!r} outside the data")
        nbytes = math.prod(shape) * torch.empty(0, dtype=torch_type).element_size()
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"entry {key!r}: {offsets[1] - offsets[0]} bytes for {nbytes}")
        spans.append((offsets[0], offsets[1], key, torch_type, shape))
    spans.sort(key=lambda s: (s[0], s[1]))
    position = 0
    for begin, end, key, _, _ in spans:
        if begin != position:
            raise bad(f"entry {key!r} starts at {begin}, expected {position} (holes or overlaps)")
        position = end
    if position != buffer_len:
        raise bad(f"the tensors cover {position} of the {buffer_len} data bytes")
    tensors: dict[str, torch.Tensor] = {}
    for begin, end, key, torch_type, shape in spans:
        if end == begin:
            tensors[key] = torch.empty(shape, dtype=torch_type)
            continue
        data = bytearray(storage.read_range(path, base + begin, end - begin))
        if len(data) != end - begin:
            raise bad(f"entry {key!r}: the file ends early")
        tensors[key] = torch.frombuffer(data, dtype=torch_type).reshape(shape)
        if progress is not None:
            progress(end - begin)
    ordered = {k: tensors[k] for k in header}  # the header's order, as written
    return ordered, metadata


def _flat_tensors(obj: Any, src: str) -> dict[str, torch.Tensor]:
    """``obj`` as a flat ``{str: tensor}`` dict, or a clear error saying what is in the way."""
    if not isinstance(obj, dict):
        raise SafetensorsError(
            f"safetensors holds a flat dict of tensors; {src} is a {type(obj).__name__}"
        )
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            nested = [
                k
                for k, v in obj.items()
                if isinstance(v, dict)
                and v
                and all(isinstance(t, torch.Tensor) for t in v.values())
            ]
            hint = (
                f"; convert one part with --key, e.g. --key {nested[0]}"
                if nested
                else "; select a flat dict of tensors with --key"
            )
            raise SafetensorsError(
                "safetensors holds a flat dict of str -> tensor; "
                f"{child_path('state', key)} in {src} is {type(value).__name__}"
                + ("" if isinstance(key, str) else f" under a {type(key).__name__} key")
                + hint
            )
    return dict(obj)


def write_safetensors(
    tensors: dict[str, torch.Tensor],
    storage: Storage,
    path: str,
    metadata: dict[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write a flat dict of tensors as safetensors, atomically; returns the file size."""
    if sys.byteorder != "little":
        raise SafetensorsError("writing safetensors on a big-endian machine is not supported")
    # The header keeps the dict's order (readers return it); the data is laid out widest
    # dtype first, which keeps every tensor aligned to its element size.
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    for key, t in tensors.items():
        st = _ST_NAMES.get(str(t.dtype).removeprefix("torch."))
        if st is None:
            raise SafetensorsError(f"safetensors has no dtype for {key!r} ({t.dtype})")
        header[key] = {"dtype": st, "shape": list(t.shape), "data_offsets": [0, 0]}
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    position = 0
    for key in order:
        nbytes = tensors[key].numel() * tensors[key].element_size()
        header[key]["data_offsets"] = [position, position + nbytes]
        position += nbytes
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    body += b" " * (-len(body) % 8)  # pad with spaces so the data starts 8-byte aligned
    with storage.atomic_write(path) as out:
        out.write(struct.pack("<Q", len(body)))
        out.write(body)
        for key in order:
            t = tensors[key].detach().cpu().contiguous()
            if t.numel():
                data = t.reshape(-1).view(torch.uint8).numpy()
                out.write(data.data)
                if progress is not None:
                    progress(len(data))
    return 8 + len(body) + position


def _select(obj: Any, key: str | None, src: str) -> Any:
    if not key:
        return obj
    path = "state"
    for part in key.strip("/").split("/"):
        if isinstance(obj, dict):
            if part in obj:
                obj, path = obj[part], child_path(path, part)
                continue
            if part.lstrip("-").isdigit() and int(part) in obj:
                obj, path = obj[int(part)], child_path(path, int(part))
                continue
            raise UsageError(
                f"asyncckpt convert: {src} has no key {part!r} at {path}; keys there: "
                + ", ".join(repr(k) for k in list(obj)[:20])
            )
        if isinstance(obj, (list, tuple)) and part.isdigit() and int(part) < len(obj):
            obj, path = obj[int(part)], f"{path}[{part}]"
            continue
        raise UsageError(f"asyncckpt convert: {path} in {src} has no part {part!r}")
    return obj


def _tensors_in(obj: Any) -> tuple[int, int]:
    count = nbytes = 0
    seen: set[int] = set()
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            count += 1
            nbytes += value.numel() * value.element_size()
        elif isinstance(value, dict) and id(value) not in seen:
            seen.add(id(value))
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)) and id(value) not in seen:
            seen.add(id(value))
            stack.extend(value)
    return count, nbytes


def cmd_convert(args: argparse.Namespace) -> int:
    """``asyncckpt convert SRC DST``."""
    dst_format = format_of(args.dst, args.dst_format, "DST")
    assert dst_format is not None
    src_ref = locate(args.src, args.options)
    src_format = format_of(args.src, args.src_format, "SRC")
    if isinstance(src_ref, RootRef):
        if src_format not in (None, "ackpt"):
            raise UsageError(f"asyncckpt convert: {args.src} is a checkpoint root (asyncckpt)")
        src_format = "ackpt"
    src = single_file(src_ref)
    src_format = src_format or _sniff(src)
    dst_storage, dst_path = resolve(args.dst, args.options)
    if not args.force and _kind(dst_storage, dst_path) != "missing":
        raise UsageError(f"asyncckpt convert: {args.dst} exists; pass --force to replace it")
    size = src.storage.size(src.path)
    metadata: dict[str, str] | None = None
    with _progress(args, size, f"read {src_format}") as bar:
        if src_format == "ackpt":
            obj = load_ackpt(src, bar.update)
        elif src_format == "torch":
            obj = load_torch(src, bar.update)
        else:
            obj, metadata = read_safetensors(src.storage, src.path, bar.update)
    obj = _select(obj, args.key, src.name)
    count, nbytes = _tensors_in(obj)
    with _progress(args, nbytes, f"write {dst_format}") as bar:
        if dst_format == "safetensors":
            what = f"{src.name} --key {args.key}" if args.key else src.name
            flat = _flat_tensors(obj, what)
            written = write_safetensors(flat, dst_storage, dst_path, metadata, bar.update)
        elif dst_format == "torch":
            written = save_torch(obj, dst_storage, dst_path, bar.update)
        else:
            written = save_ackpt(obj, dst_storage, dst_path, args.compression, bar.update)
    dst_name = display(dst_storage, dst_path)
    doc = {
        "src": src.name,
        "src_format": src_format,
        "dst": dst_name,
        "dst_format": dst_format,
        "key": args.key,
        "tensors": count,
        "raw_bytes": nbytes,
        "src_bytes": size,
        "dst_bytes": written,
    }
    _emit(
        args,
        doc,
        f"converted {src.name} ({src_format}, {format_bytes(size)}) -> {dst_name} "
        f"({dst_format}, {format_bytes(written)}): {plural(count, 'tensor')}, "
        f"{format_bytes(nbytes)}",
    )
    return EXIT_OK


# -- bench ----------------------------------------------------------------------------------


def _bench_state(nbytes: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors totalling about ``nbytes``, in pieces of at most 16 MiB."""
    g = torch.Generator().manual_seed(0)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    piece = (16 << 20) // itemsize
    left = max(1, nbytes // itemsize)
    state: dict[str, torch.Tensor] = {}
    while left > 0:
        n = min(piece, left)
        state[f"layer{len(state)}.weight"] = (torch.randn(n, generator=g) * 0.02).to(dtype)
        left -= n
    return state


def _url_join(url: str, name: str) -> str:
    if "://" in url:
        return url.rstrip("/") + "/" + name
    return os.path.join(url, name)


def cmd_bench(args: argparse.Namespace) -> int:
    """``asyncckpt bench URL``."""
    from . import api

    if args.size_mib <= 0 or args.repeat < 1:
        raise UsageError("asyncckpt bench: --size-mib must be positive and --repeat at least 1")
    dtype = getattr(torch, args.dtype)
    state = _bench_state(int(args.size_mib * (1 << 20)), dtype)
    raw = sum(t.numel() * t.element_size() for t in state.values())
    folder_url = _url_join(args.url, f"asyncckpt-bench-{uuid.uuid4().hex[:8]}")
    storage, folder = resolve(folder_url, args.options)
    pt_path = storage.join(folder, "state.pt")
    ackpt_url = _url_join(folder_url, "state.ackpt")
    runs: dict[str, list[float]] = {
        "copy into preallocated buffers": [],
        "torch.save (sync, durable)": [],
        "asyncckpt.save: caller blocked": [],
        "asyncckpt.save: until durable": [],
        "torch.load (weights_only)": [],
        "asyncckpt.load": [],
    }
    names = list(runs)
    sizes: dict[str, int] = {}
    buffers = [torch.empty_like(t) for t in state.values()]
    for buf, t in zip(buffers, state.values()):  # fault the pages in before timing
        buf.copy_(t)
    try:
        with _progress(args, raw * args.repeat * 4, "bench") as bar:
            for r in range(args.repeat):
                label = f"bench {r + 1}/{args.repeat}"
                started = time.perf_counter()
                for buf, t in zip(buffers, state.values()):
                    buf.copy_(t)
                runs[names[0]].append(time.perf_counter() - started)

                bar.relabel(f"{label} torch.save")
                started = time.perf_counter()
                sizes["torch"] = save_torch(state, storage, pt_path)
                runs[names[1]].append(time.perf_counter() - started)
                bar.update(raw)

                bar.relabel(f"{label} asyncckpt.save")
                handle = api.save(state, ackpt_url, storage_options=args.options)
                info = handle.result()
                runs[names[2]].append(info.stats.blocking_s)
                runs[names[3]].append(info.stats.total_s or math.nan)
                sizes["asyncckpt"] = info.stats.stored_bytes or 0
                bar.update(raw)

                bar.relabel(f"{label} torch.load")
                started = time.perf_counter()
                load_torch(FileRef(storage, pt_path), mmap=False)
                runs[names[4]].append(time.perf_counter() - started)
                bar.update(raw)

                bar.relabel(f"{label} asyncckpt.load")
                started = time.perf_counter()
                api.load(ackpt_url, map_location="cpu", storage_options=args.options)
                runs[names[5]].append(time.perf_counter() - started)
                bar.update(raw)
    finally:
        with contextlib.suppress(AsyncCkptError):
            api.wait()
        if not args.keep:
            with contextlib.suppress(AsyncCkptError):
                storage.delete_tree(folder)
    floor = statistics.median(runs[names[0]])
    results = {}
    for name, values in runs.items():
        median = statistics.median(values)
        results[name] = {
            "median_s": median,
            "runs_s": values,
            "ratio_to_copy": median / floor if floor > 0 else None,
            "raw_gb_per_s": raw / median / 1e9 if median > 0 else None,
        }
    plot = None if args.no_plot else _plot(results, args.plot, raw, args.url)
    doc = {
        "url": args.url,
        "raw_bytes": raw,
        "dtype": args.dtype,
        "repeat": args.repeat,
        "threads": _threads(),
        "results": results,
        "stored_bytes": sizes,
        "plot": plot,
        "kept": display(storage, folder) if args.keep else None,
    }
    rows = [
        [
            name,
            f"{r['median_s']:.3f}",
            f"{r['ratio_to_copy']:.1f}" if r["ratio_to_copy"] is not None else "-",
            f"{r['raw_gb_per_s']:.2f}" if r["raw_gb_per_s"] is not None else "-",
        ]
        for name, r in results.items()
    ]
    lines = [
        f"bench on {args.url}: {format_bytes(raw)} of {args.dtype} in "
        f"{plural(len(state), 'tensor')}, median of {plural(args.repeat, 'run')}",
        "",
        *_table(["OPERATION", "SECONDS", "x COPY", "GB/s (raw)"], rows),
        "",
        f"stored: torch.save {format_bytes(sizes.get('torch', 0))}, asyncckpt "
        f"{format_bytes(sizes.get('asyncckpt', 0))}"
        + (f" ({100 * sizes['asyncckpt'] / raw:.1f}% of raw)" if sizes.get("asyncckpt") else ""),
        "loads read files just written, so they may come from the page cache",
    ]
    if plot:
        lines.append(f"plot: {plot}")
    elif not args.no_plot:
        lines.append("plot: skipped (matplotlib is not installed)")
    if args.keep:
        lines.append(f"files kept under {display(storage, folder)}")
    _emit(args, doc, lines)
    return EXIT_OK


def _plot(results: dict[str, dict[str, Any]], path: str, raw: int, url: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(results)[::-1]
    values = [results[n]["median_s"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = [
        "#2b6cb0" if n.startswith("asyncckpt") else "#dd6b20" if n.startswith("torch") else "#999"
        for n in names
    ]
    bars = ax.barh(names, values, color=colors)
    for bar, name in zip(bars, names):
        ratio = results[name]["ratio_to_copy"]
        if ratio is not None:
            ax.text(
                bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {ratio:.1f}x", va="center"
            )
    ax.set_xlabel("seconds (median); labels: x the in-memory copy")
    ax.set_title(f"asyncckpt bench: {format_bytes(raw)} on {url}", fontsize=10)
    ax.margins(x=0.2)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
