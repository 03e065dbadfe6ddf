"""Metrics in COMMIT, retention policies (keep last/best/every/for), best(), rewind (issue 21).

* ``save(metrics=...)`` stores validated JSON metadata in the version's ``COMMIT``; ``info``
  reads it without loading the state; an old ``COMMIT`` without metrics still reads;
* every retention rule is data in :class:`RetentionPolicy`, combined as a union, applied by
  the one :func:`deletion_plan` (never the newest, nor a spared step);
* ``rewind(step)`` deletes every newer version, fenced, and saving goes on from ``step``.
"""

from __future__ import annotations

import datetime
import inspect
import json
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from asyncckpt import Checkpointer
from asyncckpt._storage import resolve
from asyncckpt._versions.metrics import check_metrics
from asyncckpt._versions.protocol import (
    COMMITTED,
    CommitRecord,
    StepEntry,
    commit_from,
    step_dir,
)
from asyncckpt._versions.retention import RULES, RetentionPolicy, deletion_plan, policy_from
from asyncckpt.errors import (
    CheckpointNotFoundError,
    FencedError,
    InvalidMetricsError,
    UnknownMetricError,
    UnreadableRecordError,
)
from tests.api.test_checkpointer import (
    _drain_saves,  # noqa: F401 (an autouse fixture)
    assert_state,
    make_state,
)


def _entry(step: int, metrics: dict[str, Any] | None = None, at: float | None = None) -> StepEntry:
    stamp = None if at is None else datetime.datetime.fromtimestamp(at, datetime.timezone.utc)
    commit = CommitRecord(
        step, ("a.ackpt",), "w", metrics=metrics or {}, time=stamp and stamp.isoformat()
    )
    return StepEntry(step, COMMITTED, commit=commit)


def _plan(entries: list[StepEntry], policy: RetentionPolicy, now: float = 0.0) -> list[int]:
    pinned = entries[-1].step
    return [e.step for e in deletion_plan(entries, policy, pinned, now=now, good=pinned)]


# -- metrics ---------------------------------------------------------------------------------


def test_an_integer_metric_too_large_for_a_float_is_invalid(any_root: str) -> None:
    with Checkpointer(any_root) as ckpt, pytest.raises(InvalidMetricsError, match="'n'"):
        ckpt.save(1, make_state(1), metrics={"n": 10**400})
    assert check_metrics({"n": 10**300}) == {"n": 10**300}  # a float holds it: ranked as one


def test_metrics_are_kept_in_commit_and_read_by_info(any_root: str) -> None:
    with Checkpointer(any_root) as ckpt:
        ckpt.save(1, make_state(1), metrics={"eval_loss": 0.31, "tag": "warmup", "n": 3})
        ckpt.save(2, make_state(2))
        ckpt.wait()
        one, two = ckpt.info(1), ckpt.info()
    assert one.step == 1 and one.metrics == {"eval_loss": 0.31, "tag": "warmup", "n": 3}
    assert one.kind == "single" and one.size is not None and one.size > 0
    assert one.time is not None and datetime.datetime.fromisoformat(one.time).year >= 2024
    assert two.step == 2 and two.metrics == {}
    storage, root = resolve(any_root, None)
    raw = storage.read_bytes(storage.join(step_dir(storage, root, 1), "COMMIT"), 1 << 20)
    assert json.loads(raw)["metrics"] == {"eval_loss": 0.31, "tag": "warmup", "n": 3}
    raw = storage.read_bytes(storage.join(step_dir(storage, root, 2), "COMMIT"), 1 << 20)
    assert "metrics" not in json.loads(raw)  # no metrics: the record older readers know


def test_info_of_a_step_not_committed(any_root: str) -> None:
    ckpt = Checkpointer(any_root, read_only=True)
    with pytest.raises(CheckpointNotFoundError, match="nothing is committed"):
        ckpt.info()
    with pytest.raises(CheckpointNotFoundError, match="step 4 is not committed"):
        ckpt.info(4)


