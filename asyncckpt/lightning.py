"""Lightning integration: :class:`AsyncCkptIO`, a ``CheckpointIO`` plugin backed by asyncckpt.

``Trainer(plugins=[AsyncCkptIO()])`` makes every checkpoint the Trainer writes (through
``ModelCheckpoint``, ``trainer.save_checkpoint`` ...) an asyncckpt file: saved in the
background once the state is snapshotted, compressed, checksummed and replaced atomically,
and loaded (``trainer.fit(ckpt_path=...)``) without unpickling anything.

A Lightning checkpoint holds more than tensors: hyperparameters (``AttributeDict``, enums,
paths, dataclasses ...), callback and loop state. asyncckpt never pickles, so the plugin
*projects* the checkpoint onto plain data (:func:`to_plain`), recording which value had which
class, and on load rebuilds the values whose class it trusts (:func:`from_plain`); no class
is ever imported by a name read from a file. ``docs/lightning.md`` lists what round-trips.

:func:`load_from_checkpoint` is ``LightningModule.load_from_checkpoint`` for these files
(which Lightning's own method cannot read: it calls ``torch.load``), reading only the
weights and hyperparameters, not the optimizer states.

Names: tools take Lightning's ``.ckpt`` files for ``torch.save`` ones, so
:class:`ModelCheckpoint` here names them ``.ackpt``, and :class:`AsyncCkptIO` warns once
when it writes asyncckpt bytes under a ``.ckpt`` name, saying how to read them.

This module imports Lightning (the ``lightning`` package, ``pip install
'asyncckpt[lightning]'``); ``import asyncckpt`` does not import this module.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

try:
    import lightning.pytorch as pl
    from lightning.pytorch import callbacks as pl_callbacks
    from lightning.pytorch.core import saving as pl_saving
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "asyncckpt.lightning needs the `lightning` package: pip install 'asyncckpt[lightning]'"
    ) from exc

from torch import Tensor

from asyncckpt._api import dropin as api
from asyncckpt._convert.lightning_plain import (
    CHECKPOINT_ROOT,
    PROJECTION_KEY,
    PROJECTION_VERSION,
    from_plain,
    to_plain,
)
from asyncckpt._device import MapLocation
from asyncckpt._format.tree import ROOT_NAME
from asyncckpt._settings import Settings, SettingsArg
from asyncckpt._storage import resolve
from asyncckpt.errors import AsyncCkptWarning, UnsupportedObjectError

__all__ = [
    "EXTENSION",
    "PROJECTION_KEY",
    "PROJECTION_VERSION",
    "AsyncCkptIO",
    "ModelCheckpoint",
    "from_plain",
    "load_from_checkpoint",
    "to_plain",
]

#: The training state only ``trainer.fit(ckpt_path=...)`` restores: never read by
#: :func:`load_from_checkpoint` (for Adam, the optimizer states are twice the weights).
TRAINING_STATE_KEYS = frozenset({"optimizer_states", "lr_schedulers", "loops", "callbacks"})

#: The extension of the files :class:`ModelCheckpoint` names.
EXTENSION = ".ackpt"
#: Lightning's name for its checkpoints, which tools take for a ``torch.save`` file.
_TORCH_EXTENSION = ".ckpt"

_Loadable = TypeVar("_Loadable", bound="pl.LightningModule | pl.LightningDataModule")


def _target_key(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


class ModelCheckpoint(pl_callbacks.ModelCheckpoint):  # type: ignore[misc]
    """Lightning's ``ModelCheckpoint``, naming its files ``.ackpt`` instead of ``.ckpt``.

    Use it with :class:`AsyncCkptIO`, so that the files' names say what they are:
    ``torch.load``, ``LightningModule.load_from_checkpoint`` and colleagues' scripts would
    take a ``.ckpt`` for a ``torch.save`` file and fail with torch's advice to retry with
    ``weights_only=False`` (which cannot work). Every argument is Lightning's; Lightning
    finds ``last.ackpt`` for ``ckpt_path="last"`` (it looks for the callback's extension).

    Example:
        >>> from asyncckpt.lightning import AsyncCkptIO, ModelCheckpoint
        >>> callback = ModelCheckpoint(dirpath="ckpts", monitor="val_loss", save_last=True)
        >>> callback.FILE_EXTENSION
        '.ackpt'

        With a Trainer: ``Trainer(plugins=[AsyncCkptIO()], callbacks=[callback])``.
    """

    FILE_EXTENSION = EXTENSION


class AsyncCkptIO(CheckpointIO):  # type: ignore[misc]
    """A Lightning ``CheckpointIO`` that saves through :func:`asyncckpt.save`.

    ``save_checkpoint`` returns once the checkpoint is snapshotted; the write goes on in the
    background. A background failure is raised, once, by the next ``save_checkpoint``,
    ``remove_checkpoint``, ``load_checkpoint`` or ``teardown`` (which Lightning calls at the
    end of ``fit``/``validate``/``test``); ``teardown`` also waits for every pending save.

    Args:
        compression: ``"auto"`` (default), ``"zstd"`` or ``"none"``, as for
            :func:`asyncckpt.save`.
        storage_options: fsspec options for URL paths (e.g. ``{"endpoint_url": ...}``).
        classes: classes to rebuild on load besides the built-in trusted ones (see
            :func:`from_plain`): your hyperparameter enums, dataclasses, dict subclasses.
        map_location: where ``load_checkpoint`` puts tensors when Lightning passes none
            (it never does): as for :func:`asyncckpt.load`; None puts CPU tensors on the
            CPU and accelerator tensors on this process's current device.
        settings: the tunables of every save and load of the plugin, fixed when it is
            built: an :class:`asyncckpt.Settings`, or a dict such as ``{"threads": 4}``
            over the ``ASYNCCKPT_*`` environment variables.
        on_durable: called with each file's path once its save is durable (on the
            training thread, at the plugin's next call: a save, remove, load or the
            ``teardown`` that ends ``fit``), so that a logger records durable checkpoints
            only; Lightning's ``after_save_checkpoint`` fires at the snapshot. Not called
            for a failed save.

    Example:
        >>> import tempfile, os, torch
        >>> io = AsyncCkptIO()
        >>> path = os.path.join(tempfile.mkdtemp(), "epoch=0.ackpt")
        >>> io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 0}, path)
        >>> io.load_checkpoint(path)["state_dict"]["w"]
        tensor([1., 1.])
        >>> io.remove_checkpoint(path); io.teardown()
        >>> os.path.exists(path)
        False

        With a Trainer: ``Trainer(plugins=[AsyncCkptIO()])``.
    """

    def __init__(
        self,
        *,
        compression: str = "auto",
        storage_options: dict[str, Any] | None = None,
        classes: Iterable[type] = (),
        map_location: MapLocation = None,
        settings: SettingsArg = None,
        on_durable: Callable[[str], object] | None = None,
    ) -> None:
        super().__init__()
        self.on_durable = on_durable
        #: Resolved once, when the plugin is built (argument > ``ASYNCCKPT_*`` > default).
        self.settings = Settings.of(settings)
        api.write_options(compression, self.settings)  # a bad value fails here, not later
        self.compression = compression
        self.storage_options = dict(storage_options or {})
        self.classes = tuple(classes)
        self.map_location = map_location
        self._pending: dict[str, list[api.SaveHandle]] = {}
        self._failures: list[BaseException] = []
        self._warned_name = False

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Snapshot ``checkpoint`` and write it to ``path`` in the background.

        Args:
            checkpoint: the state Lightning assembled.
            path: the target file (``*.ckpt``; the extension does not matter) or URL.
            storage_options: a dict of fsspec options for this save, over the plugin's.

        Raises:
            UnsupportedObjectError: the checkpoint holds a value that cannot be stored
                (see :func:`to_plain`); nothing was written.
            TypeError: ``storage_options`` is not a dict.
            Exception: an earlier background save of this plugin failed (this save is
                still made).
        """
        # Collect earlier failures first (observing them, so that asyncckpt.save does not
        # raise one instead of saving), make this save anyway, then report them: a failure
        # must stop training, but need not cost the checkpoint asked for now.
        self._collect()
        options = self._options(storage_options)
        plain = to_plain(checkpoint)
        try:
            handle = api.save(
                plain,
                path,
                compression=self.compression,
                storage_options=options,
                settings=self.settings,
            )
        except UnsupportedObjectError as exc:
            # asyncckpt.save names the root "state"; the user knows it as the checkpoint.
            reason = str(exc).removeprefix(f"cannot save {exc.key_path}: ")
            key_path = CHECKPOINT_ROOT + exc.key_path.removeprefix(ROOT_NAME)
            raise UnsupportedObjectError(key_path, reason) from None
        self._pending.setdefault(_target_key(path), []).append(handle)
        self._warn_torch_name(path)
        self._raise_failure()

    def _warn_torch_name(self, path: str | os.PathLike[str]) -> None:
        """Once per plugin: asyncckpt bytes under a ``.ckpt`` name, and how to read them.

        Lightning's own temporary files (``.temp.ckpt``, ``.lr_find_*.ckpt``: hidden names
        it writes and deletes itself) are nobody else's to read.
        """
        name = os.path.basename(os.fspath(path).rstrip("/"))
        if self._warned_name or not name.endswith(_TORCH_EXTENSION) or name.startswith("."):
            return
        self._warned_name = True
        warnings.warn(
            f"{os.fspath(path)} holds asyncckpt bytes under Lightning's torch name: "
            "torch.load and LightningModule.load_from_checkpoint cannot read it (torch's "
            "advice to retry with weights_only=False cannot work). Read it with "
            "asyncckpt.lightning.load_from_checkpoint(MyModule, path) or asyncckpt.load, or "
            f"export it with `asyncckpt convert {name} {name[: -len(_TORCH_EXTENSION)]}.pt`; "
            "to name the files .ackpt, use asyncckpt.lightning.ModelCheckpoint instead of "
            "Lightning's (the same arguments)",
            AsyncCkptWarning,
            stacklevel=2,
        )

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: MapLocation = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint, verifying every checksum; never unpickles.

        A save of this process to ``path`` still in flight is waited for first, and so is
        one of another process (its marker, docs/PROTOCOL.md §8). A save left unfinished by
        a process that died (the crash a resume follows) is logged, and the file is loaded
        as it is: the state of the save before it.

        Args:
            path: the file or URL.
            map_location: as for :func:`asyncckpt.load`; None uses the plugin's.
            weights_only: accepted for Lightning's interface and ignored: nothing is ever
                unpickled, so every load is as safe as ``weights_only=True``.

        Returns:
            The checkpoint, with trusted classes rebuilt (see :func:`from_plain`).

        Raises:
            CheckpointNotFoundError: no file at ``path``.
            ChecksumError: the file was damaged after it was written.
            FormatError: not an asyncckpt file (e.g. written by ``torch.save``).
            Exception: a background save of this plugin failed.
        """
        del weights_only
        map_location = self._settled(path, map_location)
        # A save of this file left unfinished by a dead process (the crash this load is
        # resuming from, typically) leaves its marker: resume from the file as it is.
        options = self._options(None)
        loaded = api.load(
            path, map_location, storage_options=options, dead_writer="load", settings=self.settings
        )
        return from_plain(loaded, self.classes, name=os.fspath(path))

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the checkpoint at ``path`` once any save of it in flight has finished.

        Waiting matters: deleting first would let the pending write put the file back.

        Args:
            path: the file or URL; a missing file is not an error.

        Raises:
            StorageError: the delete failed.
            Exception: a background save of this plugin failed.
        """
        self._settled(path)
        storage, target = resolve(path, self._options(None), self.settings)
        storage.delete(target)

    def teardown(self) -> None:
        """Wait until every pending save is durable.

        Raises:
            Exception: the first failure among the pending saves (the others are logged by
                asyncckpt and raised by the next call).
        """
        for key in list(self._pending):
            self._wait_for(key)
        self._raise_failure()

    def _options(self, extra: Any | None) -> dict[str, Any] | None:
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(
                f"storage_options must be a dict of fsspec options, not {type(extra).__name__}"
            )
        return {**self.storage_options, **(extra or {})} or None

    def _settled(self, path: str | os.PathLike[str], where: MapLocation = None) -> MapLocation:
        """Before reading ``path``: wait for this plugin's saves to it, raise any failure.
        Returns the map_location to use (``where``, else the plugin's)."""
        self._wait_for(path)
        self._raise_failure()
        return self.map_location if where is None else where

    def _wait_for(self, path: str | os.PathLike[str]) -> None:
        for handle in self._pending.pop(_target_key(path), []):
            self._settle(handle, None)

    def _settle(self, handle: api.SaveHandle, timeout: float | None) -> None:
        """Take the outcome of a finished (or, with no timeout, awaited) save."""
        seen = handle.observed  # observed elsewhere (asyncckpt.wait ...): raised there
        failure = handle.exception(timeout)
        if failure is not None and not seen:
            self._failures.append(failure)
        elif failure is None and self.on_durable is not None:
            self.on_durable(handle.path)

    def _collect(self) -> None:
        """Take the outcome of every finished save, forget the successes. Observing them
        here keeps asyncckpt's next ``save`` from raising a failure this plugin reports."""
        for key, handles in list(self._pending.items()):
            running = []
            for handle in handles:
                if handle.done():
                    self._settle(handle, 0)
                else:
                    running.append(handle)
            if running:
                self._pending[key] = running
            else:
                del self._pending[key]

    def _raise_failure(self) -> None:
        """Raise the oldest failure of a finished save not raised yet."""
        self._collect()
        if self._failures:
            raise self._failures.pop(0)


