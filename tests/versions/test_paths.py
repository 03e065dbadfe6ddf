"""One path model for Python and the command line (issue 31 item 8): what ``load``,
``Checkpointer`` and the commands make of FILE, ROOT, ROOT@STEP, a folder of checkpoints,
and a Hugging Face run's ``output_dir`` and ``checkpoint-N`` folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt._versions import paths
from asyncckpt.errors import CheckpointNotFoundError, PathKindError


def _root(path: Path, steps: tuple[int, ...] = (1, 3)) -> Path:
    with Checkpointer(path) as ckpt:
        for step in steps:
            ckpt.save(step, {"w": torch.full((2,), float(step))}).result()
    return path


def test_load_of_root_at_step_loads_that_version(tmp_path: Path) -> None:
    root = _root(tmp_path / "ckpt")
    assert asyncckpt.load(f"{root}@1")["w"].tolist() == [1.0, 1.0]
    assert asyncckpt.load(root)["w"].tolist() == [3.0, 3.0]  # the newest


def test_load_of_a_step_not_committed_names_the_committed_ones(tmp_path: Path) -> None:
    root = _root(tmp_path / "ckpt")
    with pytest.raises(CheckpointNotFoundError, match=r"step 2 .*committed steps: 1, 3"):
        asyncckpt.load(f"{root}@2")


def test_a_real_file_named_like_root_at_step_conflicts(tmp_path: Path) -> None:
    root = _root(tmp_path / "ckpt")
    asyncckpt.save({"w": torch.zeros(1)}, f"{root}@1").result()
    with pytest.raises(PathKindError, match=r"ckpt@1 names both an existing file and step 1"):
        asyncckpt.load(f"{root}@1")


def test_a_file_named_at_step_without_a_root_is_that_file(tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.zeros(1)}, tmp_path / "run@3").result()
    assert asyncckpt.load(tmp_path / "run@3")["w"].tolist() == [0.0]


def test_load_of_a_folder_names_what_is_below(tmp_path: Path) -> None:
    for name in ("a.ackpt", "b.ackpt"):
        asyncckpt.save({"w": torch.zeros(1)}, tmp_path / name).result()
    with pytest.raises(PathKindError, match=r"folder of 2 checkpoints .*a\.ackpt.*b\.ackpt"):
        asyncckpt.load(tmp_path)


def test_load_of_a_folder_with_one_checkpoint_loads_it(tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.ones(1)}, tmp_path / "last.ackpt").result()
    assert asyncckpt.load(tmp_path)["w"].tolist() == [1.0]


def test_load_of_an_empty_folder_says_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"a folder with no checkpoint in it"):
        asyncckpt.load(tmp_path)


def test_checkpointer_of_a_file_is_refused_at_once(tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.zeros(1)}, tmp_path / "x.ackpt").result()
    with pytest.raises(PathKindError, match=r"x\.ackpt is a file, not a checkpoint root"):
        Checkpointer(tmp_path / "x.ackpt")


def test_hugging_face_output_dir_and_checkpoint_folder(tmp_path: Path) -> None:
    _root(tmp_path / "out" / paths.HF_ROOT_NAME, steps=(4, 8))
    (tmp_path / "out" / "checkpoint-4").mkdir()
    (tmp_path / "out" / "checkpoint-4" / "trainer_state.json").write_text("{}")
    assert asyncckpt.load(tmp_path / "out")["w"].tolist() == [8.0, 8.0]
    assert asyncckpt.load(tmp_path / "out" / "checkpoint-4")["w"].tolist() == [4.0, 4.0]
    found = paths.find(tmp_path / "out" / "checkpoint-4")
    assert (found.kind, found.step, found.path) == (
        "root",
        4,
        str(tmp_path / "out" / paths.HF_ROOT_NAME),
    )


def test_the_hugging_face_root_name_is_the_integrations() -> None:
    transformers = pytest.importorskip("asyncckpt.transformers")
    assert transformers.ROOT_NAME == paths.HF_ROOT_NAME


def test_at_step_after_a_file_is_refused(tmp_path: Path) -> None:
    asyncckpt.save({"w": torch.zeros(1)}, tmp_path / "x.ackpt").result()
    with pytest.raises(PathKindError, match=r"x\.ackpt is a file"):
        paths.find(f"{tmp_path / 'x.ackpt'}@3")


def test_memory_root_at_step(memory_root: str) -> None:
    with Checkpointer(memory_root) as ckpt:
        ckpt.save(5, {"w": torch.ones(1)}).result()
        ckpt.save(6, {"w": torch.zeros(1)}).result()
    assert asyncckpt.load(f"{memory_root}@5")["w"].tolist() == [1.0]


def test_a_version_directory_is_that_version(tmp_path: Path) -> None:
    root = _root(tmp_path / "ckpt")
    found = paths.find(root / "1")
    assert (found.kind, found.path, found.step) == ("root", str(root), 1)
    assert asyncckpt.load(root / "1")["w"].tolist() == [1.0, 1.0]


@pytest.mark.timeout(120)
def test_loading_a_plain_file_imports_no_torch_dcp(tmp_path: Path) -> None:
    """A restarted job's first load of a file pays every import on its way: importing
    ``torch.distributed.checkpoint`` (for sharded versions only) cost it about 0.5 s."""
    path = tmp_path / "x.ackpt"
    asyncckpt.save({"w": torch.ones(3)}, path).result()
    code = (
        "import sys, asyncckpt\n"
        f"assert asyncckpt.load({str(path)!r})['w'].tolist() == [1.0, 1.0, 1.0]\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
