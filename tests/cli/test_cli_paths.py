"""The command line reads paths as ``asyncckpt.load`` does (issue 31 item 8): ``ls FILE``,
``ls ROOT@STEP``, a folder holding one checkpoint for ``inspect`` and ``convert``, and a
Hugging Face run's ``output_dir`` and ``checkpoint-N`` folders for every command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer, cli
from asyncckpt._versions.paths import HF_ROOT_NAME


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _root(path: Path, steps: tuple[int, ...]) -> Path:
    with Checkpointer(path) as ckpt:
        for step in steps:
            ckpt.save(step, {f"w{step}": torch.full((2,), float(step))}).result()
    return path


@pytest.fixture
def hf_run(tmp_path: Path) -> Path:
    """A Hugging Face output_dir as asyncckpt.transformers leaves it: versions 4 and 8."""
    out = tmp_path / "out"
    _root(out / HF_ROOT_NAME, (4, 8))
    for step in (4, 8):
        (out / f"checkpoint-{step}").mkdir()
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    return out


def test_ls_of_a_file_shows_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.ones(3)}, tmp_path / "x.ackpt").result()
    code, out, err = run(capsys, "--json", "ls", tmp_path / "x.ackpt")
    assert code == 0, err
    (row,) = json.loads(out)["roots"]
    assert row["layout"] == "file" and row["path"].endswith("x.ackpt")


def test_ls_of_root_at_step_shows_that_version(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root = _root(tmp_path / "run", (1, 2, 3))
    code, out, err = run(capsys, "--json", "ls", f"{root}@2")
    assert code == 0, err
    assert [v["step"] for v in json.loads(out)["versions"]] == [2]


def test_inspect_and_convert_of_a_folder_with_one_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "lightning").mkdir()
    asyncckpt.save({"w": torch.ones(3)}, tmp_path / "lightning" / "last.ackpt").result()
    code, out, err = run(capsys, "inspect", tmp_path / "lightning")
    assert code == 0, err
    assert "'w'" in out
    code, _, err = run(capsys, "convert", tmp_path / "lightning", tmp_path / "x.pt")
    assert code == 0, err
    assert torch.load(tmp_path / "x.pt")["w"].tolist() == [1.0, 1.0, 1.0]


def test_inspect_of_a_folder_of_several_names_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for name in ("a.ackpt", "b.ackpt"):
        asyncckpt.save({"w": torch.ones(1)}, tmp_path / name).result()
    code, _, err = run(capsys, "inspect", tmp_path)
    assert code == 2
    assert "folder of 2 checkpoints" in err and "a.ackpt" in err and "b.ackpt" in err


def test_every_command_takes_a_hugging_face_run(
    capsys: pytest.CaptureFixture[str], hf_run: Path
) -> None:
    code, out, err = run(capsys, "--json", "ls", hf_run)
    assert code == 0, err
    assert [v["step"] for v in json.loads(out)["versions"]] == [4, 8]
    code, out, err = run(capsys, "inspect", hf_run / "checkpoint-4")
    assert code == 0, err
    assert "w4" in out and "w8" not in out
    code, out, err = run(capsys, "--json", "verify", hf_run / "checkpoint-4")
    assert code == 0, err
    assert [f["step"] for f in json.loads(out)["files"]] == [4]
    code, _, err = run(capsys, "convert", hf_run, hf_run / "last.pt")
    assert code == 0, err
    assert list(torch.load(hf_run / "last.pt")) == ["w8"]
