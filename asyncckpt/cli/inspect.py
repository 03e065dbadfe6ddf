"""``asyncckpt inspect PATH | ROOT[@STEP]``: what a checkpoint holds, without its data.

Files asyncckpt did not write are shown too: ``torch.save`` files (loaded weights-only,
memory-mapped where torch can) and safetensors files (their JSON header only). Their rows
have the shape of an asyncckpt file's rows (key, depth, kind, dtype, shape, nbytes, device),
so the table and ``--json`` read the same for every format.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from asyncckpt._convert.consolidate import ShardedSource
from asyncckpt._convert.safetensors import read_header
from asyncckpt._engine.decode import Budget
from asyncckpt._format.container import DTYPE_ITEMSIZE, FORMAT_VERSION, Manifest
from asyncckpt._format.tree import child_path
from asyncckpt.cli.common import (
    EXIT_OK,
    DataRef,
    FileRef,
    RootRef,
    UsageError,
    chosen_step,
    display,
    emit,
    locate,
    manifest_tree,
    pending_note,
    plural,
    short_time,
    single_file,
)
from asyncckpt.cli.formats import load_torch, open_sharded, part_at, read_ackpt, sniff
from asyncckpt.cli.progress import format_bytes
from asyncckpt.cli.terminal import table, terminal_width


def _codecs(manifest: Manifest, sid: int) -> tuple[list[str], int]:
    entry = manifest.storages[sid]
    chunks = manifest.chunks[entry.first_chunk : entry.first_chunk + entry.num_chunks]
    return sorted({c.codec for c in chunks}), sum(c.stored_len for c in chunks)


def _leaf_row(
    kind: str, dtype: str, shape: Sequence[int], nbytes: int, device: str, codecs: list[str]
) -> dict[str, Any]:
    """A tensor's or array's row, the same fields for every format (more may follow)."""
    return dict(
        kind=kind, dtype=dtype, shape=list(shape), nbytes=nbytes, device=device, codecs=codecs
    )


def _tensor_row(manifest: Manifest, index: int, seen: dict[int, str]) -> dict[str, Any]:
    t = manifest.tensors[index]
    entry = manifest.storages[t.storage]
    codecs, stored = _codecs(manifest, t.storage)
    nbytes = math.prod(t.shape) * DTYPE_ITEMSIZE.get(t.dtype, 1)
    kind = "parameter" if t.parameter else "tensor"
    out = {
        **_leaf_row(kind, t.dtype, t.shape, nbytes, entry.device, codecs),
        "storage": t.storage,
        "storage_bytes": entry.nbytes,
        "stored_bytes": stored,
        "requires_grad": t.requires_grad,
    }
    if t.storage in seen:
        out["shares_storage_with"] = seen[t.storage]
    else:
        seen[t.storage] = t.key
    return out


def _array_row(manifest: Manifest, index: int) -> dict[str, Any]:
    a = manifest.arrays[index]
    codecs, stored = _codecs(manifest, a.storage)
    nbytes = manifest.storages[a.storage].nbytes
    return {**_leaf_row("ndarray", a.dtype, a.shape, nbytes, "cpu", codecs), "stored_bytes": stored}


def entries(manifest: Manifest, obj: Any, root: str) -> list[dict[str, Any]]:
    """One row per node of ``obj`` (the file's tree from
    :func:`~asyncckpt.cli.common.manifest_tree`, or a part of it, labelled ``root``), parents
    before their children: key path, depth, kind and details."""
    seen: dict[int, str] = {}

    def leaf(value: Any) -> dict[str, Any] | None:
        if isinstance(value, DataRef) and value.table == "tensor":
            return _tensor_row(manifest, value.index, seen)
        if isinstance(value, DataRef):
            return _array_row(manifest, value.index)
        return None

    return walk_tree(obj, root, leaf)


def _value_row(value: Any) -> dict[str, Any]:
    text = repr(value)
    return {"kind": type(value).__name__, "value": text if len(text) <= 60 else text[:57] + "..."}


def walk_tree(
    obj: Any, root: str, leaf: Callable[[Any], dict[str, Any] | None]
) -> list[dict[str, Any]]:
    """Rows of a tree, parents before children: containers with their length, leaves as
    ``leaf`` describes them (None: shown by their ``repr``); ``root`` names the top."""
    rows: list[dict[str, Any]] = []

    def walk(value: Any, path: str, depth: int) -> None:
        if isinstance(value, dict):
            kind = "OrderedDict" if isinstance(value, OrderedDict) else "dict"
            rows.append({"key": path, "depth": depth, "kind": kind, "length": len(value)})
            for k, v in value.items():
                walk(v, child_path(path, k), depth + 1)
        elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
            kind = type(value).__name__
            rows.append({"key": path, "depth": depth, "kind": kind, "length": len(value)})
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]", depth + 1)
        else:
            rows.append({"key": path, "depth": depth, **(leaf(value) or _value_row(value))})

    walk(obj, root, 0)
    return rows


def deep_enough(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows down to ``--depth`` (all of them without it)."""
    return [r for r in rows if args.depth is None or int(r["depth"]) <= args.depth]


