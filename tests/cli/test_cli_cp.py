"""``asyncckpt cp SRC[@STEP] DST``: versions copied between stores in commit order (data,
then COMMIT, then VERSION), each data file verified at DST before its COMMIT; resumable."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer, cli
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage, resolve
from asyncckpt._versions.protocol import (
    committed_steps,
    latest_step,
    read_commit,
    step_dir,
)
from asyncckpt.cli.common import RootRef
from asyncckpt.cli.cp import copy_versions
from asyncckpt.cli.verify import verify_file
from tests.crashpoints import CrashPlan, CrashStorage

STEPS = (1, 2, 3)


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _source(root: str) -> str:
    with Checkpointer(root) as ckpt:
        for step in STEPS:
            state = {"w": torch.arange(3000.0) * step, "step": step}
            ckpt.save(step, state, metrics={"loss": 1.0 / step}).result()
    return root


def _memory() -> str:
    return f"memory://cp-{uuid.uuid4().hex[:8]}"


def _sound(storage: Storage, root: str) -> list[int]:
    """The steps committed at ``root``, each checked: every file its COMMIT names is there,
    of the recorded size, and every data file verifies."""
    steps = committed_steps(storage, root)
    for step in steps:
        commit = read_commit(storage, root, step)
        assert commit is not None
        for name, size in zip(commit.files, commit.sizes, strict=True):
            path = storage.join(step_dir(storage, root, step), name)
            assert storage.size(path) == size
            if name.endswith(".ackpt"):
                report = verify_file(storage, path)
                assert report.ok, report.errors
    return steps


def test_cp_copies_every_version_and_a_rerun_skips_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    src = _source(str(tmp_path / "src"))
    dst = _memory()
    code, out, err = run(capsys, "--json", "cp", src, dst)
    assert code == 0, err
    assert [(v["step"], v["action"]) for v in json.loads(out)["versions"]] == [
        (1, "copied"),
        (2, "copied"),
        (3, "copied"),
    ]
    assert asyncckpt.load(f"{dst}@2")["step"] == 2
    assert torch.equal(asyncckpt.load(dst)["w"], torch.arange(3000.0) * 3)
    storage, root = resolve(dst, None)
    assert _sound(storage, root) == [1, 2, 3] and latest_step(storage, root) == 3
    assert read_commit(storage, root, 2).metrics == {"loss": 0.5}  # type: ignore[union-attr]
    code, out, err = run(capsys, "--json", "cp", src, dst)
    assert code == 0, err
    assert {v["action"] for v in json.loads(out)["versions"]} == {"present"}
    asyncckpt.save({"w": torch.ones(1)}, tmp_path / "x.ackpt").result()
    code, _, err = run(capsys, "cp", src, tmp_path / "x.ackpt")
    assert code == 1 and "x.ackpt is a file, not a checkpoint root" in err
    code, _, err = run(capsys, "cp", tmp_path / "x.ackpt", dst)
    assert code == 2 and "x.ackpt is a file; cp copies the versions" in err


def test_cp_of_one_step(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    src = _source(str(tmp_path / "src"))
    dst = tmp_path / "dst"
    code, _, err = run(capsys, "cp", f"{src}@2", dst)
    assert code == 0, err
    assert committed_steps(*resolve(dst, None)) == [2]
    assert asyncckpt.load(dst)["step"] == 2


def test_cp_refuses_a_damaged_source_version_and_commits_nothing_of_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    src = _source(str(tmp_path / "src"))
    storage, root = resolve(src, None)
    commit = read_commit(storage, root, 2)
    assert commit is not None
    data = Path(step_dir(storage, root, 2)) / commit.files[0]
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # inside the first chunk
    data.write_bytes(bytes(raw))
    dst = tmp_path / "dst"
    code, _, err = run(capsys, "cp", src, dst)
    assert code == 1 and "step 2" in err
    assert committed_steps(*resolve(dst, None)) == [1]  # stops at the damaged one


def test_cp_interrupted_at_every_storage_call_never_commits_missing_data(
    tmp_path: Path,
) -> None:
    src_ref = RootRef(*resolve(_source(str(tmp_path / "src")), None))
    counting = CrashPlan("count")
    dst_storage, dst_root = resolve(_memory(), None)
    copy_versions(src_ref, CrashStorage(dst_storage, counting), dst_root, Settings())
    points = counting.points("crash")
    assert points > 3 * 3  # a file, a COMMIT and a VERSION per version at least
    for at in range(1, points + 1):
        dst_storage, dst_root = resolve(_memory(), None)
        plan = CrashPlan("crash", at)
        with pytest.raises(asyncckpt.AsyncCkptError):
            copy_versions(src_ref, CrashStorage(dst_storage, plan), dst_root, Settings())
        assert plan.fired is not None
        committed = _sound(dst_storage, dst_root)  # no COMMIT without its data, verified
        newest = latest_step(dst_storage, dst_root)
        assert newest == (committed[-1] if committed else None), (at, plan.fired)
        results = copy_versions(
            src_ref, dst_storage, dst_root, Settings()
        )  # the rerun completes it
        assert [r.step for r in results if r.action == "copied"] == [
            s for s in STEPS if s not in committed
        ], (at, plan.fired)
        assert _sound(dst_storage, dst_root) == list(STEPS)
        assert latest_step(dst_storage, dst_root) == STEPS[-1]


@pytest.mark.timeout(300)
def test_cp_local_to_s3_and_back(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, s3_root: str, s3_server: Any
) -> None:
    src = _source(str(tmp_path / "src"))
    endpoint = ["--endpoint-url", s3_server.endpoint_url]
    code, _, err = run(capsys, "cp", src, s3_root, *endpoint)
    assert code == 0, err
    back = tmp_path / "back"
    code, _, err = run(capsys, "cp", f"{s3_root}@3", back, *endpoint)
    assert code == 0, err
    assert asyncckpt.load(back)["step"] == 3
    assert _sound(*resolve(s3_root, s3_server.storage_options)) == list(STEPS)
