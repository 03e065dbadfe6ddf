"""safetensors files in and out, through the ``safetensors`` package (``asyncckpt[safetensors]``).

safetensors holds a flat ``{str: tensor}`` dict and refuses tensors that share memory. A
state with tied weights (``lm_head.weight is embed.weight``) is written with each shared
tensor once; the file's ``__metadata__`` records which keys alias which
(:data:`ALIASES_KEY`) and the keys' original order (:data:`ORDER_KEY`, since safetensors
sorts its header), and :func:`read_safetensors` restores both. Other files read as they are.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

from asyncckpt._engine.snapshot import byte_view
from asyncckpt._format.tree import child_path
from asyncckpt._storage import Storage
from asyncckpt.errors import SafetensorsError as SafetensorsError

#: ``__metadata__`` entry: JSON ``{alias: key}``, keys whose tensor is another key's tensor.
ALIASES_KEY = "asyncckpt.aliases"
#: ``__metadata__`` entry: JSON list of every key in the order of the dict that was written.
ORDER_KEY = "asyncckpt.order"
#: Bytes copied per step between a storage and a local scratch file.
_COPY_BLOCK = 8 << 20
#: torch dtype -> safetensors dtype name (the format's spelling).
_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
}
#: A tensor as a safetensors header lays it out: key, dtype, shape.
_Spec = tuple[str, torch.dtype, tuple[int, ...]]


def _library() -> Any:
    """The ``safetensors`` package, or an error saying how to install it."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise SafetensorsError(
            "reading and writing safetensors needs the safetensors package: "
            "pip install 'asyncckpt[safetensors]'"
        ) from None
    return safetensors


# -- reading --------------------------------------------------------------------------------


@contextlib.contextmanager
def _local_copy(
    storage: Storage, path: str, progress: Callable[[int], None] | None
) -> Iterator[str]:
    """A local path to the file: itself when local, else a temporary copy streamed from the
    storage (safetensors opens files by name only)."""
    if storage.local_paths:
        yield path
        return
    fd, scratch = tempfile.mkstemp(suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f:
            size, start = storage.size(path), 0
            while start < size:
                piece = storage.read_range(path, start, min(_COPY_BLOCK, size - start))
                if not piece:
                    break
                f.write(piece)
                start += len(piece)
                if progress is not None:
                    progress(len(piece))
        yield scratch
    finally:
        os.remove(scratch)


def read_safetensors(
    storage: Storage, path: str, progress: Callable[[int], None] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file tensor by tensor, restoring tied weights and key order.

    Returns:
        ``(tensors, metadata)``: tensors in the order they were written (aliased keys are
        the same tensor object), and the file's ``__metadata__`` without asyncckpt's own
        entries.

    Raises:
        SafetensorsError: the file is not valid safetensors, or its asyncckpt entries are
            damaged.

    Example:
        >>> import torch
        >>> from asyncckpt._storage import resolve
        >>> w = torch.ones(2)
        >>> where = resolve("memory://st/t.safetensors", None)
        >>> _ = write_safetensors({"emb": w, "head": w}, *where)
        >>> tensors, meta = read_safetensors(*where)
        >>> tensors["head"] is tensors["emb"], meta
        (True, {'format': 'pt'})
    """
    st = _library()
    local = storage.local_paths
    tensors: dict[str, torch.Tensor] = {}
    with _local_copy(storage, path, progress) as name:
        try:
            with st.safe_open(name, framework="pt") as f:
                metadata: dict[str, str] = dict(f.metadata() or {})
                for key in f.offset_keys():  # file order: one sequential pass
                    tensors[key] = f.get_tensor(key)
                    if progress is not None and local:
                        progress(tensors[key].numel() * tensors[key].element_size())
        except st.SafetensorError as exc:
            raise SafetensorsError(
                f"{storage.describe(path)}: not a valid safetensors file: {exc}"
            ) from None
    return _restore(tensors, metadata, storage.describe(path))


def _json_entry(metadata: dict[str, str], key: str, kind: type, where: str) -> Any:
    if key not in metadata:
        return kind()
    try:
        value = json.loads(metadata[key])
    except ValueError:
        value = None
    if not isinstance(value, kind):
        raise SafetensorsError(f"{where}: __metadata__[{key!r}] is not a JSON {kind.__name__}")
    return value


def _restore(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], where: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Re-tie aliased keys and put the keys back in their recorded order."""
    aliases = _json_entry(metadata, ALIASES_KEY, dict, where)
    for alias, target in aliases.items():
        if alias in tensors or target not in tensors:
            raise SafetensorsError(
                f"{where}: __metadata__[{ALIASES_KEY!r}] maps {alias!r} to {target!r}, but "
                "the file holds the first or lacks the second"
            )
        tensors[alias] = tensors[target]
    order = _json_entry(metadata, ORDER_KEY, list, where)
    if sorted(order) == sorted(tensors):
        tensors = {key: tensors[key] for key in order}
    else:
        tensors = dict(sorted(tensors.items()))
    rest = {k: v for k, v in metadata.items() if k not in (ALIASES_KEY, ORDER_KEY)}
    return tensors, rest


# -- writing --------------------------------------------------------------------------------


def flat_tensors(obj: Any, src: str) -> dict[str, torch.Tensor]:
    """``obj`` (the selected part of the state) as a new flat ``{str: tensor}`` dict, or a
    clear error naming ``src`` and saying what is in the way.

    Raises:
        SafetensorsError: ``obj`` is not a flat dict of tensors; the message suggests a
            ``--key`` when a nested dict of tensors is there.

    Example:
        >>> flat_tensors({"w": torch.zeros(1)}, "x.pt")
        {'w': tensor([0.])}
    """
    if not isinstance(obj, dict):
        raise SafetensorsError(
            f"safetensors holds a flat dict of tensors; {src} is a {type(obj).__name__}"
        )
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise SafetensorsError(
                "safetensors holds a flat dict of str -> tensor; "
                f"{child_path('state', key)} in {src} is {type(value).__name__}"
                + ("" if isinstance(key, str) else f" under a {type(key).__name__} key")
                + _key_hint(obj)
            )
    return dict(obj)


def _key_hint(obj: dict[Any, Any]) -> str:
    nested = [
        k
        for k, v in obj.items()
        if isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) for t in v.values())
    ]
    if nested:
        return f"; convert one part with --key, e.g. --key {nested[0]}"
    return "; select a flat dict of tensors with --key"


