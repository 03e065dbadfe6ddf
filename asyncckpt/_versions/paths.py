"""What a path a user typed names: the one path model of ``asyncckpt.load``, ``Checkpointer``
and every ``asyncckpt`` command.

A user types ``FILE``, ``ROOT``, ``ROOT@STEP``, an ``asyncckpt.dcp`` directory, a Hugging
Face run's ``output_dir`` or one of its ``checkpoint-N`` folders, or a folder of checkpoints
(a Lightning ``dirpath``, a bucket of runs). :func:`find` says which, as a :class:`Target`:

- a file: ``FILE``;
- a Checkpointer root (a version file or a step directory below it): ``ROOT``, with
  ``ROOT@STEP``'s step when one was given;
- ``OUT`` whose :data:`HF_ROOT_NAME` folder is a root (``asyncckpt.transformers`` keeps its
  versions there): that root; ``OUT/checkpoint-N``: step N of it;
- a version's directory ``ROOT/STEP`` (it holds a ``COMMIT``): ``ROOT@STEP``;
- an ``asyncckpt.dcp`` directory (its ``.metadata`` at the top, no versions);
- any other folder: what is below it (:func:`checkpoints_below`) decides what a command
  does with it; :func:`one_checkpoint` takes it when it holds exactly one checkpoint.

``NAME@STEP``: a path that exists as typed is that path (a file may be named ``run@3``),
unless ``NAME`` is a checkpoint root too: then the two readings conflict and
:class:`~asyncckpt.errors.PathKindError` says so (rename one). Nothing is ever created or
changed here.
"""

from __future__ import annotations

import os
import re
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from asyncckpt._format.container import MAGIC
from asyncckpt._format.names import METADATA_NAME, rank_of_data_file
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage, resolve
from asyncckpt._versions.protocol import (
    COMMIT_FILE,
    VERSION_FILE,
    CommitRecord,
    committed_steps,
    latest_step,
    parse_step,
    read_commit,
    step_dirs,
)
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    PathKindError,
)

#: The folder under a Hugging Face run's ``output_dir`` that ``asyncckpt.transformers``
#: keeps its Checkpointer root in (``asyncckpt.transformers.ROOT_NAME``).
HF_ROOT_NAME = "asyncckpt"
#: A Hugging Face ``Trainer`` checkpoint folder's name.
_HF_FOLDER = re.compile(r"checkpoint-([0-9]{1,18})")
#: ``NAME@STEP``.
_AT_STEP = re.compile(r"(.+)@([0-9]{1,18})")
#: How many folders below the one given are searched, and how many at most.
MAX_DEPTH, MAX_FOLDERS = 4, 2000
#: Names under which asyncckpt files are found besides ``.ackpt``: Lightning's ``.ckpt``
#: (``AsyncCkptIO`` keeps the names Lightning gives) and torch's; their first bytes tell.
TORCH_NAMES = (".ckpt", ".pt", ".pth")

FILE, ROOT, DCP, FOLDER, MISSING = "file", "root", "dcp", "folder", "missing"


@dataclass(frozen=True)
class Target:
    """What a typed path names.

    Attributes:
        storage: the backend it is on.
        path: the file, root, directory or folder itself (for a Hugging Face run, its root).
        kind: ``"file"``, ``"root"``, ``"dcp"``, ``"folder"`` or ``"missing"``.
        step: ``ROOT@STEP``'s (or ``checkpoint-N``'s) step; None: the newest.
        typed: the path as the user typed it.

    Example:
        >>> import tempfile
        >>> find(tempfile.mkdtemp() + "/nothing").kind
        'missing'
    """

    storage: Storage
    path: str
    kind: str
    step: int | None = None
    typed: str = ""

    @property
    def name(self) -> str:
        """The path as the storage describes it."""
        return self.storage.describe(self.path)


def find(
    typed: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    settings: Settings | None = None,
) -> Target:
    """What ``typed`` names (see the module). Reads listings, never writes.

    Raises:
        PathKindError: ``NAME@STEP`` names both an existing path and a step of root NAME,
            or ``@STEP`` follows something that is not a root.
        StorageError: the URL cannot be resolved, or listing failed.

    Example:
        >>> import torch, asyncckpt, tempfile
        >>> root = tempfile.mkdtemp()
        >>> with asyncckpt.Checkpointer(root) as ckpt:
        ...     _ = ckpt.save(3, {"w": torch.ones(1)}).result()
        >>> found = find(root + "@3")
        >>> found.kind, found.step
        ('root', 3)
    """
    text = os.fspath(typed)
    target = _what_is(*resolve(text, storage_options, settings), text)
    match = _AT_STEP.fullmatch(text)
    if match is None:
        return target
    base = _what_is(*resolve(match.group(1), storage_options, settings), match.group(1))
    step = int(match.group(2))
    if base.kind == ROOT and base.step is None:
        if target.kind != MISSING:
            raise PathKindError(
                f"{text} names both an existing {target.kind} and step {step} of checkpoint "
                f"root {base.name}; rename one of them"
            )
        return replace(base, step=step, typed=text)
    if target.kind == MISSING and base.kind != MISSING:
        raise PathKindError(
            f"{text}: @STEP selects a version of a checkpoint root, and {base.name} is "
            f"{_described(base)}"
        )
    return target


