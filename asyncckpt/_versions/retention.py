"""Retention: which versions of a root may be deleted, decided in one place.

A :class:`RetentionPolicy` keeps what any of its rules (:data:`RULES`) keeps;
:func:`policy_from` builds one from keyword names, the one place behind the ``Checkpointer``
keywords, ``asyncckpt gc``'s flags and the Hugging Face mapping. :func:`deletion_plan`
applies it, with the protocol's own guarantees on top (docs/PROTOCOL.md §5).
"""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from asyncckpt._versions.protocol import COMMITTED, UNREADABLE, StepEntry
from asyncckpt.errors import UnknownMetricError

#: The two ways to rank a metric: lower is better, or higher is better.
BEST_MODES = ("min", "max")

#: How an error names a keyword: as Python spells it (``keep_last``), or, for ``gc``, as a
#: flag (``--keep-last``).
Spell = Callable[[str], str]


class RetentionRule(Protocol):
    """One retention rule: which of the committed versions it keeps.

    A policy keeps what any of its rules keeps, so a rule need not care about the others,
    nor about the versions the protocol never deletes (:func:`deletion_plan`).

    Example:
        >>> class KeepOdd:
        ...     def keeps(self, committed, now):
        ...         return {e.step for e in committed if e.step % 2}
        >>> entries = [StepEntry(s, COMMITTED) for s in (1, 2, 3, 4)]
        >>> sorted(RetentionPolicy((KeepOdd(),)).keeps(entries))
        [1, 3]
    """

    def keeps(self, committed: Sequence[StepEntry], now: float) -> set[int]:
        """The steps among ``committed`` (ascending, with their commit records) this rule
        keeps; ``now`` is the time (seconds since the epoch) ages count from."""
        ...


_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]*)?)\s*([smhd]?)")


def parse_duration(text: str) -> float:
    """Seconds in a duration as text: a number with an optional unit s, m, h or d.

    Raises:
        ValueError: not such a duration.

    Example:
        >>> parse_duration("7d"), parse_duration("90")
        (604800.0, 90.0)
    """
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"takes a positive duration such as 3600, 90m, 12h or 7d; got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _count(value: object, name: str, spell: Spell) -> int:
    """``value`` as a positive count, or a ValueError that names the keyword."""
    if type(value) is not int:
        raise ValueError(f"{spell(name)} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{spell(name)} must be at least 1, got {value!r}")
    return value


def _seconds(value: object, name: str, spell: Spell) -> float:
    """A duration (a ``timedelta`` or a number of seconds) as seconds, checked positive."""
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(f"{spell(name)} must be None, seconds or a timedelta, got {value!r}")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{spell(name)} must be a positive, finite duration, got {value!r}")
    return seconds


@dataclass(frozen=True)
class Ranking:
    """How versions are ranked: by the metric ``metric`` of their ``COMMIT``, lower is
    better (``mode="min"``, e.g. a loss) or higher (``"max"``, e.g. an accuracy). A
    ``metric`` of None gives only the mode (for ``Checkpointer.best(metric)``).

    Raises:
        ValueError: an empty metric name or a bad mode.

    Example:
        >>> Ranking("eval_loss").mode
        'min'
    """

    metric: str | None
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.metric is not None and (not isinstance(self.metric, str) or not self.metric):
            raise ValueError(f"best_metric must be a metric's name, got {self.metric!r}")
        if self.mode not in BEST_MODES:
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.mode!r}")

    def order(self, committed: Sequence[StepEntry]) -> list[int]:
        """The steps that have the metric, best first (:func:`ranked`); none without a metric.

        Raises:
            UnknownMetricError: (:func:`check_ranked`) names the metric and the metrics there are.
        """
        if self.metric is None:
            return []
        check_ranked(self.metric, metric_names(committed))
        return ranked(committed, self.metric, self.mode)


def check_ranked(metric: str, names: Collection[str], where: str = "") -> None:
    """Refuse a metric to rank by that no version has while versions have others (their
    ``names``): a typo in its name would otherwise rank nothing, and retention would delete
    the real best version. ``where`` names the root (and step) for the message.

    Raises:
        UnknownMetricError: names the metric and the metrics there are.

    Example:
        >>> check_ranked("eval_loss", [])  # no version has metrics yet: nothing to rank
    """
    if names and metric not in names:
        raise UnknownMetricError(metric, sorted(names), where)


