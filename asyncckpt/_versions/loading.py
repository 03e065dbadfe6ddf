"""A load of a committed version, executed down the layers: plain or sharded as its
``COMMIT`` says, following the newest version when retention deletes the one being read.

``Checkpointer.load`` chooses the step, waits for it and plans the load
(:class:`~asyncckpt._versions.reading.LoadRequest`); nothing here calls back up.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Final

from asyncckpt._engine.decode import Budget
from asyncckpt._format.tree import holds_dtensor
from asyncckpt._versions.protocol import SHARDED, CommitRecord
from asyncckpt._versions.reading import LoadRequest, RootReader
from asyncckpt.errors import AsyncCkptError, CheckpointNotFoundError, IncompleteCheckpointError

log = logging.getLogger(__name__)

#: How many versions a load of the newest version tries, when retention deletes each one
#: while it is read, before it gives up (a trainer whose ``keep_last`` versions are all
#: written faster than this process reads one).
FOLLOW_ATTEMPTS: Final = 5


def load(reader: RootReader, step: int, commit: CommitRecord | None, request: LoadRequest) -> Any:
    """Load committed version ``step``, plain or sharded, as its ``COMMIT`` records.

    If retention deletes the version while it is read (its ``COMMIT`` is gone: an
    evaluator loading the newest version while the trainer saves with ``keep_last``), a
    load that asked for the newest version (``request.follow_latest``) moves on to the
    newest one, at most :data:`FOLLOW_ATTEMPTS` times in all; a load of a given step raises.

    ``commit`` is ``step``'s marker, or None if it was retired since it was chosen. Each
    attempt has the request's whole budget. Raises what ``Checkpointer.load`` documents.

    Example:
        >>> import tempfile
        >>> from asyncckpt._device import Placement
        >>> from asyncckpt._settings import Settings
        >>> from asyncckpt._storage import LocalStorage
        >>> reader = RootReader(LocalStorage(), tempfile.mkdtemp())
        >>> load(reader, 1, None, LoadRequest(Placement(None), Settings()))
        Traceback (most recent call last):
        ...
        asyncckpt.errors.IncompleteCheckpointError: step 1 under ... was deleted while ...
    """
    for _ in range(FOLLOW_ATTEMPTS):
        try:
            if commit is None:  # deleted again before it could be read
                raise CheckpointNotFoundError(f"step {step} under {reader.where} is not committed")
            budget = Budget(request.max_bytes)
            if commit.kind == SHARDED:
                # Imported here: it imports torch.distributed.checkpoint (about 0.5 s), which
                # a restart's load of a plain version would otherwise pay before reading.
                from asyncckpt._versions.sharded_reading import read_sharded

                return read_sharded(reader, commit, request, budget)
            if holds_dtensor(request.into):
                raise ValueError(
                    f"step {step} under {reader.where} was not saved from DTensors; load it "
                    "without DTensors in `into`"
                )
            return reader.read_plain(step, request, budget)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if not isinstance(exc, AsyncCkptError) and not _is_dcp_failure(exc):
                raise
            step = _after_interruption(reader, step, request.follow_latest, exc)
        commit = reader.commit_of(step)
    raise IncompleteCheckpointError(
        f"{reader.where}: retention deleted {FOLLOW_ATTEMPTS} versions in a row while this "
        f"process loaded them (the last was step {step}); keep more versions (keep_last) "
        "or give load() a step that is kept"
    )


def _is_dcp_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is torch DCP's ``CheckpointException`` (a sharded read's failure).

    Asked only once the module is imported: importing it to ask would cost every plain load.

    Example:
        >>> _is_dcp_failure(ValueError("x"))
        False
    """
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api is not None and isinstance(exc, api.CheckpointException)


def _after_interruption(reader: RootReader, step: int, follow: bool, exc: BaseException) -> int:
    """The step to load after ``exc`` interrupted the load of ``step``; else raise."""
    error = reader.interrupted(step, exc)
    if error is exc:
        raise exc
    newest = reader.latest()
    if not follow or newest is None or newest == step:
        raise error from exc
    log.info("step %d was deleted while loading; moving to step %d", step, newest)
    return newest
