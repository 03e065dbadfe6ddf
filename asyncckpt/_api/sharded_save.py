"""Sharded versions: every rank writes its own shards; the writer rank commits.

``Checkpointer.save`` comes here when the state holds ``DTensor``s (FSDP2, TP, their
optimizer states from ``get_state_dict``). Every rank stages its own part (each DTensor
replaced by its local shard, plain values as they are) and writes one file in the
background; the writer rank commits the version once every rank's file is durable, with
no collective during the write. Layout of a sharded step directory::

    ROOT/<step>/r<rank:05d>-<attempt>.ackpt   rank <rank>'s file: its state tree, DTensors
                                              replaced by their local shard (None where
                                              another rank stores that replicated piece)
    ROOT/<step>/r<rank:05d>-<attempt>.beat    the rank's progress while it writes
    ROOT/<step>/r<rank:05d>-<attempt>.done    its completion marker: file, size, pieces
    ROOT/<step>/r<rank:05d>-<attempt>.failed  or its failure marker
    ROOT/<step>/r<writer:05d>-<attempt>.metadata  DCP-style JSON index of every piece
    ROOT/<step>/COMMIT                        names every rank file and the metadata (kind
                                              "sharded")

``<attempt>`` (32 hex digits) is the same on every rank: derived from a token that the
writer rank broadcasts once per Checkpointer (the only collective, in the first sharded
``save``), the step and a save counter, so two attempts never share a name: everything a
save puts under a step is named by its attempt, and a writer that lost the lease removes
nothing else. Loading is in :mod:`asyncckpt._api.sharded_load`; ``docs/sharded.md`` describes the
whole protocol.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from asyncckpt import _config as config
from asyncckpt._api.dropin import SaveHandle, raise_unobserved_failure, stage, submit, write_options
from asyncckpt._engine import writer_process
from asyncckpt._engine.encode import WriteOptions
from asyncckpt._engine.snapshot import Snapshot
from asyncckpt._format.container import DTYPE_ITEMSIZE, MAX_DEPTH, MAX_NDIM
from asyncckpt._format.index import (
    MAX_METADATA_BYTES,
    ItemLocation,
    data_file_name,
    decode_metadata,
    encode_metadata,
)
from asyncckpt._format.tree import ROOT_NAME, child_path, dtype_name, flatten, torch_dtype
from asyncckpt._storage import Storage
from asyncckpt._threads import pool
from asyncckpt._versions.protocol import (
    SHARDED,
    decode_record,
    encode_record,
    metadata_file_name,
    step_dir,
)
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    FencedError,
    FormatError,
    IncompleteCheckpointError,
    UnsupportedObjectError,
)

if TYPE_CHECKING:
    from asyncckpt._api.checkpointer import Checkpointer

log = logging.getLogger(__name__)

DONE: Final = ".done"
FAILED: Final = ".failed"
BEAT: Final = ".beat"
#: Threads that read rank markers in parallel on the writer rank.
_MARKER_READERS: Final = 16
#: The DCP metadata version recorded (the one DCP's FileSystemWriter writes).
_DCP_VERSION: Final = "1.0.0"
_MAX_POLL_S: Final = 0.25  # one listing per poll: cheap, and it bounds the commit's delay
Path = tuple[str | int, ...]


# ------------------------------------------------------------------ what a state holds


def dtensor_type() -> type[Any] | None:
    """``torch.distributed.tensor.DTensor``, or None in a torch built without it."""
    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def holds_dtensor(obj: Any) -> bool:
    """Whether ``obj`` (nested dicts, lists, tuples) holds a ``DTensor`` anywhere.

    Example:
        >>> holds_dtensor({"model": {"w": torch.zeros(2)}, "step": 3})
        False
    """
    kind = dtensor_type()
    if kind is None or obj is None:
        return False
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, kind):
            return True
        if depth < MAX_DEPTH and isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif depth < MAX_DEPTH and isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)
    return False


def fqn_of(path: Path) -> str:
    """The flat name of the leaf at ``path``: its keys joined by dots, as DCP names them.

    Example:
        >>> fqn_of(("optim", "state", "0.weight", "exp_avg"))
        'optim.state.0.weight.exp_avg'
    """
    return ".".join(str(k) for k in path)


def dtensor_leaves(obj: Any) -> Iterator[tuple[Path, str, Any]]:
    """Every DTensor in ``obj`` as ``(path, key path, DTensor)``, in ``flatten``'s order.

    Raises:
        UnsupportedObjectError: a DTensor sits under a key that is not a str or int.
    """
    kind = dtensor_type()
    if kind is None:
        return
    stack: list[tuple[Any, Path, str]] = [(obj, (), ROOT_NAME)]
    while stack:
        node, path, key = stack.pop()
        if isinstance(node, kind):
            _check_path(path, key)
            yield path, key, node
        elif len(path) < MAX_DEPTH and isinstance(node, dict):
            items = [(v, (*path, k), child_path(key, k)) for k, v in node.items()]
            stack.extend(reversed(items))
        elif len(path) < MAX_DEPTH and isinstance(node, (list, tuple)):
            items = [(v, (*path, i), f"{key}[{i}]") for i, v in enumerate(node)]
            stack.extend(reversed(items))


def _check_path(path: Path, key: str) -> None:
    if not all(type(k) in (str, int) for k in path):
        raise UnsupportedObjectError(key, "a DTensor's keys must be str or int (its DCP name)")


# ------------------------------------------------------------------ pieces and markers


@dataclass(frozen=True)
class Piece:
    """One chunk of a DTensor stored in one rank's file.

    Attributes:
        fqn: the DTensor's flat name (:func:`fqn_of` of ``path``).
        path: its keys from the root of the state.
        shape: the global tensor's shape.
        dtype: its dtype name (``"float32"``).
        offsets: where the chunk starts in the global tensor.
        sizes: the chunk's shape.
        entry: the chunk's index in the file's tensor table.
        nbytes: the chunk's raw length in bytes.
    """

    fqn: str
    path: Path
    shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    entry: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        """The piece as a JSON object (in a ``.done`` marker)."""
        return {
            "fqn": self.fqn,
            "path": list(self.path),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "entry": self.entry,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, doc: Any, where: str) -> Piece:
        """Parse and check one piece of a marker.

        Raises:
            FormatError: a field is missing, of the wrong type or out of range.

        Example:
            >>> p = Piece("w", ("w",), (4,), "float32", (2,), (2,), 0, 8)
            >>> Piece.from_json(p.to_json(), "x") == p
            True
        """
        bad = FormatError(f"{where}: malformed piece {str(doc)[:200]}")
        if not isinstance(doc, dict):
            raise bad
        path, dims = doc.get("path"), [doc.get(k) for k in ("shape", "offsets", "sizes")]
        scalars = [doc.get("entry"), doc.get("nbytes")]
        if not (
            isinstance(doc.get("fqn"), str)
            and isinstance(path, list)
            and 0 < len(path) <= MAX_DEPTH
            and all(type(k) in (str, int) for k in path)
            and doc.get("dtype") in DTYPE_ITEMSIZE
            and all(_dims(d) for d in dims)
            and len({len(d) for d in dims}) == 1  # type: ignore[arg-type]
            and all(type(v) is int and v >= 0 for v in scalars)
        ):
            raise bad
        shape, offsets, sizes = (tuple(d) for d in dims)  # type: ignore[arg-type]
        if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise bad
        entry, nbytes = doc["entry"], doc["nbytes"]
        return cls(doc["fqn"], tuple(path), shape, doc["dtype"], offsets, sizes, entry, nbytes)


def _dims(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_NDIM
        and all(type(v) is int and 0 <= v < 1 << 62 for v in value)
    )


@dataclass(frozen=True)
class RankMarker:
    """A rank's completion marker: its file is durable and holds ``pieces``.

    Attributes:
        rank: the rank (in the Checkpointer's group).
        file: its data file's name.
        size: that file's size in bytes.
        pieces: the DTensor chunks the file stores.
    """

    rank: int
    file: str
    size: int
    pieces: tuple[Piece, ...] = field(default_factory=tuple)

    def encode(self, step: int, attempt: str) -> bytes:
        """The marker's bytes (a protocol record)."""
        doc = {
            "kind": "rank-done",
            "step": step,
            "attempt": attempt,
            "rank": self.rank,
            "file": self.file,
            "size": self.size,
            "pieces": [p.to_json() for p in self.pieces],
        }
        return encode_record(doc)

    @classmethod
    def decode(cls, raw: bytes, where: str, step: int, attempt: str, rank: int) -> RankMarker:
        """Parse and check a completion marker.

        Raises:
            FormatError: malformed, or written for another step, attempt or rank.
        """
        doc = decode_record(raw, where)
        file, size, pieces = doc.get("file"), doc.get("size"), doc.get("pieces")
        if (
            doc.get("kind") != "rank-done"
            or (doc.get("step"), doc.get("attempt"), doc.get("rank")) != (step, attempt, rank)
            or file != data_file_name(rank, attempt)
            or type(size) is not int
            or size < 0
            or not isinstance(pieces, list)
        ):
            raise FormatError(f"{where}: not the completion marker of rank {rank}'s save")
        return cls(rank, file, size, tuple(Piece.from_json(p, where) for p in pieces))


def marker_name(rank: int, attempt: str, suffix: str) -> str:
    """The name of a rank's marker of one attempt (suffix :data:`DONE`, ``FAILED``, ``BEAT``).

    Example:
        >>> marker_name(3, "ab" * 16, DONE)
        'r00003-abababababababababababababababab.done'
    """
    return data_file_name(rank, attempt).removesuffix(".ackpt") + suffix


# ------------------------------------------------------------------ the caller's part


@dataclass
class _Session:
    """What the ranks of one Checkpointer agreed on: a token, and how many saves so far."""

    token: str
    saves: int = 0


_sessions: weakref.WeakKeyDictionary[Checkpointer, _Session] = weakref.WeakKeyDictionary()


def next_attempt(ckpt: Checkpointer, step: int) -> str:
    """This save's attempt id, the same on every rank (a broadcast on the first call only).

    Every rank calls ``save`` the same number of times, so the counter agrees; the token
    differs per Checkpointer, so a restarted job never reuses a name.
    """
    session = _sessions.get(ckpt)
    if session is None:
        token = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8)
        token = token.to(ckpt._collective_device())
        dist.broadcast(token, group=ckpt._group, group_src=ckpt.writer_rank)
        session = _sessions[ckpt] = _Session(bytes(token.cpu().tolist()).hex())
    session.saves += 1
    seed = f"{session.token}:{step}:{session.saves}".encode()
    return hashlib.blake2b(seed, digest_size=16).hexdigest()


