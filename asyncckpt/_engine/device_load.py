"""A CUDA load streamed through a bounded, reused pinned window.

Reading a whole file into host memory before the first host-to-device copy holds the state
twice (host and device) and serializes reading and copying. Here storages bound for one
CUDA device are read into one half of a pinned window (``pin_budget_bytes``) and copied to
the device asynchronously while the other half is read; a half is reused only once the
event after its copies has happened.

Only fresh device tensors are filled this way: ``load(into=...)`` keeps reading every
storage before touching the caller's tensors (a damaged chunk found late must not leave
them half overwritten).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from asyncckpt._device import Placement, cuda
from asyncckpt._engine.arena import ALIGN, aligned, pinned_host
from asyncckpt._engine.chunks import read_runs, run_bytes, whole_run
from asyncckpt._engine.opened import OpenedFile


def streamable(opened: OpenedFile, placement: Placement, sids: Sequence[int]) -> list[int]:
    """The storages of ``sids`` a load can stream: those ``placement`` puts on CUDA, if it
    puts them all on one device (and is not a callable, which gets host storages)."""
    where = placement.map_location
    if callable(where) and not isinstance(where, Mapping):
        return []
    storages = opened.manifest.storages
    chosen = [sid for sid in sids if placement.device_for(storages[sid].device).type == "cuda"]
    devices = {placement.device_for(storages[sid].device) for sid in chosen}
    return chosen if len(devices) == 1 else []


def stream_to_device(
    opened: OpenedFile,
    placement: Placement,
    sids: Sequence[int],
    threads: int,
    window: int,
) -> dict[int, torch.Tensor]:
    """Read storages ``sids`` (from :func:`streamable`) and copy them to their device
    through two pinned halves of ``window`` bytes; returns ``{storage: device tensor}``
    (1-D uint8). Storages larger than a half are left out (the caller reads them whole).
    Returns once every copy has landed, so the window can be freed.

    Raises:
        ChecksumError: a chunk is damaged (device tensors already filled are dropped).
    """
    storages = opened.manifest.storages
    sizes = {sid: run_bytes(opened, whole_run(opened, sid)) for sid in sids}
    rooms = {sid: aligned(n) for sid, n in sizes.items()}
    half = max(ALIGN, window // 2)
    # A small load pins what it needs, no more.
    half = min(half, max(ALIGN, sum(room for room in rooms.values() if room <= half)))
    index = placement.device_for(storages[sids[0]].device).index or 0 if sids else 0
    halves: list[torch.Tensor | None] = [None, None]
    events: list[Any] = [None, None]
    placed: dict[int, torch.Tensor] = {}
    batch: list[int] = []  # storages
    state = {"turn": 0, "used": 0}

    def flush() -> None:
        turn = state["turn"]
        if not batch:
            return
        if events[turn] is not None:
            cuda().synchronize_event(events[turn])  # the copies out of this half landed
        buffer = halves[turn]
        if buffer is None:
            buffer = halves[turn] = pinned_host(half, index)
        views, at = {}, 0
        for sid in batch:
            views[sid] = buffer[at : at + sizes[sid]]
            at += rooms[sid]
        read_runs(opened, {sid: whole_run(opened, sid) for sid in batch}, threads, into=views)
        for sid in batch:
            placed[sid] = placement.place(views[sid], storages[sid].device)
        events[turn] = cuda().record_event(cuda().current_stream(index))
        state["turn"], state["used"] = 1 - turn, 0
        batch.clear()

    try:
        for sid in sids:
            if rooms[sid] > half:
                continue
            if state["used"] + rooms[sid] > half:
                flush()
            batch.append(sid)
            state["used"] += rooms[sid]
        flush()
    except BaseException:
        with contextlib.suppress(Exception):  # the first error is the one to raise
            _landed(events)
        raise
    _landed(events)  # the window is freed on return: no copy may still read it
    return placed


def _landed(events: list[Any]) -> None:
    for event in events:
        if event is not None:
            cuda().synchronize_event(event)
