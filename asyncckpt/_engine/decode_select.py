"""Which entries of a file a partial load reads: the top-level keys asked for (``keys=``),
or the subtrees an ``into=`` target has, found in the manifest's root before any chunk is
read, so that the chunks of everything else are never fetched.

Selection is by top-level key of a saved dict (``{"model": ..., "optim": ...}``); nested
paths are not selected (load the top-level key and index it).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from asyncckpt._format.container import MAX_DEPTH, Manifest
from asyncckpt._format.tree import unflatten
from asyncckpt.errors import FormatError, MissingKeyError

__all__ = ["Selection", "for_into", "referenced", "select", "top_level"]


@dataclass(frozen=True)
class Selection:
    """The manifest's root with only the selected top-level pairs, and the indices into
    the file's tensor and array tables that it refers to."""

    root: Any
    tensors: frozenset[int]
    arrays: frozenset[int]


def top_level(root: Any, name: str) -> list[tuple[Any, Any]] | None:
    """The ``(key, value node)`` pairs of the saved root dict, keys decoded; None if the
    saved object is not a dict.

    Raises:
        FormatError: a key node is malformed.

    Example:
        >>> top_level({"dict": [["w", {"tensor": 0}], [3, None]]}, "f")
        [('w', {'tensor': 0}), (3, None)]
    """
    if type(root) is not dict:
        return None
    pairs = root.get("odict", root.get("dict")) if len(root) <= 2 else None
    if type(pairs) is not list:
        return None
    out = []
    for pair in pairs:
        if type(pair) is not list or len(pair) != 2:
            raise FormatError(f"{name}: invalid manifest at the root: expected [key, value]")
        out.append((unflatten(pair[0], (), (), name), pair[1]))
    return out


def referenced(nodes: Iterable[Any]) -> tuple[set[int], set[int]]:
    """The tensor and array table indices that ``nodes`` refer to (malformed nodes are left
    to :func:`~asyncckpt._format.tree.unflatten` to refuse).

    Example:
        >>> referenced([{"list": [{"tensor": 1}, {"ndarray": 0}, 5]}])
        ({1}, {0})
    """
    tensors: set[int] = set()
    arrays: set[int] = set()
    stack = [(node, 0) for node in nodes]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            continue
        if type(node) is list:
            stack.extend((item, depth + 1) for item in node)
        elif type(node) is dict:
            for tag, value in node.items():
                if tag in ("tensor", "ndarray") and type(value) is int:
                    (tensors if tag == "tensor" else arrays).add(value)
                else:
                    stack.append((value, depth + 1))
    return tensors, arrays


def select(manifest: Manifest, keys: Collection[Any], name: str) -> Selection:
    """The selection of the top-level ``keys`` of the saved dict, in the file's order.

    Raises:
        MissingKeyError: a key is not a top-level key of the file (or the saved object is
            not a dict); names the file and the keys it has.

    Example:
        >>> from asyncckpt._format.container import Manifest
        >>> root = {"dict": [["model", {"tensor": 0}], ["optim", {"tensor": 1}]]}
        >>> select(Manifest((), (), (), (), root), ["model"], "f").tensors
        frozenset({0})
    """
    if isinstance(keys, (str, bytes, int)):
        raise TypeError(f"keys must be a collection of top-level keys, got {keys!r}")
    pairs = top_level(manifest.root, name)
    if pairs is None:
        raise MissingKeyError(
            f"{name}: keys= selects top-level keys of a saved dict, but this file holds "
            "something else; load it without keys="
        )
    wanted = list(keys)
    have = [key for key, _node in pairs]
    missing = [key for key in wanted if key not in have]
    if missing:
        raise MissingKeyError(
            f"{name}: no top-level key {missing[0]!r}; the file's top-level keys are {have}"
        )
    return _pruned(manifest.root, [i for i, (key, _node) in enumerate(pairs) if key in wanted])


def for_into(manifest: Manifest, into: Any, name: str) -> Selection | None:
    """What a load into ``into`` reads: the top-level subtrees ``into`` has, and every
    top-level value that holds no tensor or array (a step count: nothing to fetch). None
    (read everything) unless both ``into`` and the saved object are dicts.

    Example:
        >>> from asyncckpt._format.container import Manifest
        >>> root = {"dict": [["model", {"tensor": 0}], ["optim", {"tensor": 1}], ["step", 3]]}
        >>> for_into(Manifest((), (), (), (), root), {"model": {}}, "f").root
        {'dict': [['model', {'tensor': 0}], ['step', 3]]}
    """
    pairs = top_level(manifest.root, name) if isinstance(into, dict) else None
    if pairs is None:
        return None
    kept = [
        i
        for i, (key, node) in enumerate(pairs)
        if _hashable_in(key, into) or referenced([node]) == (set(), set())
    ]
    return _pruned(manifest.root, kept)


def _hashable_in(key: Any, into: dict[Any, Any]) -> bool:
    try:
        return key in into
    except TypeError:
        return False


def _pruned(root: dict[str, Any], kept: list[int]) -> Selection:
    """``root`` with only its pairs at the indices ``kept`` (key nodes as saved)."""
    tag = "odict" if "odict" in root else "dict"
    pruned = {**root, tag: [root[tag][i] for i in kept]}
    tensors, arrays = referenced([pruned])
    return Selection(pruned, frozenset(tensors), frozenset(arrays))