@dataclass
class RankState:
    """One rank's part of a state: what it stages, and the DTensor chunks it stores.

    Attributes:
        plain: the state with each DTensor replaced by its local shard, or by None where
            another rank stores that (replicated) piece.
        stored: ``(path, key path, DTensor, local shard)`` of each chunk this rank stores.
    """

    plain: Any
    stored: list[tuple[Path, str, Any, torch.Tensor]]


def split_state(state: Any) -> RankState:
    """Replace every DTensor of ``state`` by what this rank stores of it.

    A DTensor's local shard is stored by this rank unless the placement replicates it
    over a mesh dimension on which this rank's coordinate is not 0 (another rank holds the
    same values), or it is empty while the tensor is not.

    Raises:
        UnsupportedObjectError: a DTensor with ``Partial`` placements (reduce it first),
            several local chunks, or a key that is not a str or int; names the key path.
    """
    local: dict[int, torch.Tensor] = {}
    stored: list[tuple[Path, str, Any, torch.Tensor]] = []
    replaced: dict[Path, torch.Tensor | None] = {}
    names: dict[str, Path] = {}
    for path, key, dt in dtensor_leaves(state):
        fqn = fqn_of(path)
        if names.setdefault(fqn, path) != path:
            raise UnsupportedObjectError(key, f"another DTensor has the same name {fqn!r}")
        if not _stores(dt, key):
            replaced[path] = None
            continue
        if id(dt) not in local:  # tied weights: one shard object, stored once
            with torch.no_grad():
                local[id(dt)] = dt.to_local()
        replaced[path] = local[id(dt)]
        stored.append((path, key, dt, local[id(dt)]))
    above = {path[:i] for path in replaced for i in range(len(path))}
    return RankState(_rebuilt(state, (), replaced, above), stored)


