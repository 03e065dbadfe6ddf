"""``inspect`` and ``convert`` on files that are not (only) what their names say.

A file's format is told by its first bytes (an asyncckpt file named ``.pt`` is read as
asyncckpt, never handed to ``torch.load``); ``inspect`` shows ``torch.save`` files (loaded
weights-only) and safetensors files (their JSON header only) in the same table as asyncckpt
files; ``convert`` creates the output folders; no message tells a user to unpickle a file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import cli


class Opaque:
    """A class ``torch.load(weights_only=True)`` refuses to unpickle."""


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def state() -> dict[str, Any]:
    return {"model": {"w": torch.ones(4, 3), "b": torch.zeros(3, dtype=torch.float16)}, "n": 7}


# -- convert (issue 21, part 4, item 3) -------------------------------------------------------


@pytest.mark.parametrize("dst", ["o.ackpt", "o.pt", "o.safetensors", "hub"])
def test_convert_creates_missing_output_folders(
    tmp_path: Path, dst: str, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save(state()["model"], tmp_path / "a.pt")
    out = tmp_path / "new" / "deeper" / dst
    extra = ["--shard-size", "1MiB"] if dst == "hub" else []
    code, _, err = run(capsys, "convert", tmp_path / "a.pt", out, *extra)
    assert code == 0, err
    assert out.exists()


def test_an_asyncckpt_file_named_pt_is_told_by_its_magic_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncckpt.save(state(), tmp_path / "real.pt").result()
    code, out, err = run(capsys, "--json", "convert", tmp_path / "real.pt", tmp_path / "x.pt")
    assert code == 0, err
    assert json.loads(out)["src_format"] == "ackpt"
    back = torch.load(tmp_path / "x.pt", weights_only=True)
    assert torch.equal(back["model"]["w"], torch.ones(4, 3)) and back["n"] == 7
    # and a torch.save file named .ackpt is read as what it is
    torch.save(state()["model"], tmp_path / "fake.ackpt")
    code, out, err = run(capsys, "--json", "convert", tmp_path / "fake.ackpt", tmp_path / "y.ackpt")
    assert code == 0, err
    assert json.loads(out)["src_format"] == "torch"
    assert torch.equal(asyncckpt.load(tmp_path / "y.ackpt")["w"], torch.ones(4, 3))


def test_from_that_contradicts_the_magic_bytes_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncckpt.save(state(), tmp_path / "real.bin").result()
    code, _, err = run(
        capsys, "convert", tmp_path / "real.bin", tmp_path / "x.pt", "--from", "torch"
    )
    assert code == 2 and "asyncckpt file" in err and "--from" in err
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_no_message_suggests_unpickling_a_file(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"x": Opaque()}, tmp_path / "custom.pt")
    args = [tmp_path / "c.ackpt"] if command == "convert" else []
    code, _, err = run(capsys, command, tmp_path / "custom.pt", *args)
    assert code == 1 and "weights_only=True" in err
    lowered = err.lower()
    assert "trust" not in lowered and "weights_only=false" not in lowered
    assert "full unpickling" not in lowered and "never unpickles" in lowered


def test_a_safetensors_header_length_that_looks_like_a_pickle_is_safetensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    # A header of 0x80 + 256k bytes begins with the byte a pickle begins with.
    name = "k" * (128 - len('{"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'))
    save_file({name: torch.ones(1)}, str(tmp_path / "w.bin"))
    assert (tmp_path / "w.bin").read_bytes()[:1] == b"\x80"
    code, out, err = run(capsys, "--json", "convert", tmp_path / "w.bin", tmp_path / "w.ackpt")
    assert code == 0, err
    assert json.loads(out)["src_format"] == "safetensors"


# -- inspect of torch.save and safetensors files (item 1) --------------------------------------


def _keys(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["key"]: row for row in doc["entries"]}


def test_inspect_shows_a_torch_save_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = state()
    saved["head"] = saved["model"]["w"]  # tied: one storage under two keys
    torch.save(saved, tmp_path / "m.pt")
    code, out, err = run(capsys, "inspect", tmp_path / "m.pt")
    assert code == 0, err
    assert "torch.save file" in out and "[4, 3]" in out and "float16" in out
    code, out, err = run(capsys, "--json", "inspect", tmp_path / "m.pt")
    doc = json.loads(out)
    assert doc["format"] == "torch" and doc["tensors"] == 2 and doc["raw_bytes"] == 54
    w = _keys(doc)["state['model']['w']"]
    assert (w["dtype"], w["shape"], w["nbytes"]) == ("float32", [4, 3], 48)
    assert _keys(doc)["state['head']"]["shares_storage_with"] == "state['model']['w']"
    assert _keys(doc)["state['n']"]["value"] == "7"
    code, out, _ = run(capsys, "--json", "inspect", tmp_path / "m.pt", "--key", "model")
    assert json.loads(out)["entries"][0]["key"] == "state['model']"


def test_inspect_reads_only_the_header_of_a_safetensors_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncckpt._storage import LocalStorage

    torch.save(
        {"embed": (e := torch.randn(10, 4)), "head": e, "b": torch.zeros(3)}, tmp_path / "m.pt"
    )
    assert run(capsys, "convert", tmp_path / "m.pt", tmp_path / "m.safetensors")[0] == 0
    raw = (tmp_path / "m.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    reads: list[tuple[int, int]] = []
    real = LocalStorage.read_range

    def spy(self: LocalStorage, path: str, start: int, length: int) -> bytes:
        reads.append((start, length))
        return real(self, path, start, length)

    monkeypatch.setattr(LocalStorage, "read_range", spy)
    monkeypatch.setattr(LocalStorage, "read_into", lambda *a: pytest.fail("data was read"))
    code, out, err = run(capsys, "--json", "inspect", tmp_path / "m.safetensors")
    assert code == 0, err
    assert reads and max(start + length for start, length in reads) <= header_end
    doc = json.loads(out)
    assert doc["format"] == "safetensors" and doc["tensors"] == 2
    keys = _keys(doc)
    assert list(keys) == ["state", "state['embed']", "state['head']", "state['b']"]  # saved order
    assert (keys["state['embed']"]["dtype"], keys["state['embed']"]["shape"]) == (
        "float32",
        [10, 4],
    )
    assert keys["state['head']"]["shares_storage_with"] == "state['embed']"
    code, out, err = run(capsys, "inspect", tmp_path / "m.safetensors", "--depth", "0")
    assert code == 0 and "safetensors file" in out and "embed" not in out


def test_inspect_of_a_damaged_safetensors_header_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}}'
    (tmp_path / "bad.safetensors").write_bytes(len(body).to_bytes(8, "little") + body + b"\0" * 8)
    code, _, err = run(capsys, "inspect", tmp_path / "bad.safetensors")
    assert code == 1 and "bad.safetensors" in err and "not a valid safetensors file" in err
