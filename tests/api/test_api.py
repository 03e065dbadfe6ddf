"""Round trips through ``asyncckpt.save(...).result()`` and ``asyncckpt.load``.

Covers the object model (every supported Python, numpy and torch type, exactly, types
included), tensors of every fixed-size dtype and layout, shared storage and identity, real
training states, snapshot semantics, ``map_location``, unsupported objects and the
``SaveHandle`` API. Runs on every backend of the ``any_root`` fixture.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import os
import pickle
import random
import struct
import threading
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as npst
from torch import nn

import asyncckpt
import asyncckpt._api.dropin
from asyncckpt._engine import arena as arena_mod
from asyncckpt._engine import encode as writer
from asyncckpt._engine import snapshot as staging
from asyncckpt._format import tree
from asyncckpt._format.container import DTYPE_ITEMSIZE
from asyncckpt._settings import Settings
from asyncckpt._storage import TEMP_MARK, resolve
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    UnsupportedObjectError,
)

# Every dtype the format knows that this torch build has (complex32 is "experimental").
DTYPES: list[torch.dtype] = [
    d for d in (getattr(torch, n, None) for n in DTYPE_ITEMSIZE) if isinstance(d, torch.dtype)
]
pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
]

_names = itertools.count()


# --------------------------------------------------------------------------- helpers


def target(root: str, name: str | None = None) -> str:
    """A file under ``root`` (a local directory or a URL); a fresh name by default."""
    name = name or f"ckpt-{next(_names)}.ackpt"
    return f"{root}/{name}" if "://" in root else os.path.join(root, name)


def listing(root: str) -> list[str]:
    """Names of the files directly under ``root``."""
    if "://" in root:
        fs, path = fsspec.core.url_to_fs(root)
        if not fs.exists(path):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    return sorted(os.listdir(root))


def read_raw(path: str) -> bytes:
    with fsspec.open(path, "rb") as f:
        return bytes(f.read())


def exists(path: str) -> bool:
    fs, inner = fsspec.core.url_to_fs(path)
    return bool(fs.exists(inner))


def roundtrip(obj: Any, root: str, compression: str = "zstd", **load_kwargs: Any) -> Any:
    path = target(root)
    asyncckpt.save(obj, path, compression=compression).result()
    return asyncckpt.load(path, **load_kwargs)


def element_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of every element of ``t`` in logical order, as a uint8 tensor.

    Works for every dtype (float8, float4, complex32, bool) because it only indexes bytes,
    and compares NaNs by their bit patterns.
    """
    k = t.element_size()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return torch.as_strided(
        raw, (*t.shape, k), (*(s * k for s in t.stride()), 1), t.storage_offset() * k
    )


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    assert type(b) is type(a), where
    assert b.dtype is a.dtype, where
    assert b.shape == a.shape, where
    assert b.stride() == a.stride(), where
    assert b.storage_offset() == a.storage_offset(), where
    assert b.requires_grad == a.requires_grad, where
    assert b.device == a.device, where
    assert b.is_leaf, where
    assert torch.equal(element_bytes(a), element_bytes(b)), where


def float_same(a: float, b: float) -> bool:
    if math.isnan(a):
        return math.isnan(b)
    return struct.pack("<d", a) == struct.pack("<d", b)  # tells -0.0 from 0.0


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Deep equality, types included, tensors bit for bit."""
    assert type(b) is type(a), f"{where}: {type(b)} is not {type(a)}"
    if isinstance(a, torch.Tensor):
        assert_same_tensor(a, b, where)
    elif isinstance(a, np.ndarray):
        assert b.dtype == a.dtype and b.shape == a.shape, where
        assert b.tobytes() == a.tobytes(), where
    elif isinstance(a, np.generic):
        assert b.dtype == a.dtype and b.tobytes() == a.tobytes(), where
    elif type(a) is float:
        assert float_same(a, b), f"{where}: {b!r} != {a!r}"
    elif isinstance(a, (list, tuple)) and type(a) is not torch.Size:
        assert len(b) == len(a), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert [(type(k), k) for k in b] == [(type(k), k) for k in a], where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
        assert hasattr(b, "_metadata") == hasattr(a, "_metadata"), where
        if hasattr(a, "_metadata"):
            assert_same(a._metadata, b._metadata, f"{where}._metadata")
    elif isinstance(a, torch.dtype):
        assert b is a, where
    else:  # None, bool, int, str, bytes, torch.Size, torch.device
        assert b == a, f"{where}: {b!r} != {a!r}"


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold every background write until the event is set (set at teardown at the latest)."""
    event = threading.Event()
    real = asyncckpt._engine.writer_process.write

    def gated(*args: Any, **kwargs: Any) -> int:
        assert event.wait(60), "test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(asyncckpt._engine.writer_process, "write", gated)
    yield event
    event.set()
    asyncckpt.wait()


