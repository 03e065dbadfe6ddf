"""Hugging Face ``transformers`` integration: :class:`AsyncCkptTrainer` and its mixin.

``Trainer._save_checkpoint`` writes the model, optimizer, scheduler, scaler and RNG states
with ``torch.save`` while training waits, and its rotation (mtime plus ``rmtree``) may delete
a folder whose save is still running. :class:`AsyncCkptTrainerMixin` keeps every
``TrainingArguments`` option (``save_steps``, ``save_total_limit``,
``load_best_model_at_end``, ``metric_for_best_model`` ...) and instead saves each checkpoint
as one :class:`~asyncckpt.Checkpointer` version, snapshotted and written in the background.

Under ``output_dir``: ``asyncckpt/`` (:data:`ROOT_NAME`), one version per saved
``global_step`` (model, optimizer, scheduler, scaler, every process's RNG states, the
``TrainerState`` JSON); and ``checkpoint-N/``, written once version N is committed and
removed with it (so ``get_last_checkpoint`` sees committed checkpoints only), holding the
stock Trainer's small files and :data:`MARKER_FILE`, not the weights: ``asyncckpt convert
output_dir/asyncckpt@N output_dir/checkpoint-N/model.safetensors --key model`` adds them.
Callbacks defining ``on_checkpoint_committed`` are told; ``push_to_hub`` pushes nothing
during training (warned once at ``train``).

``train(resume_from_checkpoint=True)`` resumes from the newest committed version; a
``.../checkpoint-N`` path from version N of the run that folder belongs to, else from the
stock files in it. Resuming from an older version of this run rewinds the newer ones
(:meth:`~asyncckpt.Checkpointer.rewind`, fenced, logged as a warning), where the stock
Trainer overwrites their folders; any other start over newer versions is refused before
the first step. ``save_total_limit`` is the Checkpointer's ``keep_total``, counted and
ranked (``metric_for_best_model``, ``greater_is_better``) as
``transformers.trainer_utils.rotate_checkpoints`` counts; stock Trainer folders are never
removed, and a ``checkpointer=`` passed in keeps its own retention. docs/guide.md ("Hugging
Face: Trainer and accelerate") says the rest.

Were one of the overridden ``Trainer`` methods (:data:`OVERRIDDEN`) renamed by a
``transformers`` release, the stock one would run instead (synchronous ``torch.save``
files, or a resume looking for files that are not there);
``tests/integrations/test_transformers.py`` fails then. DeepSpeed and FSDP (also on XLA)
are refused.

This module imports ``transformers`` (``pip install 'asyncckpt[transformers]'``);
``import asyncckpt`` does not import it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any

import torch

try:
    import transformers
    from transformers.trainer import TRAINING_ARGS_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "asyncckpt.transformers needs the `transformers` package: "
        "pip install 'asyncckpt[transformers]'"
    ) from exc

from asyncckpt._api.checkpointer import Checkpointer
from asyncckpt._api.jobs import SaveHandle
from asyncckpt._settings import Settings, SettingsArg
from asyncckpt._versions.paths import HF_ROOT_NAME
from asyncckpt.accelerate import gathered_rng_states, set_rng_states
from asyncckpt.errors import AsyncCkptError, ConflictError, FormatError

__all__ = ["MARKER_FILE", "OVERRIDDEN", "ROOT_NAME", "AsyncCkptTrainer", "AsyncCkptTrainerMixin"]

#: The Checkpointer root's folder name under ``args.output_dir`` (where ``asyncckpt.load``
#: and the command line look for it too).
ROOT_NAME = HF_ROOT_NAME
#: The ``transformers.Trainer`` methods the mixin overrides.
OVERRIDDEN = (
    "train",
    "_save_checkpoint",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
    "_load_best_model",
)
_FORMAT_KEY = "asyncckpt_transformers"
_FORMAT = 1
_STATE_FILE = "trainer_state.json"
#: Marks a ``checkpoint-N`` folder as ours (the version it stands for, the export command).
MARKER_FILE = "asyncckpt.json"
_FOLDER = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")

log = logging.getLogger(__name__)


class AsyncCkptTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it) to checkpoint asynchronously.

    Args:
        checkpointer: where versions go; default ``Checkpointer(output_dir/asyncckpt)``,
            built on first use.
        settings: the tunables of the Checkpointer built here (an
            :class:`asyncckpt.Settings`, or a dict such as ``{"threads": 4}`` over the
            ``ASYNCCKPT_*`` environment variables); one passed in keeps its own.
        *args, **kwargs: those of ``Trainer``.

    Example:
        >>> class MyTrainer(AsyncCkptTrainerMixin, transformers.Trainer):  # doctest: +SKIP
        ...     def compute_loss(self, model, inputs, **kwargs): ...
    """

    # What transformers.Trainer provides; declared for the type checker.
    args: Any
    state: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    control: Any
    callback_handler: Any
    hp_search_backend: Any

    def __init__(
        self,
        *args: Any,
        checkpointer: Checkpointer | None = None,
        settings: SettingsArg = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._ackpt = checkpointer
        self._ackpt_settings = Settings.of(settings)  # an entry point: resolved once, here
        self._ackpt_built = False  # ours to close (one passed in is the caller's)
        # The version last loaded, by (root, step): the load methods each ask for it.
        self._ackpt_loaded: tuple[tuple[str, int], dict[str, Any]] | None = None
        # Saves whose checkpoint-N folder is written once they are committed.
        self._ackpt_pending: dict[int, tuple[SaveHandle, str, dict[str, bytes]]] = {}

    @property
    def checkpointer(self) -> Checkpointer:
        """The Checkpointer the trainer saves to (built on first use)."""
        if self._ackpt is None:
            args = self.args
            metric = args.metric_for_best_model
            if metric is not None and not metric.startswith("eval_"):
                metric = f"eval_{metric}"  # the name the Trainer logs it under
            limit = args.save_total_limit  # None or <= 0: the stock Trainer deletes nothing
            self._ackpt = Checkpointer(
                os.path.join(args.output_dir, ROOT_NAME),
                keep_total=limit if limit is not None and limit > 0 else None,
                best_metric=metric,
                best_mode="max" if args.greater_is_better else "min",
                settings=self._ackpt_settings,
            )
            self._ackpt_built = True
        return self._ackpt

    # -- train ------------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` means the newest committed version.

        Returns once the last checkpoint is committed (its folder written, rotation applied).
        """
        self._check_supported()
        self._warn_hub_strategy()
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._resume_folder(trial) or True
        try:
            self._clear_newer_versions(resume_from_checkpoint, trial)
            output = super().train(  # type: ignore[misc]
                resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs
            )
            self._finish_saves(wait=True)
            self._rotate(self._get_output_dir(trial=trial))  # type: ignore[attr-defined]
        finally:
            self._ackpt_loaded = None
            self._close_built()
        return output

    def _close_built(self) -> None:
        """Close the Checkpointer this trainer built (its lease heartbeat ends; retention
        runs once more), so that nothing of it outlives ``train``; a later use opens the
        root again. One passed in is the caller's to close."""
        if self._ackpt is None or not self._ackpt_built:
            return
        ckpt, self._ackpt, self._ackpt_built = self._ackpt, None, False
        self._ackpt_pending.clear()  # close() waits for them; their folders are written
        ckpt.close()

    def _resume_folder(self, trial: Any) -> str | None:
        step = self.checkpointer.latest()
        if step is None:
            return None
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        state = self._version(folder)
        if state is not None and not os.path.isfile(os.path.join(folder, _STATE_FILE)):
            # The job died before writing it (the small model files are then missing).
            _write_file(folder, MARKER_FILE, _marker(step))
            _write_file(folder, _STATE_FILE, state["trainer_state"].encode())
        return folder

    def _clear_newer_versions(self, resume: str | bool | None, trial: Any) -> None:
        """Make room for the steps training will save: steps only increase, so versions
        newer than the step it resumes from would fail its first save after them."""
        ckpt = self.checkpointer
        newest = ckpt.latest()
        folder = resume if isinstance(resume, str) else None
        start = _start_step(folder)
        if newest is None or newest <= start:
            return
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        ours = folder is not None and self._is_run_dir(os.path.dirname(os.path.normpath(folder)))
        if ours and start in ckpt.versions():
            if ckpt.is_writer:
                removed = ckpt.rewind(start)
                log.warning(
                    "resuming from %s: rewound %s to step %d, deleting the newer step(s) %s "
                    "(the stock Trainer would overwrite them as training reaches them)",
                    folder,
                    ckpt.root,
                    start,
                    ", ".join(map(str, removed)),
                )
                self._rotate(run_dir)
            return
        raise ConflictError(_newer_versions_message(ckpt, start, newest, run_dir))

    # -- saving -----------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """One background version instead of ``save_model`` + ``torch.save`` files."""
        self._check_supported()
        step = self.state.global_step
        if self.hp_search_backend is None and trial is None:
            self.store_flos()  # type: ignore[attr-defined]
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        if self.state.best_global_step and self.args.save_strategy in ("steps", "epoch", "best"):
            # Its folder appears once the version is committed; the version is kept.
            best = f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}"
            self.state.best_model_checkpoint = os.path.join(run_dir, best)
        self._update_callback_states()
        self._finish_saves(wait=False)
        handle = self.checkpointer.save(step, self._state(), metrics=self._eval_metrics())
        if self.checkpointer.is_writer:
            folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
            self._ackpt_pending[step] = (handle, folder, self._folder_files(step))
        self._rotate(run_dir)

    def _folder_files(self, step: int) -> dict[str, bytes]:
        """What ``checkpoint-N`` gets once version N is committed, rendered now (as the
        stock Trainer writes them at the save); ``trainer_state.json`` last: its presence
        means the folder is complete."""
        with tempfile.TemporaryDirectory(prefix="asyncckpt-hf-") as tmp:
            self._save_small_files(tmp)
            files = _read_tree(tmp)
        files[MARKER_FILE] = _marker(step)
        files[_STATE_FILE] = self._state_json().encode()
        return files

    def _save_small_files(self, directory: str) -> None:
        """What ``Trainer.save_model`` writes besides the weights, into ``directory``."""
        model = self.accelerator.unwrap_model(self.model)
        if isinstance(model, transformers.PreTrainedModel):
            # As save_pretrained: the class name is what AutoModel dispatches on.
            model.config.architectures = [type(model).__name__]
            model.config.save_pretrained(directory)
            if model.can_generate() and model.generation_config is not None:
                model.generation_config.save_pretrained(directory)
        processor = getattr(self, "processing_class", None)
        if processor is not None:
            processor.save_pretrained(directory)
        torch.save(self.args, os.path.join(directory, TRAINING_ARGS_NAME))

    def _warn_hub_strategy(self) -> None:
        """Said once, at ``train``: our ``checkpoint-N`` folders hold no weights to push."""
        args = self.args
        if not args.push_to_hub or str(args.hub_strategy.value) == "end":
            return
        log.warning(
            "push_to_hub with hub_strategy=%r: AsyncCkptTrainer pushes nothing while training "
            "(its checkpoint-N folders hold no weights; the stock Trainer uploads each "
            "save's model). Call trainer.push_to_hub() after train() to save and upload the "
            "final model",
            args.hub_strategy.value,
        )

    def _state(self) -> dict[str, Any]:
        only_model = self.args.save_only_model
        scaler = getattr(self.accelerator, "scaler", None)
        return {
            _FORMAT_KEY: _FORMAT,
            "step": self.state.global_step,
            "model": self.model.state_dict(),
            "optimizer": None if only_model else self.optimizer.state_dict(),
            "scheduler": None if only_model else self.lr_scheduler.state_dict(),
            "scaler": None if only_model or scaler is None else scaler.state_dict(),
            "rng": None if only_model else gathered_rng_states(),
            "trainer_state": self._state_json(),
        }

    def _state_json(self) -> str:
        # What TrainerState.save_to_json writes.
        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"

    def _update_callback_states(self) -> None:
        # As Trainer._save_checkpoint: ExportableState callbacks and TrainerControl.
        exportable = transformers.trainer_callback.ExportableState
        callbacks = [*self.callback_handler.callbacks, self.control]
        for cb in [cb for cb in callbacks if isinstance(cb, exportable)]:
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state

    def _eval_metrics(self) -> dict[str, float] | None:
        """The finite numbers of this step's evaluation log entry, if it evaluated (a NaN
        loss is left out: the version is then not ranked by it)."""
        for entry in reversed(self.state.log_history):
            if entry.get("step") != self.state.global_step:
                break
            if any(str(k).startswith("eval_") for k in entry):
                return {
                    str(k): v
                    for k, v in entry.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                }
        return None

    def _finish_saves(self, wait: bool) -> None:
        """Write the folders of committed saves (all of them, after waiting, if ``wait``),
        and tell the callbacks that have ``on_checkpoint_committed``."""
        if wait:
            self.checkpointer.wait()
        for step, (handle, folder, files) in list(self._ackpt_pending.items()):
            if not handle.done():
                continue
            del self._ackpt_pending[step]
            if handle.failed() or handle.cancelled():
                continue
            for name, data in files.items():  # trainer_state.json last
                _write_file(folder, name, data)
            log.info("%s committed (step %d)", folder, step)
            self._committed_event(folder, step)

    def _committed_event(self, folder: str, step: int) -> None:
        """``on_checkpoint_committed(args, state, control, checkpoint=folder, step=step)``
        on each callback that defines it (``on_save`` fires at the snapshot, before the
        version is durable), on the training thread."""
        for callback in self.callback_handler.callbacks:
            event = getattr(callback, "on_checkpoint_committed", None)
            if callable(event):
                event(self.args, self.state, self.control, checkpoint=folder, step=step)

    def _rotate(self, run_dir: str) -> None:
        """Remove our ``checkpoint-N`` folders whose version retention deleted.

        Only folders with our marker (or, from earlier releases, holding nothing but
        ``trainer_state.json``): a stock Trainer folder stays.
        """
        if not self.checkpointer.is_writer or not os.path.isdir(run_dir):
            return
        kept = {*self.checkpointer.versions(), *self._ackpt_pending}
        for name in os.listdir(run_dir):
            match = _FOLDER.match(name)
            folder = os.path.join(run_dir, name)
            if match is None or int(match.group(1)) in kept or not os.path.isdir(folder):
                continue
            names = set(os.listdir(folder))
            if MARKER_FILE in names or names <= {_STATE_FILE}:
                shutil.rmtree(folder, ignore_errors=True)

    # -- loading ----------------------------------------------------------------------

    def _version(self, checkpoint: str | None) -> dict[str, Any] | None:
        """The committed version a ``checkpoint-N`` folder stands for, loaded once; or None.

        Another run's folder means version N of *that* run's root (read only), never this
        run's; a stock Trainer's folder means None: its own files are loaded.
        """
        if checkpoint is None:
            return None
        folder = os.path.normpath(checkpoint)
        match = _FOLDER.match(os.path.basename(folder))
        if match is None:
            return None
        step, run_dir = int(match.group(1)), os.path.dirname(folder)
        ours = self._is_run_dir(run_dir)
        key = (self.checkpointer.root if ours else os.path.realpath(run_dir), step)
        if self._ackpt_loaded is not None and self._ackpt_loaded[0] == key:
            return self._ackpt_loaded[1]
        if ours:
            state = self._load_version(self.checkpointer, step, collective=None)
        elif os.path.isdir(os.path.join(run_dir, ROOT_NAME)):
            with Checkpointer(os.path.join(run_dir, ROOT_NAME), read_only=True) as other:
                # Not this job's root: every rank reads the committed version on its own.
                state = self._load_version(other, step, collective=False)
        else:
            return None
        if state is not None:
            self._ackpt_loaded = (key, state)
        return state

    def _is_run_dir(self, directory: str) -> bool:
        """Whether ``directory`` is where this trainer writes its ``checkpoint-N`` folders:
        ``output_dir``, or a hyperparameter search trial's ``run-*`` folder in it."""
        output, found = os.path.realpath(self.args.output_dir), os.path.realpath(directory)
        parent, name = os.path.split(found)
        return found == output or (parent == output and name.startswith("run-"))

    def _load_version(
        self, ckpt: Checkpointer, step: int, collective: bool | None
    ) -> dict[str, Any] | None:
        if step not in ckpt.versions():
            return None
        state = ckpt.load(step, map_location=self.args.device, collective=collective)
        if not isinstance(state, dict) or state.get(_FORMAT_KEY) != _FORMAT:
            raise FormatError(
                f"{ckpt.root} step {step} was not written by asyncckpt.transformers (or by a "
                "newer one)"
            )
        return state

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        state = self._version(resume_from_checkpoint)
        if state is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        (model if model is not None else self.model).load_state_dict(state["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        state = self._version(checkpoint)
        if state is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        elif state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        state = self._version(checkpoint)
        if state is None:
            super()._load_scaler(checkpoint)  # type: ignore[misc]
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        state = self._version(checkpoint)
        if state is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
        elif rngs := state["rng"]:
            index = self.args.process_index
            where = f"{self.checkpointer.root} step {state['step']}"
            set_rng_states(rngs[index] if index < len(rngs) else rngs[0], where)

    def _load_best_model(self) -> None:
        self._finish_saves(wait=True)  # the best may be the save still being written
        state = self._version(self.state.best_model_checkpoint)
        if state is None:
            super()._load_best_model()  # type: ignore[misc]
            return
        self.model.load_state_dict(state["model"])

    def _check_supported(self) -> None:
        for flag in ("is_deepspeed_enabled", "is_fsdp_enabled", "is_fsdp_xla_enabled"):
            if getattr(self, flag, False):
                raise AsyncCkptError(
                    f"asyncckpt.transformers does not support {flag[3:-8]} yet; use the stock "
                    "transformers.Trainer for it"
                )


class AsyncCkptTrainer(AsyncCkptTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` whose checkpoints are written in the background.

    Takes what ``Trainer`` takes, plus ``checkpointer=`` and ``settings=`` (see
    :class:`AsyncCkptTrainerMixin`).
    """


def _start_step(folder: str | None) -> int:
    """The step training resumes from with ``folder``: its ``trainer_state.json``'s
    ``global_step`` (as ``Trainer.train`` reads it), else its name's N; 0 without one."""
    if folder is None:
        return 0
    try:
        with open(os.path.join(folder, _STATE_FILE)) as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        match = _FOLDER.match(os.path.basename(os.path.normpath(folder)))
        return int(match.group(1)) if match else 0


def _newer_versions_message(ckpt: Checkpointer, start: int, newest: int, run_dir: str) -> str:
    """Why training from ``start`` over versions up to ``newest`` is refused, and the ways on."""
    older = [s for s in ckpt.versions() if s <= start]
    where = f"training from step {start} would save steps that {ckpt.root} already holds "
    if older:
        undo = (
            f"run `asyncckpt rewind {ckpt.root} {older[-1]} --yes` to delete the versions "
            f"newer than {older[-1]}"
        )
    else:
        undo = f"choose a new output_dir (or delete {ckpt.root})"
    steps = ", ".join(map(str, ckpt.versions()))
    folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-N")
    return (
        f"{where}(up to step {newest}), and steps only increase: pass "
        f"resume_from_checkpoint=True to continue from step {newest}, or "
        f"resume_from_checkpoint={folder!r} for a committed N ({steps}) to go back to "
        f"version N (the newer ones are rewound, as the stock Trainer overwrites them), or "
        f"{undo}. Nothing was changed"
    )


def _write_file(folder: str, name: str, data: bytes) -> None:
    """Write ``folder/name`` atomically (a reader never sees half a file)."""
    path = os.path.join(folder, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".asyncckpt.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _read_tree(directory: str) -> dict[str, bytes]:
    """Every file under ``directory``, by its path relative to it."""
    root = pathlib.Path(directory)
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _marker(step: int) -> bytes:
    """Our marker file: which version the folder stands for, and how to export its weights
    into it (``asyncckpt convert``), so that ``from_pretrained`` reads the folder."""
    export = (
        f"asyncckpt convert {ROOT_NAME}@{step} {PREFIX_CHECKPOINT_DIR}-{step}/model.safetensors "
        "--key model"
    )
    record = {"root": f"../{ROOT_NAME}", "step": step, "export_weights_from_output_dir": export}
    return (json.dumps(record, indent=2) + "\n").encode()