def _label(row: dict[str, Any], parent: str | None) -> str:
    key: str = row["key"]
    if parent is not None and key.startswith(parent):
        key = key[len(parent) :]
    return "  " * int(row["depth"]) + key


def _table(rows: list[dict[str, Any]], last: str = "CODEC", fit: int | None = None) -> list[str]:
    """The rows as the table ``inspect`` prints, keys indented by depth."""
    out: list[list[str]] = []
    parents: list[str] = []
    for row in rows:
        del parents[row["depth"] :]
        label = _label(row, parents[-1] if parents else None)
        kind = row["kind"]
        if "length" in row:
            parents.append(row["key"])
            out.append([label, kind, plural(row["length"], "item"), "", "", ""])
        elif "dtype" in row:
            detail = f"{row['dtype']} {list(row['shape'])}"
            codecs = ",".join(row["codecs"]) or "-"
            if "shards" in row:
                codecs = plural(row["shards"], "shard")
            if "shares_storage_with" in row:
                codecs = f"shares storage with {row['shares_storage_with']}"
            out.append([label, kind, detail, format_bytes(row["nbytes"]), row["device"], codecs])
        else:
            out.append([label, kind, row["value"], "", "", ""])
    return table(["KEY", "TYPE", "DTYPE/SHAPE/VALUE", "SIZE", "DEVICE", last], out, fit=fit)


