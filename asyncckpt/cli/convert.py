"""``asyncckpt convert SRC DST``: between torch.save, asyncckpt and safetensors files."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from asyncckpt._api.dropin import write_options
from asyncckpt._convert.consolidate import (
    ShardedSource,
    materialize_all,
    write_ackpt_stream,
    write_safetensors_stream,
)
from asyncckpt._convert.safetensors import (
    flat_tensors,
    header_metadata,
    read_safetensors,
    write_hub_shards,
    write_safetensors,
)
from asyncckpt._engine.decode import Budget
from asyncckpt._engine.encode import abort_strays
from asyncckpt._progress import Progress, format_bytes
from asyncckpt._storage import Storage, resolve
from asyncckpt.cli.common import (
    EXIT_OK,
    FileRef,
    RootRef,
    display,
    emit,
    kind_of,
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
from asyncckpt.errors import SafetensorsError, UsageError


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


def _source(args: argparse.Namespace) -> tuple[FileRef, str]:
    """The file to read and its format."""
    src_ref = locate(args.src, args.options)
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
            return load_ackpt(src, bar.update, args.max_bytes), None
        if fmt == "torch":
            return load_torch(src, bar.update), None
        return read_safetensors(src.storage, src.path, bar.update)


def cmd_convert(args: argparse.Namespace) -> int:
    """``asyncckpt convert SRC DST``.

    Returns:
        The exit status (0).

    Raises:
        UsageError: DST exists (without ``--force``), or a format cannot be told.
    """
    if args.shard_size is not None and args.dst_format not in (None, "safetensors"):
        raise UsageError("asyncckpt convert: --shard-size writes safetensors shards only")
    dst_format = "safetensors" if args.shard_size else format_of(args.dst, args.dst_format, "DST")
    dst_storage, dst_path = resolve(args.dst, args.options)
    sharded = _sharded_source(args)
    if sharded is not None:
        with sharded:
            if not args.force and kind_of(dst_storage, dst_path) != "missing":
                raise UsageError(
                    f"asyncckpt convert: {args.dst} exists; pass --force to replace it"
                )
            assert dst_format is not None
            return _convert_sharded(args, sharded, dst_format, dst_storage, dst_path)
    if not args.force and kind_of(dst_storage, dst_path) != "missing":
        raise UsageError(f"asyncckpt convert: {args.dst} exists; pass --force to replace it")
    src, src_format = _source(args)
    size = src.storage.size(src.path)
    obj, metadata = _read(args, src, src_format)
    obj = part_at(obj, args.key, src.name)[0]
    count, nbytes = tensors_in(obj)
    with progress(args, nbytes, f"write {dst_format}") as bar:
        if args.shard_size:
            flat = flat_tensors(obj, f"{src.name} --key {args.key}" if args.key else src.name)
            del obj
            specs = {k: (t.dtype, tuple(t.shape)) for k, t in flat.items()}
            written = _write_hub(args, flat, flat.__getitem__, specs, dst_storage, dst_path, bar)
        elif dst_format == "safetensors":
            flat = flat_tensors(obj, f"{src.name} --key {args.key}" if args.key else src.name)
            del obj  # the flat dict holds the same tensors; nothing else should keep them
            written = write_safetensors(flat, dst_storage, dst_path, metadata, bar.update)
        elif dst_format == "torch":
            written = save_torch(obj, dst_storage, dst_path, bar.update)
        else:
            written = save_ackpt(obj, dst_storage, dst_path, args.compression, bar.update)
    abort_strays(dst_storage, dst_path)  # a convert killed mid-upload to DST left one
    dst_name = display(dst_storage, dst_path)
    doc = {
        "src": src.name,
        "src_format": src_format,
        "dst": dst_name,
        "dst_format": dst_format,
        "key": args.key,
        "tensors": count,
        "raw_bytes": nbytes,
        "src_bytes": size,
        "dst_bytes": written,
    }
    emit(
        args,
        doc,
        f"converted {src.name} ({src_format}, {format_bytes(size)}) -> {dst_name} "
        f"({dst_format}, {format_bytes(written)}): {plural(count, 'tensor')}, "
        f"{format_bytes(nbytes)}",
    )
    return EXIT_OK


def _sharded_source(args: argparse.Namespace) -> ShardedSource | None:
    """The sharded checkpoint SRC names, opened; None for a single file or version (see
    :func:`~asyncckpt.cli.formats.open_sharded`)."""
    if args.src_format not in (None, "ackpt"):
        return None
    ref = locate(args.src, args.options)
    if not isinstance(ref, RootRef):
        return None
    return open_sharded(ref, args.settings)


def _convert_sharded(
    args: argparse.Namespace, src: ShardedSource, dst_format: str, storage: Storage, path: str
) -> int:
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
        if args.shard_size:
            flat = flat_tensors(tree, f"{src.name} --key {args.key}" if args.key else src.name)
            specs = {k: src.spec(t) for k, t in flat.items()}
            written = _write_hub(args, flat, lambda k: src.full(flat[k]), specs, storage, path, bar)
        elif dst_format == "safetensors":
            flat = flat_tensors(tree, f"{src.name} --key {args.key}" if args.key else src.name)
            try:
                written = write_safetensors_stream(
                    src, flat, storage, path, header_metadata(flat, {}, None), bar.update
                )
            except ValueError as exc:
                raise SafetensorsError(f"cannot write {storage.describe(path)}: {exc}") from None
        elif dst_format == "torch":
            # torch.save pickles one object: the whole state is built in memory first.
            written = save_torch(materialize_all(src, tree), storage, path, bar.update)
        else:
            options = write_options(args.compression)
            written = write_ackpt_stream(src, tree, storage, path, options, bar.update)
    abort_strays(storage, path)
    dst_name = display(storage, path)
    doc = {
        "src": src.name,
        "src_format": "sharded",
        "dst": dst_name,
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
    emit(
        args,
        doc,
        f"consolidated {src.name} ({len(sizes)} rank files, {format_bytes(sum(sizes.values()))}) "
        f"-> {dst_name} ({dst_format}, {format_bytes(written)}): {plural(count, 'tensor')}, "
        f"{format_bytes(nbytes)}",
    )
    return EXIT_OK


def _write_hub(
    args: argparse.Namespace,
    flat: dict[str, torch.Tensor],
    build: Callable[[str], torch.Tensor],
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    storage: Storage,
    directory: str,
    bar: Progress,
) -> int:
    """``--shard-size``: the folder of safetensors shards and the index ``from_pretrained``
    reads, one tensor in memory at a time (:func:`write_hub_shards`)."""
    try:
        names, written = write_hub_shards(
            flat, build, specs, storage, directory, args.shard_size, bar.update
        )
    except ValueError as exc:
        raise SafetensorsError(f"cannot write {storage.describe(directory)}: {exc}") from None
    for name in names:
        abort_strays(storage, storage.join(directory, name))
    return written
