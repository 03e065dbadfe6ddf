"""Loading only what you need (issue 21 part 3): ``keys=``, ``into=`` subtrees, ``mmap``."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt._api import dropin
from asyncckpt._engine.opened import OpenedFile
from asyncckpt.errors import AsyncCkptError, AsyncCkptWarning, MissingKeyError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _state() -> dict[str, Any]:
    model = _model()
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": 7}


def _model_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = _state()
    path = tmp_path / "s.ackpt"
    asyncckpt.save(state, path, compression="none").result()
    return path, state


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Bytes of chunk data read (every chunk goes through ``OpenedFile.read_into``)."""
    counted: list[int] = []
    real = OpenedFile.read_into

    def counting(self: OpenedFile, start: int, out: memoryview) -> int:
        got = real(self, start, out)
        counted.append(got)
        return got

    monkeypatch.setattr(OpenedFile, "read_into", counting)
    yield counted


def test_keys_loads_only_those_keys_and_reads_only_their_chunks(
    saved: tuple[Path, dict[str, Any]], bytes_read: list[int]
) -> None:
    path, state = saved
    got = asyncckpt.load(path, keys=["model"])
    assert list(got) == ["model"]
    for key, value in state["model"].items():
        assert torch.equal(got["model"][key], value)
    model_only = sum(bytes_read)
    assert model_only == _model_bytes(state)  # uncompressed: exactly the model's bytes
    bytes_read.clear()
    asyncckpt.load(path)
    assert sum(bytes_read) >= 3 * model_only  # Adam's two moments besides the model


def test_keys_without_tensors_reads_no_chunk(
    saved: tuple[Path, dict[str, Any]], bytes_read: list[int]
) -> None:
    path, _ = saved
    assert asyncckpt.load(path, keys=["step"]) == {"step": 7}
    assert sum(bytes_read) == 0


def test_keys_in_file_order_and_several(saved: tuple[Path, dict[str, Any]]) -> None:
    path, state = saved
    got = asyncckpt.load(path, keys=("step", "optim"))
    assert list(got) == ["optim", "step"]
    assert got["optim"]["param_groups"] == state["optim"]["param_groups"]


def test_an_unknown_key_names_the_file_and_the_keys_it_has(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    path, _ = saved
    with pytest.raises(MissingKeyError) as caught:
        asyncckpt.load(path, keys=["model", "ema"])
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, AsyncCkptError)
    text = str(caught.value)
    assert str(path) in text and "'ema'" in text and "['model', 'optim', 'step']" in text


def test_keys_of_a_file_that_is_no_dict_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "l.ackpt"
    asyncckpt.save([torch.ones(2)], path).result()
    with pytest.raises(MissingKeyError, match="something else"):
        asyncckpt.load(path, keys=["a"])


