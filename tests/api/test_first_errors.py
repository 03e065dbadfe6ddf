"""The errors a user meets first (issue 19, section 3): each says what went wrong and what
to do, at the call that made the mistake, before anything is read or written."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt.errors import AsyncCkptError

DeviceUnavailableError = getattr(asyncckpt.errors, "DeviceUnavailableError", RuntimeError)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "x.ackpt"
    asyncckpt.save({"w": torch.arange(3.0), "n": 1}, path).result()
    return path


# --------------------------------------------------------------------------- map_location


needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")


@needs_no_cuda
@pytest.mark.parametrize(
    "where",
    ["cuda:0", "cuda", torch.device("cuda", 1), {"cpu": "cuda:0"}],
    ids=["cuda:0", "cuda", "device", "dict"],
)
def test_map_location_to_cuda_without_cuda_says_so_and_how_to_load_to_cpu(
    saved: Path, where: Any
) -> None:
    with pytest.raises(DeviceUnavailableError) as caught:
        asyncckpt.load(saved, map_location=where)
    text = str(caught.value)
    assert "CUDA is not available" in text and "map_location='cpu'" in text
    assert "cannot allocate" not in text
    assert isinstance(caught.value, RuntimeError)  # what torch.load raises here
    assert isinstance(caught.value, AsyncCkptError)


@needs_no_cuda
def test_an_unavailable_device_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    # No file there: the device is checked first, so the error is about the device.
    with pytest.raises(DeviceUnavailableError, match="CUDA is not available"):
        asyncckpt.load(tmp_path / "missing.ackpt", map_location="cuda:0")
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, {"w": torch.ones(2)}).result()
        with pytest.raises(DeviceUnavailableError, match="CUDA is not available"):
            ckpt.load(map_location="cuda:0")


@pytest.mark.parametrize("kind", ["mps", "xpu"])
def test_other_unavailable_accelerators_are_named(saved: Path, kind: str) -> None:
    module = getattr(torch, kind, None)
    if module is None or module.is_available():
        pytest.skip(f"{kind} is available here (or unknown to this torch)")
    with pytest.raises(DeviceUnavailableError, match=rf"{kind} is not available.*'cpu'"):
        asyncckpt.load(saved, map_location=kind)


def test_a_map_location_that_is_no_device_is_a_value_error(saved: Path) -> None:
    with pytest.raises(ValueError, match=r"map_location='gpu:0'"):
        asyncckpt.load(saved, map_location="gpu:0")


@needs_no_cuda
def test_a_dict_entry_no_tensor_uses_is_ignored_as_by_torch(saved: Path, tmp_path: Path) -> None:
    """A job's map_location written for GPU ranks, {"cuda:1": "cuda:0"}, loads a file of CPU
    tensors on a machine without CUDA: torch.load ignores the unused entry, and so do we."""
    where = {"cuda:1": "cuda:0", "cuda:2": "cuda:0"}
    torch.save({"w": torch.arange(3.0)}, tmp_path / "t.pt")
    assert torch.load(tmp_path / "t.pt", map_location=where)["w"].sum() == 3  # the reference
    assert asyncckpt.load(saved, map_location=where)["w"].sum() == 3
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, {"w": torch.ones(2)}).result()
        assert ckpt.load(map_location=where)["w"].sum() == 2


def test_available_devices_still_load(saved: Path) -> None:
    for where in ("cpu", torch.device("cpu"), {"cuda:0": "cpu"}, None):
        assert asyncckpt.load(saved, map_location=where)["w"].sum() == 3


# --------------------------------------------------------------------------- save(model)


def test_saving_a_model_or_optimizer_says_to_save_its_state_dict(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    for obj, advice in ((model, "model.state_dict()"), (optimizer, "optimizer.state_dict()")):
        with pytest.raises(asyncckpt.errors.UnsupportedObjectError, match=rf"{advice}"):
            asyncckpt.save(obj, tmp_path / "m.ackpt")
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- step=


@pytest.mark.parametrize(
    ("step", "error"),
    [("latest", TypeError), (2.0, TypeError), (True, TypeError), (-1, ValueError)],
    ids=["latest", "float", "bool", "negative"],
)
def test_checkpointer_load_step_is_none_or_a_non_negative_int(
    tmp_path: Path, step: Any, error: type[Exception]
) -> None:
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, {"w": torch.ones(2)}).result()
        with pytest.raises(error, match=r"step must be None \(the newest\) or a non-negative int"):
            ckpt.load(step=step)
        assert ckpt.load(step=1)["w"].sum() == 2 and ckpt.load(None)["w"].sum() == 2


# --------------------------------------------------------------------------- keywords


# ``keys`` was refused here until partial loads (issue 21 part 3) made it a parameter.
@pytest.mark.parametrize("keyword", ["key", "map_locaton", "strict"])
def test_an_unknown_load_keyword_is_a_type_error(saved: Path, keyword: str) -> None:
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{keyword}'"):
        asyncckpt.load(saved, **{keyword: ["w"]})


def test_torch_load_extras_are_accepted_and_ignored(saved: Path) -> None:
    extras = {
        "weights_only": True,
        "mmap": True,
        "encoding": "latin1",
        "errors": "strict",
        "fix_imports": True,
        "buffers": None,
    }
    assert asyncckpt.load(saved, None, pickle, **extras)["n"] == 1


@pytest.mark.parametrize("keyword", ["keys", "compresion", "overwrite"])
def test_an_unknown_save_keyword_is_a_type_error(tmp_path: Path, keyword: str) -> None:
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{keyword}'"):
        asyncckpt.save({"w": torch.ones(2)}, tmp_path / "s.ackpt", **{keyword: 1})
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- into=


def test_into_that_shares_no_key_with_the_file_names_both_sides(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "both.ackpt"
    asyncckpt.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, path).result()
    target = _model()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError) as caught:
        asyncckpt.load(path, into=target.state_dict())
    text = str(caught.value)
    assert str(path) in text
    assert "'model'" in text and "'optim'" in text  # the file's top-level keys
    assert "'0.weight'" in text and "'2.bias'" in text  # into's
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key])  # nothing was loaded into it
    loaded = asyncckpt.load(path, into={"model": target.state_dict()})  # the fix it suggests
    assert torch.equal(target.state_dict()["0.weight"], model.state_dict()["0.weight"])
    assert loaded["optim"]["param_groups"][0]["lr"] == 0.1


def test_into_without_any_tensor_is_refused_too(saved: Path) -> None:
    with pytest.raises(ValueError, match="shares no tensor"):
        asyncckpt.load(saved, into={"step": 0})


def test_checkpointer_load_into_that_shares_no_key_is_refused(tmp_path: Path) -> None:
    model = _model()
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(3, {"model": model.state_dict(), "step": 3}).result()
        with pytest.raises(ValueError, match=r"top-level keys are \['model', 'step'\]"):
            ckpt.load(into=_model().state_dict())
        assert ckpt.load(into={"model": _model().state_dict()})["step"] == 3