#: Local chunk lists by mesh, then (placements, global shape): together they determine them
#: on a rank. Computing one costs tens of microseconds per DTensor (hundreds of DTensors in
#: a model and its optimizer state: milliseconds of every save's stall), and a training
#: state has the same few keys at every save. The mesh is held weakly: a DeviceMesh holds
#: its ProcessGroups, and a cache that kept it would keep them, and their worker threads,
#: alive after ``destroy_process_group()``, into the interpreter's shutdown.
_chunk_cache: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], list[Any]]]
_chunk_cache = weakref.WeakKeyDictionary()
_CHUNK_CACHE_MAX: Final = 4096


def _chunks(dt: Any) -> list[Any]:
    """``dt.__create_chunk_list__()``, from :data:`_chunk_cache` when it was seen before."""
    by_layout = _chunk_cache.get(dt.device_mesh)
    if by_layout is None:
        by_layout = _chunk_cache[dt.device_mesh] = {}
    key = (tuple(dt.placements), dt.shape)
    chunks = by_layout.get(key)
    if chunks is None:
        chunks = dt.__create_chunk_list__()
        if len(by_layout) >= _CHUNK_CACHE_MAX:
            by_layout.clear()
        by_layout[key] = chunks
    return chunks


def _stores(dt: Any, key: str) -> bool:
    try:
        chunks = _chunks(dt)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        raise UnsupportedObjectError(key, f"DTensor {dt.placements}: {exc}") from None
    if len(chunks) != 1:
        raise UnsupportedObjectError(key, f"a DTensor with {len(chunks)} local chunks")
    coordinate = dt.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the DTensor's mesh
        return False
    if dt.numel() == 0:  # every shard is empty: one rank records the tensor's shape
        return all(c == 0 for c in coordinate)
    if chunks[0].sizes.numel() == 0:
        return False
    return all(c == 0 for c, p in zip(coordinate, dt.placements) if p.is_replicate())