def _what_is(storage: Storage, path: str, typed: str) -> Target:
    """:func:`find` of a path without ``@STEP``."""
    kind, names = kind_of(storage, path)
    if kind != "dir":
        return Target(storage, path, kind, typed=typed)
    if is_root(storage, path, names):
        return Target(storage, path, ROOT, typed=typed)
    folder = path.replace("\\", "/").rstrip("/").rsplit("/", 1)
    step = parse_step(folder[-1])
    if step is not None and COMMIT_FILE in names and len(folder) == 2:
        return Target(storage, folder[0], ROOT, step, typed)  # ROOT/STEP: version STEP
    if is_dcp_directory(storage, path, names):
        return Target(storage, path, DCP, typed=typed)
    hf = storage.join(path, HF_ROOT_NAME)
    if HF_ROOT_NAME in names and _is_root_dir(storage, hf):
        return Target(storage, hf, ROOT, typed=typed)
    match = _HF_FOLDER.fullmatch(folder[-1])
    if match and len(folder) == 2:
        run = storage.join(folder[0], HF_ROOT_NAME)
        if _is_root_dir(storage, run):
            return Target(storage, run, ROOT, int(match.group(1)), typed)
    return Target(storage, path, FOLDER, typed=typed)


def _is_root_dir(storage: Storage, path: str) -> bool:
    try:
        return is_root(storage, path)
    except AsyncCkptError:
        return False


def kind_of(storage: Storage, path: str) -> tuple[str, list[str]]:
    """What is at ``path``: ``("dir", names)``, ``("file", [])`` or ``("missing", [])``; an
    empty local folder is a ``"dir"`` (an object store has no empty folders: a prefix with
    nothing is missing). Where a path with bytes is a file
    (:attr:`~asyncckpt._storage.Storage.sized_paths_are_files`), its size is asked first and
    names a file in one request; elsewhere the listing comes first (a folder has a size)."""
    if storage.local_paths:
        if os.path.isdir(path):
            return "dir", sorted(os.listdir(path))
        return (FILE if os.path.isfile(path) else MISSING), []
    sized_first = storage.sized_paths_are_files
    size = storage.size_or_none(path) if sized_first else None
    if size:  # an object with bytes: a file, named in one request (a restart's load)
        return FILE, []
    names = storage.list_dir(path)  # some stores give a prefix a size (0): list it
    if names:
        return "dir", names
    if not sized_first:
        size = storage.size_or_none(path)
    return (MISSING if size is None else FILE), []


def _described(target: Target) -> str:
    return {
        FILE: "a file",
        DCP: "an asyncckpt.dcp directory (one checkpoint, no versions)",
        FOLDER: "a folder that is no checkpoint root",
        MISSING: "not there",
        ROOT: "a checkpoint root",
    }[target.kind]


def is_root(storage: Storage, path: str, names: list[str] | None = None) -> bool:
    """Whether ``path`` is a Checkpointer root: a version file or a step directory.

    Example:
        >>> import tempfile
        >>> from asyncckpt._storage import LocalStorage
        >>> is_root(LocalStorage(), tempfile.mkdtemp())
        False
    """
    names = storage.list_dir(path) if names is None else names
    return VERSION_FILE in names or any(parse_step(n) is not None for n in names)


def is_dcp_directory(storage: Storage, path: str, names: list[str] | None = None) -> bool:
    """Whether ``path`` is a directory an ``asyncckpt.dcp.Writer`` wrote: its ``.metadata``
    at the top, no versions (a Checkpointer root keeps them in step directories).

    Example:
        >>> from asyncckpt._storage import LocalStorage
        >>> is_dcp_directory(LocalStorage(), "/nonexistent")
        False
    """
    if names is None:
        try:
            names = storage.list_dir(path)
        except AsyncCkptError:
            return False
    return METADATA_NAME in names and not any(parse_step(n) is not None for n in names)


def is_checkpoint_file(storage: Storage, path: str) -> bool:
    """Whether ``path`` is an asyncckpt file: named ``.ackpt``, or named like a torch file
    (:data:`TORCH_NAMES`) and starting with asyncckpt's magic bytes (a folder is not).

    Example:
        >>> from asyncckpt._storage import LocalStorage
        >>> is_checkpoint_file(LocalStorage(), "/nonexistent/last.ckpt")
        False
    """
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if name.endswith(".ackpt"):
        return True
    if not name.endswith(TORCH_NAMES):
        return False
    try:
        return storage.read_range(path, 0, len(MAGIC)) == MAGIC
    except (AsyncCkptError, OSError):  # a folder, or gone meanwhile
        return False


