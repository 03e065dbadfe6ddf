"""``asyncckpt convert SRC DST``: between torch.save, asyncckpt and safetensors files."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from asyncckpt._api.dropin import write_options
from asyncckpt._convert.consolidate import ShardedSource, materialize_all, write_ackpt_stream
from asyncckpt._convert.safetensors import (
    dense_copy_bytes,
    flat_tensors,
    header_metadata,
    read_safetensors,
    stream_safetensors,
    tensor_spec,
    write_hub_shards,
    write_safetensors,
)
from asyncckpt._engine.decode import Budget
from asyncckpt._engine.encode import abort_strays
from asyncckpt._storage import Storage, resolve
from asyncckpt._versions import paths
from asyncckpt.cli.common import (
    EXIT_OK,
    FileRef,
    RootRef,
    UsageError,
    display,
    emit,
    locate,
    plural,
    progress,
    single_file,
)
from asyncckpt.cli.formats import (
    format_of,
    load_ackpt,
    load_torch,
    open_sharded,
    part_at,
    save_ackpt,
    save_torch,
    source_format,
)
from asyncckpt.cli.progress import Progress, format_bytes
from asyncckpt.errors import SafetensorsError


def tensors_in(obj: Any) -> tuple[int, int]:
    """How many tensors ``obj`` holds and their bytes (a tensor seen twice counts twice).

    Example:
        >>> tensors_in({"a": torch.zeros(2), "b": [torch.zeros(3, dtype=torch.int8)]})
        (2, 11)
    """
    count = nbytes = 0
    seen: set[int] = set()
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            count += 1
            nbytes += value.numel() * value.element_size()
        elif isinstance(value, dict) and id(value) not in seen:
            seen.add(id(value))
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)) and id(value) not in seen:
            seen.add(id(value))
            stack.extend(value)
    return count, nbytes


def _source(args: argparse.Namespace, src_ref: FileRef | RootRef) -> tuple[FileRef, str]:
    """The file to read (``src_ref``: what SRC names) and its format."""
    src_format = format_of(args.src, args.src_format, "SRC")
    if isinstance(src_ref, RootRef):
        if src_format not in (None, "ackpt"):
            raise UsageError(f"asyncckpt convert: {args.src} is a checkpoint root (asyncckpt)")
        src_format = "ackpt"
    src = single_file(src_ref)
    return src, source_format(src, args.src_format, src_format)


def _read(args: argparse.Namespace, src: FileRef, fmt: str) -> tuple[Any, dict[str, str] | None]:
    """The state in ``src`` and, for safetensors, its metadata."""
    with progress(args, src.storage.size(src.path), f"read {fmt}") as bar:
        if fmt == "ackpt":
            return load_ackpt(src, bar.update, args.max_bytes, settings=args.settings), None
        if fmt == "torch":
            return load_torch(src, bar.update), None
        return read_safetensors(src.storage, src.path, bar.update)


def cmd_convert(args: argparse.Namespace) -> int:
    """``asyncckpt convert SRC DST``."""
    if args.shard_size is not None and args.dst_format not in (None, "safetensors"):
        raise UsageError("asyncckpt convert: --shard-size writes safetensors shards only")
    dst_format = "safetensors" if args.shard_size else format_of(args.dst, args.dst_format, "DST")
    assert dst_format is not None  # DST's format is told, or format_of raised
    storage, path = resolve(args.dst, args.options, args.settings)
    src_ref = locate(args.src, args.options, one=True, settings=args.settings)
    sharded = None  # a sharded checkpoint, opened (None: a single file or version)
    if args.src_format in (None, "ackpt") and isinstance(src_ref, RootRef):
        sharded = open_sharded(src_ref, args.settings)
    with contextlib.nullcontext() if sharded is None else sharded:
        if not args.force and paths.kind_of(storage, path)[0] != paths.MISSING:
            raise UsageError(f"asyncckpt convert: {args.dst} exists; pass --force to replace it")
        if sharded is None:
            doc, source = _convert_file(args, src_ref, dst_format, storage, path)
        else:
            doc, source = _convert_sharded(args, sharded, dst_format, storage, path)
    abort_strays(storage, path)  # a convert killed mid-upload to DST left one
    emit(
        args,
        doc,
        f"{source} -> {doc['dst']} ({dst_format}, {format_bytes(doc['dst_bytes'])}): "
        f"{plural(doc['tensors'], 'tensor')}, {format_bytes(doc['raw_bytes'])}",
    )
    return EXIT_OK


def _convert_file(
    args: argparse.Namespace,
    src_ref: FileRef | RootRef,
    dst_format: str,
    storage: Storage,
    path: str,
) -> tuple[dict[str, Any], str]:
    """Convert one file (or single-file version): its report and how the line names SRC."""
    src, src_format = _source(args, src_ref)
    size = src.storage.size(src.path)
    obj, metadata = _read(args, src, src_format)
    obj = part_at(obj, args.key, src.name)[0]
    count, nbytes = tensors_in(obj)
    with progress(args, nbytes, f"write {dst_format}") as bar:
        if dst_format == "safetensors":
            flat = _flat(args, obj, src.name)
            del obj  # the flat dict holds the same tensors; nothing else should keep them
            _charge_dense_copies(args, flat, src.name)
            if args.shard_size:
                written = _write_hub(args, flat, storage, path, bar)
            else:
                with _writing(storage, path):
                    written = write_safetensors(flat, storage, path, metadata, bar.update)
        elif dst_format == "torch":
            written = save_torch(obj, storage, path, bar.update)
        else:
            written = save_ackpt(
                obj, storage, path, args.compression, bar.update, settings=args.settings
            )
    doc = {
        "src": src.name,
        "src_format": src_format,
        "dst": display(storage, path),
        "dst_format": dst_format,
        "key": args.key,
        "tensors": count,
        "raw_bytes": nbytes,
        "src_bytes": size,
        "dst_bytes": written,
    }
    return doc, f"converted {src.name} ({src_format}, {format_bytes(size)})"


def _charge_dense_copies(
    args: argparse.Namespace, flat: dict[str, torch.Tensor], name: str
) -> None:
    """Refuse, within ``--max-bytes``, the copies safetensors' dense layout needs on top of
    the state as loaded: a broadcast (zero-stride) tensor stored in a few bytes is written
    at its whole size. One file holds every copy at once; ``--shard-size`` one at a time."""
    copies = dense_copy_bytes(flat)
    if not copies:
        return
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in flat.values()}
    extra = max(copies) if args.shard_size else sum(copies)
    Budget(args.max_bytes).charge(
        name, sum(held.values()) + extra, "its tensors made dense for safetensors"
    )


def _convert_sharded(
    args: argparse.Namespace, src: ShardedSource, dst_format: str, storage: Storage, path: str
) -> tuple[dict[str, Any], str]:
    """Consolidate a sharded checkpoint into one file, tensor by tensor (see
    :mod:`asyncckpt._convert.consolidate`)."""
    tree = part_at(src.skeleton, args.key, src.name)[0]
    count, nbytes, largest = src.raw_bytes(tree)
    if dst_format == "torch":  # torch.save pickles one object: all of it is built first
        Budget(args.max_bytes).charge(src.name, nbytes, "the whole state (torch.save output)")
    else:  # streamed: one tensor at a time
        Budget(args.max_bytes).charge(src.name, largest, "its largest tensor")
    sizes = {loc.file: loc.file_size for loc in src.metadata.storage_data.values()}
    with progress(args, nbytes, f"write {dst_format}") as bar:
        if dst_format == "safetensors":
            flat = _flat(args, tree, src.name)
            if args.shard_size:
                written = _write_hub(args, flat, storage, path, bar, src)
            else:
                specs = [(key, *src.spec(t)) for key, t in flat.items()]
                meta = header_metadata(flat, {}, None)
                with _writing(storage, path):
                    written = stream_safetensors(
                        specs, lambda key: src.full(flat[key]), storage, path, meta, bar.update
                    )
        elif dst_format == "torch":
            written = save_torch(materialize_all(src, tree), storage, path, bar.update)
        else:
            options = write_options(args.compression, args.settings)
            written = write_ackpt_stream(src, tree, storage, path, options, bar.update)
    doc = {
        "src": src.name,
        "src_format": "sharded",
        "dst": display(storage, path),
        "dst_format": dst_format,
        "key": args.key,
        "tensors": count,
        "raw_bytes": nbytes,
        "largest_tensor_bytes": largest,
        "src_files": len(sizes),
        "src_bytes": sum(sizes.values()),
        "dst_bytes": written,
        "streamed": dst_format != "torch",
    }
    source = f"({plural(len(sizes), 'rank file')}, {format_bytes(sum(sizes.values()))})"
    return doc, f"consolidated {src.name} {source}"


@contextlib.contextmanager
def _writing(storage: Storage, path: str) -> Iterator[None]:
    """What safetensors cannot hold (a dtype, a shape) is an error that names DST."""
    try:
        yield
    except ValueError as exc:  # SafetensorsError included: it names the key
        raise SafetensorsError(f"cannot write {storage.describe(path)}: {exc}") from None


def _flat(args: argparse.Namespace, tree: Any, name: str) -> dict[str, torch.Tensor]:
    """The selected part as safetensors' flat dict (the error names SRC and ``--key``)."""
    return flat_tensors(tree, f"{name} --key {args.key}" if args.key else name)


def _write_hub(
    args: argparse.Namespace,
    flat: dict[str, torch.Tensor],
    storage: Storage,
    directory: str,
    bar: Progress,
    src: ShardedSource | None = None,
) -> int:
    """``--shard-size``: the folder of safetensors shards and the index ``from_pretrained``
    reads, one tensor in memory at a time (built by ``src``, if sharded)."""
    full, spec = (lambda t: t, tensor_spec) if src is None else (src.full, src.spec)
    with _writing(storage, directory):
        names, written = write_hub_shards(
            flat, full, spec, storage, directory, args.shard_size, bar.update
        )
    for name in names:
        abort_strays(storage, storage.join(directory, name))
    return written