def _rebuilt(node: Any, path: Path, replaced: dict[Path, Any], above: set[Path]) -> Any:
    """A copy of the containers ``above`` a replaced leaf; everything else is shared."""
    if path in replaced:
        return replaced[path]
    if path not in above:
        return node
    if isinstance(node, dict):
        pairs = [(k, _rebuilt(v, (*path, k), replaced, above)) for k, v in node.items()]
        out = OrderedDict(pairs) if isinstance(node, OrderedDict) else dict(pairs)
        if hasattr(node, "_metadata"):
            out._metadata = node._metadata  # type: ignore[attr-defined]
        return out
    items = [_rebuilt(v, (*path, i), replaced, above) for i, v in enumerate(node)]
    return items if isinstance(node, list) else tuple(items)


def pieces_of(rank_state: RankState) -> list[Piece]:
    """The chunks this rank stores, with their entries in its file's tensor table.

    The table is ``flatten``'s (the one ``stage`` writes): tensors in order of first
    appearance, each object once.
    """
    table = {id(t): i for i, (t, _) in enumerate(flatten(rank_state.plain).tensors)}
    pieces = []
    for path, _key, dt, shard in rank_state.stored:
        (chunk,) = _chunks(dt)
        pieces.append(
            Piece(
                fqn=fqn_of(path),
                path=path,
                shape=tuple(dt.shape),
                dtype=dtype_name(dt.dtype),
                offsets=tuple(chunk.offsets),
                sizes=tuple(chunk.sizes),
                entry=table[id(shard)],
                nbytes=shard.numel() * shard.element_size(),
            )
        )
    return pieces


