"""Loading straight into existing tensors (``into=``), as ``load_state_dict`` would."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt._engine import chunks


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_model_state_is_read_into_parameter_memory(any_root: str, compression: str) -> None:
    source = _model()
    path = os.path.join(any_root, "m.ackpt") if "://" not in any_root else f"{any_root}/m.ackpt"
    asyncckpt.save(source.state_dict(), path, compression=compression).result()
    target = _model()
    addresses = {k: v.data_ptr() for k, v in target.state_dict().items()}
    loaded = asyncckpt.load(path, into=target.state_dict())
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)
        assert loaded[key].data_ptr() == addresses[key]  # the same memory, not a copy
    assert type(loaded) is type(source.state_dict())


def test_into_is_written_only_from_verified_buffers(tmp_path: Any, monkeypatch: Any) -> None:
    # Reading straight into the caller's tensors would leave them half overwritten when a
    # later chunk fails its checksum, so into= reads through buffers like a plain load.
    source = _model()
    path = tmp_path / "m.ackpt"
    asyncckpt.save(source.state_dict(), path).result()
    allocated: list[int] = []
    real = chunks._allocate

    def counting(nbytes: int, pin: bool) -> torch.Tensor:
        allocated.append(nbytes)
        return real(nbytes, pin)

    monkeypatch.setattr(chunks, "_allocate", counting)
    asyncckpt.load(path, into=_model().state_dict())
    assert len(allocated) == len(source.state_dict())


def test_views_and_mismatched_layouts_are_copied(tmp_path: Any) -> None:
    base = torch.arange(12, dtype=torch.float32)
    state = {"whole": base, "view": base[2:8], "t": torch.arange(6.0).view(2, 3).t()}
    path = tmp_path / "v.ackpt"
    asyncckpt.save(state, path).result()
    target = {"whole": torch.zeros(12), "view": torch.zeros(6), "t": torch.zeros(3, 2)}
    loaded = asyncckpt.load(path, into=target)
    for key in state:
        assert torch.equal(target[key], state[key])
        assert loaded[key] is target[key]


def test_keys_missing_from_target_are_read_only_when_asked_for(tmp_path: Any) -> None:
    # Until issue 21 part 3, into= read the whole file and returned "b" too; now it reads
    # only the subtrees the target has (and tensor-free values such as "step"), and keys=
    # asks for more.
    path = tmp_path / "p.ackpt"
    asyncckpt.save({"a": torch.ones(3), "b": torch.full((2,), 7.0), "step": 4}, path).result()
    target = {"a": torch.zeros(3)}
    loaded = asyncckpt.load(path, into=target)
    assert torch.equal(target["a"], torch.ones(3))
    assert set(loaded) == {"a", "step"} and loaded["step"] == 4
    loaded = asyncckpt.load(path, into={"a": torch.zeros(3)}, keys=["a", "b", "step"])
    assert torch.equal(loaded["b"], torch.full((2,), 7.0)) and loaded["step"] == 4


@pytest.mark.parametrize(
    "wrong", [torch.zeros(4), torch.zeros(3, dtype=torch.float64)], ids=["shape", "dtype"]
)
def test_mismatched_target_raises_naming_the_key(tmp_path: Any, wrong: torch.Tensor) -> None:
    path = tmp_path / "w.ackpt"
    asyncckpt.save({"layer": {"w": torch.ones(3)}}, path).result()
    with pytest.raises(ValueError, match=r"state\['layer'\]\['w'\]"):
        asyncckpt.load(path, into={"layer": {"w": wrong}})


def test_checkpointer_load_into(tmp_path: Any) -> None:
    source = _model()
    with asyncckpt.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(5, {"model": source.state_dict(), "step": 5})
        target = _model()
        state = ckpt.load(into={"model": target.state_dict()})
    assert state["step"] == 5
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)


def test_corrupt_chunk_still_raises_with_into(tmp_path: Any) -> None:
    path = tmp_path / "c.ackpt"
    asyncckpt.save({"w": torch.randn(1000)}, path, compression="none").result()
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(asyncckpt.errors.ChecksumError):
        asyncckpt.load(path, into={"w": torch.zeros(1000)})


def test_a_tensor_saved_at_two_paths_is_loaded_into_every_one(tmp_path: Any) -> None:
    source = _model()
    sd = source.state_dict()
    asyncckpt.save({"model": sd, "ema": sd}, tmp_path / "m.ackpt").result()  # one table entry
    model, ema = _model(), _model()
    asyncckpt.load(
        tmp_path / "m.ackpt", into={"model": model.state_dict(), "ema": ema.state_dict()}
    )
    for key, value in sd.items():
        assert torch.equal(model.state_dict()[key], value)
        assert torch.equal(ema.state_dict()[key], value), key


def test_tied_weights_are_loaded_into_both_names(tmp_path: Any) -> None:
    def tied() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
        model[1].weight = model[0].weight
        return model

    source = tied()
    asyncckpt.save(source.state_dict(keep_vars=True), tmp_path / "t.ackpt").result()
    target = {k: torch.zeros_like(v) for k, v in source.state_dict().items()}  # untied copies
    asyncckpt.load(tmp_path / "t.ackpt", into=target)
    assert torch.equal(target["0.weight"], source[0].weight)
    assert torch.equal(target["1.weight"], source[0].weight)
