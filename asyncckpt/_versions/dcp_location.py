"""Where a DCP checkpoint lives: the part ``Writer`` and ``Reader`` share."""

from __future__ import annotations

import os
from typing import Any

from asyncckpt._format.index import METADATA_NAME
from asyncckpt._settings import Settings
from asyncckpt._storage import Storage, resolve
from asyncckpt._versions.protocol import parse_step, read_commit_strict


class CheckpointLocation:
    """A checkpoint directory (URL), its storage backend, and its commit object's path.

    Example:
        >>> where = CheckpointLocation("memory://ckpt/3", None, Settings())
        >>> where.checkpoint_id, where.metadata_path
        ('memory://ckpt/3', '/ckpt/3/.metadata')
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: Any,
        settings: Settings,
    ) -> None:
        self._storage_options = dict(storage_options or {})
        #: The entry point's settings; they travel with a pickled location, so the storage
        #: opened on the other side is built with them, not that process's environment.
        self._settings = settings
        self._open(url)

    def _open(self, url: str | os.PathLike[str]) -> None:
        self._url = os.fspath(url)
        self._storage: Storage
        self._storage, self._path = resolve(self._url, self._storage_options, self._settings)
        #: The commit object's name when known (a caller read the version's COMMIT).
        self._metadata_name: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The storage backend is opened again on the other side instead of pickled: DCP's
        # process-based async_save sends its storage writer to another process, and an s3fs
        # client with live sessions cannot travel.
        state = dict(self.__dict__)
        del state["_storage"], state["_path"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open(self._url)
        self._metadata_name = state.get("_metadata_name")

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory (URL)."""
        return self._url

    @property
    def metadata_path(self) -> str:
        """The commit object's path within the storage backend (``dcp.Writer``'s name)."""
        return self._storage.join(self._path, METADATA_NAME)

    def committed_metadata_path(self) -> str:
        """Where a reader finds the commit object.

        A sharded ``Checkpointer`` version (a step directory with a ``COMMIT``) names its
        metadata, written under the save attempt's own name, in that ``COMMIT``; anything
        else (an ``asyncckpt.dcp.Writer`` directory, an older root) has ``.metadata``.

        Raises:
            FormatError: the directory's ``COMMIT`` cannot be understood.
        """
        name = self._metadata_name
        if name is None:
            head, _, tail = self._path.rstrip("/").rpartition("/")
            step = parse_step(tail)
            commit = None if step is None else read_commit_strict(self._storage, head, step)
            found = None if commit is None else commit.metadata_file
            name = found or METADATA_NAME
        return self._storage.join(self._path, name)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any path or fsspec URL names a checkpoint directory."""
        return isinstance(checkpoint_id, (str, os.PathLike))
