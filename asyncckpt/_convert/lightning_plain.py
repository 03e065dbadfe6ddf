"""The Lightning plugin's projection: a Lightning checkpoint onto plain data, and back.

A Lightning checkpoint holds more than tensors (hyperparameters in ``AttributeDict``,
enums, paths, dataclasses ...). :func:`to_plain` projects it onto what asyncckpt stores and
records, under :data:`PROJECTION_KEY`, which value had which class; :func:`from_plain`
rebuilds the values whose class it trusts. No class is ever imported by a name read from a
file. Used by :class:`asyncckpt.lightning.AsyncCkptIO`, which re-exports these names.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import pathlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.data import AttributeDict as _FabricAttributeDict
from lightning.pytorch.utilities.parsing import AttributeDict as _PLAttributeDict

from asyncckpt._format.container import MAX_DEPTH
from asyncckpt._format.tree import child_path
from asyncckpt.errors import FormatError, UnsupportedObjectError

#: The reserved top-level key under which a saved checkpoint records the projection.
PROJECTION_KEY = "asyncckpt_lightning"
#: Bumped when the record's layout changes; a newer record is refused, not misread.
PROJECTION_VERSION = 1

#: How messages name the checkpoint dict (its keys are shown below it).
CHECKPOINT_ROOT = "checkpoint"
_Key = str | int | float | bool | None
_KEY_TYPES = (str, int, float, bool, type(None))
# Stored as they are: asyncckpt.save takes them (tree.py). Exact types only: a subclass of
# int or str is recorded as a conversion so that it is not silently flattened.
_PLAIN = (bool, int, float, str, bytes, torch.Size, torch.dtype, torch.device)
_SCALARS: tuple[type[Any], ...] = (int, float, str, bytes)
_KINDS = frozenset(
    {"mapping", "namespace", "sequence", "namedtuple", "set", "enum", "dataclass", "path"}
    | {"scalar", "class"}
)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# Classes rebuilt without being asked: each is rebuilt from plain data by a constructor that
# runs no user code, so trusting them cannot execute anything a file chooses.
_BUILTIN_TRUSTED: dict[str, type] = {
    _name(cls): cls
    for cls in (
        _FabricAttributeDict,
        _PLAttributeDict,
        argparse.Namespace,
        set,
        frozenset,
        collections.Counter,
        pathlib.PurePath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
    )
}
# Concrete paths come back as the loading platform's Path: a PosixPath saved on Linux cannot
# be instantiated on Windows, and the other way round.
for _cls in (pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath):
    _BUILTIN_TRUSTED[_name(_cls)] = pathlib.Path


def to_plain(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Project a Lightning checkpoint onto the plain data ``asyncckpt.save`` stores.

    Tensors, numpy arrays, numbers, strings, bytes, ``None``, plain ``dict``/``OrderedDict``
    (``_metadata`` kept), ``list`` and ``tuple`` pass through unchanged. Other values are
    converted, and each conversion is recorded under ``checkpoint[PROJECTION_KEY]``:

    - ``dict`` subclasses (``AttributeDict``, ``Counter`` ...) -> ``dict``;
    - ``argparse.Namespace`` and dataclass instances -> ``dict`` of their fields;
    - enum members -> their ``value`` (itself projected);
    - ``pathlib`` paths -> ``str``;
    - named tuples and other ``list``/``tuple`` subclasses -> ``tuple``/``list``;
    - ``set``/``frozenset`` -> ``list``;
    - subclasses of ``int``/``float``/``str``/``bytes`` -> the base type;
    - classes (e.g. Lightning's ``hparams_type``) -> their ``"module.QualName"``.

    Nothing is copied but the containers: tensors are shared with ``checkpoint``.

    Args:
        checkpoint: the dict Lightning passes to ``CheckpointIO.save_checkpoint``.

    Returns:
        A new dict of plain data, with the record of conversions under ``PROJECTION_KEY``.

    Raises:
        UnsupportedObjectError: a value is none of the above (a function, a module, an
            arbitrary object); the message names its key path, e.g.
            ``checkpoint['hyper_parameters']['loss_fn']``.

    Example:
        >>> import enum, pathlib
        >>> class Mode(enum.Enum):
        ...     FAST = "fast"
        >>> plain = to_plain({"hp": {"mode": Mode.FAST, "root": pathlib.Path("/data")}})
        >>> plain["hp"]
        {'mode': 'fast', 'root': '/data'}
        >>> from_plain(plain)["hp"]  # Mode is not trusted: it stays a plain value
        {'mode': 'fast', 'root': PosixPath('/data')}
        >>> from_plain(to_plain({"m": Mode.FAST}), classes=[Mode])["m"]
        <Mode.FAST: 'fast'>
    """
    if not isinstance(checkpoint, dict):
        raise UnsupportedObjectError(
            CHECKPOINT_ROOT, f"a checkpoint must be a dict, not {type(checkpoint).__qualname__}"
        )
    if PROJECTION_KEY in checkpoint:
        raise UnsupportedObjectError(
            child_path(CHECKPOINT_ROOT, PROJECTION_KEY),
            "this top-level key is reserved by asyncckpt",
        )
    projector = _Projector()
    plain = projector.value(checkpoint, CHECKPOINT_ROOT, (), 0)
    plain[PROJECTION_KEY] = {"version": PROJECTION_VERSION, "conversions": projector.records}
    return plain  # type: ignore[no-any-return]


