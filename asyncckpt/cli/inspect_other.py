"""``inspect`` of files asyncckpt did not write: ``torch.save`` files (loaded weights-only,
memory-mapped where torch can) and safetensors files (their JSON header only).

The rows have the shape of an asyncckpt file's rows (key, depth, kind, dtype, shape,
nbytes, device), so the table and ``--json`` read the same for every format.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from asyncckpt._convert.safetensors import read_header
from asyncckpt._progress import format_bytes
from asyncckpt.cli.common import FileRef, emit, plural
from asyncckpt.cli.terminal import table


def _leaf(value: Any) -> dict[str, Any] | None:
    if isinstance(value, torch.Tensor):
        return {
            "kind": "parameter" if isinstance(value, torch.nn.Parameter) else "tensor",
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "nbytes": value.numel() * value.element_size(),
            "device": str(value.device),
            "codecs": [],
            "_storage": (value.untyped_storage().data_ptr(), value.storage_offset())
            if value.numel()
            else None,
        }
    if isinstance(value, np.ndarray):
        return {
            "kind": "ndarray",
            "dtype": str(value.dtype),
            "shape": list(value.shape),
            "nbytes": value.nbytes,
            "device": "cpu",
            "codecs": [],
        }
    return None


def torch_rows(
    args: argparse.Namespace, ref: FileRef, walk: Callable[..., list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """The rows of a ``torch.save`` file, loaded with ``weights_only=True`` (mmap if it can).

    Raises:
        pickle.UnpicklingError: the file holds objects weights-only loading refuses.
    """
    from asyncckpt.cli.formats import load_torch, part_at  # imports torch: only when run

    obj, root = part_at(load_torch(ref), args.key, ref.name)
    rows = walk(obj, _leaf, root)
    first: dict[tuple[int, int], str] = {}
    for row in rows:  # tied weights: one storage saved under several keys
        ident = row.pop("_storage", None)
        if ident is not None and ident in first:
            row["shares_storage_with"] = first[ident]
        elif ident is not None:
            first[ident] = row["key"]
    return rows


def safetensors_rows(
    args: argparse.Namespace, ref: FileRef, walk: Callable[..., list[dict[str, Any]]]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The rows of a safetensors file from its header (no data read), and its metadata.

    Raises:
        SafetensorsError: the header is not valid.
    """
    from asyncckpt.cli.formats import part_at

    entries, metadata = read_header(ref.storage, ref.path)

    def leaf(value: Any) -> dict[str, Any] | None:
        if not isinstance(value, _Entry):
            return None
        row = {"kind": "tensor", **value.info, "device": "-", "codecs": []}
        row.pop("offset", None)
        if "alias_of" in row:
            row["shares_storage_with"] = f"state[{row.pop('alias_of')!r}]"
        return row

    tree = {key: _Entry(info) for key, info in entries.items()}
    obj, root = part_at(tree, args.key, ref.name)
    return walk(obj, leaf, root), metadata


class _Entry:
    """A safetensors header entry standing in for its tensor in the tree."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info


def show_other(
    args: argparse.Namespace,
    ref: FileRef,
    fmt: str,
    rows: list[dict[str, Any]],
    metadata: dict[str, str] | None,
    table_rows: Callable[[list[dict[str, Any]]], list[list[str]]],
) -> None:
    """Print the summary and the table (or ``--json``) of a torch or safetensors file."""
    tensors = [r for r in rows if "dtype" in r and "shares_storage_with" not in r]
    raw = sum(int(r["nbytes"]) for r in tensors)
    size = ref.storage.size(ref.path)
    doc = {
        "file": ref.name,
        "step": None,
        "format": fmt,
        "size": size,
        "raw_bytes": raw,
        "tensors": len(tensors),
        "metadata": metadata,
        "entries": rows,
    }
    what = (
        "torch.save file (read with weights_only=True)"
        if fmt == "torch"
        else ("safetensors file (header only)")
    )
    lines = [
        ref.name,
        f"  {what}: {plural(len(tensors), 'tensor')}",
        f"  {format_bytes(raw)} raw, file {format_bytes(size)}",
        "",
    ]
    lines += table(
        ["KEY", "TYPE", "DTYPE/SHAPE/VALUE", "SIZE", "DEVICE", "CODEC"], table_rows(rows)
    )
    emit(args, doc, lines)