def _view_id(t: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two tensors that are the same view of the same memory (tied weights)."""
    address = t.untyped_storage().data_ptr()
    return (t.device, address, t.storage_offset(), t.shape, t.stride(), t.dtype)


def untie(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(unique, aliases)``: tensors safetensors accepts, and ``{dropped key: key kept}``.

    A key whose tensor is the same view as an earlier key's (tied weights) becomes an alias.
    safetensors writes dense, unshared memory only: other views of a storage already kept,
    and non-contiguous tensors, are copied; nothing else is, so a conversion holds the state
    once.

    Example:
        >>> w = torch.ones(2)
        >>> unique, aliases = untie({"emb": w, "head": w, "half": w[:1]})
        >>> list(unique), aliases, unique["emb"].data_ptr() == w.data_ptr()  # not copied
        (['emb', 'half'], {'head': 'emb'}, True)
    """
    kept, aliases = _untie_plan(tensors)
    unique = {
        key: t.clone(memory_format=torch.contiguous_format) if copy else t
        for key, (t, copy) in kept.items()
    }
    return unique, aliases


def dense_copy_bytes(tensors: dict[str, torch.Tensor]) -> list[int]:
    """The bytes of each copy :func:`untie` makes of ``tensors`` (a broadcast tensor of a
    few stored bytes becomes its whole dense size): what a memory budget must count.

    Example:
        >>> dense_copy_bytes({"w": torch.zeros(1).expand(1000), "b": torch.zeros(3)})
        [4000]
    """
    kept, _ = _untie_plan(tensors)
    return [t.numel() * t.element_size() for t, copy in kept.values() if copy]


def _untie_plan(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, tuple[torch.Tensor, bool]], dict[str, str]]:
    """:func:`untie`'s decisions, with no copy made: each kept key's CPU tensor and whether
    it must be copied, and the aliases."""
    kept: dict[str, tuple[torch.Tensor, bool]] = {}
    aliases: dict[str, str] = {}
    first_of_view: dict[tuple[Any, ...], str] = {}
    memories: set[tuple[Any, int]] = set()
    for key, t in tensors.items():
        t = t.detach().cpu()
        if t.numel() == 0:  # no bytes: a fresh tensor shares nothing
            kept[key] = (torch.empty(t.shape, dtype=t.dtype), False)
            continue
        view = _view_id(t)
        if view in first_of_view:
            aliases[key] = first_of_view[view]
            continue
        first_of_view[view] = key
        memory = (t.device, t.untyped_storage().data_ptr())
        shared = memory in memories
        memories.add(memory)
        kept[key] = (t, shared or not t.is_contiguous())
    return kept, aliases


def header_metadata(
    tensors: dict[str, torch.Tensor], aliases: dict[str, str], given: dict[str, str] | None
) -> dict[str, str]:
    """A safetensors header's ``__metadata__``: ``given``, the aliases of tied tensors and,
    if the keys are not sorted, their order (safetensors sorts them; a load restores it)."""
    metadata = {"format": "pt", **(given or {})}
    metadata.pop(ALIASES_KEY, None)
    metadata.pop(ORDER_KEY, None)
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, separators=(",", ":"))
    if list(tensors) != sorted(tensors):  # safetensors sorts; record the order to restore
        metadata[ORDER_KEY] = json.dumps(list(tensors), separators=(",", ":"))
    return metadata