class _Projector:
    def __init__(self) -> None:
        # Post-order: a value's inner conversions come before its own, the order from_plain
        # applies them in.
        self.records: list[dict[str, Any]] = []
        self.open: set[int] = set()

    def record(self, plain: Any, keys: tuple[_Key, ...], kind: str, cls: type) -> Any:
        """Record that ``plain`` (returned) stands for a ``cls`` converted as ``kind``."""
        self.records.append({"path": list(keys), "kind": kind, "class": _name(cls)})
        return plain

    def value(self, obj: Any, path: str, keys: tuple[_Key, ...], depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedObjectError(path, f"nesting deeper than {MAX_DEPTH} levels")
        kind = type(obj)
        if obj is None or kind in _PLAIN:
            return obj
        # Tensors and arrays go to asyncckpt.save as they are; it checks their dtype/layout.
        if isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
            return obj
        # Before the int/str checks: IntEnum and StrEnum members are ints and strs too.
        if isinstance(obj, enum.Enum):
            plain = self.value(obj.value, f"{path}.value", keys, depth + 1)
            return self.record(plain, keys, "enum", kind)
        # Before the dataclass check: a dataclass *class* is a dataclass too.
        if isinstance(obj, type):
            return self.record(_name(obj), keys, "class", obj)
        if isinstance(obj, pathlib.PurePath):
            return self.record(str(obj), keys, "path", kind)
        if isinstance(obj, (dict, list, tuple, set, frozenset)):
            return self.container(obj, path, keys, depth)
        if isinstance(obj, argparse.Namespace):
            return self.record(self.items(vars(obj), path, keys, depth), keys, "namespace", kind)
        if dataclasses.is_dataclass(obj):
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return self.record(self.items(fields, path, keys, depth), keys, "dataclass", kind)
        base = next((b for b in _SCALARS if isinstance(obj, b)), None)
        if base is not None:  # e.g. a str subclass: stored as the str it is
            return self.record(base(obj), keys, "scalar", kind)
        raise UnsupportedObjectError(path, _unsupported_reason(obj))

    def container(self, obj: Any, path: str, keys: tuple[_Key, ...], depth: int) -> Any:
        if id(obj) in self.open:
            raise UnsupportedObjectError(path, "the object contains itself (a reference cycle)")
        self.open.add(id(obj))
        try:
            kind = type(obj)
            if isinstance(obj, dict):
                plain = self.items(obj, path, keys, depth)
                if kind is OrderedDict:
                    out: OrderedDict[Any, Any] = OrderedDict(plain)
                    if hasattr(obj, "_metadata"):  # what load_state_dict uses for versions
                        out._metadata = obj._metadata  # type: ignore[attr-defined]
                    return out
                return plain if kind is dict else self.record(plain, keys, "mapping", kind)
            items = [
                self.value(v, f"{path}[{i}]", (*keys, i), depth + 1) for i, v in enumerate(obj)
            ]
            if isinstance(obj, (set, frozenset)):
                return self.record(items, keys, "set", kind)
            if kind is list:
                return items
            if kind is tuple:
                return tuple(items)
            if isinstance(obj, tuple):
                named = "namedtuple" if hasattr(obj, "_fields") else "sequence"
                return self.record(tuple(items), keys, named, kind)
            return self.record(items, keys, "sequence", kind)
        finally:
            self.open.discard(id(obj))

    def items(
        self, mapping: dict[Any, Any], path: str, keys: tuple[_Key, ...], depth: int
    ) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for key, value in mapping.items():
            if type(key) not in _KEY_TYPES:
                raise UnsupportedObjectError(
                    f"{path}[{key!r}]",
                    "dict keys must be str, int, float, bool or None, not "
                    f"{type(key).__qualname__}",
                )
            out[key] = self.value(value, child_path(path, key), (*keys, key), depth + 1)
        return out


def _unsupported_reason(obj: Any) -> str:
    kind = type(obj)
    if isinstance(obj, torch.nn.Module):
        return (
            f"a module ({kind.__qualname__}) cannot be stored; if it is a hyperparameter, "
            "leave it out with self.save_hyperparameters(ignore=[...])"
        )
    if callable(obj):
        return (
            f"{kind.__qualname__} objects (functions, lambdas, callables) cannot be stored "
            "without pickle; leave it out with self.save_hyperparameters(ignore=[...]) or "
            "store its name instead"
        )
    return (
        f"objects of type {kind.__module__}.{kind.__qualname__} are not supported (asyncckpt "
        "never pickles); store plain data, a dataclass or an enum instead, e.g. in "
        "on_save_checkpoint"
    )


def from_plain(
    checkpoint: dict[str, Any], classes: Iterable[type] = (), name: str = "checkpoint"
) -> dict[str, Any]:
    """Undo :func:`to_plain` for the values whose class is trusted.

    Trusted are Lightning's ``AttributeDict``, ``pathlib`` paths, ``argparse.Namespace``,
    ``set``, ``frozenset``, ``collections.Counter``, and ``classes``. Values of other classes
    stay the plain values they were stored as (an enum its value, a dataclass a dict ...).
    The record under ``PROJECTION_KEY`` is removed; a checkpoint without one is returned as
    it is.

    Args:
        checkpoint: what ``asyncckpt.load`` returned for a file the plugin saved. It is
            modified in place.
        classes: enum, dataclass, dict/list/tuple subclass ... classes to rebuild, matched by
            ``module.QualName``. No class is ever imported by a name read from a file.
        name: the file, for error messages.

    Returns:
        The checkpoint with trusted values rebuilt.

    Raises:
        FormatError: the record is malformed, newer than this version understands, or a
            stored value no longer fits its class (e.g. an enum member was removed).

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass
        ... class Opt:
        ...     lr: float = 0.1
        >>> plain = to_plain({"hp": Opt()})
        >>> from_plain(dict(plain))["hp"]
        {'lr': 0.1}
        >>> from_plain(dict(plain), classes=[Opt])["hp"]
        Opt(lr=0.1)
    """
    if not isinstance(checkpoint, dict):
        raise FormatError(f"{name}: a checkpoint must be a dict, not {type(checkpoint).__name__}")
    meta = checkpoint.pop(PROJECTION_KEY, None)
    if meta is None:
        return checkpoint
    records = _parse_record(meta, name)
    trusted = dict(_BUILTIN_TRUSTED)
    trusted.update((_name(cls), cls) for cls in classes)
    by_path: dict[tuple[Any, ...], list[tuple[str, str]]] = {}
    prefixes: set[tuple[Any, ...]] = set()
    for keys, kind, cls_name in records:
        if cls_name in trusted:
            by_path.setdefault(keys, []).append((kind, cls_name))
            prefixes.update(keys[:i] for i in range(len(keys) + 1))
    if not by_path:
        return checkpoint
    return _Rebuilder(by_path, prefixes, trusted, name).node(checkpoint, (), CHECKPOINT_ROOT)  # type: ignore[no-any-return]


def _parse_record(meta: Any, name: str) -> list[tuple[tuple[Any, ...], str, str]]:
    def bad(what: str) -> FormatError:
        return FormatError(f"{name}: invalid {PROJECTION_KEY} record: {what}")

    if type(meta) is not dict or type(meta.get("conversions")) is not list:
        raise bad("expected a dict with a list of conversions")
    version = meta.get("version")
    if type(version) is not int or not 1 <= version <= PROJECTION_VERSION:
        raise bad(
            f"version {version!r}; this asyncckpt reads versions 1 to {PROJECTION_VERSION} "
            "(upgrade asyncckpt to read newer ones)"
        )
    out = []
    for entry in meta["conversions"]:
        if type(entry) is not dict:
            raise bad("a conversion is not a dict")
        keys, kind, cls_name = entry.get("path"), entry.get("kind"), entry.get("class")
        if type(keys) is not list or not all(type(k) in _KEY_TYPES for k in keys):
            raise bad(f"bad path {keys!r}")
        if kind not in _KINDS or type(cls_name) is not str:
            raise bad(f"bad kind or class {kind!r} {cls_name!r}")
        out.append((tuple(keys), kind, cls_name))
    return out


@dataclasses.dataclass
class _Rebuilder:
    by_path: dict[tuple[Any, ...], list[tuple[str, str]]]
    prefixes: set[tuple[Any, ...]]
    trusted: dict[str, type]
    name: str

    def node(self, obj: Any, keys: tuple[Any, ...], path: str) -> Any:
        # Children first: a trusted value is built from already rebuilt parts.
        if isinstance(obj, dict):
            for key in list(obj):
                if (*keys, key) in self.prefixes:
                    obj[key] = self.node(obj[key], (*keys, key), child_path(path, key))
        elif isinstance(obj, (list, tuple)):
            items = [
                self.node(v, (*keys, i), f"{path}[{i}]") if (*keys, i) in self.prefixes else v
                for i, v in enumerate(obj)
            ]
            obj = items if isinstance(obj, list) else tuple(items)
        for kind, cls_name in self.by_path.get(keys, ()):
            obj = self.build(kind, self.trusted[cls_name], obj, path)
        return obj

    def build(self, kind: str, cls: type, value: Any, path: str) -> Any:
        builders: dict[str, Callable[[], Any]] = {
            "mapping": lambda: cls(self.expect(value, dict)),
            "namespace": lambda: cls(**self.expect(value, dict)),
            "sequence": lambda: cls(self.expect(value, (list, tuple))),
            "namedtuple": lambda: cls(*self.expect(value, (list, tuple))),
            "set": lambda: cls(self.expect(value, list)),
            "enum": lambda: cls(value),
            "dataclass": lambda: self.dataclass(cls, self.expect(value, dict)),
            "path": lambda: cls(self.expect(value, str)),
            "scalar": lambda: cls(value),
            "class": lambda: cls,
        }
        try:
            return builders[kind]()
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise FormatError(
                f"{self.name}: cannot rebuild {path} as {_name(cls)} ({kind}) from the stored "
                f"{type(value).__name__}: {exc}. Did the class change since the save? Load "
                "without it in classes= to get the plain value."
            ) from exc

    def expect(self, value: Any, types: type | tuple[type, ...]) -> Any:
        if not isinstance(value, types):
            raise TypeError(f"expected {types}, found {type(value).__name__}")
        return value

    @staticmethod
    def dataclass(cls: type, fields: dict[str, Any]) -> Any:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__qualname__} is not a dataclass")
        spec = dataclasses.fields(cls)
        obj = cls(**{f.name: fields[f.name] for f in spec if f.init and f.name in fields})
        for f in spec:  # init=False fields are set after construction, frozen or not
            if not f.init and f.name in fields:
                object.__setattr__(obj, f.name, fields[f.name])
        return obj
