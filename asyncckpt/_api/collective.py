"""The collectives of a ``Checkpointer``'s load: agreeing on the step, the group's timeout.

Example:
    >>> check_load_step(3)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncckpt._device import cuda
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    ConflictError,
    FormatError,
    IncompleteCheckpointError,
    StorageError,
)

log = logging.getLogger(__name__)

#: Errors a collective load can report from the writer rank to the others, by index.
COLLECTIVE_ERRORS: tuple[type[AsyncCkptError], ...] = (
    AsyncCkptError,
    CheckpointNotFoundError,
    StorageError,
    FormatError,
    ConflictError,
    IncompleteCheckpointError,
    CheckpointTimeoutError,
)
#: What a rank sends for "the newest" or "no step".
NO_STEP = -1


def agree_on_step(
    group: Any,
    writer_rank: int,
    step: int | None,
    choose: Callable[[], int | None],
    token: str,
    where: str,
) -> tuple[int | None, str]:
    """One ``all_gather`` of (the writer's choice or error, the step each rank asked, the
    writer's token); returns the agreed step and the writer's token.

    The token tells every rank whose save of the step it waits for: a ``FAILED`` marker
    another job left for the same step is not that save's failure. ``choose`` (the
    writer's newest step, its own pending saves included) is called on the writer only;
    ``token`` (12 hex digits) is read there only.

    Raises:
        ValueError: the ranks asked for different steps.
        AsyncCkptError: (a subclass) the writer failed to choose (with any error: the others
            get an AsyncCkptError, or the subclass the writer raised); on the writer, its
            own error.
    """
    is_writer = dist.get_rank(group) == writer_rank
    choice, error = NO_STEP, None
    if is_writer:
        try:
            found = step if step is not None else choose()
            choice = NO_STEP if found is None else found
        except BaseException as exc:  # any error: every rank must hear of it, or they hang
            error = exc
            choice = -2 - (error_index(exc) if isinstance(exc, AsyncCkptError) else 0)
    asked = NO_STEP if step is None else step
    mine_token = int(token, 16) if is_writer else 0  # 48 bits: fits an int64
    mine = torch.tensor(
        [choice, asked, mine_token], dtype=torch.int64, device=collective_device(group)
    )
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [tuple(int(v) for v in t.tolist()) for t in gathered]
    if error is not None:
        raise error
    agreed, writer = rows[writer_rank][0], f"{rows[writer_rank][2]:012x}"
    if agreed <= -2:
        kind = COLLECTIVE_ERRORS[min(-2 - agreed, len(COLLECTIVE_ERRORS) - 1)]
        raise kind(
            f"the writer rank ({writer_rank}) failed to choose the step to load "
            f"from {where}; its error is in its own log"
        )
    asked_by = sorted({row[1] for row in rows})
    if len(asked_by) > 1:
        shown = ", ".join("newest" if a == NO_STEP else str(a) for a in asked_by)
        raise ValueError(
            f"the ranks of a collective load of {where} asked for different steps "
            f"({shown}); pass the same step on every rank"
        )
    return (None if agreed < 0 else agreed), writer


def collective_device(group: Any) -> torch.device:
    """Where a collective's tensors live for ``group``'s backend: for NCCL, this rank's
    own device (:meth:`asyncckpt._device.Cuda.own_device`), never every rank's GPU 0."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", cuda().own_device())
    return torch.device("cpu")


def announce_loaded(group: Any) -> Any:
    """Every rank's announcement, once its part of a collective load is over, that it reads
    the agreed step no more: a non-blocking ``all_reduce`` (no rank waits in it), whose work
    the writer asks ``is_completed()`` when retention runs: then every rank has finished.

    Every rank of a collective load calls it once, even when its read failed, so the group's
    collectives stay in step. Returns the work, or None if the backend refused (the step is
    then spared until the next collective load, as a slower rank may still read it).
    """
    try:
        flag = torch.zeros(1, device=collective_device(group))
        return dist.all_reduce(flag, group=group, async_op=True)
    except RuntimeError as exc:
        log.warning("could not announce the end of a collective load: %s", exc)
        return None


def error_index(exc: AsyncCkptError) -> int:
    """The index in :data:`COLLECTIVE_ERRORS` of the most specific class of ``exc``."""
    return max(i for i, kind in enumerate(COLLECTIVE_ERRORS) if isinstance(exc, kind))


def group_timeout(group: Any) -> float:
    """The process group's timeout in seconds (what a collective would wait at most)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            options = pg._get_backend(torch.device(device)).options
            timeout = getattr(options, "_timeout", None)
        except Exception:  # the backend for that device does not exist
            continue
        if isinstance(timeout, timedelta):
            return timeout.total_seconds()
    backend = dist.get_backend(group)
    return float(dist.distributed_c10d._get_default_timeout(backend).total_seconds())


def check_load_step(step: Any) -> None:
    """Refuse a ``step`` that ``load`` cannot mean: only None (the newest) or an int >= 0.

    Example:
        >>> check_load_step("latest")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: step must be None (the newest) or a non-negative int, not str 'latest'...
    """
    accepted = "step must be None (the newest) or a non-negative int"
    if step is not None and type(step) is not int:
        raise TypeError(
            f"{accepted}, not {type(step).__qualname__} {step!r}; load() or load(step=None) "
            "loads the newest committed version"
        )
    if step is not None and step < 0:
        raise ValueError(f"{accepted}, not {step}")