def write_safetensors(
    tensors: dict[str, torch.Tensor],
    storage: Storage,
    path: str,
    metadata: dict[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write a flat dict of tensors as safetensors, atomically, tied weights written once.

    Written by :func:`stream_safetensors` straight from the tensors' memory (no copy of the
    state), laid out as the safetensors library lays it out (widest dtype first), with the
    ``__metadata__`` entries ``metadata`` (``{"format": "pt"}`` is the default). Returns
    the file's size.

    Raises:
        SafetensorsError: a tensor's dtype has no safetensors name.

    Example:
        >>> from asyncckpt._storage import resolve
        >>> write_safetensors({"w": torch.zeros(4)}, *resolve("memory://st/w.safetensors", None))
        112
    """
    unique, aliases = untie(tensors)
    specs = sorted(((key, *tensor_spec(t)) for key, t in unique.items()), key=_widest_first)
    meta = header_metadata(tensors, aliases, metadata)
    return stream_safetensors(specs, unique.__getitem__, storage, path, meta, progress)


def _widest_first(spec: _Spec) -> tuple[int, str]:
    # As the safetensors library lays data out: every tensor then starts aligned to its
    # element size (the header is padded to 8 bytes), and readers that map the file can view
    # each tensor in place.
    return -spec[1].itemsize, spec[0]


def tensor_spec(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    """A plain tensor's dtype and shape (what :meth:`ShardedSource.spec` gives a placeholder)."""
    return t.dtype, tuple(t.shape)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def safetensors_dtype(dtype: torch.dtype, key: str) -> str:
    """The safetensors name of ``dtype``.

    Raises:
        SafetensorsError: safetensors has no name for it (a ValueError).

    Example:
        >>> safetensors_dtype(torch.bfloat16, "w")
        'BF16'
    """
    name = _SAFETENSORS_DTYPES.get(dtype)
    if name is None:
        raise SafetensorsError(f"{key}: safetensors has no dtype for {dtype}")
    return name


def safetensors_header(specs: list[_Spec], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``specs`` back to
    back, padded to 8 bytes as the safetensors library pads it, so the data is aligned.

    Example:
        >>> head = safetensors_header([("w", torch.float32, (2,))], {"format": "pt"})
        >>> int.from_bytes(head[:8], "little") == len(head) - 8, len(head) % 8
        (True, 0)
    """
    doc: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    start = 0
    for key, dtype, shape in specs:
        end = start + math.prod(shape) * dtype.itemsize
        doc[key] = {
            "dtype": safetensors_dtype(dtype, key),
            "shape": list(shape),
            "data_offsets": [start, end],
        }
        start = end
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


def stream_safetensors(
    specs: list[_Spec],
    build: Callable[[str], torch.Tensor],
    storage: Storage,
    path: str,
    metadata: dict[str, str],
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write a safetensors file, atomically, one tensor at a time (each asked of ``build``,
    written and dropped): the one writer of the format. Returns the file's size.

    Raises:
        SafetensorsError: a dtype safetensors cannot hold, or a big-endian host.
    """
    head = safetensors_header(specs, metadata)
    written = len(head)
    with storage.atomic_write(path) as out:
        out.write(head)
        for key, dtype, shape in specs:
            whole = build(key).detach().contiguous()
            if (whole.dtype, tuple(whole.shape)) != (dtype, shape):
                raise SafetensorsError(
                    f"{storage.describe(path)}: {key} was built as {whole.dtype} "
                    f"{tuple(whole.shape)}; its header says {dtype} {shape}"
                )
            if sys.byteorder != "little" and whole.element_size() > 1:
                raise SafetensorsError("safetensors is little-endian; this host is not")
            data = flat_bytes(whole)
            out.write(byte_view(data))
            written += data.numel()
            if progress is not None:
                progress(data.numel())
            del whole, data
    return written


# -- sharded safetensors for the Hub (``from_pretrained``'s layout) ---------------------------

#: The index ``transformers``' ``from_pretrained`` reads for a sharded checkpoint.
HUB_INDEX_NAME = "model.safetensors.index.json"


def hub_shard_name(index: int, count: int) -> str:
    """The name of shard ``index`` (1-based) of ``count``, as ``transformers`` names them.

    Example:
        >>> hub_shard_name(1, 3)
        'model-00001-of-00003.safetensors'
    """
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_shards(specs: list[_Spec], shard_size: int) -> list[list[_Spec]]:
    """``specs`` in key order, cut into shards of at most ``shard_size`` bytes of data (a
    larger tensor gets a shard of its own); each shard laid out widest dtype first.

    Example:
        >>> f = torch.float32
        >>> [[k for k, _, _ in s] for s in plan_shards([("b", f, (2,)), ("a", f, (2,))], 8)]
        [['a'], ['b']]
    """
    shards: list[list[_Spec]] = [[]]
    used = 0
    for spec in sorted(specs, key=lambda s: s[0]):
        nbytes = math.prod(spec[2]) * spec[1].itemsize
        if shards[-1] and used + nbytes > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += nbytes
    return [sorted(s, key=_widest_first) for s in shards if s]


def write_hub_shards(
    tensors: dict[str, torch.Tensor],
    full: Callable[[torch.Tensor], torch.Tensor],
    spec: Callable[[torch.Tensor], tuple[torch.dtype, tuple[int, ...]]],
    storage: Storage,
    directory: str,
    shard_size: int,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[str], int]:
    """Write ``tensors`` as sharded safetensors and ``model.safetensors.index.json``.

    Shards of at most ``shard_size`` data bytes hold one tensor in memory at a time
    (``full`` builds a whole tensor of ``tensors``, maybe placeholders; ``spec`` tells its
    dtype and shape); the index comes last, so a folder with one is complete. Tied weights
    are written once, their aliases in the index's ``metadata`` (:data:`ALIASES_KEY`):
    ``transformers`` ties them again itself.

    Returns:
        ``(file names, bytes written)``, the index last.

    Raises:
        SafetensorsError: a dtype safetensors cannot hold.
    """
    aliases = _aliases_by_identity(tensors)
    stored = [(k, *spec(t)) for k, t in tensors.items() if k not in aliases]
    shards = plan_shards(stored, shard_size)
    names, written, weight_map = [], 0, {}
    build = lambda key: full(tensors[key])  # noqa: E731
    for number, shard in enumerate(shards, 1):
        name = hub_shard_name(number, len(shards))
        path = storage.join(directory, name)
        written += stream_safetensors(shard, build, storage, path, {"format": "pt"}, progress)
        weight_map.update({key: name for key, _, _ in shard})
        names.append(name)
    total = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in stored)
    meta: dict[str, Any] = {"total_size": total}
    if aliases:
        meta[ALIASES_KEY] = aliases
    index = json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    storage.write_bytes(storage.join(directory, HUB_INDEX_NAME), index.encode())
    return [*names, HUB_INDEX_NAME], written + len(index)


def _aliases_by_identity(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Keys whose tensor is an earlier key's tensor (tied weights) -> that key."""
    first: dict[Any, str] = {}
    aliases: dict[str, str] = {}
    for key, t in tensors.items():
        # A placeholder (no elements) is tied by identity; a real tensor by its view.
        view = id(t) if t.numel() == 0 else _view_id(t)
        if view in first:
            aliases[key] = first[view]
        else:
            first[view] = key
    return aliases


#: The largest JSON header :func:`read_header` reads (the safetensors library's own limit).
MAX_HEADER_BYTES = 100_000_000


def read_header(storage: Storage, path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The JSON header of a safetensors file: no tensor data is read.

    Returns:
        ``(entries, metadata)``: ``{key: {"dtype": "float32", "shape": [...], "nbytes": n}}``
        in the order the keys were written (asyncckpt's recorded order when there is one,
        else the data's), and ``__metadata__``.

    Raises:
        SafetensorsError: the header is not valid safetensors (the message names the file
            and the key).
    """
    where = storage.describe(path)
    size = storage.size(path)
    (length,) = struct.unpack("<Q", storage.read_range(path, 0, 8).ljust(8, b"\0"))
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise SafetensorsError(f"{where}: not a valid safetensors file: header of {length} B")
    try:
        doc = json.loads(storage.read_range(path, 8, length))
        metadata = {str(k): str(v) for k, v in (doc.pop("__metadata__", None) or {}).items()}
        names = {v: str(k).removeprefix("torch.") for k, v in _SAFETENSORS_DTYPES.items()}
        entries = {
            key: {
                "dtype": names.get(e["dtype"], e["dtype"]),
                "shape": [int(n) for n in e["shape"]],
                "nbytes": int(e["data_offsets"][1]) - int(e["data_offsets"][0]),
                "offset": int(e["data_offsets"][0]),
            }
            for key, e in doc.items()
        }
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise SafetensorsError(f"{where}: not a valid safetensors file: {exc!r}") from None
    for alias, key in _json_entry(metadata, ALIASES_KEY, dict, where).items():
        if key in entries:  # a tied weight, written once under ``key``
            entries[alias] = {**entries[key], "alias_of": key}
    order = [k for k in _json_entry(metadata, ORDER_KEY, list, where) if k in entries]
    rest = sorted((k for k in entries if k not in order), key=lambda k: entries[k]["offset"])
    return {k: entries[k] for k in [*order, *rest]}, metadata