# --------------------------------------------------------------------------- strategies


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of any dtype: 0-d, empty or not, contiguous or a view (transposed,
    sliced, stepped, broadcast)."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    n = math.prod(shape)
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["random", "low-entropy", "zeros"]))
    rng = np.random.default_rng(seed)
    nbytes = n * dtype.itemsize
    if kind == "random":
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    elif kind == "low-entropy":
        data = rng.integers(0, 3, nbytes, dtype=np.uint8)
    else:
        data = np.zeros(nbytes, dtype=np.uint8)
    if dtype is torch.bool:
        data &= 1
    raw = torch.from_numpy(data) if nbytes else torch.empty(0, dtype=torch.uint8)
    t = raw.view(dtype).reshape(shape)
    view = draw(st.sampled_from(["plain", "transpose", "slice", "step", "expand", "index"]))
    if view == "transpose" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif view == "slice" and t.dim() >= 1:
        t = t[1:]
    elif view == "step" and t.dim() >= 1:
        t = t[::2]
    elif view == "expand":
        t = t.unsqueeze(0).expand(2, *t.shape)
    elif view == "index" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1]  # a lower-dimensional view with a storage offset
    if dtype.is_floating_point and draw(st.booleans()) and dtype.itemsize >= 2:
        t = t.detach().requires_grad_(True)
    return t


NP_DTYPES = [
    np.dtype(s)
    for s in (
        "<f8",
        "<f4",
        "<f2",
        ">f8",
        "<c8",
        "<c16",
        "<i8",
        "<i4",
        "<i2",
        "|i1",
        ">i4",
        "<u8",
        "<u4",
        "<u2",
        "|u1",
        "|b1",
    )
]


def np_arrays() -> st.SearchStrategy[np.ndarray[Any, Any]]:
    arrays = st.sampled_from(NP_DTYPES).flatmap(
        lambda dt: npst.arrays(dt, npst.array_shapes(min_dims=0, max_dims=3, min_side=0))
    )
    # Non-contiguous arrays are stored contiguous; their values must survive.
    return st.one_of(
        arrays, arrays.map(lambda a: a.T), arrays.map(lambda a: a[::2] if a.ndim else a)
    )


def np_scalars() -> st.SearchStrategy[Any]:
    return st.sampled_from(NP_DTYPES).flatmap(lambda dt: npst.arrays(dt, ())).map(lambda a: a[()])


# Ints are JSON numbers; the library stores up to about 4,200 digits (JSON readers refuse
# more than 4,300) and refuses longer ones inside ``save``.
huge_ints = st.integers(1, 4200).flatmap(
    lambda digits: st.integers(10 ** (digits - 1), 10**digits - 1)
) | st.sampled_from([2**63, -(2**63) - 1, 2**64, -(10**4200 - 1)])

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**128), 2**128),
    huge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, 0.0, math.inf, -math.inf, math.nan, 5e-324]),
    st.text(),
    st.binary(max_size=32),
    st.lists(st.integers(0, 2**40), max_size=4).map(torch.Size),
    st.sampled_from(DTYPES),
    st.sampled_from(
        [torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda", 3), torch.device("meta")]
    ),
    np_arrays(),
    np_scalars(),
    tensors(),
)
keys = st.one_of(st.text(max_size=6), st.integers(-(2**70), 2**70))


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(OrderedDict),
    )