def metric_names(committed: Sequence[StepEntry]) -> list[str]:
    """Every metric name some version of ``committed`` has, sorted."""
    return sorted({n for e in committed if e.commit is not None for n in e.commit.metrics})


@dataclass(frozen=True)
class KeepLast:
    """Keep the newest ``n`` committed versions (keyword ``keep_last``, ``gc --keep-last``).

    Example:
        >>> sorted(KeepLast(2).keeps([StepEntry(s, COMMITTED) for s in (1, 2, 3)], 0.0))
        [2, 3]
    """

    keyword: ClassVar[str] = "keep_last"
    metavar: ClassVar[str] = "N"
    parse: ClassVar[Callable[[str], Any]] = int
    help: ClassVar[str] = "keep the newest N committed versions"

    n: int

    @classmethod
    def build(cls, value: Any, ranking: Ranking | None, spell: Spell) -> KeepLast:
        """The rule for ``keep_last=value``."""
        return cls(_count(value, cls.keyword, spell))

    def keeps(self, committed: Sequence[StepEntry], now: float) -> set[int]:
        """The newest ``n``."""
        return {e.step for e in committed[max(0, len(committed) - self.n) :]}


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``n`` best versions by ``ranking`` (keyword ``keep_best`` with
    ``best_metric``/``best_mode``). Only versions with the metric as a number are ranked
    (ties: the newer step first); one without it is kept only if another rule keeps it.

    Example:
        >>> from asyncckpt._versions.protocol import CommitRecord
        >>> entries = [StepEntry(s, COMMITTED, commit=CommitRecord(
        ...     s, ("a.ackpt",), "w", metrics={"loss": v})) for s, v in [(1, .2), (2, .5)]]
        >>> KeepBest(1, Ranking("loss")).keeps(entries, 0.0)
        {1}
    """

    keyword: ClassVar[str] = "keep_best"
    metavar: ClassVar[str] = "K"
    parse: ClassVar[Callable[[str], Any]] = int
    help: ClassVar[str] = "keep the K best versions by --best-metric"

    n: int
    ranking: Ranking

    @classmethod
    def build(cls, value: Any, ranking: Ranking | None, spell: Spell) -> KeepBest:
        """The rule for ``keep_best=value``: it needs the ranking."""
        n = _count(value, cls.keyword, spell)
        if ranking is None or ranking.metric is None:
            raise ValueError(
                f"{spell('keep_best')} needs {spell('best_metric')}: the metric to rank versions by"
            )
        return cls(n, ranking)

    def keeps(self, committed: Sequence[StepEntry], now: float) -> set[int]:
        """The ``n`` best.

        Raises:
            UnknownMetricError: no version has the metric, while some have others.
        """
        return set(self.ranking.order(committed)[: self.n])


@dataclass(frozen=True)
class KeepEvery:
    """Keep every version whose step is a multiple of ``m``, for ever (``keep_every``).

    Example:
        >>> sorted(KeepEvery(2).keeps([StepEntry(s, COMMITTED) for s in (1, 2, 3, 4)], 0.0))
        [2, 4]
    """

    keyword: ClassVar[str] = "keep_every"
    metavar: ClassVar[str] = "M"
    parse: ClassVar[Callable[[str], Any]] = int
    help: ClassVar[str] = "keep every version whose step is a multiple of M"

    m: int

    @classmethod
    def build(cls, value: Any, ranking: Ranking | None, spell: Spell) -> KeepEvery:
        """The rule for ``keep_every=value``."""
        return cls(_count(value, cls.keyword, spell))

    def keeps(self, committed: Sequence[StepEntry], now: float) -> set[int]:
        """The multiples of ``m``."""
        return {e.step for e in committed if e.step % self.m == 0}


@dataclass(frozen=True)
class KeepFor:
    """Keep every version committed less than ``seconds`` ago (``keep_for``: seconds or a
    ``timedelta``; ``gc --keep-for 7d``). A version whose ``COMMIT`` has no time is kept.

    Example:
        >>> KeepFor.build(datetime.timedelta(hours=1), None, str).seconds
        3600.0
    """

    keyword: ClassVar[str] = "keep_for"
    metavar: ClassVar[str] = "DURATION"
    parse: ClassVar[Callable[[str], Any]] = staticmethod(parse_duration)
    help: ClassVar[str] = (
        "keep versions younger than DURATION: seconds, or a number with s, m, h or d (7d)"
    )

    seconds: float

    @classmethod
    def build(cls, value: Any, ranking: Ranking | None, spell: Spell) -> KeepFor:
        """The rule for ``keep_for=value``."""
        return cls(_seconds(value, cls.keyword, spell))

    def keeps(self, committed: Sequence[StepEntry], now: float) -> set[int]:
        """Those committed after ``now - seconds``, and those of unknown age."""
        horizon = now - self.seconds
        stamps = {e.step: e.commit.timestamp if e.commit is not None else None for e in committed}
        return {step for step, stamp in stamps.items() if stamp is None or stamp >= horizon}


@dataclass(frozen=True)
class KeepTotal:
    """Keep at most ``n`` versions in all, the newest and the best by ``ranking`` among them,
    as the stock ``transformers.Trainer`` counts ``save_total_limit``
    (``transformers.trainer_utils.rotate_checkpoints``): the newest and the best always stay
    (so ``n=1`` keeps two when the best is not the newest), the other places go to the
    newest others (keyword ``keep_total``).

    Example:
        >>> from asyncckpt._versions.protocol import CommitRecord
        >>> entries = [StepEntry(s, COMMITTED, commit=CommitRecord(
        ...     s, ("a.ackpt",), "w", metrics={"loss": v}))
        ...     for s, v in [(1, .1), (2, .5), (3, .4), (4, .3)]]
        >>> sorted(KeepTotal(2, Ranking("loss")).keeps(entries, 0.0))
        [1, 4]
    """

    keyword: ClassVar[str] = "keep_total"
    metavar: ClassVar[str] = "N"
    parse: ClassVar[Callable[[str], Any]] = int
    help: ClassVar[str] = (
        "keep at most N versions in all, the newest and the best by --best-metric among them "
        "(the transformers Trainer's save_total_limit)"
    )

    n: int
    ranking: Ranking | None = None

    @classmethod
    def build(cls, value: Any, ranking: Ranking | None, spell: Spell) -> KeepTotal:
        """The rule for ``keep_total=value`` (ranked by ``best_metric`` if one is given)."""
        return cls(_count(value, cls.keyword, spell), ranking)

    def keeps(self, committed: Sequence[StepEntry], now: float) -> set[int]:
        """The newest, the best, then the newest others up to ``n`` in all.

        Raises:
            UnknownMetricError: no version has the metric, while some have others.
        """
        if not committed:
            return set()
        kept = {committed[-1].step}
        if self.ranking is not None:
            kept.update(self.ranking.order(committed)[:1])
        others = [e.step for e in reversed(committed) if e.step not in kept]
        return kept | set(others[: max(0, self.n - len(kept))])


#: Every rule built by keyword name, in the order ``gc --help`` lists their flags. A new rule
#: is one class here, with ``keyword`` (its ``Checkpointer`` keyword; ``gc``'s flag is the
#: same with dashes), ``metavar``, ``help`` and ``parse`` (the flag's text to a value) for
#: ``gc``, a ``build`` classmethod (value, ranking, spell) and ``keeps``.
RULES: tuple[Any, ...] = (KeepLast, KeepBest, KeepEvery, KeepFor, KeepTotal)


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed versions retention keeps: the union of what its rules keep.

    A policy with no rule keeps every committed version. Whatever the policy,
    :func:`deletion_plan` never deletes the newest committed version (the version file's),
    the newest one that verifies, anything newer, or a step a collective load may be
    reading. Build one by keyword names with :func:`policy_from`.

    Attributes:
        rules: the rules.
        ranking: the metric :meth:`Checkpointer.best` ranks by by default (``best_metric``,
            ``best_mode``), and the rules that rank use; None: none given.

    Example:
        >>> entries = [StepEntry(s, COMMITTED) for s in (1, 2, 3, 4)]
        >>> sorted(RetentionPolicy((KeepLast(1), KeepEvery(2))).keeps(entries))
        [2, 4]
    """

    rules: tuple[RetentionRule, ...] = ()
    ranking: Ranking | None = None

    def keeps(self, committed: Sequence[StepEntry], now: float | None = None) -> set[int]:
        """The steps, among ``committed`` (ascending; their commit records give metrics
        and times), that some rule keeps; ``now`` (seconds since the epoch, None: now) is
        what ages count from.

        Raises:
            UnknownMetricError: a rule ranks by a metric no version has, while some have
                others.
        """
        if not self.rules:
            return {e.step for e in committed}
        at = time.time() if now is None else now
        return set().union(*(rule.keeps(committed, at) for rule in self.rules))

    def ranked_metrics(self) -> list[str]:
        """The metrics the rules rank by (a typo in one would delete the real best).

        Example:
            >>> policy_from({"keep_best": 1, "best_metric": "eval_loss"}).ranked_metrics()
            ['eval_loss']
        """
        rankings = [getattr(rule, "ranking", None) for rule in self.rules]
        return sorted({r.metric for r in rankings if isinstance(r, Ranking) and r.metric})

    def keyword(self, name: str) -> Any:
        """The value of keyword ``name`` this policy was built from (None: not given), for
        reports such as ``gc --json``.

        Example:
            >>> policy_from({"keep_last": 3}).keyword("keep_last")
            3
        """
        if name == "best_metric":
            return None if self.ranking is None else self.ranking.metric
        if name == "best_mode":
            return "min" if self.ranking is None else self.ranking.mode
        for rule in self.rules:
            if getattr(rule, "keyword", None) == name:
                return next(iter(vars(rule).values()))
        return None


