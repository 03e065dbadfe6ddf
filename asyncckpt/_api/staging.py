"""Staging a save: the tunables of its write, and its copy into a host arena.

The blocking part of every save (``asyncckpt.save``, each rank's ``Checkpointer.save``)
is :func:`stage`: validate the state and copy its data into an arena leased from the
process's one :class:`~asyncckpt._engine.arena.ArenaPool`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from asyncckpt import _threads as workers
from asyncckpt._device import cuda
from asyncckpt._engine import writer_process
from asyncckpt._engine.arena import ArenaPool
from asyncckpt._engine.encode import WriteOptions
from asyncckpt._engine.snapshot import Snapshot, arena_bytes, snapshot, snapshot_device
from asyncckpt._format.codec import check_compression
from asyncckpt._format.tree import flatten
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage

_lock = threading.Lock()
_arenas: ArenaPool | None = None


def arena_pool(settings: Settings) -> ArenaPool:
    """The process's arena pool, sized by the first caller's ``max_inflight``."""
    global _arenas
    with _lock:
        if _arenas is None:
            _arenas = ArenaPool(settings.max_inflight)
        return _arenas


@workers.after_fork_in_child
def _forget_parent_arenas() -> None:
    """In a forked child: its own arenas (the parent's may be in memory shared with the
    parent's writer process, or leased to a save whose thread the child lacks)."""
    global _lock, _arenas
    _lock = threading.Lock()
    workers.keep_from_parent(_arenas)
    _arenas = None


def write_options(compression: str, settings: Settings) -> WriteOptions:
    """The options of one save's write, from its ``settings`` (the entry point's).

    Raises:
        ValueError: ``compression`` is not one of ``"auto"``, ``"zstd"``, ``"none"``.
    """
    return WriteOptions(check_compression(compression), settings)


def stage(
    obj: Any,
    options: WriteOptions,
    overlap: bool = False,
    on_layout: Callable[[Snapshot], None] | None = None,
    *,
    in_this_process: bool = False,
) -> Snapshot:
    """Validate ``obj`` and copy its data into a host arena (the blocking part of a save).

    ``options``: those of the write that follows. ``on_layout`` lets a writer start before
    the copy ends (see ``snapshot``). For a background write, if the options ask for a
    writer process, the arena is in shared memory and the process is started (if need be)
    once the copy is done. For a write ``in_this_process`` (on a thread of its own), the arena
    is in shared memory all the same when writer processes are on: the saves that follow
    reuse it instead of replacing it.

    Example:
        >>> import torch
        >>> from asyncckpt._settings import Settings
        >>> options = write_options("none", Settings())
        >>> snap = stage({"w": torch.ones(2)}, options, in_this_process=True)
        >>> snap.raw_bytes
        8
        >>> snap.release()
    """
    settings = options.settings
    if in_this_process:
        shared = writer_process.shares_arenas(settings)
    else:
        shared = writer_process.wanted(options)
    snap = snapshot(
        flatten(obj), arena_pool(settings), overlap, on_layout, shared, settings=settings
    )
    if not in_this_process and shared:
        # After the copy: a child starting up beside it (an interpreter, its imports) takes
        # CPU from the copy the caller waits for. Checkpointer starts it at construction.
        writer_process.start(settings)
    return snap


def start_writer(storage: Storage, settings: Settings) -> None:
    """Start the writer process now if saves through ``storage`` will use it, so that its
    start-up (an interpreter and its imports, on a core of its own) is over before the
    first save instead of beside its copy. What ``Checkpointer`` does at construction."""
    if not storage.process_local and writer_process.wanted(write_options("none", settings)):
        writer_process.start(settings)


def reserve_arena(state_or_nbytes: Any, settings: Settings) -> threading.Thread | None:
    """Reserve an arena for saves of a state this big, in a background thread.

    See :func:`asyncckpt.reserve`.
    """
    if isinstance(state_or_nbytes, int):
        nbytes = state_or_nbytes + state_or_nbytes // 64 + (1 << 20)  # room for alignment
        pin = cuda().own_device() if cuda().in_use() else None
    else:
        flat = flatten(state_or_nbytes)
        nbytes = arena_bytes(flat)
        pin = snapshot_device(flat)
    shared = writer_process.wanted(write_options("none", settings))
    if shared:
        writer_process.start(settings)  # its start-up (an interpreter importing torch) too
    # The device is chosen here, on the caller's thread: the reserve thread's is 0.
    return arena_pool(settings).reserve(nbytes, shared, pin)
