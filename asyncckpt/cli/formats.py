"""Checkpoint file formats the command line reads and writes: which format a file is,
``torch.save`` and asyncckpt files in and out (safetensors is in
:mod:`asyncckpt._convert.safetensors`), and sharded checkpoints opened for the commands.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import struct
from collections.abc import Callable
from typing import IO, Any, TypeVar, cast

import numpy as np
import torch

from asyncckpt._api.dropin import stage, write_options
from asyncckpt._convert.consolidate import ShardedSource
from asyncckpt._device import Placement
from asyncckpt._engine.decode import Budget, OpenedFile, materialize, read_file
from asyncckpt._engine.encode import write_snapshot
from asyncckpt._format.container import MAGIC
from asyncckpt._format.tree import child_path
from asyncckpt._settings import Settings, SettingsArg
from asyncckpt._storage import AtomicWriter, ReadHandle, Storage
from asyncckpt._versions.protocol import SHARDED, latest_step, read_commit, step_dir
from asyncckpt.cli.common import (
    FORMATS,
    FileRef,
    RootRef,
    UsageError,
    dcp_files,
    is_dcp_directory,
)
from asyncckpt.errors import AsyncCkptError, FormatError

#: The second byte of a pickle (its protocol) that a legacy ``torch.save`` file begins with.
_PROTOCOLS = (b"\x02", b"\x03", b"\x04", b"\x05")
#: Bytes a remote ``torch.load`` reads per request.
_READ_BLOCK = 8 << 20

T = TypeVar("T")


def format_of(spec: str, explicit: str | None, role: str) -> str | None:
    """The format named by ``--from/--to`` (``explicit``) or by the extension of ``spec`` (a
    path or URL, maybe with ``@STEP``); None for a SRC whose name does not tell (it is
    sniffed).

    Raises:
        UsageError: the format of DST cannot be told.

    Example:
        >>> format_of("model.pth", None, "DST"), format_of("run@20", None, "SRC")
        ('torch', None)
    """
    if explicit:
        return explicit
    base = re.sub(r"@[0-9]+\Z", "", spec).rstrip("/").lower()
    for name, extensions in FORMATS.items():
        if base.endswith(extensions):
            return name
    if role == "DST":
        raise UsageError(
            f"asyncckpt convert: cannot tell the format of {spec} from its extension "
            "(.pt/.pth/.bin, .ackpt, .safetensors); pass --to torch|ackpt|safetensors"
        )
    return None


def sniff(ref: FileRef) -> str:
    """The format of a file, from its first bytes."""
    head = ref.storage.read_range(ref.path, 0, 16)
    if head.startswith(MAGIC):
        return "ackpt"
    # safetensors before torch: its header length (8 bytes, little-endian) may begin with
    # 0x80, as a legacy pickle does; a "{" after it and a length inside the file tell it.
    if len(head) >= 9 and head[8:9] == b"{":
        (length,) = struct.unpack("<Q", head[:8])
        if 8 + length <= ref.storage.size(ref.path):
            return "safetensors"
    if head.startswith(b"PK\x03\x04") or (head[:1] == b"\x80" and head[1:2] in _PROTOCOLS):
        return "torch"
    raise UsageError(
        f"asyncckpt convert: cannot tell the format of {ref.name}; pass --from "
        "torch|ackpt|safetensors"
    )


def source_format(ref: FileRef, explicit: str | None, guess: str | None) -> str:
    """The format of a file to read: its first bytes decide, not its name.

    An asyncckpt file named ``model.pt`` is read as asyncckpt (never handed to
    ``torch.load``), a ``torch.save`` file named ``.ackpt`` as torch. ``guess`` (what the
    extension or ``--from`` names) is used when the bytes match no known format.

    Raises:
        UsageError: ``--from`` names another format than the bytes show, or neither the
            bytes nor the name tell the format.
    """
    try:
        found = sniff(ref)
    except UsageError:
        if guess is None:
            raise
        return guess
    if explicit is not None and explicit != found:
        raise UsageError(
            f"asyncckpt convert: {ref.name} is {_ARTICLE[found]} file by its first bytes, "
            f"not {explicit}; drop --from {explicit}"
        )
    return found


_ARTICLE = {"ackpt": "an asyncckpt", "torch": "a torch.save", "safetensors": "a safetensors"}


def reject_other_format(ref: FileRef) -> None:
    """Raise a FormatError saying how to convert it if ``ref`` is a torch.save or
    safetensors file."""
    other = None
    with contextlib.suppress(UsageError, AsyncCkptError):
        other = sniff(ref)
    if other is not None and other != "ackpt":
        raise FormatError(
            f"{ref.name} is a {other} file, not an asyncckpt file; convert it first: "
            f"asyncckpt convert {ref.name} OUT.ackpt"
        )


def read_ackpt(ref: FileRef, work: Callable[[OpenedFile], T]) -> T:
    """``read_file`` of an asyncckpt file, saying so when it is a torch.save or safetensors
    file instead."""
    try:
        return read_file(ref.storage, ref.path, work)
    except FormatError:
        reject_other_format(ref)
        raise


def open_sharded(ref: RootRef, settings: Settings) -> ShardedSource | None:
    """The sharded checkpoint ``ref`` names, opened; None for a plain version (or when
    nothing is committed: the caller's single-file path says so)."""
    storage = ref.storage
    if is_dcp_directory(storage, ref.path):
        dcp_files(ref, settings)  # refuses ROOT@STEP of a dcp directory
        return ShardedSource.open(storage, ref.path, None, settings)
    step = ref.step if ref.step is not None else latest_step(storage, ref.path)
    if step is None:
        return None
    commit = read_commit(storage, ref.path, step)
    if commit is None or commit.kind != SHARDED:
        return None
    return ShardedSource.open(storage, step_dir(storage, ref.path, step), commit, settings)


class _Metered:
    """A storage whose handles report every byte read to a progress callback (a load reads
    through its handle only); everything else is the inner storage's."""

    def __init__(self, inner: Storage, progress: Callable[[int], None]) -> None:
        self.inner, self.progress = inner, progress

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open_read(self, path: str) -> ReadHandle:
        return _MeteredHandle(self.inner.open_read(path), self.progress)


class _MeteredHandle(ReadHandle):
    """A handle that reports every byte read to a progress callback."""

    def __init__(self, inner: ReadHandle, progress: Callable[[int], None]) -> None:
        super().__init__(inner.name, inner.size)
        self.inner, self.progress = inner, progress

    def read_range(self, start: int, length: int) -> bytes:
        data = self.inner.read_range(start, length)
        self.progress(len(data))
        return data

    def read_into(self, start: int, out: memoryview) -> int:
        n = self.inner.read_into(start, out)
        self.progress(n)
        return n

    def close(self) -> None:
        self.inner.close()


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


class RangeReader(io.RawIOBase):
    """A seekable, read-only file object over ranged reads of a storage.

    ``torch.load`` of a zip-format file seeks to each record it needs, so a remote file is
    read through this (wrapped in a buffer) instead of being copied whole into memory first.

    Example:
        >>> import fsspec, io
        >>> from asyncckpt._storage import resolve
        >>> fsspec.filesystem("memory").pipe_file("/rr/x", b"0123456789")
        >>> storage, path = resolve("memory://rr/x", None)
        >>> f = io.BufferedReader(RangeReader(storage, path))
        >>> _ = f.seek(4); f.read(3)
        b'456'
    """

    def __init__(
        self, storage: Storage, path: str, progress: Callable[[int], None] | None = None
    ) -> None:
        super().__init__()
        self.storage, self.path, self.progress = storage, path, progress
        self.length = storage.size(path)
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        want = min(len(out), self.length - self.position)
        if want <= 0:
            return 0
        n = self.storage.read_into(self.path, self.position, out[:want])
        self.position += n
        if self.progress is not None:
            self.progress(n)
        return n


def load_ackpt(
    ref: FileRef,
    progress: Callable[[int], None] | None = None,
    max_bytes: int | None = None,
    *,
    settings: SettingsArg = None,
) -> Any:
    """Load an asyncckpt file on the CPU, within ``max_bytes`` of decoded data (as
    ``asyncckpt.load`` takes it), reporting the bytes read to ``progress``. A public
    function of :mod:`asyncckpt.cli`, so an entry point: ``settings`` as ``asyncckpt.load``
    takes them (the command line passes its own).

    Raises:
        MemoryBudgetError: the file needs more than ``max_bytes``.
    """
    resolved = Settings.of(settings)  # once, here
    storage = ref.storage if progress is None else cast(Storage, _Metered(ref.storage, progress))
    budget = Budget(max_bytes)
    return read_file(
        storage,
        ref.path,
        lambda opened: materialize(opened, Placement("cpu"), resolved, None, budget),
        budget,
    )


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
    torch's weights-only defaults, as torch's documentation suggests for them. A remote
    file is read through ranged reads as torch asks for its parts, never copied whole; a
    local one is mapped with ``mmap`` (reading it where it cannot be).

    Raises:
        pickle.UnpicklingError: the file holds something weights-only loading refuses.
        FormatError: torch could not read it (torch's unpickler raises what a crafted or
            damaged file makes it raise: ``IndexError``, ``KeyError``...), naming the file.
        MemoryError: reading it took more memory than there is, naming the file.
    """
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            if ref.storage.local_paths:
                return _load_local_torch(ref, progress, mmap)
            raw = RangeReader(ref.storage, ref.path, progress)
            with io.BufferedReader(raw, buffer_size=_READ_BLOCK) as f:
                return torch.load(f, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, AsyncCkptError, OSError):
        raise
    except MemoryError as exc:  # a damaged or crafted length, or a file too big for here
        raise MemoryError(f"{ref.name}: torch.load ran out of memory reading it") from exc
    except Exception as exc:
        raise FormatError(
            f"{ref.name}: torch.load cannot read it ({type(exc).__name__}: {exc})"
        ) from exc


def _load_local_torch(ref: FileRef, progress: Callable[[int], None] | None, mmap: bool) -> Any:
    try:
        obj = torch.load(ref.path, map_location="cpu", weights_only=True, mmap=mmap)
    except RuntimeError as exc:
        if not mmap or "mmap" not in str(exc):
            raise
        obj = torch.load(ref.path, map_location="cpu", weights_only=True)
    if progress is not None:
        progress(ref.storage.size(ref.path))
    return obj


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
    *,
    settings: SettingsArg = None,
) -> int:
    """Write an asyncckpt file synchronously (``compression``: ``"zstd"`` or ``"none"``);
    returns its size. An entry point, as :func:`load_ackpt`: ``settings`` as
    ``asyncckpt.save`` takes them."""
    options = write_options(compression, Settings.of(settings))  # once, here
    snap = stage(obj, options, in_this_process=True)
    try:
        return write_snapshot(snap, storage, path, options, progress)
    finally:
        snap.release()


def part_at(obj: Any, key: str | None, src: str) -> tuple[Any, str]:
    """The part of ``obj`` at ``key`` (``"model"``, ``"optim/state/0"``; integer parts index
    lists and int-keyed dicts), or all of it, with its key path as ``inspect`` shows it.

    Raises:
        UsageError: a part of the path is not there; the message lists what is.

    Example:
        >>> part_at({"model": {"w": 1}, "step": 3}, "model/w", "x.pt")
        (1, "state['model']['w']")
    """
    path = "state"
    for part in (key or "").strip("/").split("/") if key else ():
        if isinstance(obj, dict):
            if part in obj:
                obj, path = obj[part], child_path(path, part)
                continue
            if part.lstrip("-").isdigit() and int(part) in obj:
                obj, path = obj[int(part)], child_path(path, int(part))
                continue
            raise UsageError(
                f"{src} has no key {part!r} at {path}; keys there: "
                + ", ".join(repr(k) for k in list(obj)[:20])
            )
        if isinstance(obj, (list, tuple)) and part.isdigit() and int(part) < len(obj):
            obj, path = obj[int(part)], f"{path}[{part}]"
            continue
        raise UsageError(f"{path} in {src} has no part {part!r}")
    return obj, path
