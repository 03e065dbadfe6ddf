"""A lazily read checkpoint: its keys, shapes and dtypes from the manifest, each top-level
entry read (and verified) only when asked for, through the one handle that pins the file
(``asyncckpt.open``, ``Checkpointer.open``), like safetensors' ``safe_open``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from asyncckpt._device import Placement
from asyncckpt._engine.decode import check_devices, materialize
from asyncckpt._engine.decode_select import top_level
from asyncckpt._engine.opened import OpenedFile
from asyncckpt._format.tree import torch_dtype
from asyncckpt._settings import Settings
from asyncckpt.errors import AsyncCkptError

__all__ = ["LazyCheckpoint", "LazyEntries"]


class LazyEntries(Mapping[Any, Any]):
    """What every lazily opened checkpoint is: a read-only mapping over the saved dict's
    top-level keys (listed when opened), each entry loaded, and verified, when asked for.

    Subclasses name the checkpoint and its keys (``__init__``) and load an entry in
    ``__getitem__``.
    """

    def __init__(self, name: str, keys: list[Any]) -> None:
        self._name, self._keys = name, keys

    @property
    def name(self) -> str:
        """The checkpoint, as a user would write it."""
        return self._name

    def __getitem__(self, key: Any) -> Any:  # pragma: no cover - the subclasses'
        raise NotImplementedError

    def get_tensor(self, key: Any) -> Any:
        """``self[key]`` (the name safetensors' ``safe_open`` uses)."""
        return self[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def close(self) -> None:
        """Release what the mapping holds (idempotent)."""

    def __enter__(self) -> LazyEntries:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LazyCheckpoint(LazyEntries):
    """A read-only mapping over the top-level keys of a saved dict, loading one at a time.

    Opening reads only the file's header, footer and manifest; ``ckpt[key]`` reads and
    verifies that entry's chunks (each time it is asked for: nothing is cached). The file is
    held open, pinned, until :meth:`close` (it is a context manager): every entry comes
    from the same version of the file however often it is replaced meanwhile (on an object
    store a read of a replaced object raises ``FileReplacedError``).

    Args:
        opened: the opened file (closed by :meth:`close`).
        placement: where tensors go (``map_location``).
        settings: the load's settings (reader threads, pinned-memory budget).

    Raises:
        AsyncCkptError: the file does not hold a dict.
    """

    def __init__(self, opened: OpenedFile, placement: Placement, settings: Settings) -> None:
        pairs = top_level(opened.manifest.root, opened.name)
        if pairs is None:
            opened.close()
            raise AsyncCkptError(
                f"{opened.name}: open() reads a saved dict one key at a time, but this file "
                "holds something else; load it with asyncckpt.load"
            )
        check_devices(opened)
        self._opened, self._placement, self._settings = opened, placement, settings
        super().__init__(opened.name, [key for key, _node in pairs])
        self._lock = threading.Lock()  # one read at a time through the one handle
        self._closed = False

    def __getitem__(self, key: Any) -> Any:
        """Read, verify and return the entry ``key``.

        Raises:
            MissingKeyError: the file has no top-level ``key`` (names the keys it has).
            ChecksumError: a chunk of the entry is damaged.
            AsyncCkptError: the mapping is closed.
        """
        with self._lock:
            if self._closed:
                raise AsyncCkptError(f"{self.name}: read after close()")
            got = materialize(self._opened, self._placement, self._settings, keys=[key])
        return got[key]

    def tensors(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Every tensor's key path with its shape and dtype, from the manifest (nothing
        is read).

        Example:
            ``{"state['model']['w']": (torch.Size([3]), torch.float32)}``
        """
        return {
            entry.key: (torch.Size(entry.shape), torch_dtype(entry.dtype))
            for entry in self._opened.manifest.tensors
        }

    def nbytes(self) -> int:
        """The bytes of every storage of the file, decoded (what a whole load allocates)."""
        return sum(entry.nbytes for entry in self._opened.manifest.storages)

    def close(self) -> None:
        """Close the file's handle (idempotent)."""
        with self._lock:
            self._closed = True
            self._opened.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} keys"
        return f"<asyncckpt.open {self.name!r}: {state}>"
