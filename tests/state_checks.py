"""Bit-exact comparison of checkpoint states in tests (DTensors compared by local shard),
and of the files under a root."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch


def bits(t: torch.Tensor) -> bytes:
    """A tensor's exact bytes (NaN payloads and -0.0 included)."""
    t = t.detach().cpu().contiguous()
    return bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """``{path: leaf}`` of nested dicts, lists and tuples; DTensors become their local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(flat(v, f"{prefix}.{i}"))
        return out
    if isinstance(obj, DTensor):
        return {prefix: obj.to_local()}
    return {prefix: obj}


def assert_same(got: Any, want: Any) -> None:
    """Same keys, tensors equal bit for bit (same dtype and shape), other leaves equal."""
    g, w = flat(got), flat(want)
    assert g.keys() == w.keys(), sorted(g.keys() ^ w.keys())
    for key, expected in w.items():
        value = g[key]
        if isinstance(expected, torch.Tensor):
            assert isinstance(value, torch.Tensor), key
            assert (value.dtype, value.shape) == (expected.dtype, expected.shape), key
            assert bits(value) == bits(expected), key
        else:
            assert value == expected, key


def cloned(obj: Any) -> Any:
    """A deep copy whose tensors (DTensors: local shards) own their memory."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cloned(v) for v in obj)
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    return obj


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` and what it holds (a content hash; directories and
    links by kind): a process that rewrote a file with new bytes under the same name
    changes this, not only one that adds or removes a name."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out