states = st.recursive(leaves, containers, max_leaves=10)


# --------------------------------------------------------------------------- round trips


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(state=states, compression=st.sampled_from(["zstd", "none"]))
def test_hypothesis_roundtrip(any_root: str, state: Any, compression: str) -> None:
    assert_same(state, roundtrip(state, any_root, compression))


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    items=st.lists(tensors(), min_size=1, max_size=6), compression=st.sampled_from(["zstd", "none"])
)
def test_hypothesis_tensors(any_root: str, items: list[torch.Tensor], compression: str) -> None:
    state = {f"t{i}": t for i, t in enumerate(items)}
    assert_same(state, roundtrip(state, any_root, compression))


@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_in_many_chunks(
    any_root: str, dtype: torch.dtype, compression: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compressible and incompressible data of each dtype, split over many small chunks."""
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", "48")
    rng = np.random.default_rng(7)
    smooth = np.repeat(np.arange(40, dtype=np.uint8), 5 * dtype.itemsize)
    noise = rng.integers(0, 256, 100 * dtype.itemsize, dtype=np.uint8)
    if dtype is torch.bool:
        smooth, noise = smooth & 1, noise & 1
    a = torch.from_numpy(smooth.copy()).view(dtype).reshape(20, 10)
    b = torch.from_numpy(noise).view(dtype).reshape(10, 10)
    state = {
        "smooth": a,
        "noise": b,
        "t": a.t(),
        "rows": a[3:17:3],
        "col": a[:, 4],
        "scalar": b[2, 3],
        "empty": a[5:5],
        "zero_d": torch.from_numpy(noise[: dtype.itemsize].copy()).view(dtype).reshape(()),
    }
    assert_same(state, roundtrip(state, any_root, compression))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_loads_under_deterministic_algorithms(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """torch.use_deterministic_algorithms(True) (Lightning's ``deterministic=True``) fills
    new tensors, which some dtypes (float4) cannot do: a load must not make any."""
    raw = (torch.arange(8 * dtype.itemsize) % (2 if dtype is torch.bool else 256)).to(torch.uint8)
    state = {"w": raw.view(dtype), "zero_d": raw[: dtype.itemsize].view(dtype).reshape(())}
    path = str(tmp_path / "d.ackpt")
    asyncckpt.save(state, path).result()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert_same(state, asyncckpt.load(path))
    finally:
        torch.use_deterministic_algorithms(was)


def test_scalars_exactly(any_root: str) -> None:
    state = {
        "none": None,
        "bools": [True, False],
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64, 10**4200 - 1, -(10**4199)],
        "floats": (0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308),
        "text": ["", "ascii", "üñíçødé ✓ 漢字 🐍", "nul\x00char", "\ud7ff"],
        "bytes": [b"", b"\x00\xff" * 10],
        "size": torch.Size([2, 0, 3]),
        "empty_size": torch.Size([]),
        "dtypes": [torch.float32, torch.bfloat16, torch.bool, torch.complex64],
        "devices": [torch.device("cpu"), torch.device("cuda:1"), torch.device("meta")],
        1: "int key",
        -5: {"nested": OrderedDict([("b", 1), ("a", 2)])},
        "np": [np.float32(1.5), np.int8(-3), np.uint64(2**64 - 1), np.bool_(True)],
        "np_c": np.complex128(1 - 2j),
        "np_arr": np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2],
        "np_0d": np.array(3.25),
        "np_long": np.arange(3, dtype=np.longdouble),
        "empty": {"list": [], "tuple": (), "dict": {}, "odict": OrderedDict()},
    }
    assert_same(state, roundtrip(state, any_root))


@pytest.mark.parametrize(
    "value, key_path",
    [
        ([10**4300, -(2**20000)], "state['big'][0]"),
        ({10**5000: 1}, "state['big']"),  # the key itself has no printable repr
        (["ok", "lone \ud800 surrogate"], "state['big'][1]"),
    ],
    ids=["huge-int", "huge-int-key", "lone-surrogate"],
)
def test_values_json_cannot_hold_fail_inside_save_or_roundtrip(
    any_root: str, value: Any, key_path: str
) -> None:
    """What save accepts must be written; what it cannot write must fail inside save."""
    path = target(any_root)
    state = {"ok": 1, "big": value}
    try:
        handle = asyncckpt.save(state, path)
    except UnsupportedObjectError as exc:
        assert exc.key_path.startswith(key_path)
        asyncckpt.wait()
        assert not exists(path)
        return
    handle.result()
    assert_same(state, asyncckpt.load(path))


# --------------------------------------------------------------------------- identity and sharing


def test_parameters_keep_type_and_requires_grad(any_root: str) -> None:
    state = {
        "p": nn.Parameter(torch.randn(3, 2)),
        "frozen": nn.Parameter(torch.randn(4), requires_grad=False),
        "int_param": nn.Parameter(torch.arange(3), requires_grad=False),
        "leaf": torch.randn(2, requires_grad=True),
        "plain": torch.randn(2),
    }
    loaded = roundtrip(state, any_root)
    assert_same(state, loaded)
    assert type(loaded["p"]) is nn.Parameter and loaded["p"].requires_grad
    assert type(loaded["frozen"]) is nn.Parameter and not loaded["frozen"].requires_grad
    assert type(loaded["leaf"]) is torch.Tensor and loaded["leaf"].requires_grad
    assert not loaded["plain"].requires_grad


def test_views_share_storage_and_same_object_stays_same(any_root: str) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    other = torch.zeros(3)
    state = {
        "base": base,
        "row": base[1],
        "colT": base.t()[2:],
        "flat": base.view(-1)[5:9],
        "as_int": base.view(torch.int32),  # another dtype over the same bytes
        "again": base,
        "list": [base, other, other],
        "other": other,
    }
    loaded = roundtrip(state, any_root)
    assert_same(state, loaded)
    ptr = loaded["base"].untyped_storage().data_ptr()
    for key in ("row", "colT", "flat", "as_int"):
        assert loaded[key].untyped_storage().data_ptr() == ptr, key
    assert loaded["other"].untyped_storage().data_ptr() != ptr
    assert loaded["again"] is loaded["base"]
    assert loaded["list"][0] is loaded["base"]
    assert loaded["list"][1] is loaded["list"][2] is loaded["other"]
    loaded["base"][1, 0] = 100.0  # writes through every view, as after torch.load
    assert loaded["row"][0].item() == 100.0
    assert loaded["flat"][1].item() == 100.0


def test_tied_weights_share_storage(any_root: str) -> None:
    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    model = TiedLM()
    sd = model.state_dict()
    kept = model.state_dict(keep_vars=True)
    loaded = roundtrip({"sd": sd, "kept": kept}, any_root)
    assert_same(sd, loaded["sd"])
    a, b = loaded["sd"]["emb.weight"], loaded["sd"]["head.weight"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    # keep_vars=True hands out the Parameter itself, twice: one object comes back.
    assert loaded["kept"]["emb.weight"] is loaded["kept"]["head.weight"]
    assert type(loaded["kept"]["emb.weight"]) is nn.Parameter
    fresh = TiedLM()
    fresh.load_state_dict(loaded["sd"])
    assert torch.equal(fresh.emb.weight, model.emb.weight)
    assert fresh.head.weight is fresh.emb.weight


# --------------------------------------------------------------------------- a real state


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def test_real_training_state(any_root: str) -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        _train_step(model, opt, torch.randn(5, 4))
        sched.step()
    np.random.seed(3)
    random.seed(4)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
        "step": 3,
    }
    expected_draws = (torch.rand(4), np.random.rand(4), random.random())
    loaded = roundtrip(state, any_root)
    assert_same(state, loaded)
    assert hasattr(loaded["model"], "_metadata")

    torch.manual_seed(1)  # a differently initialized copy
    model2 = _model()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=5, gamma=0.1)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optim"])
    sched2.load_state_dict(loaded["sched"])
    assert sched2.get_last_lr() == sched.get_last_lr()

    x = torch.randn(5, 4)
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        _train_step(m, o, x)
        s.step()
    for (name, p), p2 in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(p, p2), name
    assert sched2.get_last_lr() == sched.get_last_lr()

    torch.set_rng_state(loaded["rng"]["torch"])
    np.random.set_state(loaded["rng"]["numpy"])
    random.setstate(loaded["rng"]["python"])
    assert torch.equal(torch.rand(4), expected_draws[0])
    assert np.array_equal(np.random.rand(4), expected_draws[1])
    assert random.random() == expected_draws[2]


# --------------------------------------------------------------------------- snapshot semantics


def test_snapshot_mutate_after_save(any_root: str, gate: threading.Event) -> None:
    base = torch.arange(1000, dtype=torch.float32)
    state = {
        "w": base.clone(),
        "p": nn.Parameter(torch.ones(50, 20)),
        "view": None,
        "arr": np.arange(64, dtype=np.int64),
        "np_scalar": np.float64(2.5),
        "list": [1, 2],
        "nested": {"b": torch.full((3, 3), 7, dtype=torch.int16)},
    }
    state["view"] = state["w"][10:20]
    expected = {
        "w": base.clone(),
        "p": nn.Parameter(torch.ones(50, 20)),
        "arr": np.arange(64, dtype=np.int64),
        "list": [1, 2],
        "b": torch.full((3, 3), 7, dtype=torch.int16),
    }
    path = target(any_root)
    handle = asyncckpt.save(state, path)
    assert not handle.done()  # the writer is held: everything below happens before it runs
    state["w"].mul_(-1)
    with torch.no_grad():
        state["p"].zero_()
    state["arr"][:] = -7
    state["list"].append(3)
    state["nested"]["b"].fill_(0)
    state["nested"]["c"] = 1
    gate.set()
    handle.result()
    loaded = asyncckpt.load(path)
    assert torch.equal(loaded["w"], expected["w"])
    assert torch.equal(loaded["view"], expected["w"][10:20])
    assert loaded["view"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()
    assert torch.equal(loaded["p"], expected["p"])
    assert np.array_equal(loaded["arr"], expected["arr"])
    assert loaded["list"] == [1, 2]
    assert torch.equal(loaded["nested"]["b"], expected["b"])
    assert list(loaded["nested"]) == ["b"]


def test_snapshot_free_after_save(any_root: str, gate: threading.Event) -> None:
    torch.manual_seed(5)
    state = {f"t{i}": torch.randn(256, 256) for i in range(4)}
    state["arr"] = np.random.default_rng(0).standard_normal(1000)
    expected = {
        k: (v.clone() if isinstance(v, torch.Tensor) else v.copy()) for k, v in state.items()
    }
    path = target(any_root)
    handle = asyncckpt.save(state, path)
    assert not handle.done()
    for v in state.values():  # scribble over the memory before freeing it
        if isinstance(v, torch.Tensor):
            v.fill_(float("nan"))
        else:
            v[:] = np.nan
    del state, v
    gc.collect()
    junk = [torch.full((256, 256), -1.0) for _ in range(8)]  # likely reuses the freed memory
    gate.set()
    handle.result()
    del junk
    loaded = asyncckpt.load(path)
    assert_same(expected, loaded)


# --------------------------------------------------------------------------- map_location


def _write_as_if_from(obj: Any, path: str, devices: list[str]) -> None:
    """Write ``obj`` with its storages recorded as coming from ``devices`` (one per storage).

    Goes through the real staging and writer; only the recorded device differs, as if the
    tensors had been on those devices when saved.
    """
    snap = staging.snapshot(tree.flatten(obj), arena_mod.ArenaPool(1), settings=Settings())
    try:
        assert len(snap.storages) == len(devices)
        snap.storages = [dataclasses.replace(s, device=d) for s, d in zip(snap.storages, devices)]
        storage, inner = resolve(path, None)
        writer.write_snapshot(
            snap, storage, inner, asyncckpt._api.dropin.write_options("zstd", Settings())
        )
    finally:
        snap.lease.release()


@pytest.mark.parametrize(
    "map_location",
    ["cpu", torch.device("cpu"), {"cpu": "cpu"}, {"cuda:0": "cpu"}, None],
    ids=["str", "device", "dict", "dict-unrelated", "none"],
)
def test_map_location_cpu_forms(any_root: str, map_location: Any) -> None:
    state = {"a": torch.arange(6).reshape(2, 3), "b": nn.Parameter(torch.ones(2))}
    path = target(any_root)
    asyncckpt.save(state, path).result()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = asyncckpt.load(path, map_location=map_location)
    assert_same(state, loaded)


def test_map_location_callable(any_root: str) -> None:
    state = {"a": torch.arange(6.0), "b": torch.ones(3, dtype=torch.int8)}
    path = target(any_root)
    asyncckpt.save(state, path).result()
    seen: list[tuple[type, str]] = []

    def keep(storage: Any, location: str) -> Any:
        seen.append((type(storage), location))
        return storage

    assert_same(state, asyncckpt.load(path, map_location=keep))
    assert seen == [(torch.UntypedStorage, "cpu")] * 2

    def default(storage: Any, location: str) -> None:
        return None  # as with torch.load: None keeps the default placement

    assert_same(state, asyncckpt.load(path, default))


@pytest.mark.parametrize("bad", [3, 1.5, ["cpu"], ("cpu",), b"cpu"])
def test_map_location_invalid_type(any_root: str, bad: Any) -> None:
    path = target(any_root)
    asyncckpt.save({"a": torch.ones(1)}, path).result()
    with pytest.raises(TypeError, match="map_location"):
        asyncckpt.load(path, map_location=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cuda_saved_lands_on_cpu_with_one_warning(any_root: str) -> None:
    state = {
        "a": torch.arange(5.0),
        "b": torch.ones(2, 2, dtype=torch.bfloat16),
        "c": nn.Parameter(torch.zeros(3)),
    }
    path = target(any_root)
    _write_as_if_from(state, path, ["cuda:0", "cuda:0", "cuda:1"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = asyncckpt.load(path)
    ours = [w for w in caught if "cuda" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "map_location" in str(ours[0].message)
    assert_same(state, loaded)
    # An explicit choice is silent.
    for loc in ("cpu", {"cuda:0": "cpu", "cuda:1": torch.device("cpu")}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_same(state, asyncckpt.load(path, map_location=loc))


def test_torch_load_keyword_arguments(any_root: str) -> None:
    state = {"a": torch.arange(3), "n": 1}
    path = target(any_root)
    asyncckpt.save(state, path).result()
    for kwargs in (
        {"weights_only": True},
        {"weights_only": False},
        {"mmap": True},
        {"mmap": False, "weights_only": True, "map_location": "cpu"},
        {"pickle_module": pickle},
        {"encoding": "latin1"},
    ):
        assert_same(state, asyncckpt.load(path, **kwargs))
    assert_same(state, asyncckpt.load(path, "cpu", pickle))


# --------------------------------------------------------------------------- unsupported objects


class _Custom:
    pass


class _SubTensor(torch.Tensor):
    pass


def _cycle() -> list[Any]:
    loop: list[Any] = [1]
    loop.append(loop)
    return loop


UNSUPPORTED: list[tuple[str, Callable[[], Any], str]] = [
    ("lambda", lambda: {"sched": {"lr_lambdas": [lambda e: 0.9**e]}}, "['sched']['lr_lambdas'][0]"),
    ("object", lambda: {"a": [1, {"b": _Custom()}]}, "['a'][1]['b']"),
    ("module", lambda: {"w": torch.ones(2), "m": nn.Linear(2, 2)}, "['m']"),
    ("set", lambda: {"s": {1, 2}}, "['s']"),
    ("complex", lambda: (0, [None, 1 + 2j]), "[1][1]"),
    ("defaultdict", lambda: {"dd": defaultdict(list)}, "['dd']"),
    ("tuple-key", lambda: {"k": {(1, 2): 3}}, "['k'][(1, 2)]"),
    ("sparse", lambda: {"sp": torch.eye(3).to_sparse()}, "['sp']"),
    (
        "quantized",
        lambda: {"q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)},
        "['q']",
    ),
    ("meta", lambda: {"t": torch.empty(2, device="meta")}, "['t']"),
    ("subclass", lambda: {"t": torch.ones(2).as_subclass(_SubTensor)}, "['t']"),
    ("np-str", lambda: {"arr": np.array(["a", "b"])}, "['arr']"),
    ("np-object", lambda: {"arr": np.array([None, 1], dtype=object)}, "['arr']"),
    ("np-datetime", lambda: {"x": np.datetime64("2024-01-01")}, "['x']"),
    ("cycle", lambda: {"loop": _cycle()}, "['loop'][1]"),
]


@pytest.mark.parametrize(
    "make, suffix", [u[1:] for u in UNSUPPORTED], ids=[u[0] for u in UNSUPPORTED]
)
def test_unsupported_fails_inside_save(any_root: str, make: Callable[[], Any], suffix: str) -> None:
    fresh = target(any_root)
    old = target(any_root)
    asyncckpt.save({"old": torch.arange(4)}, old).result()
    old_bytes = read_raw(old)
    before = listing(any_root)
    state = make()
    for path in (fresh, old):
        with pytest.raises(UnsupportedObjectError) as info:
            asyncckpt.save(state, path)
        assert info.value.key_path == "state" + suffix
        assert "state" + suffix in str(info.value)
        assert isinstance(info.value, AsyncCkptError) and isinstance(info.value, TypeError)
    asyncckpt.wait()  # nothing was queued, nothing fails later
    assert not exists(fresh)
    assert read_raw(old) == old_bytes
    assert listing(any_root) == before
    assert not any(TEMP_MARK in n for n in listing(any_root))
    # Nothing leaked: the next save goes through.
    asyncckpt.save({"x": torch.ones(2)}, fresh).result()
    assert torch.equal(asyncckpt.load(fresh)["x"], torch.ones(2))


def test_invalid_compression_fails_inside_save(any_root: str) -> None:
    path = target(any_root)
    with pytest.raises(ValueError, match="compression"):
        asyncckpt.save({"x": torch.ones(2)}, path, compression="lz4")
    asyncckpt.wait()
    assert not exists(path)


# --------------------------------------------------------------------------- handle API


def test_handle_api(any_root: str, gate: threading.Event) -> None:
    t = torch.zeros(10)
    state = {"a": t, "view": t[2:], "b": np.zeros(3, dtype=np.int16), "c": torch.ones(2, 2)}
    path = target(any_root)
    handle = asyncckpt.save(state, path)
    assert isinstance(handle, asyncckpt.SaveHandle)
    assert not handle.done()
    stats = handle.stats
    assert stats.raw_bytes == 40 + 6 + 16  # the shared storage counts once
    assert stats.blocking_s >= 0
    assert stats.total_s is None and stats.stored_bytes is None and stats.ratio is None
    with pytest.raises(CheckpointTimeoutError):
        handle.result(timeout=0.05)
    with pytest.raises(TimeoutError):
        handle.exception(timeout=0)
    assert not handle.done()
    assert "pending" in repr(handle)
    gate.set()
    info = handle.result(timeout=60)
    assert isinstance(info, asyncckpt.SaveInfo)
    assert handle.done() and handle.exception() is None
    assert info.stats is handle.stats
    assert info.stats.raw_bytes == 62
    assert info.stats.blocking_s == stats.blocking_s
    assert info.stats.total_s is not None and info.stats.total_s >= info.stats.blocking_s
    fs, inner = fsspec.core.url_to_fs(path)
    assert info.stats.stored_bytes == fs.size(inner)
    assert info.stats.ratio == info.stats.stored_bytes / 62
    assert info.path.rstrip("/").endswith(os.path.basename(path))
    assert_same(state, asyncckpt.load(path))


def test_wait_makes_every_pending_save_durable(any_root: str, gate: threading.Event) -> None:
    paths = [target(any_root) for _ in range(3)]
    first = asyncckpt.save({"i": 0, "t": torch.full((100,), 0.0)}, paths[0])
    assert not first.done()
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    handles = [first] + [
        asyncckpt.save({"i": i, "t": torch.full((100,), float(i))}, p)
        for i, p in enumerate(paths[1:], 1)
    ]
    asyncckpt.wait()
    opener.join()
    assert all(h.done() for h in handles)
    for i, p in enumerate(paths):
        loaded = asyncckpt.load(p)
        assert loaded["i"] == i and torch.equal(loaded["t"], torch.full((100,), float(i)))


def test_wait_timeout(any_root: str, gate: threading.Event) -> None:
    handle = asyncckpt.save({"t": torch.ones(3)}, target(any_root))
    with pytest.raises(CheckpointTimeoutError):
        asyncckpt.wait(timeout=0.05)
    gate.set()
    asyncckpt.wait()
    assert handle.done()


def test_load_waits_for_save_in_flight(any_root: str, gate: threading.Event) -> None:
    path = target(any_root)
    gate.set()
    asyncckpt.save({"v": torch.zeros(1000)}, path).result()
    gate.clear()
    handle = asyncckpt.save({"v": torch.ones(1000)}, path)
    assert not handle.done()
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    loaded = asyncckpt.load(path)
    opener.join()
    assert handle.done()
    assert torch.equal(loaded["v"], torch.ones(1000))


def test_load_waits_for_save_in_flight_under_another_spelling(
    tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save through a file:// URL and a load through a relative path name one file."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "same.ackpt"
    handle = asyncckpt.save({"v": torch.arange(10)}, f"file://{path}")
    assert not handle.done()
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    loaded = asyncckpt.load("same.ackpt")
    opener.join()
    assert torch.equal(loaded["v"], torch.arange(10))


def test_pathlike_and_file_urls(tmp_path: Path) -> None:
    state = {"v": torch.arange(5), "s": "x"}
    p = tmp_path / "sub" / "dir" / "a.ackpt"
    asyncckpt.save(state, p).result()
    assert p.is_file()
    assert_same(state, asyncckpt.load(p))
    assert_same(state, asyncckpt.load(str(p)))
    assert_same(state, asyncckpt.load(p.as_uri()))
    q = tmp_path / "b.ackpt"
    asyncckpt.save(state, q.as_uri()).result()
    assert q.is_file()
    assert_same(state, asyncckpt.load(q))


def test_missing_file(any_root: str) -> None:
    path = target(any_root)
    with pytest.raises(CheckpointNotFoundError) as info:
        asyncckpt.load(path)
    assert isinstance(info.value, FileNotFoundError)
    assert os.path.basename(path) in str(info.value)


def test_text_file_objects_are_refused(tmp_path: Path) -> None:
    """Binary file objects are written synchronously (tests/api/test_torch_compat.py); text ones
    are refused before anything is written, with the remedy."""
    with open(tmp_path / "f", "w") as f, pytest.raises(TypeError, match="mode 'wb'"):
        asyncckpt.save({"x": 1}, f)  # type: ignore[arg-type]
    assert (tmp_path / "f").read_bytes() == b""
    asyncckpt.wait()


def test_save_takes_every_torch_save_parameter() -> None:
    """Code written for torch.save runs unchanged: same names, same positions."""
    import inspect

    ours = list(inspect.signature(asyncckpt.save).parameters)
    theirs = list(inspect.signature(torch.save).parameters)
    assert ours[: len(theirs)] == theirs


def test_save_into_a_file_object_is_synchronous() -> None:
    import io

    buffer = io.BytesIO()
    handle = asyncckpt.save({"w": torch.arange(4)}, buffer)
    assert handle.done() and handle.result().stats.stored_bytes == len(buffer.getvalue())
    buffer.seek(0)
    assert asyncckpt.load(buffer)["w"].tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------- reserve


def test_reserve_is_public_and_the_first_save_reuses_its_arena(
    tmp_path: Path, arena_allocations: list[int]
) -> None:
    allocated = arena_allocations
    state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    thread = asyncckpt.reserve(state)
    assert thread is not None
    thread.join(30)
    asyncckpt.save(state, tmp_path / "a.ackpt").result()
    asyncckpt.save(state, tmp_path / "b.ackpt").result()
    assert len(allocated) == 1
    assert torch.equal(asyncckpt.load(tmp_path / "b.ackpt")["w"], state["w"])