def test_old_commit_without_metrics_reads() -> None:
    doc = {"step": 3, "files": ["r00000-a.ackpt"], "writer": "w", "sizes": [5], "epoch": 1}
    record = commit_from({**doc, "time": "2024-01-01T00:00:00+00:00"}, 3, "COMMIT")
    assert record.metrics == {} and record.timestamp == 1704067200.0
    assert commit_from(doc, 3, "COMMIT").timestamp is None


@pytest.mark.parametrize(
    ("metrics", "match"),
    [
        ({"loss": math.nan}, "'loss' is nan"),
        ({"loss": math.inf}, "'loss' is inf"),
        ({"ok": True}, "'ok' is bool"),
        ({"loss": [1.0]}, "'loss' is list"),
        ({"note": "x" * 257}, "'note' is a string of 257"),
        ({3: 1.0}, "the name 3"),
        ({"": 1.0}, "the name ''"),
        ({f"m{i}": i for i in range(65)}, "65 entries"),
        ([("loss", 1.0)], "must be a dict"),
    ],
)
def test_bad_metrics_are_refused_naming_the_key(any_root: str, metrics: Any, match: str) -> None:
    with Checkpointer(any_root) as ckpt:
        with pytest.raises(InvalidMetricsError, match=match):
            ckpt.save(1, make_state(1), metrics=metrics)
        assert ckpt.versions() == []


def test_malformed_metrics_in_a_commit_make_it_unreadable() -> None:
    doc = {"step": 1, "files": ["r00000-a.ackpt"], "writer": "w", "metrics": {"x": "y" * 300}}
    with pytest.raises(UnreadableRecordError, match="'x'"):
        commit_from(doc, 1, "COMMIT")


# -- policies --------------------------------------------------------------------------------


def test_keep_best_by_metric_min_and_max() -> None:
    losses = {1: 0.5, 2: 0.1, 3: 0.4, 4: 0.2, 5: 0.9, 6: 0.8}
    entries = [_entry(0)] + [_entry(s, {"eval_loss": v}) for s, v in losses.items()]
    policy = policy_from({"keep_best": 2, "best_metric": "eval_loss"})
    assert _plan(entries, policy) == [0, 1, 3, 5]  # 2 and 4 best; 6 newest; 0 has no metric
    policy = policy_from({"keep_best": 1, "best_metric": "eval_loss", "best_mode": "max"})
    assert _plan(entries, policy) == [0, 1, 2, 3, 4]