def checkpoints_below(storage: Storage, top: str) -> list[tuple[str, str]]:
    """The checkpoints below folder ``top`` (breadth first, at most :data:`MAX_DEPTH`
    levels; a checkpoint's own folders are not searched), each as its path and kind:
    ``"file"``, ``"root"`` or ``"dcp"``.

    Example:
        >>> import tempfile
        >>> from asyncckpt._storage import LocalStorage
        >>> checkpoints_below(LocalStorage(), tempfile.mkdtemp())
        []
    """
    found: list[tuple[str, str]] = []
    queue: deque[tuple[str, int]] = deque([(top, 0)])
    visited = 0
    while queue and visited < MAX_FOLDERS:
        folder, depth = queue.popleft()
        visited += 1
        for name in sorted(storage.list_dir(folder)):
            path = storage.join(folder, name)
            if is_checkpoint_file(storage, path):
                found.append((path, FILE))
                continue
            try:
                names = storage.list_dir(path)
            except AsyncCkptError:
                continue
            if not names:
                continue  # a file, or an empty folder
            if is_root(storage, path, names):
                found.append((path, ROOT))
            elif is_dcp_directory(storage, path, names):
                found.append((path, DCP))
            elif depth + 1 < MAX_DEPTH:
                queue.append((path, depth + 1))
    return found


def one_checkpoint(target: Target) -> Target:
    """``target``, or, for a folder, the one checkpoint below it: what a call that reads one
    checkpoint (``load``, ``inspect``, ``convert``) reads.

    Raises:
        CheckpointNotFoundError: nothing is there, or the folder holds no checkpoint.
        PathKindError: the folder holds several (the message names them).
        IncompleteCheckpointError: the folder holds rank files of a sharded save, without
            the ``.metadata`` that commits it.

    Example:
        >>> import tempfile
        >>> try:
        ...     one_checkpoint(find(tempfile.mkdtemp()))
        ... except CheckpointNotFoundError as exc:
        ...     print("a folder with no checkpoint in it" in str(exc))
        True
    """
    if target.kind == MISSING:
        raise CheckpointNotFoundError(f"{target.name}: no such file or checkpoint root")
    if target.kind != FOLDER:
        return target
    names = target.storage.list_dir(target.path)
    if COMMIT_FILE not in names and any(rank_of_data_file(n) is not None for n in names):
        raise IncompleteCheckpointError(
            f"{target.name} holds the rank files of a sharded save but no {METADATA_NAME}: "
            "an asyncckpt.dcp save still writing, or one that failed"
        )
    below = checkpoints_below(target.storage, target.path)
    if not below:
        raise CheckpointNotFoundError(
            f"{target.name}: a folder with no checkpoint in it (no asyncckpt file, "
            f"Checkpointer root or asyncckpt.dcp directory within {MAX_DEPTH} levels)"
        )
    if len(below) > 1:
        shown = ", ".join(target.storage.describe(p) for p, _ in below[:5])
        more = f" and {len(below) - 5} more" if len(below) > 5 else ""
        raise PathKindError(
            f"{target.name} is a folder of {len(below)} checkpoints ({shown}{more}); "
            "give the one to read"
        )
    path, kind = below[0]
    return Target(target.storage, path, kind, typed=target.typed)


def check_root(storage: Storage, path: str) -> None:
    """Refuse to take ``path`` as a Checkpointer root when it is a file (its saves would
    fail on the OS's "Not a directory" at the first write).

    Raises:
        PathKindError: ``path`` is a file; the message says how to read it.

    Example:
        >>> import tempfile
        >>> from asyncckpt._storage import LocalStorage
        >>> check_root(LocalStorage(), tempfile.mkdtemp())
    """
    if kind_of(storage, path)[0] == FILE:
        where = storage.describe(path)
        raise PathKindError(
            f"{where} is a file, not a checkpoint root: a Checkpointer keeps its versions in "
            f"a directory (or prefix). Read the file with asyncckpt.load({where!r}), or give "
            "the Checkpointer a directory"
        )


def version_of(target: Target) -> tuple[int, CommitRecord]:
    """The committed version a root target names (``ROOT@STEP``'s, else the newest) and its
    ``COMMIT``, read through the protocol's one reader of the records.

    Raises:
        CheckpointNotFoundError: nothing is committed under the root, or ``@STEP`` has no
            directory there (the committed steps are named).
        IncompleteCheckpointError: ``@STEP`` was begun but never committed.

    Example:
        >>> import tempfile
        >>> try:
        ...     version_of(find(tempfile.mkdtemp()))
        ... except CheckpointNotFoundError as exc:
        ...     print(str(exc)[:28])
        no committed checkpoint unde
    """
    storage, root = target.storage, target.path
    step = target.step if target.step is not None else latest_step(storage, root)
    if step is None:
        raise CheckpointNotFoundError(f"no committed checkpoint under {target.name}")
    commit = read_commit(storage, root, step)
    if commit is not None:
        return step, commit
    committed = ", ".join(map(str, committed_steps(storage, root))) or "none"
    begun = step in step_dirs(storage, root)
    raise (IncompleteCheckpointError if begun else CheckpointNotFoundError)(
        f"step {step} is not committed under {target.name}; committed steps: {committed}"
    )
