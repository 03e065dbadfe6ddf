"""The object tree: Python objects <-> JSON nodes with tensor and array references.

``flatten`` walks what the user passed to ``save``, refuses anything that is not plain data
(naming its key path) and replaces every tensor and numpy array by a reference into a table.
``unflatten`` is its inverse over already-materialized tensors and arrays; it validates every
node, so a manifest that passed its checksum but is malformed still fails with FormatError.
Node encoding: docs/FORMAT.md §6.
"""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncckpt._device import known_device
from asyncckpt._format.container import DTYPE_ITEMSIZE, MAX_DEPTH
from asyncckpt.errors import FormatError, UnsupportedObjectError

ROOT_NAME = "state"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class Flattened:
    """The result of :func:`flatten`: a JSON-able root and the tables it refers to."""

    root: Any
    tensors: list[tuple[torch.Tensor, str]] = field(default_factory=list)
    arrays: list[tuple[np.ndarray[Any, Any], str, bool]] = field(default_factory=list)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` for the dtypes the format knows.

    Raises:
        FormatError: the name is unknown, or this torch build lacks the dtype.
    """
    dtype = getattr(torch, name, None) if name in DTYPE_ITEMSIZE else None
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"dtype {name!r} is not available in torch {torch.__version__}")
    return dtype


def empty_of(dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """A tensor of no elements of ``dtype``, to ``set_`` onto a storage.

    Not ``torch.empty(0, dtype=dtype)``: under ``torch.use_deterministic_algorithms(True)``
    that fills the new tensor, which torch cannot do for every dtype (float4_e2m1fn_x2).

    Example:
        >>> empty_of(torch.float4_e2m1fn_x2).shape
        torch.Size([0])
    """
    return torch.empty(0, dtype=torch.uint8, device=device).view(dtype)


def flatten(obj: Any) -> Flattened:
    """Validate ``obj`` and encode it as JSON nodes plus tensor/array tables.

    Raises:
        UnsupportedObjectError: something in ``obj`` cannot be stored; the message names its
            key path, e.g. ``state['sched']['lr_lambdas'][0]``.
    """
    walker = _Flattener()
    root = walker.node(obj, ROOT_NAME, 0)
    return Flattened(root, walker.tensors, walker.arrays)


class _Flattener:
    def __init__(self) -> None:
        self.tensors: list[tuple[torch.Tensor, str]] = []
        self.arrays: list[tuple[np.ndarray[Any, Any], str, bool]] = []
        self.tensor_index: dict[int, int] = {}
        self.open_containers: set[int] = set()

    def node(self, obj: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedObjectError(path, f"nesting deeper than {MAX_DEPTH} levels")
        kind = type(obj)
        if obj is None or kind is bool:
            return obj
        if kind is int:
            if obj.bit_length() > 14_000:  # JSON ints are limited to 4,300 digits
                raise UnsupportedObjectError(path, "integers over 4,200 digits cannot be stored")
            return obj
        if kind is str:
            if not obj.isascii():
                try:
                    obj.encode()
                except UnicodeEncodeError:
                    raise UnsupportedObjectError(
                        path, "the string holds lone surrogates and is not valid Unicode"
                    ) from None
            return obj
        if kind is float:
            return {"float": obj.hex()}
        if kind is bytes:
            return {"bytes": base64.b64encode(obj).decode("ascii")}
        if kind is torch.Size:
            return self.size(obj, path)
        if kind is torch.dtype:
            return self.dtype(obj, path)
        if kind is torch.device:
            return {"device": str(obj)}
        if isinstance(obj, torch.Tensor):
            return {"tensor": self.tensor(obj, path)}
        if isinstance(obj, (np.ndarray, np.generic)):
            return {"ndarray": self.array(obj, path)}
        if kind in (list, tuple, dict, OrderedDict):
            return self.container(obj, path, depth)
        raise UnsupportedObjectError(path, _unsupported_reason(obj))

    def container(self, obj: Any, path: str, depth: int) -> Any:
        if id(obj) in self.open_containers:
            raise UnsupportedObjectError(path, "the object contains itself (a reference cycle)")
        self.open_containers.add(id(obj))
        try:
            if isinstance(obj, (list, tuple)):
                items = [self.node(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
                return {"list" if type(obj) is list else "tuple": items}
            pairs = [
                [self.key(k, path), self.node(v, child_path(path, k), depth + 1)]
                for k, v in obj.items()
            ]
            if type(obj) is dict:
                return {"dict": pairs}
            out: dict[str, Any] = {"odict": pairs}
            if hasattr(obj, "_metadata"):
                out["metadata"] = self.node(obj._metadata, f"{path}._metadata", depth + 1)
            return out
        finally:
            self.open_containers.discard(id(obj))

    def key(self, key: Any, path: str) -> Any:
        if key is None or type(key) in (str, int, bool, float):
            return self.node(key, path, 0)
        raise UnsupportedObjectError(
            f"{path}[{key!r}]",
            f"dict keys must be str, int, float, bool or None, not {type(key).__qualname__}",
        )

    def size(self, size: torch.Size, path: str) -> Any:
        # A reader refuses entries outside int64 (their repr raises): never write one.
        for n in size:
            if not _INT64_MIN <= n <= _INT64_MAX:
                raise UnsupportedObjectError(path, f"torch.Size entry {n} is outside int64")
        return {"size": list(size)}

    def dtype(self, dtype: torch.dtype, path: str) -> Any:
        name = dtype_name(dtype)
        if name not in DTYPE_ITEMSIZE:
            raise UnsupportedObjectError(path, f"dtype {dtype} is not supported")
        return {"dtype": name}

    def tensor(self, t: torch.Tensor, path: str) -> int:
        if id(t) in self.tensor_index:
            return self.tensor_index[id(t)]
        _check_tensor(t, path)
        self.tensor_index[id(t)] = len(self.tensors)
        self.tensors.append((t, path))
        return len(self.tensors) - 1

    def array(self, a: np.ndarray[Any, Any] | np.generic, path: str) -> int:
        if not _plain_numpy(a):
            raise UnsupportedObjectError(path, _numpy_subclass_reason(a))
        if a.dtype.kind not in "biufc":
            raise UnsupportedObjectError(
                path,
                f"numpy dtype {a.dtype} is not supported (only bool, int, uint, float and complex)",
            )
        scalar = isinstance(a, np.generic)
        self.arrays.append((np.asarray(a), path, scalar))
        return len(self.arrays) - 1


def _check_tensor(t: torch.Tensor, path: str) -> None:
    """Refuse a tensor whose bytes cannot be stored as a plain strided tensor's.

    Every refusal names the key; torch's own errors for such tensors ("Internal error:
    NestedTensorImpl doesn't support strides", "Cannot access storage of TensorWrapper")
    say nothing of where the tensor was.
    """
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedObjectError(
            path,
            f"tensor subclass {type(t).__qualname__} is not supported (DTensor and "
            "other wrapper tensors must be converted to plain tensors first)",
        )
    if t.is_nested:
        raise UnsupportedObjectError(
            path, "nested tensors are not supported; store t.unbind() (a list of tensors)"
        )
    if _functorch_wrapped(t):
        raise UnsupportedObjectError(
            path,
            "this tensor belongs to a torch.func transform (vmap, grad, ...) that has "
            "ended; save the tensors the transform returned instead",
        )
    if t.layout != torch.strided:
        raise UnsupportedObjectError(
            path, f"{t.layout} tensors are not supported; call .to_dense() first"
        )
    if t.is_quantized or dtype_name(t.dtype) not in DTYPE_ITEMSIZE:
        raise UnsupportedObjectError(path, f"tensors of dtype {t.dtype} are not supported")
    if t.device.type == "meta":
        raise UnsupportedObjectError(path, "meta tensors hold no data to save")
    try:  # what staging reads; any other tensor without plain storage fails here, named
        t.untyped_storage()
        t.stride()
    except (RuntimeError, NotImplementedError) as exc:
        raise UnsupportedObjectError(path, f"its storage cannot be read ({exc})") from None


def _functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a functorch wrapper (BatchedTensor, TensorWrapper): no storage."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(t)) if callable(check) else False


def _plain_numpy(a: np.ndarray[Any, Any] | np.generic) -> bool:
    """An ``ndarray`` itself, or one of numpy's own scalar types (not a subclass)."""
    if isinstance(a, np.ndarray):
        return type(a) is np.ndarray
    return np.dtype(type(a)).type is type(a)


def _numpy_subclass_reason(a: Any) -> str:
    kind = type(a)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(a, np.ma.MaskedArray):
        return (
            f"{name} is a subclass of numpy.ndarray and its mask would be lost; store its "
            "parts instead, e.g. {'data': a.data, 'mask': np.ma.getmaskarray(a)}"
        )
    base = "numpy.ndarray" if isinstance(a, np.ndarray) else f"numpy.{a.dtype.type.__name__}"
    return (
        f"{name} is a subclass of {base}; only plain numpy arrays and scalars are stored "
        "(a subclass would come back as its base type), convert it first (np.asarray(a))"
    )


#: Objects that hold training state but are not data, and what to save in their place.
_SAVE_INSTEAD: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (
        torch.nn.Module,
        "an nn.Module; save model.state_dict() and restore it with model.load_state_dict(...)",
    ),
    (
        torch.optim.Optimizer,
        "an optimizer; save optimizer.state_dict() and restore it with "
        "optimizer.load_state_dict(...)",
    ),
    (
        (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau),
        "a learning-rate scheduler; save "
        "scheduler.state_dict() and restore it with scheduler.load_state_dict(...)",
    ),
    (
        torch.amp.GradScaler,
        "a GradScaler; save scaler.state_dict() and restore it with scaler.load_state_dict(...)",
    ),
    (
        torch.Generator,
        "a random number generator; save generator.get_state() (a tensor) "
        "and restore it with generator.set_state(...)",
    ),
)


def _unsupported_reason(obj: Any) -> str:
    kind = type(obj)
    for base, advice in _SAVE_INSTEAD:
        if isinstance(obj, base):
            return f"{kind.__qualname__} is {advice}"
    if callable(getattr(obj, "state_dict", None)):
        return (
            f"{kind.__qualname__} objects are not data; it has a state_dict() method: "
            "save obj.state_dict() instead, and restore it with obj.load_state_dict(...)"
        )
    if callable(obj):
        return f"{kind.__qualname__} objects (functions, lambdas, callables) cannot be saved"
    if isinstance(obj, (dict, list, tuple)):
        return (
            f"{kind.__qualname__} is a subclass of {kind.__mro__[1].__qualname__}; only the "
            "plain type (and OrderedDict) is stored, convert it first"
        )
    return (
        f"objects of type {kind.__module__}.{kind.__qualname__} are not supported; "
        "store plain data (dicts, lists, numbers, strings, tensors, arrays)"
    )


def tensor_paths(obj: Any) -> dict[str, torch.Tensor]:
    """Every tensor in ``obj`` (dicts, lists, tuples) by the key path ``flatten`` gives it.

    Example:
        >>> list(tensor_paths({"model": {"w": torch.zeros(1)}}))
        ["state['model']['w']"]
    """
    found: dict[str, torch.Tensor] = {}
    for path, node in tensor_paths_all(obj):
        found.setdefault(path, node)
    return found


def tensor_paths_all(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """Every (key path, tensor) in ``obj``, a tensor held at several paths at each.

    Example:
        >>> w = torch.zeros(1)
        >>> sorted(p for p, _ in tensor_paths_all({"a": w, "b": [w]}))
        ["state['a']", "state['b'][0]"]
    """
    found: list[tuple[str, torch.Tensor]] = []
    stack: list[tuple[Any, str, int]] = [(obj, ROOT_NAME, 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, torch.Tensor):
            found.append((path, node))
        elif depth < MAX_DEPTH and isinstance(node, dict):
            stack.extend((v, child_path(path, k), depth + 1) for k, v in node.items())
        elif depth < MAX_DEPTH and isinstance(node, (list, tuple)):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))
    return found


def child_path(path: str, key: Any) -> str:
    """The key path of ``container[key]`` given the container's path."""
    return f"{path}[{key!r}]"


def unflatten(
    root: Any,
    tensors: Sequence[torch.Tensor],
    arrays: Sequence[Any],
    name: str,
) -> Any:
    """Rebuild the object tree from the manifest's ``root`` node, validating each node on
    the way; ``tensors`` and ``arrays`` are materialized, indexed as in the manifest.

    Raises:
        FormatError: a node is malformed or refers outside the tables.
    """
    return _Unflattener(tensors, arrays, name).node(root, ROOT_NAME, 0)


class _Unflattener:
    def __init__(self, tensors: Sequence[torch.Tensor], arrays: Sequence[Any], name: str):
        self.tensors = tensors
        self.arrays = arrays
        self.name = name
        self.decoders: dict[str, Callable[[Any, str, int], Any]] = {
            "float": lambda v, p, d: self.float_(v, p),
            "bytes": lambda v, p, d: self.bytes_(v, p),
            "list": lambda v, p, d: self.items(v, p, d),
            "tuple": lambda v, p, d: tuple(self.items(v, p, d)),
            "dict": lambda v, p, d: dict(self.pairs(v, p, d)),
            "size": lambda v, p, d: self.size(v, p),
            "dtype": lambda v, p, d: self.dtype(v, p),
            "device": lambda v, p, d: self.device(v, p),
            "tensor": lambda v, p, d: self.ref(self.tensors, v, p),
            "ndarray": lambda v, p, d: self.ref(self.arrays, v, p),
        }

    def fail(self, path: str, what: str) -> FormatError:
        return FormatError(f"{self.name}: invalid manifest at {path}: {what}")

    def node(self, node: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise self.fail(path, f"nesting deeper than {MAX_DEPTH}")
        if node is None or type(node) in (bool, int, str):
            return node
        if type(node) is not dict or not node:
            raise self.fail(path, f"unexpected node {type(node).__name__}")
        if "odict" in node:
            return self.odict(node, path, depth)
        if len(node) != 1:
            raise self.fail(path, f"node has several tags {sorted(node)}")
        ((tag, value),) = node.items()
        decoder = self.decoders.get(tag)
        if decoder is None:
            raise self.fail(path, f"unknown tag {tag!r}")
        return decoder(value, path, depth + 1)

    def odict(self, node: dict[str, Any], path: str, depth: int) -> Any:
        if set(node) - {"odict", "metadata"}:
            raise self.fail(path, f"unexpected fields {sorted(node)}")
        out: OrderedDict[Any, Any] = OrderedDict(self.pairs(node["odict"], path, depth + 1))
        if "metadata" in node:
            out._metadata = self.node(node["metadata"], f"{path}._metadata", depth + 1)  # type: ignore[attr-defined]
        return out

    def items(self, value: Any, path: str, depth: int) -> list[Any]:
        if type(value) is not list:
            raise self.fail(path, "expected a list")
        return [self.node(v, f"{path}[{i}]", depth) for i, v in enumerate(value)]

    def pairs(self, value: Any, path: str, depth: int) -> list[tuple[Any, Any]]:
        if type(value) is not list:
            raise self.fail(path, "expected a list of pairs")
        out = []
        for pair in value:
            if type(pair) is not list or len(pair) != 2:
                raise self.fail(path, "expected a [key, value] pair")
            key = self.node(pair[0], path, depth)
            if isinstance(key, (list, dict, torch.Tensor, np.ndarray, np.generic)):
                raise self.fail(path, f"unhashable key of type {type(key).__name__}")
            try:
                hash(key)  # a tuple holding a list
            except TypeError:
                raise self.fail(path, f"unhashable key {key!r}") from None
            out.append((key, self.node(pair[1], child_path(path, key), depth)))
        return out

    def float_(self, value: Any, path: str) -> float:
        try:
            return float.fromhex(value) if type(value) is str else float("invalid")
        except (ValueError, OverflowError):
            raise self.fail(path, f"bad float {value!r}") from None

    def bytes_(self, value: Any, path: str) -> bytes:
        try:
            return base64.b64decode(value, validate=True)
        except (TypeError, ValueError, binascii.Error):
            raise self.fail(path, "bad base64 bytes") from None

    def size(self, value: Any, path: str) -> torch.Size:
        if type(value) is not list or not all(type(v) is int for v in value):
            raise self.fail(path, "expected a list of integers")
        # One past int64 breaks torch.Size's repr and every use of it: refuse it, named.
        for n in value:
            if not _INT64_MIN <= n <= _INT64_MAX:
                raise self.fail(path, f"torch.Size entry {n} is outside int64")
        return torch.Size(value)

    def dtype(self, value: Any, path: str) -> torch.dtype:
        if type(value) is not str:
            raise self.fail(path, "bad dtype")
        try:
            return torch_dtype(value)
        except FormatError as exc:
            raise self.fail(path, str(exc)) from None

    def device(self, value: Any, path: str) -> torch.device:
        if type(value) is not str or not known_device(value):
            raise self.fail(path, f"unknown device type {value!r}")
        try:
            return torch.device(value)
        except (TypeError, ValueError, RuntimeError):
            raise self.fail(path, f"bad device {value!r}") from None

    def ref(self, table: Sequence[Any], value: Any, path: str) -> Any:
        if type(value) is not int or not 0 <= value < len(table):
            raise self.fail(path, f"reference {value!r} outside the table of {len(table)}")
        return table[value]


# -- DTensors: where a state holds them, by their path from its root ------------------------

#: A leaf's keys from the root of a state.
Path = tuple[str | int, ...]


def dtensor_type() -> type[Any] | None:
    """``torch.distributed.tensor.DTensor``, or None in a torch built without it."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def holds_dtensor(obj: Any) -> bool:
    """Whether ``obj`` (nested dicts, lists, tuples) holds a ``DTensor`` anywhere.

    Example:
        >>> holds_dtensor({"model": {"w": torch.zeros(2)}, "step": 3})
        False
    """
    kind = dtensor_type()
    if kind is None or obj is None:
        return False
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, kind):
            return True
        if depth < MAX_DEPTH and isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif depth < MAX_DEPTH and isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)
    return False


def fqn_of(path: Path) -> str:
    """The flat name of the leaf at ``path``: its keys joined by dots, as DCP names them.

    Example:
        >>> fqn_of(("optim", "state", "0.weight", "exp_avg"))
        'optim.state.0.weight.exp_avg'
    """
    return ".".join(str(k) for k in path)


def dtensor_leaves(obj: Any) -> Iterator[tuple[Path, str, Any]]:
    """Every DTensor in ``obj`` as ``(path, key path, DTensor)``, in ``flatten``'s order.

    Raises:
        UnsupportedObjectError: a DTensor sits under a key that is not a str or int.
    """
    kind = dtensor_type()
    if kind is None:
        return
    stack: list[tuple[Any, Path, str]] = [(obj, (), ROOT_NAME)]
    while stack:
        node, path, key = stack.pop()
        if isinstance(node, kind):
            _check_path(path, key)
            yield path, key, node
        elif len(path) < MAX_DEPTH and isinstance(node, dict):
            items = [(v, (*path, k), child_path(key, k)) for k, v in node.items()]
            stack.extend(reversed(items))
        elif len(path) < MAX_DEPTH and isinstance(node, (list, tuple)):
            items = [(v, (*path, i), f"{key}[{i}]") for i, v in enumerate(node)]
            stack.extend(reversed(items))


def _check_path(path: Path, key: str) -> None:
    if not all(type(k) in (str, int) for k in path):
        raise UnsupportedObjectError(key, "a DTensor's keys must be str or int (its DCP name)")
