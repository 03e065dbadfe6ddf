"""A sharded version's ranks: each writes its file and records; the writer waits for all.

Each rank's :class:`RankJob` writes its file, a progress record (``.beat``) meanwhile, then
``.done`` or ``.failed``; the writer rank commits once every file is durable, with no
collective during the write. Every name carries the save's ``<attempt>`` (the same on
every rank, never reused), so a writer that lost the lease removes only its own
(docs/sharded.md, "Layout of a sharded version"; docs/PROTOCOL.md §6b).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from typing import Final

from asyncckpt import _liveness as liveness
from asyncckpt._engine import writer_process
from asyncckpt._engine.encode import WriteOptions
from asyncckpt._engine.snapshot import Snapshot
from asyncckpt._format.index import MAX_METADATA_BYTES, data_file_name
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt._threads import pool
from asyncckpt._versions.protocol import (
    SHARDED,
    decode_record,
    encode_record,
    metadata_file_name,
    step_dir,
)
from asyncckpt._versions.rank_records import (
    BEAT,
    DONE,
    FAILED,
    Piece,
    RankDone,
    metadata_bytes,
    record_name,
)
from asyncckpt._versions.writing import Gathered, RootWriter
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    IncompleteCheckpointError,
)

log = logging.getLogger(__name__)

#: Threads that read rank records in parallel on the writer rank.
_RECORD_READERS: Final = 16
_MAX_POLL_S: Final = 0.25  # one listing per poll: cheap, and it bounds the commit's delay
_SILENT: Final = b""  # what a rank's progress record holds before its first record


# ------------------------------------------------------------------ every rank's write


@dataclass
class RankJob:
    """One rank's background part of a sharded save: a
    :class:`~asyncckpt._versions.publish.RankPart` whose writer waits for every rank."""

    storage: Storage
    root: str
    step: int
    attempt: str
    rank: int
    world: int
    snap: Snapshot | None
    pieces: list[Piece]
    options: WriteOptions
    #: The tunables of the save (its ``Checkpointer``'s): the record's renewal and expiry.
    settings: Settings
    #: The rank's progress record (:meth:`start_beat`), until its file is written.
    beat: liveness.Beat | None = None
    #: Seconds the writer rank waits for every completion record (the group's timeout).
    timeout: float = 1800.0

    def start_beat(self) -> None:
        """Start this rank's progress record (at once, then every ``lease_renew_ms``): from
        here it is alive to the writer rank, whatever delays its write (docs/PROTOCOL.md
        §6b, "When a rank counts as dead")."""
        storage, path, rank, count = self.storage, self.path(BEAT), self.rank, itertools.count()

        def renew() -> None:
            beat = {"kind": "rank-beat", "rank": rank, "beat": next(count)}
            storage.write_bytes(path, encode_record(beat))

        name = f"rank {rank}'s progress record {storage.describe(path)}"
        period = self.settings.lease_renew_ms / 1000
        self.beat = liveness.heartbeat().add(name, period, renew, at_once=True)

    def copy_failed(self, exc: BaseException) -> None:
        """The copy failed: tell the writer rank at once (a ``.failed`` record)."""
        if self.beat is not None:
            self.beat.stop()
        self._mark_failed(exc)

    def refused(self) -> None:
        """The writer lease was refused: remove the progress record (best effort)."""
        if self.beat is not None:
            self.beat.stop()
            with contextlib.suppress(AsyncCkptError):
                self.storage.delete(self.path(BEAT))

    def gather(self, writer: RootWriter, size: int, started: float) -> Gathered:
        """Every rank's completion record, then the version's metadata (fenced first)."""
        records = await_ranks(self, self.timeout, started)
        body = metadata_bytes(records, self.attempt, self.storage.describe(self.directory))
        ordered = [records[r] for r in sorted(records)]
        metadata = metadata_file_name(self.rank, self.attempt)
        files = (*(m.file for m in ordered), metadata)
        sizes = (*(m.size for m in ordered), len(body))
        keep = tuple(record_name(m.rank, self.attempt, DONE) for m in ordered)
        # Right before the metadata lands: a writer that lost the lease (frozen while the
        # ranks wrote) writes nothing more there, and removes only its attempt's files.
        writer.fence(self.step, (*files[:-1], *keep))
        self.storage.write_bytes(self.storage.join(self.directory, metadata), body)
        return Gathered(files, sizes, SHARDED, keep)

    @property
    def directory(self) -> str:
        """The step directory."""
        return step_dir(self.storage, self.root, self.step)

    @property
    def data_path(self) -> str:
        """This rank's data file."""
        return self.path(".ackpt")

    def path(self, suffix: str, rank: int | None = None) -> str:
        """The path of a rank's data file (``".ackpt"``) or record of this attempt."""
        name = record_name(self.rank if rank is None else rank, self.attempt, suffix)
        return self.storage.join(self.directory, name)

    def write(self, snap: Snapshot | None = None) -> int:
        """Write this rank's file, then its completion record; return the file's size. A
        failure leaves a ``.failed`` record (best effort): the writer rank stops waiting."""
        if self.beat is None:
            self.start_beat()
        assert self.beat is not None
        snap = snap or self.snap
        assert snap is not None, "a job is written once its state is staged"
        try:
            try:
                self.beat.wait_first()  # so the record is there before any data
                size = writer_process.write(snap, self.storage, self.data_path, self.options)
            finally:
                self.beat.stop()
            # Every byte was read. Not on failure: the copy may still write into the arena,
            # which the save's job runtime frees once the copy has ended.
            snap.release()
            name = data_file_name(self.rank, self.attempt)
            record = RankDone(self.rank, name, size, tuple(self.pieces))
            self.storage.write_bytes(self.path(DONE), record.encode(self.step, self.attempt))
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


