"""Aliased storages, load(into=) atomicity, untrusted devices and sizes, overlap guards."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import asyncckpt
from asyncckpt._device import Placement
from asyncckpt._engine import chunks, overlap
from asyncckpt._format.container import FOOTER_SIZE, decode_footer, encode_footer
from asyncckpt._settings import Settings
from asyncckpt.errors import ChecksumError, FormatError

# -- 1. storages that alias one buffer are de-duplicated by byte range ------------------------


def _same_start(buf: bytearray) -> dict[str, torch.Tensor]:
    whole = torch.frombuffer(buf, dtype=torch.float32)
    short = torch.frombuffer(buf, dtype=torch.float32, count=10)
    return {"short": short, "a": whole[:10], "b": whole}


def _overlapping(buf: bytearray) -> dict[str, torch.Tensor]:
    return {
        "head": torch.frombuffer(buf, dtype=torch.float32, count=60),
        "tail": torch.frombuffer(buf, dtype=torch.float32, count=60, offset=160),
        "mid": torch.frombuffer(buf, dtype=torch.int16, count=30, offset=100),
    }


def _misaligned(buf: bytearray) -> dict[str, torch.Tensor]:
    # Offsets of 2 bytes between float32 storages cannot be one element offset apart.
    return {
        "x": torch.frombuffer(buf, dtype=torch.float32, count=50),
        "y": torch.frombuffer(buf, dtype=torch.float32, count=50, offset=2),
        "z": torch.frombuffer(buf, dtype=torch.uint8, count=7, offset=3),
    }


def _mixed_dtypes(buf: bytearray) -> dict[str, torch.Tensor]:
    return {
        "i16": torch.frombuffer(buf, dtype=torch.int16, count=20),
        "f64": torch.frombuffer(buf, dtype=torch.float64),
        "u8": torch.frombuffer(buf, dtype=torch.uint8, count=3, offset=397),
    }


def _from_numpy(buf: bytearray) -> dict[str, torch.Tensor]:
    array = np.frombuffer(buf, dtype=np.float32).copy()
    return {
        "first": torch.from_numpy(array[:10]),
        "all": torch.from_numpy(array),
        "middle": torch.from_numpy(array[5:50]),
        "strided": torch.from_numpy(array[1::3]),
        "2d": torch.from_numpy(array.reshape(10, 10)[2:, 1:4]),
    }


@pytest.mark.parametrize(
    "make", [_same_start, _overlapping, _misaligned, _mixed_dtypes, _from_numpy]
)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
def test_aliased_buffers_round_trip_bit_exact(
    tmp_path: Path, make: Callable[[bytearray], dict[str, torch.Tensor]], reverse: bool
) -> None:
    buf = bytearray(np.random.default_rng(0).integers(0, 256, 400, dtype=np.uint8).tobytes())
    state = make(buf)
    if reverse:
        state = dict(reversed(state.items()))
    expected = {k: v.clone() for k, v in state.items()}
    asyncckpt.save(state, tmp_path / "alias.ackpt").result()
    loaded = asyncckpt.load(tmp_path / "alias.ackpt")
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape
        got, want = loaded[key].contiguous(), value.contiguous()
        assert got.view(torch.uint8).tolist() == want.view(torch.uint8).tolist(), key


def test_same_range_is_stored_once(tmp_path: Path) -> None:
    buf = bytearray(4000)
    state = {
        "a": torch.frombuffer(buf, dtype=torch.float32, count=10),
        "b": torch.frombuffer(buf, dtype=torch.float32),
    }
    asyncckpt.save(state, tmp_path / "once.ackpt").result()
    manifest = _manifest(tmp_path / "once.ackpt")
    assert [s[0] for s in manifest["storages"]] == [4000]
    loaded = asyncckpt.load(tmp_path / "once.ackpt")
    assert loaded["a"].untyped_storage().data_ptr() == loaded["b"].untyped_storage().data_ptr()


# -- 2. load(into=) leaves `into` untouched when it raises ------------------------------------


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_checksum_error_leaves_into_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str
) -> None:
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", "256")
    g = torch.Generator().manual_seed(1)
    source = {f"w{i}": torch.randn(200, generator=g) for i in range(4)}
    source["view"] = source["w0"][10:20]
    path = tmp_path / "m.ackpt"
    asyncckpt.save(source, path, compression=compression).result()
    manifest = _manifest(path)
    assert len(manifest["chunks"]) > 4
    _flip(path, manifest["chunks"][-1][0])
    into = {k: torch.full_like(v, -1.0) for k, v in source.items()}
    before = {k: v.clone() for k, v in into.items()}
    with pytest.raises(ChecksumError):
        asyncckpt.load(path, into=into)
    for key, value in into.items():
        assert torch.equal(value, before[key]), key


def test_shape_mismatch_leaves_earlier_targets_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "s.ackpt"
    asyncckpt.save({"a": torch.ones(4), "b": torch.ones(3)[1:]}, path).result()
    into = {"a": torch.zeros(4), "b": torch.zeros(5)}
    with pytest.raises(ValueError, match=r"state\['b'\]"):
        asyncckpt.load(path, into=into)
    assert torch.equal(into["a"], torch.zeros(4))


# -- 3. device strings and sizes from a file are untrusted ------------------------------------


def _manifest(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    footer = decode_footer(data[-FOOTER_SIZE:], len(data), str(path))
    start = footer.manifest_offset
    doc: dict[str, Any] = json.loads(data[start : start + footer.manifest_length])
    return doc


def _rewrite(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = path.read_bytes()
    footer = decode_footer(data[-FOOTER_SIZE:], len(data), str(path))
    doc = _manifest(path)
    edit(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(
        data[: footer.manifest_offset] + body + encode_footer(footer.manifest_offset, body)
    )


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _with_device(path: Path, device: str) -> None:
    asyncckpt.save({"layer": {"w": torch.arange(4.0)}}, path).result()

    def edit(doc: dict[str, Any]) -> None:
        doc["storages"][0][2] = device

    _rewrite(path, edit)


@pytest.mark.parametrize("device", ["_dynamo:0", "ops", "nn:1", "onnx", "hub", "distributed"])
def test_unknown_device_types_are_refused(tmp_path: Path, device: str) -> None:
    path = tmp_path / "d.ackpt"
    _with_device(path, device)
    with pytest.raises(FormatError, match=r"d\.ackpt.*state\['layer'\]\['w'\]"):
        asyncckpt.load(path)


def test_known_device_types_load_on_cpu(tmp_path: Path) -> None:
    for device in ("cpu", "cuda:1", "mps", "xpu:0", "hpu:2", "privateuseone:0"):
        path = tmp_path / f"{device.replace(':', '_')}.ackpt"
        _with_device(path, device)
        with pytest.warns(UserWarning) if device != "cpu" else _no_warning():
            loaded = asyncckpt.load(path)
        assert torch.equal(loaded["layer"]["w"], torch.arange(4.0))


class _no_warning:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_device_check_imports_no_torch_subpackage(tmp_path: Path) -> None:
    path = tmp_path / "d.ackpt"
    _with_device(path, "_dynamo:0")
    code = (
        "import sys, asyncckpt\n"
        "try:\n"
        f"    asyncckpt.load({str(path)!r})\n"
        "except asyncckpt.errors.FormatError:\n"
        "    pass\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_device_nodes_in_the_tree_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "n.ackpt"
    asyncckpt.save({"where": torch.device("cpu")}, path).result()

    def edit(doc: dict[str, Any]) -> None:
        doc["root"] = {"dict": [["where", {"device": "_dynamo"}]]}

    _rewrite(path, edit)
    with pytest.raises(FormatError, match=r"n\.ackpt.*state\['where'\]"):
        asyncckpt.load(path)


def _recording_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[int, bool]]:
    calls: list[tuple[int, bool]] = []

    def fake(nbytes: int, pin: bool) -> torch.Tensor:
        calls.append((nbytes, pin))
        if nbytes > 1 << 30:
            raise RuntimeError("refusing to allocate in a test")
        return torch.empty(nbytes, dtype=torch.uint8)  # never pinned: no CUDA here

    monkeypatch.setattr(chunks, "_allocate", fake)
    return calls


def test_crafted_terabyte_manifest_fails_before_allocating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "huge.ackpt"
    asyncckpt.save({"w": torch.zeros(64, dtype=torch.uint8)}, path, compression="zstd").result()

    def edit(doc: dict[str, Any]) -> None:
        offset, stored, _, _, crc = doc["chunks"][0]
        doc["chunks"] = [[offset, stored, 1 << 30, "zstd", crc]] * 1024
        doc["storages"] = [[1 << 40, 1, "cpu", 0, 1024]]
        doc["tensors"][0][2] = [1 << 40]

    _rewrite(path, edit)
    calls = _recording_allocator(monkeypatch)
    with pytest.raises(FormatError, match=r"huge\.ackpt"):
        asyncckpt.load(path)
    assert calls == []


def test_pinned_memory_stays_within_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"w{i}": torch.full((1000,), float(i)) for i in range(8)}  # 4,000 bytes each
    path = tmp_path / "p.ackpt"
    asyncckpt.save(state, path).result()
    monkeypatch.setenv("ASYNCCKPT_PIN_BUDGET_BYTES", "10000")
    monkeypatch.setattr(Placement, "wants_pinned", lambda self, saved: True)
    calls = _recording_allocator(monkeypatch)
    loaded = asyncckpt.load(path)
    assert sum(n for n, pin in calls if pin) <= 10_000
    assert any(pin for _, pin in calls)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_load_past_the_pin_budget_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"w{i}": torch.randn(1000, device="cuda") for i in range(8)}
    asyncckpt.save(state, tmp_path / "c.ackpt").result()
    monkeypatch.setenv("ASYNCCKPT_PIN_BUDGET_BYTES", "10000")  # two of eight storages
    loaded = asyncckpt.load(tmp_path / "c.ackpt")
    for key, value in state.items():
        assert loaded[key].device.type == "cuda" and torch.equal(loaded[key], value)


def test_pin_budget_env_must_be_a_positive_integer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCKPT_PIN_BUDGET_BYTES", "lots")
    with pytest.raises(ValueError, match="ASYNCCKPT_PIN_BUDGET_BYTES"):
        Settings.resolve()
    monkeypatch.setenv("ASYNCCKPT_PIN_BUDGET_BYTES", "0")
    with pytest.raises(ValueError, match="positive"):
        Settings.resolve()
    monkeypatch.delenv("ASYNCCKPT_PIN_BUDGET_BYTES")
    assert Settings.resolve().pin_budget_bytes == Settings.help()["pin_budget_bytes"][0]


# -- 4. overlap guards: wait before anything mutates snapshotted state ------------------------


class _Recorder:
    """A fake ``wait`` that records, at each call, the value of a probe."""

    def __init__(self, probe: Callable[[], Any]) -> None:
        self.probe = probe
        self.seen: list[Any] = []

    def __call__(self) -> None:
        self.seen.append(self.probe())


def _tracked(bn: torch.nn.BatchNorm1d) -> int:
    assert bn.num_batches_tracked is not None
    return int(bn.num_batches_tracked)


def test_module_forward_waits_before_batchnorm_updates_its_buffers() -> None:
    bn = torch.nn.BatchNorm1d(4)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), bn).train()
    wait = _Recorder(lambda: (_tracked(bn), bn.running_mean.clone()))  # type: ignore[union-attr]
    handle = overlap.guard(model, wait)
    model(torch.randn(5, 3))
    assert len(wait.seen) >= 1
    assert wait.seen[0][0] == 0 and torch.equal(wait.seen[0][1], torch.zeros(4))
    assert _tracked(bn) == 1
    handle.remove()
    count = len(wait.seen)
    model(torch.randn(5, 3))
    assert len(wait.seen) == count


def test_submodule_called_on_its_own_waits_when_passed_too() -> None:
    bn = torch.nn.BatchNorm1d(4)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), bn).train()
    wait = _Recorder(lambda: _tracked(bn))
    with overlap.guard([model, bn], wait):
        bn(torch.randn(5, 4))
        model(torch.randn(5, 3))
    assert wait.seen[0] == 0 and wait.seen[1:] == [1, 1]


def test_guard_hook_runs_before_hooks_registered_earlier() -> None:
    model = torch.nn.Linear(2, 2)
    order: list[str] = []
    model.register_forward_pre_hook(lambda m, a: order.append("user"))
    handle = overlap.guard(model, lambda: order.append("wait"))
    model(torch.randn(1, 2))
    assert order == ["wait", "user"]
    handle.remove()


def test_optimizer_step_waits_before_parameters_change() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.ones(3)
    wait = _Recorder(lambda: p.detach().clone())
    handle = overlap.guard(opt, wait)
    opt.step()
    assert len(wait.seen) == 1 and torch.equal(wait.seen[0], torch.ones(3))
    assert torch.equal(p.detach(), torch.zeros(3))
    handle.remove()
    opt.step()
    assert len(wait.seen) == 1


def _train_step(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> None:
    params = [p for group in opt.param_groups for p in group["params"]]
    scaler.scale(sum(p.sum() for p in params)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_grad_scaler_update_and_unscale_wait_first() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()  # type: ignore[no-untyped-call]
    wait = _Recorder(lambda: (scaler.get_scale(), p.grad.clone()))  # type: ignore[union-attr]
    handle = overlap.guard(scaler, wait)
    scaler.unscale_(opt)
    assert wait.seen[0][0] == 8.0 and torch.equal(wait.seen[0][1], torch.full((2,), 8.0))
    scaler.step(opt)
    scaler.update()
    assert wait.seen[-1][0] == 8.0 and scaler.get_scale() == 16.0
    calls = len(wait.seen)
    handle.remove()
    assert "update" not in vars(scaler) and "unscale_" not in vars(scaler)
    _train_step(scaler, opt)
    assert len(wait.seen) == calls


def test_list_of_targets_and_remove_undoes_all() -> None:
    model = torch.nn.BatchNorm1d(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    calls: list[int] = []
    handle = overlap.guard([model, (opt, scaler)], lambda: calls.append(1))
    model(torch.randn(3, 2))
    assert len(calls) == 1
    _train_step(scaler, opt)  # step() unscales first: unscale_, optimizer step, update
    assert len(calls) == 4
    handle.remove()
    handle.remove()  # idempotent
    model(torch.randn(3, 2))
    _train_step(scaler, opt)
    assert len(calls) == 4


def test_removal_out_of_order_keeps_the_other_wrapper() -> None:
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    first: list[int] = []
    second: list[int] = []
    h1 = overlap.guard(scaler, lambda: first.append(1))
    h2 = overlap.guard(scaler, lambda: second.append(1))
    h1.remove()
    _train_step(scaler, opt)
    assert first == [] and len(second) == 2
    h2.remove()
    assert "update" not in vars(scaler) and "unscale_" not in vars(scaler)


def test_unsupported_targets_are_refused() -> None:
    with pytest.raises(TypeError, match="int"):
        overlap.guard([torch.nn.Linear(1, 1), 3], lambda: None)
