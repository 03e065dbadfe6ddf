"""Every exception asyncckpt raises.

All of them derive from :class:`AsyncCkptError`, so ``except asyncckpt.AsyncCkptError``
catches anything the library raises on purpose. Where a builtin has the same meaning, the
error also derives from it (a missing checkpoint is a ``FileNotFoundError``, a bad argument
a ``ValueError``), so code written against ``torch.load`` keeps working. Errors from a
storage backend are chained with ``raise ... from`` so the original stays visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class AsyncCkptWarning(UserWarning):
    """Every warning asyncckpt issues, so that users can filter them as one class.

    Example:
        >>> import warnings
        >>> warnings.simplefilter("ignore", AsyncCkptWarning)
    """


class AsyncCkptError(Exception):
    """Base class of every error raised by asyncckpt."""


class FormatError(AsyncCkptError, ValueError):
    """The bytes are not a valid asyncckpt file (bad magic, version, footer or manifest)."""


class UnreadableRecordError(FormatError):
    """A protocol record exists but cannot be understood (damaged, or a newer protocol).

    Readers skip such a version; a writer refuses to touch a root that holds one, since it
    cannot tell what it would destroy.
    """


class TruncatedFileError(FormatError):
    """The file is shorter than its own footer or manifest says it is."""


class ChecksumError(FormatError):
    """A chunk's bytes do not match the checksum recorded when it was written.

    Every read of one load goes to the same version of the file (see
    ``Storage.open_read``; a file replaced meanwhile is either still read as it was, or
    raises :class:`FileReplacedError`), so a mismatch means the stored bytes themselves
    changed after the save: damage on the storage or in a copy, or an edit.

    Attributes:
        path: the file that holds the chunk.
        chunk: index of the damaged chunk in the file's chunk table.
        keys: key paths of the tensors whose data lives in that chunk.
    """

    def __init__(self, path: str, chunk: int, keys: Sequence[str], detail: str) -> None:
        self.path = path
        self.chunk = chunk
        self.keys = list(keys)
        shown = ", ".join(self.keys[:5]) + (" …" if len(self.keys) > 5 else "")
        super().__init__(
            f"{path}: chunk {chunk} is damaged ({detail}); it holds data of "
            f"{shown or '(no key)'}. The whole load read one version of the file, so its "
            "stored bytes changed after it was saved (storage or copy damage, or an edit), "
            "not under a concurrent save: `asyncckpt verify` lists every damaged chunk; "
            "restore the file, or load another checkpoint."
        )


class MemoryBudgetError(FormatError):
    """Loading would need more memory for decoded data than the caller's budget allows.

    Raised before the memory is allocated (``max_bytes`` of ``load`` and
    ``Checkpointer.load``, the command line's ``--max-bytes``): for a single file, before
    anything is allocated from it.

    Attributes:
        path: the file (or checkpoint) that would need the memory.
        needed: the bytes the load would allocate, all of its files together so far.
        max_bytes: the budget.
    """

    def __init__(self, path: str, needed: int, max_bytes: int, what: str) -> None:
        self.path = path
        self.needed = needed
        self.max_bytes = max_bytes
        super().__init__(
            f"{path}: loading it needs {needed:,} bytes for {what}, more than the "
            f"max_bytes budget of {max_bytes:,}; refused before allocating it"
        )


class FileReplacedError(AsyncCkptError):
    """The file was replaced by another one while it was being loaded.

    On local disk and ``memory://`` a file replaced meanwhile does not change what a load
    reads. On an object store every ranged read is pinned to the ETag of the load's first
    response (``412 Precondition Failed`` on a newer object), and the load starts over on
    the new object; this error is raised when it was replaced at every attempt.

    Attributes:
        path: the file.
    """

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"{path}: {detail}")


class CheckpointNotFoundError(AsyncCkptError, FileNotFoundError):
    """No checkpoint exists at the given path (or no committed version under a root)."""


class UnsupportedObjectError(AsyncCkptError, TypeError):
    """The object passed to ``save`` holds something asyncckpt cannot store.

    Attributes:
        key_path: where the object sits, e.g. ``state['sched']['lr_lambdas'][0]``.
    """

    def __init__(self, key_path: str, reason: str) -> None:
        self.key_path = key_path
        super().__init__(f"cannot save {key_path}: {reason}")


class DeviceUnavailableError(AsyncCkptError, RuntimeError):
    """``map_location`` names a device this machine does not have (CUDA on a machine
    without it, ``cuda:3`` with two GPUs); raised before anything is read. A
    ``RuntimeError``, as ``torch.load`` raises in the same case."""


class StorageError(AsyncCkptError, OSError):
    """A storage backend failed to read, write, list or delete (the cause is chained).

    ``errno`` is the operating system's code where the cause had one (``ENOSPC`` for a full
    disk, ``EIO``...), else None; it survives the trip back from the writer process.

    Example:
        >>> import errno
        >>> try:
        ...     asyncckpt_save_that_fills_the_disk()  # doctest: +SKIP
        ... except StorageError as exc:
        ...     if exc.errno == errno.ENOSPC:
        ...         free_some_space()
    """

    def __reduce__(self) -> tuple[Any, ...]:
        # OSError keeps errno outside __dict__, and rebuilds it only from (errno, strerror)
        # arguments, which would put "[Errno N]" in front of every message.
        return type(self), self.args, {**self.__dict__, "errno": self.errno}


class WriterProcessError(StorageError):
    """The child process running background writes (``writer_processes=1``) died or could
    not start; the save it was writing failed and its target is untouched."""


class IncompleteCheckpointError(AsyncCkptError):
    """A version exists in storage but was never committed (or was removed while loading)."""


class PathKindError(AsyncCkptError, ValueError):
    """A path names another kind of thing than the call takes: a file given as a
    Checkpointer root, a folder of several checkpoints given to a load, or ``NAME@STEP``
    naming both an existing path and a version of root ``NAME``. The message names the
    path and what is there.

    Example:
        >>> issubclass(PathKindError, ValueError)
        True
    """


class ConflictError(AsyncCkptError):
    """Another writer already committed this step, or owns this checkpoint root."""


class FencedError(ConflictError):
    """Another writer took the root over; this writer may no longer commit to it."""


class InvalidMetricsError(AsyncCkptError, ValueError):
    """The ``metrics`` of a version are not small JSON metadata (finite numbers and short
    strings under short names); the message names the key."""


class UnknownMetricError(AsyncCkptError, ValueError):
    """Retention ranks by a metric (``best_metric``, ``gc --best-metric``) that no version
    has, while versions have others: a typo would otherwise rank nothing and delete the real
    best version. The message names the metric and the metrics there are.

    Example:
        >>> error = UnknownMetricError("eval_los", ["eval_loss"], "/ckpt")
        >>> error.metric, error.known
        ('eval_los', ['eval_loss'])
    """

    def __init__(self, metric: str, known: list[str], where: str = "") -> None:
        self.metric, self.known, self.where = metric, list(known), where
        names = ", ".join(repr(n) for n in self.known)
        prefix = f"{where}: " if where else ""
        super().__init__(
            f"{prefix}no version has the metric {metric!r} that retention ranks by "
            f"(best_metric); the metrics there are: {names}"
        )


class CheckpointTimeoutError(AsyncCkptError, TimeoutError):
    """Waiting for a save to become durable, or for a step to be committed, timed out."""


class RangeNotSatisfiable(StorageError):
    """An object store's ranged read started at or past the end of the object (416); the
    object stores read it as empty, or as a sign that a shorter object replaced it."""


class MissingKeyError(AsyncCkptError, KeyError):
    """A partial load (``keys=``) or a lazy read (``asyncckpt.open``) asked for a key the
    checkpoint does not hold; the message names the file and the keys it has."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; the message reads better plain.
        return str(self.args[0]) if self.args else ""


class SafetensorsError(AsyncCkptError, ValueError):
    """A file is not valid safetensors, or a state cannot be written as safetensors."""


class DeviceCopyError(AsyncCkptError, RuntimeError):
    """A CUDA error while a save copied the state to host memory: the save did not happen.

    The message names the device and CUDA's error; the original is chained (``from``). The
    host arena and the drop-in save marker are released, so other saves and other
    processes' loads are not held up; a sticky error (an illegal access, a device-side
    assert) leaves the CUDA context unusable, and the process should be restarted.
    """
