"""``asyncckpt ls`` shows metrics; ``gc`` applies every retention policy; ``rewind`` (issue 21)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import cli
from asyncckpt._versions.retention import RULES, parse_duration
from asyncckpt.cli.gc import flag


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _root(tmp_path: Path, losses: dict[int, float]) -> Path:
    root = tmp_path / "run"
    with asyncckpt.Checkpointer(root) as ckpt:
        for step, loss in losses.items():
            ckpt.save(step, {"w": torch.full((2,), float(step))}, metrics={"eval_loss": loss})
    return root


def test_ls_shows_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _root(tmp_path, {1: 0.5, 2: 0.25})
    code, out, _ = run(capsys, "ls", root)
    assert code == 0 and "METRICS" in out and "eval_loss=0.25" in out
    code, out, _ = run(capsys, "ls", root, "--json")
    assert [v["metrics"] for v in json.loads(out)["versions"]] == [
        {"eval_loss": 0.5},
        {"eval_loss": 0.25},
    ]


def test_gc_keep_best_every_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _root(tmp_path, {1: 0.5, 2: 0.1, 3: 0.4, 4: 0.3, 5: 0.9, 6: 0.8})

    def goes(*flags: str) -> list[int]:
        code, out, err = run(capsys, "gc", root, *flags, "--dry-run", "--json")
        assert code == 0, err
        return [d["step"] for d in json.loads(out)["delete"]]

    assert goes("--keep-best", "1", "--best-metric", "eval_loss") == [1, 3, 4, 5]
    assert goes("--keep-best", "1", "--best-metric", "eval_loss", "--best-mode", "max") == [
        1,
        2,
        3,
        4,
    ]
    assert goes("--keep-every", "2") == [1, 3, 5]
    assert goes("--keep-every", "3", "--keep-last", "2") == [1, 2, 4]
    assert goes("--keep-for", "1d") == []  # all were committed just now
    code, _, _ = run(capsys, "gc", root, "--keep-best", "2", "--best-metric", "eval_loss")
    assert code == 0
    assert asyncckpt.Checkpointer(root, read_only=True).versions() == [2, 4, 6]


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ((), "--keep-last"),
        (("--keep-best", "1"), "--best-metric"),
        (("--keep-best", "0", "--best-metric", "x"), "--keep-best must be at least 1"),
        (("--keep-every", "0"), "--keep-every must be at least 1"),
        (("--keep-for", "soon"), "--keep-for"),
        (("--keep-for", "-3"), "--keep-for takes a positive duration"),
    ],
)
def test_gc_bad_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], match: str
) -> None:
    root = _root(tmp_path, {1: 0.5})
    code, _, err = run(capsys, "gc", root, *flags)
    assert code == 2 and match in err


def test_parse_duration() -> None:
    assert parse_duration("90m") == 5400.0 and parse_duration("1.5h") == 5400.0
    with pytest.raises(ValueError, match="positive duration"):
        parse_duration("-3")


def test_rewind_needs_yes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _root(tmp_path, {1: 0.5, 2: 0.4, 3: 0.3})
    code, out, _ = run(capsys, "rewind", root, "1")
    assert code == 1 and "would delete step(s) 3, 2" in out
    assert asyncckpt.Checkpointer(root, read_only=True).versions() == [1, 2, 3]
    code, out, _ = run(capsys, "rewind", root, "1", "--yes", "--json")
    assert code == 0 and json.loads(out)["delete"] == [3, 2]
    with asyncckpt.Checkpointer(root) as ckpt:
        assert ckpt.versions() == [1] and ckpt.latest() == 1
        ckpt.save(2, {"w": torch.zeros(2)})
    code, _, err = run(capsys, "rewind", root, "7", "--yes")
    assert code == 1 and "step 7" in err and "not committed" in err


def test_gc_refuses_a_best_metric_no_version_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _root(tmp_path, {1: 0.1, 2: 0.5, 3: 0.4})
    code, _, err = run(
        capsys, "gc", root, "--keep-last", "1", "--keep-best", "1", "--best-metric", "eval_los"
    )
    assert code == 2 and "'eval_los'" in err and "the metrics there are: 'eval_loss'" in err
    assert asyncckpt.Checkpointer(root, read_only=True).versions() == [1, 2, 3]  # 1 is the best


def test_gc_has_a_flag_for_every_rule(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "gc", "--help")
    assert code == 0
    for rule in RULES:
        assert flag(rule.keyword) in out and flag(rule.keyword) == "--" + rule.keyword.replace(
            "_", "-"
        )