def save(ckpt: Checkpointer, step: int, state: Any) -> SaveHandle:
    """Snapshot this rank's part of ``state`` and write it as part of sharded version ``step``.

    Called by ``Checkpointer.save`` on every rank when ``state`` holds DTensors; returns
    once this rank's part is staged. The handle of a rank that is not the writer completes
    once its file and completion marker are durable; the writer's, once the version is
    committed.

    Raises:
        AsyncCkptError: torch.distributed is not initialized.
        UnsupportedObjectError: the state cannot be stored (nothing was written).
        ValueError, ConflictError: as for ``Checkpointer.save``.
    """
    from asyncckpt._api.checkpointer import _group_timeout  # the checkpointer imports this module

    started = time.perf_counter()
    if not ckpt._distributed:
        raise AsyncCkptError("a state holding DTensors needs torch.distributed initialized")
    # First, while every rank is sure to get here: a rank raising before the (first save's)
    # broadcast would leave the others waiting in it.
    attempt = next_attempt(ckpt, step)
    ckpt._raise_own_failure()
    raise_unobserved_failure()
    options = write_options(ckpt.compression)
    group = ckpt._group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    part = split_state(state)
    pieces = pieces_of(part)
    with ckpt._lock:
        ckpt._check_new_step(step)
        job = RankJob(ckpt._storage, ckpt._root, step, attempt, rank, world, None, pieces, options)
        job.beat = _Heartbeat(job.storage, job.path(BEAT), rank)
        # From here this rank is alive to the writer, whatever delays its write (a long
        # copy, an arena still held by its previous save): see _ProgressWatch.
        job.beat.start()
        try:
            snap = job.snap = stage(part.plain, ckpt.overlap, options=options)
        except BaseException as exc:
            job.beat.stop()
            job._mark_failed(exc)  # so the writer stops waiting for this rank at once
            raise
        ckpt._last_snapshot = snap
        ckpt._last_step = step
        if rank == ckpt.writer_rank:
            timeout = _group_timeout(group)
            work = lambda: _write_and_commit(ckpt, job, timeout)  # noqa: E731
        else:
            work = job.write
        where = ckpt._storage.describe(job.path(".ackpt"))
        nice = options.settings.writer_nice
        handle = submit(work, where, snap.raw_bytes, started, nice=nice)
        ckpt._pending = [(s, h) for s, h in ckpt._pending if not _settled(h)]
        ckpt._pending.append((step, handle))
    return handle


def _settled(handle: SaveHandle) -> bool:
    return handle.done() and (not handle.failed() or handle.observed)


# ------------------------------------------------------------------ every rank's write