def test_a_single_string_is_not_taken_for_a_list_of_keys(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    with pytest.raises(TypeError, match="collection"):
        asyncckpt.load(saved[0], keys="model")


def test_into_reads_only_the_subtrees_it_has(
    saved: tuple[Path, dict[str, Any]], bytes_read: list[int]
) -> None:
    path, state = saved
    target = _model()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    got = asyncckpt.load(path, into={"model": target.state_dict()})
    assert sum(bytes_read) == _model_bytes(state)  # optim's moments never fetched
    assert set(got) == {"model", "step"}  # step holds no tensor: it comes for free
    for key, value in state["model"].items():
        assert torch.equal(target.state_dict()[key], value)


def test_checkpointer_load_keys(tmp_path: Path, bytes_read: list[int]) -> None:
    state = _state()
    with asyncckpt.Checkpointer(tmp_path / "run", compression="none") as ckpt:
        ckpt.save(1, state).result()
        bytes_read.clear()
        got = ckpt.load(keys=["model"])
        assert list(got) == ["model"] and sum(bytes_read) == _model_bytes(state)
        with pytest.raises(MissingKeyError, match="top-level keys are"):
            ckpt.load(1, keys=["nope"])


def test_mmap_true_warns_once_and_loads(
    saved: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dropin, "_mmap_warned", type(dropin._mmap_warned)())
    path, state = saved
    with pytest.warns(AsyncCkptWarning, match="mmap=True"):
        got = asyncckpt.load(path, mmap=True)
    assert torch.equal(got["model"]["0.weight"], state["model"]["0.weight"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncckpt.load(path, mmap=True)  # once per process
        asyncckpt.load(path, mmap=False)  # mmap=False asks for nothing: no warning


# --------------------------------------------------------------------------- asyncckpt.open


def test_open_lists_keys_shapes_dtypes_and_reads_one_entry_at_a_time(
    saved: tuple[Path, dict[str, Any]], bytes_read: list[int]
) -> None:
    path, state = saved
    with asyncckpt.open(path) as ckpt:
        assert list(ckpt) == ["model", "optim", "step"] and len(ckpt) == 3 and "model" in ckpt
        shapes = ckpt.tensors()
        assert shapes["state['model']['0.weight']"] == (torch.Size([64, 64]), torch.float32)
        assert sum(bytes_read) == 0  # the manifest only
        model = ckpt["model"]
        assert sum(bytes_read) == _model_bytes(state)
        assert torch.equal(model["2.bias"], state["model"]["2.bias"])
        assert ckpt["step"] == 7 and ckpt.get_tensor("step") == 7
        with pytest.raises(MissingKeyError, match=r"top-level keys are \['model', 'optim'"):
            ckpt["ema"]
    with pytest.raises(AsyncCkptError, match="after close"):
        ckpt["model"]


def test_open_holds_one_handle_pinned_on_the_version_opened(
    saved: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncckpt._storage.local import LocalStorage

    path, state = saved
    opens: list[str] = []
    real = LocalStorage.open_read

    def counting(self: LocalStorage, where: str) -> Any:
        opens.append(where)
        return real(self, where)

    monkeypatch.setattr(LocalStorage, "open_read", counting)
    with asyncckpt.open(path) as ckpt:
        asyncckpt.save({"model": {"x": torch.zeros(1)}}, path).result()  # replaced meanwhile
        assert torch.equal(ckpt["model"]["0.weight"], state["model"]["0.weight"])
        assert ckpt["step"] == 7
    assert len(opens) == 1


def test_open_detects_a_damaged_entry(tmp_path: Path) -> None:
    from asyncckpt.errors import ChecksumError

    path = tmp_path / "d.ackpt"
    asyncckpt.save({"a": torch.ones(1000), "b": torch.zeros(10)}, path, compression="none").result()
    data = bytearray(path.read_bytes())
    data[200] ^= 0xFF  # inside "a"'s chunk (the first after the header)
    path.write_bytes(bytes(data))
    with asyncckpt.open(path) as ckpt:
        assert torch.equal(ckpt["b"], torch.zeros(10))
        with pytest.raises(ChecksumError):
            ckpt["a"]


def test_open_of_a_file_that_is_no_dict_says_so(tmp_path: Path) -> None:
    path = tmp_path / "l.ackpt"
    asyncckpt.save([1, 2], path).result()
    with pytest.raises(AsyncCkptError, match="holds something else"):
        asyncckpt.open(path)


def test_checkpointer_open_plain_versions(tmp_path: Path) -> None:
    with asyncckpt.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, {"model": {"w": torch.ones(2)}, "step": 1})
        ckpt.save(2, {"model": {"w": torch.full((2,), 2.0)}, "step": 2})
        with ckpt.open() as newest:
            assert newest["step"] == 2 and torch.equal(newest["model"]["w"], torch.full((2,), 2.0))
        with ckpt.open(1) as first:
            assert first["step"] == 1
    empty = asyncckpt.Checkpointer(tmp_path / "empty", read_only=True)
    with pytest.raises(asyncckpt.errors.CheckpointNotFoundError):
        empty.open()
