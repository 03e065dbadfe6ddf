"""``asyncckpt convert`` through the ``safetensors`` package, and ``gc --keep-last``.

Tied weights (two keys, one tensor) are what safetensors refuses to write; convert writes
them once, records the alias in ``__metadata__`` and ties them again when reading back.
Remote files (``memory://`` here) are read through ranged reads, never copied whole.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import asyncckpt
from asyncckpt import cli
from asyncckpt._convert.safetensors import ALIASES_KEY, read_safetensors, untie
from asyncckpt._storage import resolve
from asyncckpt.cli.formats import RangeReader, load_torch


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def tied_model() -> dict[str, torch.Tensor]:
    """A language-model-like state dict whose output layer is the embedding (tied)."""
    torch.manual_seed(0)
    embed = torch.randn(10, 4)
    return {
        "embed.weight": embed,
        "block.weight": torch.randn(4, 4),
        "head.weight": embed,  # tied: the same tensor under two keys
        "block.bias": torch.zeros(4),
    }


@pytest.fixture
def memory_dir() -> Any:
    fs = fsspec.filesystem("memory")
    url = "memory://cli-convert-test"
    yield url
    if fs.exists(url):
        fs.rm(url, recursive=True)


def test_tied_weights_are_written_once_and_tied_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tied_model()
    torch.save(state, tmp_path / "m.pt")
    assert run(capsys, "convert", tmp_path / "m.pt", tmp_path / "m.safetensors")[0] == 0

    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        stored = set(f.keys())
        metadata = f.metadata()
    assert stored == {"embed.weight", "block.weight", "block.bias"}  # the tie written once
    assert json.loads(metadata[ALIASES_KEY]) == {"head.weight": "embed.weight"}
    plain = load_file(tmp_path / "m.safetensors")  # any safetensors reader opens it
    assert torch.equal(plain["embed.weight"], state["embed.weight"])

    assert run(capsys, "convert", tmp_path / "m.safetensors", tmp_path / "back.pt")[0] == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert list(back) == list(state)  # the original key order, not safetensors' sorted one
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert back["head.weight"].data_ptr() == back["embed.weight"].data_ptr()  # tied again

    assert run(capsys, "convert", tmp_path / "m.safetensors", tmp_path / "m.ackpt")[0] == 0
    loaded = asyncckpt.load(tmp_path / "m.ackpt")
    assert loaded["head.weight"].data_ptr() == loaded["embed.weight"].data_ptr()


def test_views_that_share_memory_are_written_as_copies(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    state = {"base": base, "row": base[1], "t": base.t(), "empty": base[:0]}
    unique, aliases = untie(state)
    assert aliases == {}
    assert unique["base"].data_ptr() == base.data_ptr()  # the first view is not copied
    assert unique["row"].data_ptr() != base.data_ptr() and unique["t"].is_contiguous()
    storage, path = resolve(tmp_path / "v.safetensors", None)
    cli.write_safetensors(state, storage, path)
    back, _ = read_safetensors(storage, path)
    assert list(back) == list(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_damaged_alias_records_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "bad.safetensors"
    save_file({"a": torch.ones(1)}, str(path), metadata={ALIASES_KEY: '{"b": "missing"}'})
    with pytest.raises(cli.SafetensorsError, match="lacks the second"):
        read_safetensors(*resolve(path, None))


def test_convert_between_remote_files(
    memory_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tied_model()
    buf = io.BytesIO()
    torch.save(state, buf)
    fsspec.filesystem("memory").pipe_file(f"{memory_dir}/m.pt", buf.getvalue())
    src, dst = f"{memory_dir}/m.pt", f"{memory_dir}/m.safetensors"
    assert run(capsys, "convert", src, dst)[0] == 0
    assert run(capsys, "convert", dst, tmp_path / "m.ackpt")[0] == 0
    back = asyncckpt.load(tmp_path / "m.ackpt")
    assert list(back) == list(state) and all(torch.equal(back[k], v) for k, v in state.items())


class _Counting(RangeReader):
    largest = 0

    def readinto(self, buffer: Any) -> int:
        _Counting.largest = max(_Counting.largest, len(memoryview(buffer)))
        return super().readinto(buffer)


def test_remote_torch_load_reads_through_a_file_object(
    memory_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.load gets a seekable file over ranged reads, not one bytes copy of the file."""
    state = {"w": torch.randn(1 << 20)}  # 4 MiB, read in 64 KiB blocks below
    buf = io.BytesIO()
    torch.save(state, buf)
    fsspec.filesystem("memory").pipe_file(f"{memory_dir}/big.pt", buf.getvalue())
    monkeypatch.setattr("asyncckpt.cli.formats.RangeReader", _Counting)
    monkeypatch.setattr("asyncckpt.cli.formats._READ_BLOCK", 64 << 10)
    storage, path = resolve(f"{memory_dir}/big.pt", None)
    read: list[int] = []
    obj = load_torch(cli.FileRef(storage, path), read.append)
    assert torch.equal(obj["w"], state["w"])
    assert sum(read) >= 4 << 20
    assert _Counting.largest < len(buf.getvalue())  # never asked for the whole file at once


def test_gc_takes_keep_last_and_the_old_keep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with asyncckpt.Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((2,), float(step))})
    code, out, _ = run(capsys, "gc", root, "--keep-last", "2", "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["keep_last"] == 2 and [d["step"] for d in doc["delete"]] == [1]
    code, out, _ = run(capsys, "gc", root, "--keep", "2", "--dry-run", "--json")  # hidden alias
    assert code == 0 and [d["step"] for d in json.loads(out)["delete"]] == [1]
    code, _, err = run(capsys, "gc", root)
    assert code == 2 and "--keep-last" in err
    code, _, err = run(capsys, "gc", root, "--keep-last", "0")
    assert code == 2 and "--keep-last must be at least 1" in err

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["gc", "--help"])
    help_text = capsys.readouterr().out
    assert "--keep-last N" in help_text and "--keep " not in help_text


@pytest.mark.parametrize("src_kind", ["file", "root"])
def test_convert_looks_its_source_up_once(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    src_kind: str,
) -> None:
    from asyncckpt.cli import convert

    state = {"w": torch.arange(6.0)}
    if src_kind == "file":
        src = tmp_path / "m.ackpt"
        asyncckpt.save(state, src).result()
    else:
        src = tmp_path / "run"
        with asyncckpt.Checkpointer(src) as ckpt:
            ckpt.save(1, state).result()
    lookups: list[str] = []
    real = convert.locate

    def locate(spec: str, *args: Any, **kwargs: Any) -> Any:
        lookups.append(spec)
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(convert, "locate", locate)
    code, _, err = run(capsys, "convert", src, tmp_path / "m.safetensors")
    assert code == 0, err
    assert lookups == [str(src)]  # each lookup of a remote SRC costs round trips
    assert torch.equal(load_file(tmp_path / "m.safetensors")["w"], state["w"])