@dataclass
class RankJob:
    """One rank's background part of a sharded save."""

    storage: Storage
    root: str
    step: int
    attempt: str
    rank: int
    world: int
    snap: Snapshot | None
    pieces: list[Piece]
    options: WriteOptions
    #: The rank's progress marker, started by ``save`` before the copy (or by :meth:`write`).
    beat: _Heartbeat | None = None

    @property
    def directory(self) -> str:
        """The step directory."""
        return step_dir(self.storage, self.root, self.step)

    def path(self, suffix: str, rank: int | None = None) -> str:
        """The path of a rank's data file (``".ackpt"``) or marker of this attempt."""
        name = marker_name(self.rank if rank is None else rank, self.attempt, suffix)
        return self.storage.join(self.directory, name)

    def write(self) -> int:
        """Write this rank's file, then its completion marker; return the file's size.

        A failure leaves a ``.failed`` marker (best effort), so the writer rank stops
        waiting for this rank at once.
        """
        if self.beat is None:
            self.beat = _Heartbeat(self.storage, self.path(BEAT), self.rank)
            self.beat.start()
        snap = self.snap
        assert snap is not None, "a job is written once its state is staged"
        try:
            try:
                self.beat.wait_first()  # so the marker is there before any data
                size = writer_process.write(snap, self.storage, self.path(".ackpt"), self.options)
            finally:
                self.beat.stop()
                snap.lease.release()
            name = data_file_name(self.rank, self.attempt)
            marker = RankMarker(self.rank, name, size, tuple(self.pieces))
            self.storage.write_bytes(self.path(DONE), marker.encode(self.step, self.attempt))
            # Each rank removes its own progress file, in parallel with the others, instead
            # of the writer sweeping world of them one by one after the commit.
            with contextlib.suppress(AsyncCkptError):
                self.storage.delete(self.path(BEAT))
            return size
        except BaseException as exc:
            self._mark_failed(exc)
            raise

    def _mark_failed(self, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"[:2000]
        doc = {"kind": "rank-failed", "step": self.step, "rank": self.rank, "error": error}
        try:
            self.storage.write_bytes(self.path(FAILED), encode_record(doc))
        except Exception as again:  # best effort: the writer then waits for the timeout
            log.warning("could not record rank %d's failure: %s", self.rank, again)


class _Heartbeat:
    """Rewrites a rank's ``.beat`` marker every ``lease_renew_ms`` from its ``save`` call
    until its file is written, so the writer rank can tell a slow rank from a dead one."""

    def __init__(self, storage: Storage, path: str, rank: int) -> None:
        self.storage, self.path, self.rank = storage, path, rank
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread: threading.Thread | None = None
        self._launched: Future[None] | None = None

    def _write(self, beat: int) -> None:
        try:
            record = encode_record({"kind": "rank-beat", "rank": self.rank, "beat": beat})
            self.storage.write_bytes(self.path, record)
        except Exception as exc:  # a missed beat only makes the writer give up sooner
            log.warning("rank %d could not record its progress: %s", self.rank, exc)

    def start(self) -> None:
        """Write the first beat and renew it, on a thread of its own.

        The thread is started by the ``beats`` pool: ``Thread.start`` waits until the new
        thread runs, milliseconds on a loaded machine, which ``save`` would pay.
        """
        interval = config.tunable("lease_renew_ms", None) / 1000

        def run() -> None:
            beat = 0
            try:
                if self._stop.is_set():  # stopped before it ran: no beat after the stop
                    return
                self._write(beat)
            finally:
                self._first.set()
            while not self._stop.wait(interval):
                beat += 1
                self._write(beat)

        self._thread = threading.Thread(target=run, name="asyncckpt-beat", daemon=True)
        self._launched = pool("beats", 1).submit(self._thread.start)

    def wait_first(self) -> None:
        """Block until the first beat was written (or failed to be)."""
        if self._launched is not None:
            self._launched.result()  # a thread that could not start: the write fails
            self._first.wait()

    def stop(self) -> None:
        """Stop renewing (after the beat being written, if any); idempotent."""
        self._stop.set()
        launched, thread = self._launched, self._thread
        # The pool only starts threads, so waiting for it is short.
        if launched is not None and thread is not None and launched.exception() is None:
            thread.join()

    def remove(self) -> None:
        """Stop, and delete the marker (best effort)."""
        self.stop()
        with contextlib.suppress(AsyncCkptError):
            self.storage.delete(self.path)


# ------------------------------------------------------------------ the writer's commit


def _write_and_commit(ckpt: Checkpointer, job: RankJob, timeout: float) -> int:
    """The writer rank's job: its own file, every rank's marker, metadata, ``COMMIT``."""
    started = time.monotonic()  # the other ranks' markers are awaited from here
    writer = ckpt._writer
    try:
        writer.acquire()  # first save only; before writing, since it cleans up
    except BaseException:
        if job.beat is not None:
            job.beat.remove()
        if job.snap is not None:
            job.snap.lease.release()
        raise  # not this root's writer: no marker
    try:
        size = job.write()
        markers = await_markers(job, timeout, started)
        body = metadata_bytes(markers, job.attempt, ckpt._storage.describe(job.directory))
        ordered = [markers[r] for r in sorted(markers)]
        metadata = metadata_file_name(job.rank, job.attempt)
        files = (*(m.file for m in ordered), metadata)
        sizes = (*(m.size for m in ordered), len(body))
        keep = tuple(marker_name(m.rank, job.attempt, DONE) for m in ordered)
        # Right before the metadata lands: a writer that lost the lease (frozen while the
        # ranks wrote) writes nothing more there, and removes only its attempt's files.
        writer.fence(job.step, (*files[:-1], *keep))
        job.storage.write_bytes(job.storage.join(job.directory, metadata), body)
        writer.commit(job.step, files, sizes, kind=SHARDED, keep=keep)
    except FencedError:
        raise  # the root is another writer's now: leave no marker in it
    except BaseException as exc:
        writer.mark_failed(job.step, exc)  # only if there is no COMMIT, and the lease holds
        raise
    writer.apply_retention(ckpt.keep_last, job.step, ckpt._agreed_step)
    return size


def await_markers(
    job: RankJob, timeout: float, started: float | None = None
) -> dict[int, RankMarker]:
    """Poll the step directory until every rank's completion marker is there.

    Args:
        job: the writer rank's job of the save.
        timeout: seconds to wait at most for every completion marker (the group's timeout).
        started: ``time.monotonic()`` when the writer started this save's job (default:
            now); a rank without any marker ``lease_expiry_ms`` after it is given up.

    Returns:
        ``{rank: marker}`` for every rank of the group.

    Raises:
        IncompleteCheckpointError: a rank recorded that its write failed.
        CheckpointTimeoutError: a rank wrote no marker at all within ``lease_expiry_ms``
            of ``started`` (it died before its save, or never called it), a rank's
            progress marker stopped changing for ``lease_expiry_ms`` (it died or froze),
            or some rank wrote no completion marker within ``timeout`` seconds.
        FormatError: a marker cannot be understood.
    """
    watch = _ProgressWatch(job, time.monotonic() if started is None else started)
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        names = set(job.storage.list_dir(job.directory))
        missing = watch.check(names)
        if not missing:
            return watch.found
        now = time.monotonic()
        if now >= deadline:
            shown = ", ".join(str(r) for r in missing[:10])
            raise CheckpointTimeoutError(
                f"step {job.step} under {job.storage.describe(job.root)}: rank(s) {shown} "
                f"wrote no completion marker within {timeout:.0f} s; not committing it"
            )
        time.sleep(min(delay * (0.5 + random.random()), max(0.0, deadline - now)))
        delay = min(delay * 2, _MAX_POLL_S)


class _ProgressWatch:
    """Every rank's markers of one attempt, as seen by the writer's polls."""

    def __init__(self, job: RankJob, started: float) -> None:
        self.job = job
        self.started = started
        self.expiry_s = config.tunable("lease_expiry_ms", None) / 1000
        self.found: dict[int, RankMarker] = {}
        self.beats: dict[int, tuple[bytes, float]] = {}
        # Progress files change every lease_renew_ms; reading all of them on every poll
        # would cost world requests per poll, so they are read once per renewal period.
        self.beat_every_s = config.tunable("lease_renew_ms", None) / 1000
        self.beats_read_at = -float("inf")

    def check(self, names: set[str]) -> list[int]:
        """Take in what a listing shows; return the ranks still missing.

        The markers a listing reveals are read in parallel: with many ranks finishing at
        once, reading them one request at a time would put world x latency between the
        last rank's write and the commit.
        """
        job = self.job
        done, writing, silent = [], [], []
        for rank in range(job.world):
            if rank in self.found:
                continue
            if marker_name(rank, job.attempt, FAILED) in names:
                raise IncompleteCheckpointError(
                    f"step {job.step} under {job.storage.describe(job.root)}: rank {rank} "
                    f"failed to write its part: {self._error(rank)}"
                )
            if marker_name(rank, job.attempt, DONE) in names:
                done.append(rank)
            elif marker_name(rank, job.attempt, BEAT) in names:
                writing.append(rank)
            elif rank not in self.beats:
                silent.append(rank)
        self._check_silent(silent)
        readers = pool("markers", _MARKER_READERS)
        markers = [readers.submit(self._read_done, rank) for rank in done]
        now = time.monotonic()
        if now - self.beats_read_at < self.beat_every_s:
            writing = []
        else:
            self.beats_read_at = now
        beats = [readers.submit(self._read_beat, rank) for rank in writing]
        for rank, marker in zip(done, markers):
            self.found[rank] = marker.result()
        for future in beats:
            self._check_beat(*future.result())
        return [r for r in range(job.world) if r not in self.found]

    def _check_silent(self, silent: list[int]) -> None:
        """Give up on ranks that wrote no marker at all within ``lease_expiry_ms``.

        Every rank starts its progress marker in ``save``, before its copy, so a rank
        that has called ``save`` shows one within a request's latency; the ranks call
        ``save`` at about the same time (training keeps them in step), and the clock
        starts only when the writer's job for this save starts (after its own copy, and
        after its previous save's commit, for which every rank's previous write ended).
        """
        waited = time.monotonic() - self.started
        if not silent or waited < self.expiry_s:
            return
        job = self.job
        shown = ", ".join(str(r) for r in silent[:10]) + (", ..." if len(silent) > 10 else "")
        raise CheckpointTimeoutError(
            f"step {job.step} under {job.storage.describe(job.root)}: "
            f"{'rank' if len(silent) == 1 else 'ranks'} {shown} recorded no progress "
            f"{waited:.1f} s after the writer rank started the save (lease_expiry_ms is "
            f"{self.expiry_s * 1000:.0f}): dead before saving, or never called save(); "
            "not committing the step"
        )

    def _read_done(self, rank: int) -> RankMarker:
        job = self.job
        path = job.path(DONE, rank)
        raw = job.storage.read_bytes(path, MAX_METADATA_BYTES)
        return RankMarker.decode(raw, job.storage.describe(path), job.step, job.attempt, rank)

    def _read_beat(self, rank: int) -> tuple[int, bytes | None]:
        try:
            return rank, self.job.storage.read_bytes(self.job.path(BEAT, rank), MAX_METADATA_BYTES)
        except CheckpointNotFoundError:
            return rank, None

    def _check_beat(self, rank: int, beat: bytes | None) -> None:
        if beat is None:
            return
        now = time.monotonic()
        seen = self.beats.get(rank)
        if seen is None or seen[0] != beat:
            self.beats[rank] = (beat, now)
        elif now - seen[1] >= self.expiry_s:
            raise CheckpointTimeoutError(
                f"step {self.job.step} under {self.job.storage.describe(self.job.root)}: "
                f"rank {rank} has not recorded progress for {now - seen[1]:.1f} s, so it died "
                "or froze while writing its part; not committing the step"
            )

    def _error(self, rank: int) -> str:
        with contextlib.suppress(AsyncCkptError, ValueError):
            raw = self.job.storage.read_bytes(self.job.path(FAILED, rank), MAX_METADATA_BYTES)
            return str(decode_record(raw, "marker").get("error", "unknown error"))
        return "unknown error"


def metadata_bytes(markers: dict[int, RankMarker], attempt: str, where: str) -> bytes:
    """DCP's metadata for every rank's pieces, as ``asyncckpt.dcp``'s JSON.

    Raises:
        FormatError: ranks disagree on a tensor's shape or dtype, store a chunk twice, or
            leave part of a tensor unstored (the checks every reader makes).
    """
    tensors: dict[str, TensorStorageMetadata] = {}
    locations: dict[MetadataIndex, ItemLocation] = {}
    paths: dict[str, Path] = {}
    for rank in sorted(markers):
        marker = markers[rank]
        for piece in marker.pieces:
            described = tensors.setdefault(
                piece.fqn,
                TensorStorageMetadata(
                    TensorProperties(dtype=torch_dtype(piece.dtype)), torch.Size(piece.shape), []
                ),
            )
            if (tuple(described.size), described.properties.dtype) != (
                piece.shape,
                torch_dtype(piece.dtype),
            ) or paths.setdefault(piece.fqn, piece.path) != piece.path:
                raise FormatError(f"{where}: ranks disagree on what {piece.fqn!r} is")
            described.chunks.append(
                ChunkStorageMetadata(torch.Size(piece.offsets), torch.Size(piece.sizes))
            )
            index = MetadataIndex(piece.fqn, piece.offsets)
            if index in locations:
                raise FormatError(f"{where}: {piece.fqn!r} at {piece.offsets} is stored twice")
            locations[index] = ItemLocation(marker.file, marker.size, piece.entry, piece.nbytes)
    metadata = Metadata(
        state_dict_metadata=dict(tensors),
        planner_data={fqn: path for fqn, path in paths.items()},
        storage_data=locations,
        storage_meta=StorageMeta(checkpoint_id=where, save_id=attempt),
        version=_DCP_VERSION,
    )
    body = encode_metadata(metadata, attempt)
    decode_metadata(body, f"{where} metadata")  # a reader's checks, before the commit
    return body