def test_keep_every_and_keep_for_and_their_union() -> None:
    entries = [_entry(s, at=100.0 * s) for s in range(1, 11)]
    assert _plan(entries, policy_from({"keep_every": 4})) == [1, 2, 3, 5, 6, 7, 9]
    # now = 1000: younger than 250 s are steps 8, 9, 10 (700 is older).
    assert _plan(entries, policy_from({"keep_for": 250}), now=1000) == [1, 2, 3, 4, 5, 6, 7]
    by_delta = policy_from({"keep_for": datetime.timedelta(seconds=250)})
    assert by_delta.keyword("keep_for") == 250.0
    assert _plan(entries, by_delta, now=1000) == [1, 2, 3, 4, 5, 6, 7]
    union = policy_from({"keep_last": 1, "keep_every": 5, "keep_for": 150})
    assert _plan(entries, union, now=1000) == [1, 2, 3, 4, 6, 7, 8]
    unknown_age = [_entry(1), _entry(2, at=0.0), _entry(3, at=1000.0)]
    assert _plan(unknown_age, policy_from({"keep_for": 10}), now=1000) == [2]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_best": 1}, "keep_best needs best_metric"),
        ({"keep_best": 0, "best_metric": "x"}, "keep_best"),
        ({"keep_every": 1.5}, "keep_every"),
        ({"best_mode": "lowest"}, "best_mode"),
        ({"keep_for": -1}, "keep_for"),
        ({"keep_for": "1d"}, "keep_for"),
        ({"best_metric": ""}, "best_metric"),
    ],
)
def test_bad_policies(any_root: str, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Checkpointer(any_root, **kwargs)


def test_checkpointer_keeps_best_and_last_and_reports_best(any_root: str) -> None:
    losses = [0.9, 0.2, 0.5, 0.7, 0.6]
    with Checkpointer(any_root, keep_last=1, keep_best=1, best_metric="loss") as ckpt:
        for step, loss in enumerate(losses, 1):
            ckpt.save(step, make_state(step), metrics={"loss": loss})
            ckpt.wait()
        assert ckpt.versions() == [2, 5]
        assert ckpt.best() == 2
        assert ckpt.best("loss", "max") == 5
        assert_state(ckpt.load(2), 2)
    assert Checkpointer(any_root, read_only=True).best("missing") is None
    with pytest.raises(ValueError, match="best\\(\\) needs a metric"):
        Checkpointer(any_root, read_only=True).best()


def test_keep_best_never_deletes_the_newest(any_root: str) -> None:
    with Checkpointer(any_root, keep_best=1, best_metric="loss") as ckpt:
        ckpt.save(1, make_state(1), metrics={"loss": 0.1})
        ckpt.save(2, make_state(2), metrics={"loss": 0.5})
        ckpt.save(3, make_state(3))
        ckpt.wait()
        assert ckpt.versions() == [1, 3]


def test_keep_total_counts_the_newest_and_the_best_within_the_limit() -> None:
    losses = {1: 0.1, 2: 0.5, 3: 0.4, 4: 0.3}  # 1 is the best
    entries = [_entry(s, {"eval_loss": v}) for s, v in losses.items()]
    total = {"best_metric": "eval_loss"}
    assert _plan(entries, policy_from({"keep_total": 1, **total})) == [2, 3]  # 2 kept: 1, 4
    assert _plan(entries, policy_from({"keep_total": 2, **total})) == [2, 3]
    assert _plan(entries, policy_from({"keep_total": 3, **total})) == [2]
    assert _plan(entries, policy_from({"keep_total": 2})) == [1, 2]  # no metric: the newest
    # keep_last and keep_best are two rules, so the best comes on top of the last N:
    assert _plan(entries, policy_from({"keep_last": 2, "keep_best": 1, **total})) == [2]


class _KeepOdd:
    """A rule of the user's own: the odd steps."""

    def keeps(self, committed: Sequence[StepEntry], now: float) -> set[int]:
        return {e.step for e in committed if e.step % 2}


def test_a_rule_is_one_object_with_keeps(any_root: str) -> None:
    with Checkpointer(any_root, keep_last=1, rules=[_KeepOdd()]) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, make_state(step))
        ckpt.wait()
        assert ckpt.versions() == [1, 3, 5, 6]  # any rule keeps it


def test_every_rule_is_a_checkpointer_keyword() -> None:
    """A rule added to RULES is built by name everywhere: the Checkpointer's keyword (which
    must be in its signature) and gc's flag (``tests/cli``) go through policy_from."""
    parameters = inspect.signature(Checkpointer).parameters
    for rule in RULES:
        assert rule.keyword in parameters, rule
        assert policy_from({rule.keyword: rule.parse("2"), "best_metric": "m"}).rules
    with pytest.raises(ValueError, match="unknown retention keyword"):
        policy_from({"keep_lsat": 2})


# -- rewind ----------------------------------------------------------------------------------


def test_rewind_then_save_an_older_step(any_root: str) -> None:
    with Checkpointer(any_root) as ckpt:
        for step in (1, 2, 3, 5):
            ckpt.save(step, make_state(step))
        with pytest.raises(ValueError, match="steps must increase"):
            ckpt.save(4, make_state(4))
        assert ckpt.rewind(2) == [5, 3]
        assert ckpt.versions() == [1, 2] and ckpt.latest() == 2
        ckpt.save(3, make_state(103))
        ckpt.wait()
        assert ckpt.versions() == [1, 2, 3]
    again = Checkpointer(any_root)
    assert again.latest() == 3
    again.save(4, make_state(4))
    again.close()
    assert again.versions() == [1, 2, 3, 4]


def test_rewind_to_a_step_not_committed_deletes_nothing(any_root: str) -> None:
    with Checkpointer(any_root) as ckpt:
        for step in (1, 3):
            ckpt.save(step, make_state(step))
        with pytest.raises(CheckpointNotFoundError, match="step 2"):
            ckpt.rewind(2)
        assert ckpt.versions() == [1, 3]


