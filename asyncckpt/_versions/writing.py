"""The writing side of a checkpoint root: the lease, recovery, commit and retention.

Only a process that saves builds a :class:`RootWriter`, and it touches the root only from
its first save on, which takes the writer lease. Every commit, and every deletion of what
another writer may own, is fenced by that lease (docs/PROTOCOL.md §0, "The writer lease"
and "Fencing of every write and deletion"; §5 for what may be deleted).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

from asyncckpt import _liveness as liveness
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage
from asyncckpt._versions.lease import lease_epoch_of, lease_epochs, lease_path, write_lease
from asyncckpt._versions.protocol import (
    COMMIT_FILE,
    COMMITTED,
    FAILED_FILE,
    LEASE_DIR,
    SINGLE,
    UNCOMMITTED,
    UNREADABLE,
    CommitRecord,
    LeaseRecord,
    StepEntry,
    VersionRecord,
    create_commit,
    delete_version,
    list_steps,
    mark_failed,
    newest_good,
    publish_version,
    read_commit_strict,
    read_failure,
    read_version_tagged,
    step_dir,
    step_dirs,
    temp_files,
    verify_commit,
)
from asyncckpt._versions.retention import RetentionPolicy, deletion_plan
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    ConflictError,
    FencedError,
    FormatError,
)

log = logging.getLogger(__name__)

#: Lease claims lost to a racing writer's pruning before the claim gives up.
_LOST_CLAIMS = 16


@dataclass(frozen=True)
class Gathered:
    """What the writer rank commits: every file of the version, relative to its directory
    (a sharded version: one data file per rank, then its metadata), each file's size as
    written, the version's kind (``SINGLE`` or ``SHARDED``, recorded in ``COMMIT``), and
    the other files of the save that the commit's sweep must leave (a sharded version's
    per-rank completion records)."""

    files: tuple[str, ...]
    sizes: tuple[int, ...]
    kind: str = SINGLE
    keep: tuple[str, ...] = ()


class RootWriter:
    """The lease holder's operations on ``root`` (a path in ``storage``).

    ``token`` is this writer's unique id (also in its data file names); ``settings`` its
    tunables (``lease_renew_ms``): its entry point's (a tool's: its command's).
    """

    def __init__(self, storage: Storage, root: str, token: str, settings: Settings) -> None:
        self.storage, self.root, self.token, self.settings = storage, root, token, settings
        self.epoch: int | None = None
        self.published: int | None = None
        self._lock = threading.Lock()
        self._heartbeat: liveness.Beat | None = None

    @property
    def where(self) -> str:
        """The root as a user would write it."""
        return self.storage.describe(self.root)

    # -- the lease ------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the root over (once): claim a new epoch, install it, clean up leftovers.

        Raises:
            ConflictError: another writer took the root at the same moment with a newer
                epoch, or the root holds records this asyncckpt cannot understand.
        """
        with self._lock:
            if self.epoch is not None:
                return
            self._refuse_unreadable()
            record, tag = read_version_tagged(self.storage, self.root)
            epoch = self._claim_epoch(record)
            self.published = self._install(epoch, record, tag)
            self.epoch = epoch
        log.info("took the writer lease on %s (epoch %d)", self.where, epoch)
        self._recover()
        self._start_heartbeat()

    def _claim_epoch(self, record: VersionRecord | None) -> int:
        # A temp file's epoch counts as taken: a writer killed while claiming it leaves one,
        # and taking that epoch again would keep its debris as this writer's own for ever.
        names = self.storage.list_dir(self.storage.join(self.root, LEASE_DIR))
        known = [record.epoch if record else 0, *filter(None, map(lease_epoch_of, names))]
        epoch = max(known) + 1
        lost = 0
        while True:
            try:
                write_lease(self.storage, self.root, LeaseRecord(epoch, self.token, 0), create=True)
                return epoch
            except ConflictError:
                epoch += 1  # another new writer claimed it first: take the next one
            except CheckpointNotFoundError:
                # A writer that claimed a later epoch meanwhile pruned this claim's temp
                # file as an older epoch's debris: a later epoch exists; take the next.
                # Bounded: a root that vanished fails this way for ever.
                lost += 1
                if lost > _LOST_CLAIMS:
                    raise
                epoch += 1

    def _install(self, epoch: int, record: VersionRecord | None, tag: str | None) -> int | None:
        """Write our epoch into the version file, rolled forward to the newest good commit."""
        while True:
            named = record.step if record is not None else None
            if named is not None and read_commit_strict(self.storage, self.root, named) is None:
                named = None  # it names a step that is not committed: never published
            step = self._newest_verified(named)
            try:
                publish_version(
                    self.storage, self.root, VersionRecord(step, self.token, epoch), tag
                )
                return step
            except ConflictError:
                record, tag = read_version_tagged(self.storage, self.root)
                if record is not None and record.epoch > epoch:
                    raise ConflictError(
                        f"another writer (id {record.writer}, epoch {record.epoch}) took "
                        f"{self.where} over at the same time as this one (epoch {epoch}); "
                        "only one job may write to a root"
                    ) from None
                # An older writer committed meanwhile: retry on top of what it published.

    def _newest_verified(self, published: int | None) -> int | None:
        for step in reversed(step_dirs(self.storage, self.root)):
            if published is not None and step <= published:
                break
            commit = read_commit_strict(self.storage, self.root, step)
            if commit is None:
                continue
            problem = verify_commit(self.storage, self.root, commit)
            if problem is None:
                return step
            log.warning("not publishing step %d under %s: %s", step, self.where, problem)
        return published

    def _refuse_unreadable(self) -> None:
        """Raise if the root holds a record we cannot understand (damaged, or newer)."""
        try:
            read_version_tagged(self.storage, self.root)
            problem = next(
                (e.problem for e in list_steps(self.storage, self.root) if e.state == UNREADABLE),
                None,
            )
        except FormatError as exc:  # damaged, oversized, or from a newer protocol
            problem = str(exc)
        if problem is not None:
            raise ConflictError(
                f"refusing to write to {self.where}: {problem}. Nothing was changed; move the "
                "record aside (or upgrade asyncckpt) if the root is really yours"
            )

    def _start_heartbeat(self) -> None:
        """Renew this writer's lease record (docs/PROTOCOL.md §0, step 5): until
        :meth:`release`, the writer is fenced, or it is garbage (held weakly)."""
        assert self.epoch is not None
        epoch, token, storage, root = self.epoch, self.token, self.storage, self.root
        record = lease_path(storage, root, epoch)
        owner, count = weakref.ref(self), itertools.count(1)
        name = f"the writer lease on {self.where}"

        def renew() -> bool:
            writer = owner()
            fenced = writer is not None and writer._lease_held() is False
            if writer is None or fenced or not storage.exists(record):
                # A record gone was pruned by a newer writer's claim: never write it back.
                # A fenced writer's renewal may have raced that pruning and brought it back:
                # remove it, as the newer writer would have.
                if fenced and lease_epochs(storage, root)[-1:] != [epoch]:
                    storage.delete(record)
                log.info("%s (epoch %d) ended: stopped renewing", name, epoch)
                return False
            del writer  # only weakly held between beats
            write_lease(storage, root, LeaseRecord(epoch, token, next(count)))
            return True

        self._heartbeat = liveness.heartbeat().add(name, self.settings.lease_renew_ms / 1000, renew)

    def release(self) -> None:
        """Stop renewing the lease (its record stays: readers see the writer stop), once a
        renewal in progress finished: none outlives its writer's close."""
        if self._heartbeat is not None:
            self._heartbeat.stop()

    # -- the lease, before every deletion ---------------------------------------------

    def _lease_held(self) -> bool | None:
        """Whether the version file still names this writer (token and epoch): one read;
        None when it cannot be told (the read failed)."""
        if self.epoch is None:
            return False
        try:
            record, _ = read_version_tagged(self.storage, self.root)
        except AsyncCkptError:
            return None
        return record is not None and record.epoch == self.epoch and record.writer == self.token

    def holds_lease(self) -> bool:
        """Whether this writer still holds the root's lease, as the version file says now
        (a read that fails counts as no): checked right before every deletion of what
        another writer may own, and before every record written under a step."""
        return self._lease_held() is True

    def _may_delete(self, what: str) -> bool:
        """:meth:`holds_lease`, logging what is not deleted when it is not held."""
        if self.holds_lease():
            return True
        log.info(
            "not deleting %s under %s: this writer (epoch %s) no longer holds the lease",
            what,
            self.where,
            self.epoch,
        )
        return False

    # -- recovery and retention -----------------------------------------------------------

    def _recover(self) -> None:
        """Drop what earlier writers left: temp files, uncommitted steps older than the
        published one (a newer one may be the fenced writer's save in flight), old lease
        records, ``FAILED`` markers of earlier epochs (docs/PROTOCOL.md §0, step 4)."""
        storage, root = self.storage, self.root
        try:
            entries = list_steps(storage, root)
            self._remove_temps(root, "temp files")
            good = newest_good(storage, root, entries)
            plan = deletion_plan(entries, RetentionPolicy(), self.published, good=good)
            for entry in plan:
                if not self._may_delete(f"step {entry.step}"):
                    return
                log.info(
                    "removing step %d under %s: it was never committed", entry.step, self.where
                )
                delete_version(storage, root, entry.step)
            doomed = {e.step for e in plan}
            for entry in entries:
                if entry.step not in doomed and not entry.link:  # a link is another run's
                    self._tidy(entry)
            self._prune_leases()
        except AsyncCkptError as exc:  # leftovers are harmless; the next retention retries
            log.warning("recovery under %s was incomplete: %s", self.where, exc)

    def _tidy(self, entry: StepEntry) -> None:
        """Remove what a crash left inside a step that stays: temp files in a committed
        version (a crash during an exclusive create), an earlier epoch's ``FAILED``."""
        storage, directory = self.storage, step_dir(self.storage, self.root, entry.step)
        floor = -1 if self.published is None else self.published
        if entry.state == COMMITTED and entry.step <= floor:
            self._remove_temps(directory, f"temp files in step {entry.step}")
        elif entry.state == UNCOMMITTED:
            failure = read_failure(storage, self.root, entry.step)
            assert self.epoch is not None
            stale = failure is not None and failure.epoch < self.epoch
            if stale and self._may_delete(f"the FAILED record of step {entry.step}"):
                log.info("removing step %d's FAILED record of an earlier epoch", entry.step)
                storage.delete(storage.join(directory, FAILED_FILE))

    def _remove_temps(self, directory: str, what: str) -> None:
        """Delete the temp files directly under ``directory``, if there are any and this
        writer holds the lease (checked only then: most calls find none)."""
        names = temp_files(self.storage, directory)
        if names and self._may_delete(what):
            for name in names:
                self.storage.delete(self.storage.join(directory, name))

    def _prune_leases(self) -> None:
        """Delete older epochs' lease records and the temp files of their writes (a writer
        killed mid-write leaves one); this epoch's temp files are its own heartbeat's."""
        assert self.epoch is not None  # called by acquire(), once the epoch is claimed
        directory = self.storage.join(self.root, LEASE_DIR)
        if self.storage.is_link(directory):
            return  # never delete through a link
        epochs = {n: lease_epoch_of(n) for n in self.storage.list_dir(directory)}
        older = [n for n, e in epochs.items() if e is not None and e < self.epoch]
        if older and self._may_delete("lease records of earlier epochs"):
            for name in older:
                self.storage.delete(self.storage.join(directory, name))

    def apply_retention(self, policy: RetentionPolicy, pinned: int, spare: int | None) -> None:
        """Delete the versions ``policy`` does not keep and leftovers older than ``pinned``:
        what :func:`~asyncckpt._versions.retention.deletion_plan` allows (never ``pinned``,
        ``spare``: a step other ranks may be reading, or anything newer), each only while
        this writer holds the lease. Failures only warn: the next save retries."""
        storage, root = self.storage, self.root
        try:
            entries = list_steps(storage, root)
            for entry in entries:
                if entry.state == UNREADABLE:
                    log.warning("retention leaves step %d alone: %s", entry.step, entry.problem)
            spared = () if spare is None else (spare,)
            good = newest_good(storage, root, entries)
            for entry in deletion_plan(entries, policy, pinned, spared, good=good):
                if not self._may_delete(f"step {entry.step} (retention)"):
                    return
                delete_version(storage, root, entry.step)
            self._remove_temps(root, "temp files")
        except AsyncCkptError as exc:
            log.warning(
                "retention under %s failed (will retry after the next save): %s", self.where, exc
            )

    def mark_failed(self, step: int, error: BaseException) -> None:
        """Write ``step``'s ``FAILED`` marker for pollers, naming this attempt (token and
        epoch), if this writer still holds the lease (best effort; never raises)."""
        if self.epoch is None or not self.holds_lease():
            log.info("not marking step %d failed under %s: not the root's writer", step, self.where)
            return
        mark_failed(self.storage, self.root, step, error, self.token, self.epoch)

    def remove_empty_step(self, step: int) -> None:
        """Remove ``step``'s directory if it holds nothing (an aborted save created it), and
        only while this writer holds the lease (best effort; never raises)."""
        where = step_dir(self.storage, self.root, step)
        try:
            if self.storage.list_dir(where) or not self._may_delete(f"empty step {step}"):
                return
            self.storage.delete_tree(where)
        except AsyncCkptError as exc:  # an empty directory is harmless; recovery removes it
            log.warning("could not remove %s: %s", self.storage.describe(where), exc)

    # -- commit ---------------------------------------------------------------------------

    def commit(
        self, step: int, version: Gathered, metrics: Mapping[str, float | int | str] | None
    ) -> None:
        """Publish version ``step`` whose files (in its directory) are durable, with its
        ``metrics`` (already checked) recorded in ``COMMIT``.

        Raises:
            FencedError: another writer took the root over; our files were removed.
            ConflictError: ``step`` is not newer than the published one, or another writer
                committed it; our files were removed.
        """
        assert self.epoch is not None, "acquire() first"
        own = version.files + version.keep
        record, tag = self.fence(step, own)
        if record.step is not None and record.step >= step:
            self._discard(step, own)
            raise ConflictError(
                f"step {step} is not newer than step {record.step}, already committed under "
                f"{self.where} (rewind first to go back: Checkpointer.rewind)"
            )
        try:
            self._create_commit(step, version, dict(metrics or {}))
            self._publish(step, tag)
            self._sweep(step, own)
        except AsyncCkptError as exc:
            # Still the lease holder, or that cannot be told: the original error stands.
            if not isinstance(exc, FencedError) and self._lease_held() is not False:
                raise
            # Taken over while committing (frozen between the check above and here): the
            # new writer's retention may have removed our data, so a marker we made may name
            # nothing. Withdraw it unless it is a whole version (then it may be published).
            if self._withdraw(step):
                raise FencedError(
                    f"another writer took {self.where} over while this one (epoch "
                    f"{self.epoch}) was committing step {step}, and its data was removed "
                    "meanwhile: this writer withdrew its COMMIT of the step and its own "
                    "files, and changed nothing else"
                ) from exc
            if isinstance(exc, FencedError):
                raise
            raise FencedError(
                f"another writer took {self.where} over while this one (epoch {self.epoch}) "
                f"was committing step {step}: {exc}"
            ) from exc

    def fence(self, step: int, own: tuple[str, ...]) -> tuple[VersionRecord, str | None]:
        """Check, right before writing what makes ``step`` a version (its metadata, its
        ``COMMIT``), that this writer still holds the lease; return the version file's
        record and tag, as read. ``own``: this attempt's files in its directory (named by
        it, so ours), removed if the lease is lost.

        Raises:
            FencedError: another writer took the root over (nothing but ``own`` deleted).
        """
        record, tag = read_version_tagged(self.storage, self.root)
        if record is not None and record.epoch == self.epoch and record.writer == self.token:
            return record, tag
        left = self._discard(step, own)
        holder = "nobody" if record is None else f"id {record.writer}, epoch {record.epoch}"
        kept = (
            f"; it could not remove {', '.join(left)}, which no version names (retention "
            "removes them with the step)"
            if left
            else ""
        )
        raise FencedError(
            f"another writer ({holder}) took {self.where} over from this one (epoch "
            f"{self.epoch}); step {step} was not committed by this writer, which removed "
            f"the {len(own)} file(s) of its own save attempt from {self.where}/{step} and "
            f"changed nothing else under the root{kept}"
        )

    def _create_commit(
        self, step: int, version: Gathered, metrics: dict[str, float | int | str]
    ) -> None:
        files = version.files
        record = CommitRecord(
            step, files, self.token, version.sizes, self.epoch or 0, version.kind, metrics
        )
        try:
            create_commit(self.storage, self.root, record)
        except ConflictError:
            existing = read_commit_strict(self.storage, self.root, step)
            if existing is not None and existing.writer == self.token and existing.files == files:
                return  # our own marker, whose creation we did not hear about
            self._discard(step, files + version.keep)
            raise ConflictError(
                f"step {step} is already committed under {self.where} by another writer "
                f"(id {existing.writer if existing else '?'}); only one job may write to a root"
            ) from None

    def _publish(self, step: int, tag: str | None) -> None:
        record = VersionRecord(step, self.token, self.epoch or 0)
        try:
            publish_version(self.storage, self.root, record, tag)
        except ConflictError:
            if self._still_newest(step):
                self.published = step
                return
            raise FencedError(
                f"step {step} is committed under {self.where}, but another writer took the "
                "root over before the version file could name it; readers keep to that "
                "writer's versions"
            ) from None
        except AsyncCkptError as exc:
            # COMMIT exists and its files verify, so the version is there for every reader
            # (latest() falls back to the newest verified marker); only the pointer lags.
            log.warning(
                "step %d under %s is committed, but the version file was not moved to it: %s",
                step,
                self.where,
                exc,
            )
        self.published = step

    def _still_newest(self, step: int) -> bool:
        """Whether our committed step is still the root's newest (whole, nothing newer
        published) after another writer took the root over between our marker and the
        version file: then it stands and the racer fails (docs/PROTOCOL.md §0, "Residual
        windows")."""
        try:
            record, _ = read_version_tagged(self.storage, self.root)
            commit = read_commit_strict(self.storage, self.root, step)
        except AsyncCkptError:
            return False
        return (
            record is not None
            and (record.step is None or record.step <= step)
            and commit is not None
            and commit.writer == self.token
            and verify_commit(self.storage, self.root, commit) is None
        )

    def _withdraw(self, step: int) -> bool:
        """Remove our own marker of ``step`` (only ours: another writer may be committing the
        same step; its token makes it ours, so no lease is needed) if it names data that is
        gone, so is no version; return whether it was removed."""
        with contextlib.suppress(AsyncCkptError):
            commit = read_commit_strict(self.storage, self.root, step)
            if commit is None or commit.writer != self.token:
                return False
            if verify_commit(self.storage, self.root, commit) is not None:
                self.storage.delete(
                    self.storage.join(step_dir(self.storage, self.root, step), COMMIT_FILE)
                )
                self._discard(step, commit.files)
                return True
        return False

    def _sweep(self, step: int, files: tuple[str, ...]) -> None:
        """After our commit of ``step``, remove what else is in its directory (nothing can
        commit it any more): only while this writer holds the lease, never through a link."""
        directory = step_dir(self.storage, self.root, step)
        with contextlib.suppress(AsyncCkptError):
            if self.storage.is_link(directory):
                log.warning(
                    "not sweeping step %d under %s: it is a symbolic link", step, self.where
                )
                return
            if not self._may_delete(f"other files in step {step}"):
                return
            for name in self.storage.list_dir(directory):
                if name not in files and name != COMMIT_FILE:
                    self.storage.delete(self.storage.join(directory, name))
            self.storage.abort_unfinished(directory)

    def _discard(self, step: int, files: tuple[str, ...]) -> list[str]:
        """Remove files of this writer's own save attempt (allowed without the lease: they
        are named by the attempt, so no other writer wrote them); return those that could
        not be removed."""
        directory = step_dir(self.storage, self.root, step)
        left = []
        for name in files:
            try:
                self.storage.delete(self.storage.join(directory, name))
            except AsyncCkptError:
                left.append(name)
        return left
