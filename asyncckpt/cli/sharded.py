"""Sharded checkpoints as the commands see them: a sharded ``Checkpointer`` version
(``ROOT@STEP``, or the latest of ``ROOT``, whose COMMIT's kind is ``sharded``) or an
``asyncckpt.dcp`` directory, opened as a :class:`~asyncckpt._convert.consolidate.ShardedSource`
(its key tree without the data; each tensor built on demand).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from asyncckpt._convert.consolidate import ShardedSource
from asyncckpt._settings import Settings
from asyncckpt._versions.protocol import SHARDED, latest_step, read_commit, step_dir
from asyncckpt.cli.common import RootRef, dcp_files, is_dcp_directory


def open_sharded(ref: RootRef, settings: Settings | None = None) -> ShardedSource | None:
    """The sharded checkpoint ``ref`` names, opened; None for a plain version (or when
    nothing is committed: the caller's single-file path says so).

    Raises:
        IncompleteCheckpointError: an ``asyncckpt.dcp`` directory without its metadata.
        FormatError: the metadata or rank 0's file is malformed.
    """
    storage = ref.storage
    if is_dcp_directory(storage, ref.path):
        dcp_files(ref)  # refuses ROOT@STEP of a dcp directory
        return ShardedSource.open(storage, ref.path, settings=settings)
    step = ref.step if ref.step is not None else latest_step(storage, ref.path)
    if step is None:
        return None
    commit = read_commit(storage, ref.path, step)
    if commit is None or commit.kind != SHARDED:
        return None
    return ShardedSource.open(storage, step_dir(storage, ref.path, step), commit, settings)


def shard_info(src: ShardedSource, placeholder: Any) -> dict[str, Any]:
    """What ``inspect`` shows of a sharded tensor: dtype, global shape, bytes, shards."""
    dtype, shape = src.spec(placeholder)
    md = src.metadata.state_dict_metadata[src.fqn_of(placeholder)]
    shards = len(md.chunks) if isinstance(md, TensorStorageMetadata) else 1
    numel = 1
    for n in shape:
        numel *= n
    return {
        "kind": "sharded tensor",
        "dtype": str(dtype).removeprefix("torch."),
        "shape": list(shape),
        "nbytes": numel * dtype.itemsize,
        "device": "-",
        "codecs": [],
        "shards": shards,
    }