def policy_from(
    keywords: Mapping[str, Any], rules: Sequence[RetentionRule] = (), spell: Spell = str
) -> RetentionPolicy:
    """The policy that keyword names describe: the one place they become rules.

    ``keywords`` maps each rule's keyword (:data:`RULES`: ``keep_last``, ``keep_best``,
    ``keep_every``, ``keep_for``, ``keep_total``) to its value (None: no such rule), plus
    ``best_metric`` and ``best_mode``, the ranking of the rules that rank; ``rules`` are
    more rule objects; ``spell`` names a keyword in errors (``gc`` spells them as flags).

    Raises:
        ValueError: a bad value (the message names the keyword), or an unknown keyword.
        TypeError: an object of ``rules`` has no ``keeps`` method.

    Example:
        >>> policy_from({"keep_last": 2, "keep_every": 100}).rules
        (KeepLast(n=2), KeepEvery(m=100))
    """
    known = {cls.keyword for cls in RULES} | {"best_metric", "best_mode"}
    unknown = sorted(set(keywords) - known)
    if unknown:
        raise ValueError(f"unknown retention keyword(s) {unknown}; known: {sorted(known)}")
    metric, mode = keywords.get("best_metric"), keywords.get("best_mode")
    if metric is not None and (not isinstance(metric, str) or not metric):
        raise ValueError(f"{spell('best_metric')} must be a metric's name, got {metric!r}")
    if mode is not None and mode not in BEST_MODES:
        raise ValueError(f"{spell('best_mode')} must be 'min' or 'max', got {mode!r}")
    given = metric is not None or mode is not None
    ranking = Ranking(metric, mode or "min") if given else None
    for rule in rules:
        if not callable(getattr(rule, "keeps", None)):
            raise TypeError(f"a retention rule needs a keeps(committed, now) method: {rule!r}")
    built = [
        cls.build(keywords[cls.keyword], ranking, spell)
        for cls in RULES
        if keywords.get(cls.keyword) is not None
    ]
    return RetentionPolicy((*built, *rules), ranking)


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
    """The one rule for which step directories may be deleted (docs/PROTOCOL.md §5, "One
    rule"): a pure function of a :func:`~asyncckpt._versions.protocol.list_steps` listing;
    the writer's retention and recovery and ``asyncckpt gc`` all delete exactly what it
    returns, ascending. ``good`` (:func:`~asyncckpt._versions.protocol.newest_good`) is
    required so that no caller can forget it (None: no committed step verifies).

    Raises:
        UnknownMetricError: a rule ranks by a metric no committed version has, while some
            have others (then nothing is deleted).

    Example:
        >>> from asyncckpt._versions.protocol import UNCOMMITTED
        >>> entries = [StepEntry(1, COMMITTED), StepEntry(2, UNREADABLE),
        ...            StepEntry(3, UNCOMMITTED), StepEntry(4, COMMITTED),
        ...            StepEntry(5, COMMITTED), StepEntry(6, UNCOMMITTED)]
        >>> last = RetentionPolicy((KeepLast(1),))
        >>> [e.step for e in deletion_plan(entries, last, 5, good=5)]
        [1, 3, 4]
        >>> [e.step for e in deletion_plan(entries, last, 5, good=4)]
        [1, 3]
    """
    if pinned is None:
        return []
    committed = [e for e in entries if e.state == COMMITTED]
    keep = policy.keeps(committed, now) | {pinned} | set(spare)
    if good is not None:
        keep.add(good)
    return [e for e in entries if e.step < pinned and e.state != UNREADABLE and e.step not in keep]
