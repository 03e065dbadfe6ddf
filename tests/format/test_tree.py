"""The object tree: flatten/unflatten directly, their node encoding, and what they refuse."""

from __future__ import annotations

import collections
import contextlib
import math
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt._format.container import MAX_DEPTH
from asyncckpt._format.tree import dtype_name, flatten, torch_dtype, unflatten
from asyncckpt.errors import AsyncCkptError, FormatError, UnsupportedObjectError


def _same(a: Any, b: Any) -> bool:
    """Equal values of exactly equal types, recursively; nan equals nan."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        if list(a) != list(b) or not all(_same(a[k], b[k]) for k in a):
            return False
        if hasattr(a, "_metadata") != hasattr(b, "_metadata"):
            return False
        return not hasattr(a, "_metadata") or _same(a._metadata, b._metadata)
    return bool(a == b)


def _roundtrip(obj: Any) -> Any:
    flat = flatten(obj)
    return unflatten(flat.root, [t for t, _ in flat.tensors], [a for a, _, _ in flat.arrays], "f")


# --------------------------------------------------------------------------- node encoding


def test_scalars_encode_as_themselves_or_tagged() -> None:
    assert flatten(None).root is None
    assert flatten(True).root is True
    assert flatten(7).root == 7
    assert flatten("x").root == "x"
    assert flatten(1.5).root == {"float": "0x1.8000000000000p+0"}
    assert flatten(float("inf")).root == {"float": "inf"}
    assert flatten(b"\x00\xff").root == {"bytes": "AP8="}


def test_containers_and_torch_values_encode_as_tagged_nodes() -> None:
    od: collections.OrderedDict[str, int] = collections.OrderedDict(a=1)
    od._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    root = flatten(
        {
            "l": [1],
            "t": (2,),
            1: od,
            "s": torch.Size([2, 3]),
            "d": torch.bfloat16,
            "v": torch.device("cpu"),
        }
    ).root
    assert root == {
        "dict": [
            ["l", {"list": [1]}],
            ["t", {"tuple": [2]}],
            [1, {"odict": [["a", 1]], "metadata": {"dict": [["", {"dict": [["version", 2]]}]]}}],
            ["s", {"size": [2, 3]}],
            ["d", {"dtype": "bfloat16"}],
            ["v", {"device": "cpu"}],
        ]
    }


def test_plain_ordereddict_has_no_metadata_field() -> None:
    assert flatten(collections.OrderedDict(a=1)).root == {"odict": [["a", 1]]}


def test_tensors_and_arrays_become_table_references() -> None:
    w = torch.ones(2)
    a = np.arange(3)
    flat = flatten({"w": w, "again": w, "a": a, "s": np.float32(1.0)})
    assert flat.root == {
        "dict": [
            ["w", {"tensor": 0}],
            ["again", {"tensor": 0}],
            ["a", {"ndarray": 0}],
            ["s", {"ndarray": 1}],
        ]
    }
    assert len(flat.tensors) == 1
    assert flat.tensors[0][0] is w
    assert flat.tensors[0][1] == "state['w']"  # the first path that reached it
    assert [(key, scalar) for _, key, scalar in flat.arrays] == [
        ("state['a']", False),
        ("state['s']", True),
    ]


def test_dtype_names_round_trip() -> None:
    for dtype in [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.complex64, torch.bool]:
        assert torch_dtype(dtype_name(dtype)) is dtype
    for bad in ["float128", "qint8", "Tensor", "nn", ""]:
        with pytest.raises(FormatError):
            torch_dtype(bad)


# --------------------------------------------------------------------------- round trips

_keys = st.one_of(st.text(max_size=8), st.integers(-(2**40), 2**40))
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**200), 2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.sampled_from([torch.Size([]), torch.Size([3, 0, 2]), torch.float16, torch.device("cpu")]),
)
_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_keys, inner, max_size=4),
        st.dictionaries(_keys, inner, max_size=4).map(collections.OrderedDict),
    ),
    max_leaves=25,
)


@settings(max_examples=150, deadline=None)
@given(_values)
def test_plain_values_round_trip_with_types(obj: Any) -> None:
    assert _same(_roundtrip(obj), obj)


def test_special_floats_and_keys_round_trip() -> None:
    obj = {
        None: -0.0,
        True: float("nan"),
        2.5: float("-inf"),
        "": 5e-324,
        -(2**70): 1.7976931348623157e308,
    }
    back = _roundtrip(obj)
    assert _same(back, obj)
    assert math.copysign(1.0, back[None]) == -1.0


def test_ordereddict_metadata_round_trips() -> None:
    state = torch.nn.Linear(2, 2).state_dict()
    back = _roundtrip(state)
    assert isinstance(back, collections.OrderedDict)
    assert back._metadata == state._metadata  # type: ignore[attr-defined]
    assert list(back) == list(state)
    assert all(back[k] is state[k] for k in state)


def test_depth_limit_is_inclusive() -> None:
    deep: Any = 1
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert _same(_roundtrip(deep), deep)
    with pytest.raises(UnsupportedObjectError, match=f"deeper than {MAX_DEPTH}"):
        flatten([deep])


def test_shared_subtrees_are_not_cycles() -> None:
    shared = [1, 2]
    obj = {"a": shared, "b": shared, "c": (shared, shared)}
    assert _same(_roundtrip(obj), obj)


# --------------------------------------------------------------------------- refusals


def _refused(obj: Any) -> UnsupportedObjectError:
    with pytest.raises(UnsupportedObjectError) as info:
        flatten(obj)
    assert info.value.key_path in str(info.value)
    assert isinstance(info.value, AsyncCkptError)
    assert isinstance(info.value, TypeError)
    return info.value


def test_lambda_in_scheduler_names_its_key_path() -> None:
    state = {"model": {"w": torch.ones(1)}, "sched": {"last_epoch": 3, "lr_lambdas": [lambda e: e]}}
    err = _refused(state)
    assert err.key_path == "state['sched']['lr_lambdas'][0]"
    assert "cannot save state['sched']['lr_lambdas'][0]" in str(err)
    assert "lambda" in str(err)


class _Custom:
    pass


class _Point(NamedTuple):
    x: int


class _MyList(list[int]):
    pass


@pytest.mark.parametrize(
    ("obj", "path", "words"),
    [
        ({"a": [1, (2, _Custom())]}, "state['a'][1][1]", "_Custom"),
        ({3: {"x": object()}}, "state[3]['x']", "object"),
        ([print], "state[0]", "callable"),
        ({"s": {1, 2}}, "state['s']", "set"),
        ({"f": frozenset()}, "state['f']", "frozenset"),
        ({"c": 1 + 2j}, "state['c']", "complex"),
        ({"b": bytearray(b"x")}, "state['b']", "bytearray"),
        ({"r": range(3)}, "state['r']", "range"),
        ({"d": collections.defaultdict(list)}, "state['d']", "subclass of dict"),
        ({"n": _Point(1)}, "state['n']", "subclass of tuple"),
        ({"m": _MyList()}, "state['m']", "subclass of list"),
        ({"k": collections.Counter()}, "state['k']", "subclass of dict"),
        ({(1, 2): 1}, "state[(1, 2)]", "dict keys"),
        ({"q": torch.qint8}, "state['q']", "qint8"),
        ({"o": np.array(["a"], dtype=object)}, "state['o']", "numpy dtype object"),
        ({"u": np.array(["ab"])}, "state['u']", "numpy dtype <U2"),
        ({"h": 10**5000}, "state['h']", "digits"),
        ({"z": "a\ud800"}, "state['z']", "surrogates"),
        ({"a\udfff": 1}, "state", "surrogates"),
        ({"s": torch.Size([1, 2**70])}, "state['s']", "outside int64"),
        ({"s": torch.Size([2**63])}, "state['s']", "outside int64"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_unsupported_values_name_their_path(obj: Any, path: str, words: str) -> None:
    err = _refused(obj)
    assert err.key_path == path
    assert words in str(err)


def test_metadata_path_is_named() -> None:
    od: collections.OrderedDict[str, int] = collections.OrderedDict()
    od._metadata = {"": {"hook": lambda: 0}}  # type: ignore[attr-defined]
    assert _refused({"sd": od}).key_path == "state['sd']._metadata['']['hook']"


def test_cycles_are_refused() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    err = _refused({"a": loop})
    assert err.key_path == "state['a'][1]"
    assert "cycle" in str(err)

    d: dict[str, Any] = {}
    d["self"] = {"inner": d}
    assert _refused(d).key_path == "state['self']['inner']"


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: torch.eye(3).to_sparse(), "sparse_coo"),
        (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr"),
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "qint8"),
        (lambda: torch.empty(3, device="meta"), "meta"),
        (lambda: torch.ones(2).as_subclass(_Sub), "subclass"),
    ],
    ids=["sparse_coo", "sparse_csr", "quantized", "meta", "subclass"],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_unsupported_tensors_are_refused(make: Any, words: str) -> None:
    err = _refused({"opt": [{"t": make()}]})
    assert err.key_path == "state['opt'][0]['t']"
    assert words in str(err)


def _vmapped_leaked() -> torch.Tensor:
    """A functorch BatchedTensor that escaped its ``vmap`` (kept from inside the call)."""
    kept: list[torch.Tensor] = []
    torch.vmap(lambda x: kept.append(x) or x)(torch.ones(2, 3))
    return kept[0]


def _grad_leaked() -> torch.Tensor:
    """A functorch TensorWrapper that escaped its ``torch.func.grad``."""
    kept: list[torch.Tensor] = []
    torch.func.grad(lambda x: kept.append(x) or x.sum())(torch.ones(2))
    return kept[0]


def _fake() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode().from_tensor(torch.ones(2))


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
        (
            lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
            "NestedTensor",
        ),
        (lambda: torch.nn.Parameter(torch.nested.nested_tensor([torch.ones(2)])), "nested"),
        (_vmapped_leaked, "torch.func"),
        (_grad_leaked, "torch.func"),
        (_fake, "FakeTensor"),
        (lambda: torch.eye(4).to_sparse_bsr((2, 2)), "sparse_bsr"),
        (lambda: torch.ones(2, 2).to_mkldnn(), "mkldnn"),
    ],
    ids=["nested", "jagged", "nested_parameter", "vmap", "grad", "fake", "bsr", "mkldnn"],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_exotic_tensors_are_refused_naming_the_key(make: Any, words: str) -> None:
    err = _refused({"opt": [{"t": make()}]})
    assert err.key_path == "state['opt'][0]['t']"
    assert words in str(err)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([1 + 2j, 3 - 1j]).conj(),  # a lazy conjugate
        lambda: torch.tensor([1 + 2j]).conj().imag,  # a negative view
        lambda: torch._neg_view(torch.tensor([1.0, 2.0])),
    ],
    ids=["conj", "conj_imag", "neg_view"],
)
def test_conjugate_and_negative_views_save_their_values(make: Any) -> None:
    import io

    import asyncckpt

    t = make()
    buffer = io.BytesIO()
    asyncckpt.save({"t": t}, buffer)
    assert torch.equal(asyncckpt.load(io.BytesIO(buffer.getvalue()))["t"], t)


class _Array(np.ndarray):  # type: ignore[type-arg]
    pass


class _Float(np.float64):
    pass


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: np.ma.masked_array([1.0, 2.0], mask=[False, True]), "MaskedArray"),
        (lambda: np.matrix([[1, 2], [3, 4]]), "matrix"),
        (lambda: np.arange(3).view(_Array), "_Array"),
        (lambda: np.ma.masked_array([1.0], mask=[True])[0], "MaskedConstant"),
        (lambda: _Float(1.5), "_Float"),
    ],
    ids=["masked", "matrix", "own_subclass", "masked_constant", "scalar_subclass"],
)
@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix
def test_numpy_subclasses_are_refused_naming_the_key(make: Any, words: str) -> None:
    err = _refused({"stats": {"a": make()}})
    assert err.key_path == "state['stats']['a']"
    assert words in str(err) and "subclass" in str(err)


def test_plain_numpy_arrays_and_scalars_are_still_stored() -> None:
    flat = flatten({"a": np.arange(3), "s": np.float32(2.5), "b": np.bool_(True)})
    assert [type(a) for a, _, _ in flat.arrays] == [np.ndarray] * 3


class _WithState:
    def state_dict(self) -> dict[str, int]:
        return {"n": 1}


def _module() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(_module().parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (_module, "model.state_dict()"),
        (lambda: torch.nn.Sequential(_module()), "model.state_dict()"),
        (_optimizer, "optimizer.state_dict()"),
        (lambda: torch.optim.lr_scheduler.StepLR(_optimizer(), 1), "scheduler.state_dict()"),
        (
            lambda: torch.optim.lr_scheduler.ReduceLROnPlateau(_optimizer()),
            "scheduler.state_dict()",
        ),
        (lambda: torch.amp.GradScaler("cpu"), "scaler.state_dict()"),
        (_WithState, "state_dict()"),
        (lambda: torch.Generator().manual_seed(1), "get_state()"),
    ],
    ids=["module", "sequential", "optimizer", "scheduler", "plateau", "scaler", "any", "rng"],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_training_objects_say_what_to_save_instead(make: Any, words: str) -> None:
    err = _refused({"model": make()})
    assert err.key_path == "state['model']"
    assert words in str(err)
    assert "callables" not in str(err)


def test_a_module_passed_whole_is_named_as_the_state() -> None:
    err = _refused(torch.nn.Linear(2, 2))
    assert err.key_path == "state" and "Linear" in str(err) and "state_dict()" in str(err)


def test_refusal_comes_before_any_table_entry_is_used() -> None:
    # flatten is all-or-nothing: a bad leaf after good tensors still raises.
    with pytest.raises(UnsupportedObjectError):
        flatten({"w": torch.ones(3), "later": [torch.ones(2), lambda: 0]})


# --------------------------------------------------------------------------- unflatten


_T = [torch.ones(1)]
_A = [np.arange(2)]


@pytest.mark.parametrize(
    "node",
    [
        1.5,
        [1, 2],
        {},
        {"nope": 1},
        {"list": [], "tuple": []},
        {"float": 1.5},
        {"float": "zz"},
        {"float": "0x1p99999"},
        {"float": None},
        {"bytes": "!!"},
        {"bytes": 5},
        {"bytes": "QQ"},
        {"list": {}},
        {"list": "ab"},
        {"tuple": 3},
        {"dict": {}},
        {"dict": [[1]]},
        {"dict": [[1, 2, 3]]},
        {"dict": [5]},
        {"dict": [[[], 1]]},
        {"dict": [[{"list": []}, 1]]},
        {"dict": [[{"tuple": [{"list": []}]}, 1]]},
        {"dict": [[{"dict": []}, 1]]},
        {"dict": [[{"tensor": 0}, 1]]},
        {"dict": [[{"ndarray": 0}, 1]]},
        {"odict": 5},
        {"odict": [], "extra": 1},
        {"odict": [], "metadata": {"bad": 1}},
        {"size": [1.5]},
        {"size": "2"},
        {"size": [True]},
        {"size": [2**63]},
        {"size": [1, 2**70]},
        {"size": [-(2**63) - 1]},
        {"dtype": "float128"},
        {"dtype": "Tensor"},
        {"dtype": 1},
        {"device": "nonsense"},
        {"device": ""},
        {"device": 2**70},
        {"device": -1},
        {"device": []},
        {"device": None},
        {"tensor": 1},
        {"tensor": -1},
        {"tensor": "0"},
        {"tensor": True},
        {"ndarray": 2},
        {"ndarray": 0.0},
        {"list": [1, {"list": [{"bogus": 0}]}]},
    ],
    ids=repr,
)
def test_malformed_nodes_raise_format_error(node: Any) -> None:
    with pytest.raises(FormatError):
        unflatten(node, _T, _A, "ckpt.ackpt")


def test_int64_sizes_round_trip() -> None:
    """The bounds of a torch.Size entry are those of int64, both of them included."""
    size = torch.Size([2**63 - 1, -(2**63), -1, 0])
    flat = flatten({"s": size})
    assert unflatten(flat.root, [], [], "x")["s"] == size


def test_malformed_node_error_names_file_and_path() -> None:
    node = {"dict": [["a", {"list": [0, {"tensor": 9}]}]]}
    with pytest.raises(FormatError) as info:
        unflatten(node, _T, _A, "ckpt.ackpt")
    assert "ckpt.ackpt" in str(info.value)
    assert "state['a'][1]" in str(info.value)


def test_unflatten_depth_limit() -> None:
    node: Any = 0
    for _ in range(MAX_DEPTH):
        node = {"list": [node]}
    assert unflatten(node, [], [], "f") is not None
    with pytest.raises(FormatError, match="deeper"):
        unflatten({"list": [node]}, [], [], "f")
    very: Any = 0
    for _ in range(5000):
        very = {"tuple": [very]}
    with pytest.raises(FormatError, match="deeper"):
        unflatten(very, [], [], "f")


def test_references_resolve_to_the_given_objects() -> None:
    node = {"tuple": [{"tensor": 0}, {"ndarray": 0}, {"tensor": 0}]}
    back = unflatten(node, _T, _A, "f")
    assert back[0] is _T[0] and back[2] is _T[0] and back[1] is _A[0]


_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 3),
        st.integers(),
        st.floats(),
        st.text(max_size=6),
        st.sampled_from(["0x1p3", "nan", "AAAA", "cpu", "float32"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(
                [
                    "float",
                    "bytes",
                    "list",
                    "tuple",
                    "dict",
                    "odict",
                    "metadata",
                    "size",
                    "dtype",
                    "device",
                    "tensor",
                    "ndarray",
                    "x",
                ]
            ),
            inner,
            min_size=1,
            max_size=2,
        ),
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_arbitrary_json_gives_a_value_or_format_error(node: Any) -> None:
    with contextlib.suppress(FormatError):
        unflatten(node, _T, _A, "f")
