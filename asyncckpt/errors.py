"""Every exception asyncckpt raises.

All of them derive from :class:`AsyncCkptError`, so ``except asyncckpt.AsyncCkptError``
catches anything the library raises on purpose. Where a builtin has the same meaning, the
error also derives from it (a missing checkpoint is a ``FileNotFoundError``, a bad argument
a ``ValueError``), so code written against ``torch.load`` keeps working. Errors from a
storage backend are chained with ``raise ... from`` so the original stays visible.
"""

from __future__ import annotations

from collections.abc import Sequence


class AsyncCkptError(Exception):
    """Base class of every error raised by asyncckpt."""


class FormatError(AsyncCkptError, ValueError):
    """The bytes are not a valid asyncckpt file (bad magic, version, footer or manifest)."""


class TruncatedFileError(FormatError):
    """The file is shorter than its own footer or manifest says it is."""


class ChecksumError(FormatError):
    """A chunk's bytes do not match the checksum recorded when it was written.

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
            f"{path}: chunk {chunk} is corrupt ({detail}); affected keys: {shown or '(none)'}. "
            "The file was damaged after it was written; load an older checkpoint."
        )


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
    """A storage backend failed to read, write, list or delete (the cause is chained)."""


class WriterProcessError(StorageError):
    """The child process running background writes (``writer_processes=1``) died or could
    not start; the save it was writing failed and its target is untouched."""


class IncompleteCheckpointError(AsyncCkptError):
    """A version exists in storage but was never committed (or was removed while loading)."""


class ConflictError(AsyncCkptError):
    """Another writer already committed this step, or owns this checkpoint root."""


class CheckpointTimeoutError(AsyncCkptError, TimeoutError):
    """Waiting for a save to become durable, or for a step to be committed, timed out."""