def test_rewind_is_fenced(any_root: str) -> None:
    old = Checkpointer(any_root)
    old.save(1, make_state(1))
    old.save(2, make_state(2))
    old.wait()
    new = Checkpointer(any_root)
    new.save(3, make_state(3))
    new.wait()
    with pytest.raises(FencedError):
        old.rewind(1)
    assert new.versions() == [1, 2, 3] and new.latest() == 3
    new.close()
    old.close()


def test_rewind_refused_on_a_reader(any_root: str) -> None:
    with Checkpointer(any_root) as ckpt:
        ckpt.save(1, make_state(1))
    with pytest.raises(Exception, match="read-only"):
        Checkpointer(any_root, read_only=True).rewind(1)


def test_small_tensor_state_still_round_trips(any_root: str) -> None:
    with Checkpointer(any_root) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}, metrics={"loss": 1})
        ckpt.wait()
        assert ckpt.load(1)["w"].tolist() == [1.0, 1.0, 1.0]
        assert ckpt.info(1).metrics == {"loss": 1}


# -- a metric no version has (issue 31) ------------------------------------------------------


def test_a_save_whose_metric_retention_ranks_by_no_version_has_is_refused(any_root: str) -> None:
    with Checkpointer(any_root, keep_last=1, keep_best=1, best_metric="eval_los") as ckpt:
        with pytest.raises(UnknownMetricError, match=r"'eval_los'.*'eval_loss'") as caught:
            ckpt.save(1, make_state(1), metrics={"eval_loss": 0.1})
        assert caught.value.known == ["eval_loss"] and any_root in str(caught.value)
        assert ckpt.versions() == []  # refused before anything was written
        ckpt.save(1, make_state(1))  # without metrics: nothing to rank yet
        ckpt.save(2, make_state(2), metrics={"eval_los": 0.5})  # the name it ranks by
        ckpt.wait()
        assert ckpt.versions() == [2]


def test_retention_deletes_nothing_when_no_version_has_its_metric(any_root: str) -> None:
    with Checkpointer(any_root) as first:
        first.save(1, make_state(1), metrics={"eval_loss": 0.1})  # the real best
        first.save(2, make_state(2), metrics={"eval_loss": 0.5})
    # A later job with a typo in the metric's name, saving without metrics.
    with Checkpointer(any_root, keep_last=1, keep_best=1, best_metric="eval_los") as ckpt:
        ckpt.save(3, make_state(3))
        ckpt.wait()
        assert ckpt.versions() == [1, 2, 3]  # not: [3], the real best gone
    entries = [_entry(1, {"eval_loss": 0.1}), _entry(2, {"eval_loss": 0.5}), _entry(3)]
    policy = policy_from({"keep_best": 1, "best_metric": "eval_los"})
    with pytest.raises(UnknownMetricError, match="the metrics there are: 'eval_loss'"):
        _plan(entries, policy)
    assert _plan(entries[2:], policy) == []  # no version has any metric: nothing to rank


def test_saves_without_the_ranked_metric_once_a_version_has_it(any_root: str) -> None:
    """Evaluation metrics at some saves only: refused until a version has the metric (it
    would rank nothing), then accepted without reading every COMMIT again."""
    with Checkpointer(any_root) as first:
        first.save(1, make_state(1), metrics={"eval_loss": 0.1})
    with Checkpointer(any_root, keep_last=1, keep_best=1, best_metric="eval_loss") as ckpt:
        ckpt.save(2, make_state(2), metrics={"train_loss": 2.0})  # step 1 has eval_loss
        ckpt.wait()
        reads = []
        real = ckpt._reader.commit_of
        ckpt._reader.commit_of = lambda step: reads.append(step) or real(step)  # type: ignore[method-assign]
        ckpt.save(3, make_state(3), metrics={"train_loss": 1.5})
        ckpt.wait()
        assert reads == []  # no COMMIT read again for the check
        assert ckpt.versions() == [1, 3]  # the best (1) stays