def _summary(doc: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    raw, stored, size = doc["raw_bytes"], doc["stored_bytes"], doc["size"]
    codecs = ", ".join(f"{n} {c}" for c, n in sorted(doc["codecs"].items()))
    return [
        doc["file"] + (f" (step {doc['step']})" if doc["step"] is not None else ""),
        f"  format {FORMAT_VERSION}, written by {meta.get('library', '?')} with torch "
        f"{meta.get('torch', '?')} at {short_time(meta.get('created'))} UTC",
        f"  {plural(doc['tensors'], 'tensor')}, {plural(doc['arrays'], 'array')} in "
        f"{plural(doc['storages'], 'storage')}, {plural(doc['chunks'], 'chunk')} ({codecs})",
        f"  {format_bytes(raw)} raw, {format_bytes(stored)} stored"
        + (f" ({100 * stored / raw:.1f}%)" if raw else "")
        + f", file {format_bytes(size)}",
        "",
    ]


def _file_format(ref: FileRef) -> str:
    """What a file named on the command line is, by its first bytes (an unknown one is
    read as asyncckpt, whose reader says what is wrong with it)."""
    try:
        return sniff(ref)
    except UsageError:
        return "ackpt"


def cmd_inspect(args: argparse.Namespace) -> int:
    """``asyncckpt inspect PATH | ROOT[@STEP]``."""
    located = locate(args.target, args.options, one=True, settings=args.settings)
    if isinstance(located, RootRef):
        src = open_sharded(located, args.settings)
        if src is not None:
            with src:
                return _inspect_sharded(args, located, src)
    ref = single_file(located)
    fmt = _file_format(ref) if ref is located else "ackpt"
    if fmt == "torch":
        _show_other(args, ref, fmt, _torch_rows(args, ref), None)
        return EXIT_OK
    if fmt == "safetensors":
        _show_other(args, ref, fmt, *_safetensors_rows(args, ref))
        return EXIT_OK
    manifest, tree, size = read_ackpt(ref, lambda o: (o.manifest, manifest_tree(o), o.size))
    rows = deep_enough(args, entries(manifest, *part_at(tree, args.key, ref.name)))
    raw = sum(s.nbytes for s in manifest.storages)
    Budget(args.max_bytes).charge(ref.name, raw, "its storages")
    stored = sum(c.stored_len for c in manifest.chunks)
    doc = {
        "file": ref.name,
        "step": ref.step,
        "format": "ackpt",
        "size": size,
        "format_version": FORMAT_VERSION,
        "meta": manifest.meta,
        "raw_bytes": raw,
        "stored_bytes": stored,
        "ratio": stored / raw if raw else None,
        "tensors": len(manifest.tensors),
        "arrays": len(manifest.arrays),
        "storages": len(manifest.storages),
        "chunks": len(manifest.chunks),
        "codecs": dict(Counter(c.codec for c in manifest.chunks)),
        "entries": rows,
        "pending": pending_note(ref.storage, ref.path),
    }
    lines = _summary(doc, manifest.meta)
    lines += _table(rows, fit=terminal_width())
    if doc["pending"]:
        lines.append(f"note: {doc['pending']}; this is the file as it was before that save")
    emit(args, doc, lines)
    return EXIT_OK


def _sharded_rows(args: argparse.Namespace, src: ShardedSource) -> list[dict[str, Any]]:
    def leaf(value: Any) -> dict[str, Any] | None:
        if isinstance(value, torch.Tensor) and src.is_placeholder(value):
            return _shard_row(src, value)
        if isinstance(value, torch.Tensor):  # a plain tensor of rank 0's state
            return _loaded_row(value, "tensor", "cpu")
        return None

    tree, root = part_at(src.skeleton, args.key, display(src.storage, src.directory))
    return deep_enough(args, walk_tree(tree, root, leaf))


def _shard_row(src: ShardedSource, placeholder: torch.Tensor) -> dict[str, Any]:
    """What ``inspect`` shows of a sharded tensor: dtype, global shape, bytes, shards."""
    dtype, shape = src.spec(placeholder)
    md = src.metadata.state_dict_metadata[src.fqn_of(placeholder)]
    shards = len(md.chunks) if isinstance(md, TensorStorageMetadata) else 1
    nbytes = math.prod(shape) * dtype.itemsize
    row = _leaf_row("sharded tensor", str(dtype).removeprefix("torch."), shape, nbytes, "-", [])
    return {**row, "shards": shards}


def _inspect_sharded(args: argparse.Namespace, ref: RootRef, src: ShardedSource) -> int:
    """``inspect`` of a sharded version or an ``asyncckpt.dcp`` directory: global dtypes,
    shapes and shard counts from its metadata, plain values from rank 0's file."""
    rows = _sharded_rows(args, src)
    sizes = {loc.file: loc.file_size for loc in src.metadata.storage_data.values()}
    step = None if ref.step is None and src.directory == ref.path else chosen_step(ref)
    tensors = [r for r in rows if "dtype" in r]
    raw = sum(int(r["nbytes"]) for r in tensors)
    doc = {
        "file": display(src.storage, src.directory),
        "step": step,
        "layout": "sharded" if step is not None else "dcp",
        "rank_files": sorted(sizes),
        "raw_bytes": raw,
        "stored_bytes": sum(sizes.values()),
        "tensors": len(tensors),
        "entries": rows,
    }
    what = "sharded version" if step is not None else "asyncckpt.dcp checkpoint"
    lines = [
        doc["file"] + (f" (step {step})" if step is not None else ""),
        f"  {what}: {plural(len(tensors), 'tensor')} in {plural(len(sizes), 'rank file')}",
        f"  {format_bytes(raw)} raw, {format_bytes(doc['stored_bytes'])} stored",
        "",
    ]
    lines += _table(rows, "SHARDS", terminal_width())
    emit(args, doc, lines)
    return EXIT_OK


def _loaded_row(value: torch.Tensor, kind: str, device: str) -> dict[str, Any]:
    dtype = str(value.dtype).removeprefix("torch.")
    return _leaf_row(kind, dtype, value.shape, value.numel() * value.element_size(), device, [])


def _torch_leaf(value: Any) -> dict[str, Any] | None:
    if isinstance(value, torch.Tensor):
        kind = "parameter" if isinstance(value, torch.nn.Parameter) else "tensor"
        return {
            **_loaded_row(value, kind, str(value.device)),
            "_storage": (value.untyped_storage().data_ptr(), value.storage_offset())
            if value.numel()
            else None,
        }
    if isinstance(value, np.ndarray):
        return _leaf_row("ndarray", str(value.dtype), value.shape, value.nbytes, "cpu", [])
    return None


def _torch_rows(args: argparse.Namespace, ref: FileRef) -> list[dict[str, Any]]:
    """The rows of a ``torch.save`` file, loaded with ``weights_only=True`` (mmap if it can).

    Raises:
        pickle.UnpicklingError: the file holds objects weights-only loading refuses.
    """
    rows = walk_tree(*part_at(load_torch(ref), args.key, ref.name), _torch_leaf)
    first: dict[tuple[int, int], str] = {}
    for row in rows:  # tied weights: one storage saved under several keys
        ident = row.pop("_storage", None)
        if ident is not None and ident in first:
            row["shares_storage_with"] = first[ident]
        elif ident is not None:
            first[ident] = row["key"]
    return rows


class _Entry:
    """A safetensors header entry standing in for its tensor in the tree."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info


def _safetensors_leaf(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, _Entry):
        return None
    row = {"kind": "tensor", **value.info, "device": "-", "codecs": []}
    row.pop("offset", None)
    if "alias_of" in row:
        row["shares_storage_with"] = f"state[{row.pop('alias_of')!r}]"
    return row


def _safetensors_rows(
    args: argparse.Namespace, ref: FileRef
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The rows of a safetensors file from its header (no data read), and its metadata.

    Raises:
        SafetensorsError: the header is not valid.
    """
    entries, metadata = read_header(ref.storage, ref.path)
    tree = {key: _Entry(info) for key, info in entries.items()}
    return walk_tree(*part_at(tree, args.key, ref.name), _safetensors_leaf), metadata


def _show_other(
    args: argparse.Namespace,
    ref: FileRef,
    fmt: str,
    rows: list[dict[str, Any]],
    metadata: dict[str, str] | None,
) -> None:
    """Print the summary and the table (or ``--json``) of a torch or safetensors file."""
    rows = deep_enough(args, rows)
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
    what = {"torch": "torch.save file (read with weights_only=True)"}.get(
        fmt, "safetensors file (header only)"
    )
    lines = [
        ref.name,
        f"  {what}: {plural(len(tensors), 'tensor')}",
        f"  {format_bytes(raw)} raw, file {format_bytes(size)}",
        "",
    ]
    lines += _table(rows, fit=terminal_width())
    emit(args, doc, lines)
