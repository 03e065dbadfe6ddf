"""Retention: which versions of a root may be deleted, decided in one place.

:class:`RetentionPolicy` is the data (keep the last N, the best K by a metric, every M-th
step, those younger than a duration: the union of what each rule keeps), and
:func:`deletion_plan` the one rule that applies it to a :func:`~asyncckpt._versions.protocol.
list_steps` listing, with the protocol's own guarantees on top (never the version file's
step, nor the newest version that verifies whatever the version file says, nothing newer,
nothing unreadable, nothing a collective load may be reading). The
writer's retention and recovery (:mod:`asyncckpt._versions.writing`) and ``asyncckpt gc``
delete exactly what it returns; see docs/PROTOCOL.md §5.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from asyncckpt._versions.protocol import COMMITTED, UNCOMMITTED, UNREADABLE, StepEntry

#: The two ways to rank a metric: lower is better, or higher is better.
BEST_MODES = ("min", "max")


def _positive(name: str, value: object) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"{name} must be None or a positive int, got {value!r}")


def _seconds(value: float | datetime.timedelta | None) -> float | None:
    """``keep_for`` as seconds (a ``timedelta`` or a number), checked positive."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(f"keep_for must be None, seconds or a timedelta, got {value!r}")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"keep_for must be a positive, finite duration, got {value!r}")
    return seconds


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed versions retention keeps: the union of what each rule set keeps.

    Each field is one rule, and a policy with no rule set keeps every committed version.
    Whatever the policy, :func:`deletion_plan` never deletes the newest committed version
    (the version file's), anything newer, or a step a collective load may be reading.

    Attributes:
        keep_last: keep the newest N committed versions (None: no such rule).
        keep_best: keep the K best committed versions by ``best_metric`` (None: no such
            rule). Only versions saved with that metric as a number are ranked (ties: the
            newer step first); one without it is kept only if another rule keeps it.
        best_metric: the name of the metric ``keep_best`` (and ``Checkpointer.best()``)
            ranks by, as passed in ``save(metrics=...)``.
        best_mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"`` (e.g. accuracy).
        keep_every: keep every version whose step is a multiple of M, for ever.
        keep_for: keep every version committed less than this long ago (seconds, or a
            ``datetime.timedelta``; stored as seconds). A version whose ``COMMIT`` has no
            time is kept.

    Raises:
        ValueError: a count that is not a positive int, a bad ``best_mode`` or
            ``keep_for``, or ``keep_best`` without ``best_metric``.

    Example:
        >>> entries = [StepEntry(s, COMMITTED) for s in (1, 2, 3, 4)]
        >>> sorted(RetentionPolicy(keep_last=1, keep_every=2).keeps(entries))
        [2, 4]
    """

    keep_last: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    keep_every: int | None = None
    keep_for: float | datetime.timedelta | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best", "keep_every"):
            _positive(name, getattr(self, name))
        if self.best_mode not in BEST_MODES:
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.best_metric is not None and (
            not isinstance(self.best_metric, str) or not self.best_metric
        ):
            raise ValueError(f"best_metric must be a metric's name, got {self.best_metric!r}")
        if self.keep_best is not None and self.best_metric is None:
            raise ValueError("keep_best needs best_metric: the metric to rank versions by")
        object.__setattr__(self, "keep_for", _seconds(self.keep_for))

    @property
    def keep_for_s(self) -> float | None:
        """``keep_for`` in seconds."""
        return None if self.keep_for is None else float(self.keep_for)  # type: ignore[arg-type]

    def keeps(self, committed: Sequence[StepEntry], now: float | None = None) -> set[int]:
        """The steps, among ``committed`` (ascending; their commit records give metrics
        and times), that some rule of the policy keeps; ``now`` (seconds since the epoch,
        None: now) is what ``keep_for`` counts from."""
        rules: list[set[int]] = []
        if self.keep_last is not None:
            newest = committed[max(0, len(committed) - self.keep_last) :]
            rules.append({e.step for e in newest})
        if self.keep_best is not None:
            assert self.best_metric is not None  # __post_init__
            rules.append(set(ranked(committed, self.best_metric, self.best_mode)[: self.keep_best]))
        if self.keep_every is not None:
            rules.append({e.step for e in committed if e.step % self.keep_every == 0})
        if self.keep_for is not None:
            rules.append(self._young(committed, time.time() if now is None else now))
        if not rules:
            return {e.step for e in committed}
        return set().union(*rules)

    def _young(self, committed: Sequence[StepEntry], now: float) -> set[int]:
        horizon = now - (self.keep_for_s or 0.0)
        stamps = {e.step: e.commit.timestamp if e.commit is not None else None for e in committed}
        return {step for step, stamp in stamps.items() if stamp is None or stamp >= horizon}


def ranked(committed: Sequence[StepEntry], metric: str, mode: str) -> list[int]:
    """The committed steps that have ``metric`` as a number, best first (ties: newer first).

    Example:
        >>> from asyncckpt._versions.protocol import CommitRecord
        >>> def entry(step, loss):
        ...     return StepEntry(step, COMMITTED, commit=CommitRecord(
        ...         step, ("a.ackpt",), "w", metrics={"loss": loss}))
        >>> ranked([entry(1, 0.5), entry(2, 0.2), entry(3, 0.2)], "loss", "min")
        [3, 2, 1]
    """
    scored = []
    for entry in committed:
        value = entry.commit.metrics.get(metric) if entry.commit is not None else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            scored.append((float(value) if mode == "min" else -float(value), -entry.step))
    return [-negative_step for _, negative_step in sorted(scored)]


def deletion_plan(
    entries: Sequence[StepEntry],
    policy: RetentionPolicy,
    pinned: int | None,
    spare: Collection[int] = (),
    now: float | None = None,
    *,
    good: int | None,
) -> list[StepEntry]:
    """The one rule for which step directories may be deleted.

    Pure function of a :func:`~asyncckpt._versions.protocol.list_steps` listing; the
    writer's retention and recovery and ``asyncckpt gc`` all delete exactly what it returns
    (see docs/PROTOCOL.md §5):

    * nothing at all when ``pinned`` is None (no version file, or one that cannot be
      understood: what is newest is unknown);
    * never ``pinned`` (the version file's step), nor anything newer (a save in
      progress), nor a step in ``spare`` (one a slower rank may still be reading);
    * never ``good``, the newest committed step whose files verify
      (:func:`~asyncckpt._versions.protocol.newest_good`), whatever ``pinned`` is: a
      version file naming a step that is gone (a ``rewind`` killed after its first
      deletion) or damaged must not make the version readers fall back to go;
    * never an :data:`UNREADABLE` step: it may be a version this asyncckpt cannot read;
    * a committed step older than ``pinned`` that ``policy`` does not keep;
    * an uncommitted step older than ``pinned``: a failed or interrupted save, which can
      never commit, since steps only increase.

    ``entries`` are the root's step directories, ascending; ``now`` is the time
    ``keep_for`` counts from (None: now); ``good`` is required so that no caller can forget
    it (None: no committed step verifies). Returns the entries to delete, ascending.

    Example:
        >>> entries = [StepEntry(1, COMMITTED), StepEntry(2, UNREADABLE),
        ...            StepEntry(3, UNCOMMITTED), StepEntry(4, COMMITTED),
        ...            StepEntry(5, COMMITTED), StepEntry(6, UNCOMMITTED)]
        >>> [e.step for e in deletion_plan(entries, RetentionPolicy(keep_last=1), 5, good=5)]
        [1, 3, 4]
        >>> [e.step for e in deletion_plan(entries, RetentionPolicy(keep_last=1), 5, good=4)]
        [1, 3]
    """
    if pinned is None:
        return []
    committed = [e for e in entries if e.state == COMMITTED]
    keep = policy.keeps(committed, now) | {pinned} | set(spare)
    if good is not None:
        keep.add(good)
    return [e for e in entries if e.step < pinned and e.state != UNREADABLE and e.step not in keep]


def retention_plan(
    committed: list[int], all_dirs: list[int], keep_last: int | None, pinned: int | None
) -> list[int]:
    """Which steps to delete: :func:`deletion_plan` for plain step lists (every step
    directory in ``all_dirs`` not in ``committed`` counts as uncommitted).

    Example:
        >>> retention_plan([1, 2, 3], [1, 2, 3, 4], keep_last=2, pinned=3)
        [1]
    """
    done = set(committed)
    entries = [
        StepEntry(s, COMMITTED if s in done else UNCOMMITTED) for s in sorted(done | set(all_dirs))
    ]
    plan = deletion_plan(entries, RetentionPolicy(keep_last), pinned, good=pinned)
    dirs = set(all_dirs)
    return [e.step for e in plan if e.step in dirs]