def load_from_checkpoint(
    cls: type[_Loadable],
    checkpoint_path: str | os.PathLike[str],
    map_location: MapLocation = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    *,
    plugin: AsyncCkptIO | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> _Loadable:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a file :class:`AsyncCkptIO` wrote.

    Lightning's own ``load_from_checkpoint`` calls ``torch.load`` and cannot read these
    files. This does what it does (Lightning's ``_load_from_checkpoint``): the stored
    hyperparameters become constructor arguments (``kwargs`` override them; arguments the
    constructor does not take are dropped unless it takes ``**kwargs``), ``hparams_file``
    replaces them, ``configure_model`` and ``on_load_checkpoint`` run, the weights are
    loaded with ``load_state_dict(strict=...)`` and the module is moved to the device of
    the loaded weights. The module is returned in training mode, as Lightning's is. Only
    what that needs is read, verified: every top-level key except the training state
    (:data:`TRAINING_STATE_KEYS`: optimizer states, schedulers, loops, callbacks), so
    ``on_load_checkpoint`` sees the keys your ``on_save_checkpoint`` added. Lightning's
    version migrations rewrite only that training state and are not applied.

    Args:
        cls: a ``LightningModule`` (or ``LightningDataModule``) subclass.
        checkpoint_path: the file or URL.
        map_location: as for :func:`asyncckpt.load`; None puts CPU tensors on the CPU and
            accelerator tensors on this process's current device (the CPU, with a warning,
            when it has none).
        hparams_file: a ``.yaml``/``.yml`` or ``.csv`` file whose hyperparameters replace
            the stored ones.
        strict: as for ``load_state_dict``; None uses ``cls``'s ``strict_loading`` (True
            by default). Contradicting a ``strict_loading`` set on the class is a
            ``ValueError``, as in Lightning.
        plugin: the :class:`AsyncCkptIO` whose ``classes``, ``storage_options`` and
            ``map_location`` (when none is passed) to use; a save of it to this path
            still in flight is waited for, and a failure of it raised. None: a default one.
        weights_only: accepted for Lightning's interface and ignored: nothing is unpickled.
        **kwargs: constructor arguments, over the stored hyperparameters.

    Returns:
        The module, with the checkpoint's weights.

    Raises:
        CheckpointNotFoundError: no file at ``checkpoint_path``.
        ChecksumError: a chunk read was damaged.
        FormatError: not an asyncckpt file (e.g. written by ``torch.save``).
        RuntimeError: ``strict`` and the weights do not match the module's parameters.
        ValueError: ``hparams_file`` is neither YAML nor CSV, or ``strict`` contradicts
            the class's ``strict_loading``.

    Example:
        ``model = load_from_checkpoint(MyModule, "epoch=3.ckpt", lr=1e-4)``
    """
    del weights_only
    plugin = plugin if plugin is not None else AsyncCkptIO()
    map_location = plugin._settled(checkpoint_path, map_location)
    skip = TRAINING_STATE_KEYS
    if issubclass(cls, pl.LightningDataModule):
        skip = skip | {"state_dict"}
    name = os.fspath(checkpoint_path)
    options = plugin._options(None)
    # One handle for every key read: all of them come from the same version of the file.
    with api.open_checkpoint(
        checkpoint_path,
        map_location,
        storage_options=options,
        dead_writer="load",
        settings=plugin.settings,
    ) as ckpt:
        plain = {key: ckpt[key] for key in ckpt if key not in skip}
    checkpoint = from_plain(plain, plugin.classes, name=name)
    return _build(cls, checkpoint, name, hparams_file, strict, kwargs)


def _build(
    cls: type[_Loadable],
    checkpoint: dict[str, Any],
    name: str,
    hparams_file: str | os.PathLike[str] | None,
    strict: bool | None,
    kwargs: dict[str, Any],
) -> _Loadable:
    """The steps of Lightning's ``_load_from_checkpoint`` after its ``torch.load``."""
    hparams_key = cls.CHECKPOINT_HYPER_PARAMS_KEY
    if hparams_file is not None:
        checkpoint[hparams_key] = _read_hparams_file(hparams_file)
    checkpoint.setdefault(hparams_key, {}).update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return cast(_Loadable, pl_saving._load_state(cls, checkpoint, **kwargs))
    model = cast(
        pl.LightningModule, pl_saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    )
    tensors = [t for t in checkpoint.get("state_dict", {}).values() if isinstance(t, Tensor)]
    if not tensors:
        warnings.warn(f"{name}: the state dict holds no parameters", AsyncCkptWarning, stacklevel=3)
        return cast(_Loadable, model)
    return cast(_Loadable, model.to(tensors[0].device))


def _read_hparams_file(path: str | os.PathLike[str]) -> Any:
    extension = os.fspath(path).rsplit(".", 1)[-1].lower()
    if extension == "csv":
        return pl_saving.load_hparams_from_tags_csv(os.fspath(path))
    if extension in ("yml", "yaml"):
        return pl_saving.load_hparams_from_yaml(os.fspath(path))
    raise ValueError(f"hparams_file {os.fspath(path)!r}: .csv, .yml or .yaml is required")