# ------------------------------------------------------------------ the writer's commit


def await_ranks(job: RankJob, timeout: float, started: float | None = None) -> dict[int, RankDone]:
    """Poll the step directory (of the writer rank's ``job``) until every rank's completion
    record is there, for at most ``timeout`` seconds; return ``{rank: record}``.

    ``started``: when the writer started this save's job, on the liveness clock (default:
    now); a rank with no record ``lease_expiry_ms`` after it is dead (docs/PROTOCOL.md §6b).

    Raises:
        IncompleteCheckpointError: a rank recorded that its write failed.
        CheckpointTimeoutError: a rank is dead (no record, or a stale one), or some rank
            wrote no completion record within ``timeout`` seconds.
        FormatError: a record cannot be understood.
    """
    watch = _ProgressWatch(job, liveness.clock().now() if started is None else started)
    missing: list[int] = []

    def attempt() -> dict[int, RankDone] | None:
        missing[:] = watch.check(set(job.storage.list_dir(job.directory)))
        return None if missing else watch.found

    def expired(waited: float) -> CheckpointTimeoutError:
        shown = ", ".join(str(r) for r in missing[:10])
        return CheckpointTimeoutError(
            f"{watch.what}: rank(s) {shown} wrote no completion record within {timeout:.0f} s; "
            "not committing it"
        )

    return liveness.poll(
        attempt, timeout=timeout, expired=expired, cap=_MAX_POLL_S, watch=watch.beats
    )


class _ProgressWatch:
    """Every rank's records of one attempt, as seen by the writer's polls."""

    def __init__(self, job: RankJob, started: float) -> None:
        self.job, self.started = job, started
        self.what = f"step {job.step} under {job.storage.describe(job.root)}"
        self.found: dict[int, RankDone] = {}
        self.beats = liveness.Staleness(job.settings.lease_expiry_ms / 1000)
        # Progress files change every lease_renew_ms; reading all of them on every poll
        # would cost world requests per poll, so they are read once per renewal period.
        self.beat_every_s = job.settings.lease_renew_ms / 1000
        self.beats_read_at = -float("inf")

    def check(self, names: set[str]) -> list[int]:
        """Take in what a listing shows; return the ranks still missing. The records it
        reveals are read in parallel: one request at a time would put world x latency
        between the last rank's write and the commit."""
        job = self.job
        done, writing, silent = [], [], []
        for rank in range(job.world):
            if rank in self.found:
                continue
            if record_name(rank, job.attempt, FAILED) in names:
                raise IncompleteCheckpointError(
                    f"{self.what}: rank {rank} failed to write its part: {self._error(rank)}"
                )
            if record_name(rank, job.attempt, DONE) in names:
                done.append(rank)
            elif record_name(rank, job.attempt, BEAT) in names:
                writing.append(rank)
            elif self.beats.seen(rank) in (None, _SILENT):
                silent.append(rank)
        self._check_silent(silent)
        readers = pool("records", _RECORD_READERS)
        records = [readers.submit(self._read_done, rank) for rank in done]
        now = liveness.clock().now()
        if now - self.beats_read_at < self.beat_every_s:
            writing = []
        else:
            self.beats_read_at = now
        beats = [readers.submit(self._read_beat, rank) for rank in writing]
        for rank, record in zip(done, records):
            self.found[rank] = record.result()
        for rank, beat in (future.result() for future in beats):
            stale = None if beat is None else self.beats.stale_for(rank, beat)
            if stale is not None:  # None: removed since the listing (the rank finished)
                raise CheckpointTimeoutError(
                    f"{self.what}: rank {rank} has not recorded progress for {stale:.1f} s, so "
                    "it died or froze while writing its part; not committing the step"
                )
        return [r for r in range(job.world) if r not in self.found]

    def _check_silent(self, silent: list[int]) -> None:
        """Give up on ranks that wrote no record at all: their record is "none yet" since
        the writer's job for this save started, stale after ``lease_expiry_ms`` as any
        (why that start: docs/PROTOCOL.md §6b, "When a rank counts as dead")."""
        dead = [r for r in silent if self.beats.stale_for(r, _SILENT, self.started) is not None]
        if not dead:
            return
        waited = liveness.clock().now() - self.started
        shown = ", ".join(str(r) for r in dead[:10]) + (", ..." if len(dead) > 10 else "")
        raise CheckpointTimeoutError(
            f"{self.what}: {'rank' if len(dead) == 1 else 'ranks'} {shown} recorded no progress "
            f"{waited:.1f} s after the writer rank started the save (lease_expiry_ms is "
            f"{self.beats.expiry_s * 1000:.0f}): dead before saving, or never called save(); "
            "not committing the step"
        )

    def _read_done(self, rank: int) -> RankDone:
        job, path = self.job, self.job.path(DONE, rank)
        raw = job.storage.read_bytes(path, MAX_METADATA_BYTES)
        return RankDone.decode(raw, job.storage.describe(path), job.step, job.attempt, rank)

    def _read_beat(self, rank: int) -> tuple[int, bytes | None]:
        try:
            return rank, self.job.storage.read_bytes(self.job.path(BEAT, rank), MAX_METADATA_BYTES)
        except CheckpointNotFoundError:
            return rank, None

    def _error(self, rank: int) -> str:
        with contextlib.suppress(AsyncCkptError, ValueError):
            raw = self.job.storage.read_bytes(self.job.path(FAILED, rank), MAX_METADATA_BYTES)
            return str(decode_record(raw, "record").get("error", "unknown error"))
        return "unknown error"
