"""asyncckpt.transformers: AsyncCkptTrainer resumes exactly as the stock Trainer does."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers.trainer_utils import get_last_checkpoint, rotate_checkpoints  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt._versions.protocol import COMMITTED, CommitRecord, StepEntry  # noqa: E402
from asyncckpt._versions.retention import (  # noqa: E402
    deletion_plan,
    policy_from,
)
from asyncckpt.errors import ConflictError  # noqa: E402
from asyncckpt.transformers import OVERRIDDEN, ROOT_NAME, AsyncCkptTrainer  # noqa: E402


class _StopAt(transformers.TrainerCallback):
    """Ends training after ``step`` (an interrupted job)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def _data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, 16), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(
    cls: type,
    out: Path,
    stop_at: int | None = None,
    checkpointer: Any = None,
    settings: Any = None,
    **args: Any,
) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)  # dropout on: the RNG states matter
    defaults: dict[str, Any] = {
        "max_steps": 8,
        "per_device_train_batch_size": 4,
        "save_strategy": "steps",
        "save_steps": 3,
        "learning_rate": 1e-3,
        "logging_steps": 100,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    training_args = transformers.TrainingArguments(output_dir=str(out), **{**defaults, **args})
    callbacks = [] if stop_at is None else [_StopAt(stop_at)]
    extra: dict[str, Any] = {} if checkpointer is None else {"checkpointer": checkpointer}
    if settings is not None:
        extra["settings"] = settings
    return cls(
        **extra,
        model=model,
        args=training_args,
        train_dataset=_data(32, 1),
        eval_dataset=_data(8, 2),
        callbacks=callbacks,
    )


def _interrupted_then_resumed(cls: type, out: Path, **args: Any) -> Any:
    _trainer(cls, out, stop_at=5, **args).train()
    resumed = _trainer(cls, out, **args)
    resumed.train(resume_from_checkpoint=True)
    return resumed


def _assert_same_training_state(a: Any, b: Any) -> None:
    for (name, p), (_, q) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(p, q), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (i, k)
    assert a.lr_scheduler.state_dict() == b.lr_scheduler.state_dict()
    assert a.state.global_step == b.state.global_step == 8


@pytest.mark.timeout(300)
def test_resume_equals_the_stock_trainer_resumed(tmp_path: Path) -> None:
    stock = _interrupted_then_resumed(transformers.Trainer, tmp_path / "stock")
    ours = _interrupted_then_resumed(AsyncCkptTrainer, tmp_path / "ours")
    _assert_same_training_state(ours, stock)
    # It resumed from step 3 (saved before the stop at 5), not from scratch.
    assert ours.checkpointer.versions() == [3, 6, 8]


@pytest.mark.timeout(300)
def test_resume_from_another_runs_folder_loads_that_runs_version(tmp_path: Path) -> None:
    other = _trainer(AsyncCkptTrainer, tmp_path / "other", learning_rate=1e-2)
    other.train()
    _trainer(AsyncCkptTrainer, tmp_path / "this").train()  # this run has its own step 3
    with asyncckpt.Checkpointer(tmp_path / "other" / ROOT_NAME, read_only=True) as ckpt:
        wanted = ckpt.load(3)["model"]
    with asyncckpt.Checkpointer(tmp_path / "this" / ROOT_NAME, read_only=True) as ckpt:
        assert not torch.equal(ckpt.load(3)["model"]["lm_head.weight"], wanted["lm_head.weight"])
    resumed = _trainer(AsyncCkptTrainer, tmp_path / "this")
    # What Trainer.train calls first with the folder it is given
    resumed._load_from_checkpoint(str(tmp_path / "other" / "checkpoint-3"))
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, wanted[name]), name


@pytest.mark.timeout(300)
def test_train_closes_the_checkpointer_it_built_and_not_one_passed_in(tmp_path: Path) -> None:
    trainer = _trainer(AsyncCkptTrainer, tmp_path / "built")
    built = trainer.checkpointer
    trainer.train()
    lease = built._writer._heartbeat
    assert built._closed and lease is not None and not lease.is_alive()
    assert trainer.checkpointer is not built  # a later use opens the root again
    assert trainer.checkpointer.versions() == [3, 6, 8]
    with asyncckpt.Checkpointer(tmp_path / "given") as given:
        _trainer(AsyncCkptTrainer, tmp_path / "run", checkpointer=given).train()
        assert not given._closed  # the caller's, to close
        given.save(9, {"w": torch.zeros(1)}).result()


@pytest.mark.timeout(300)
def test_folders_follow_the_trainer_conventions(tmp_path: Path) -> None:
    trainer = _trainer(AsyncCkptTrainer, tmp_path)
    trainer.train()
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-8")
    for step in (3, 6, 8):
        state = json.loads((tmp_path / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert state["global_step"] == step
    with asyncckpt.Checkpointer(tmp_path / ROOT_NAME, read_only=True) as ckpt:
        assert ckpt.versions() == [3, 6, 8]
        saved = ckpt.load(8)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(saved["model"][name], value), name


@pytest.mark.timeout(300)
def test_rotation_keeps_the_best_and_the_newest(tmp_path: Path) -> None:
    trainer = _trainer(
        AsyncCkptTrainer,
        tmp_path,
        save_total_limit=1,
        eval_strategy="steps",
        eval_steps=3,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        learning_rate=5e-2,  # big steps: the eval loss is not monotone
    )
    trainer.train()
    best = trainer.state.best_global_step
    versions = trainer.checkpointer.versions()
    assert versions == sorted({best, 8}), (versions, best)
    # Rotation is the Checkpointer's own retention, ranking by the metric in each COMMIT.
    assert trainer.checkpointer.retention == policy_from(
        {"keep_total": 1, "best_metric": "eval_loss", "best_mode": "min"}
    )
    assert trainer.checkpointer.best() == best
    assert "eval_loss" in trainer.checkpointer.info(best).metrics
    folders = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*"))
    # The deleted versions' folders went with them (the stock Trainer itself removes the
    # last folder at the end when save_total_limit=1 and it is not the best one).
    assert best in folders and set(folders) <= set(versions), (folders, versions)
    # load_best_model_at_end loaded the best version's weights.
    saved = trainer.checkpointer.load(best)["model"]
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(saved[name], value), name


def _stock_rotation(tmp_path: Path, steps: list[int], limit: int, best: int) -> list[int]:
    """The steps whose folders the stock Trainer's rotation leaves (``rotate_checkpoints``)."""
    run = tmp_path / f"stock-{len(steps)}-{limit}-{best}"
    for step in steps:
        (run / f"checkpoint-{step}").mkdir(parents=True)
    best_folder = str(run / f"checkpoint-{best}")
    rotate_checkpoints(str(run), limit, best_model_checkpoint=best_folder)
    return sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))


@pytest.mark.parametrize("limit", [None, 1, 2, 3])
def test_save_total_limit_counts_as_the_stock_trainer_counts(
    tmp_path: Path, limit: int | None
) -> None:
    """save_total_limit with a best model: the best counts within the limit (stock keeps
    ``max(limit, 2)`` when the best is not the newest; once, ours kept ``limit + 1``), and
    no limit deletes nothing (once, ours kept only the best and the newest)."""
    trainer = _trainer(
        AsyncCkptTrainer,
        tmp_path / "ours",
        save_total_limit=limit,
        eval_strategy="steps",
        eval_steps=3,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
    )
    policy = trainer.checkpointer.retention
    for count in range(1, 7):
        steps = [3 * i for i in range(1, count + 1)]
        for best in steps:
            entries = [
                StepEntry(s, COMMITTED, commit=CommitRecord(s, ("a",), "w", metrics=m))
                for s in steps
                for m in [{"eval_loss": 0.1 if s == best else 1.0 + s}]
            ]
            pinned = steps[-1]
            deleted = {e.step for e in deletion_plan(entries, policy, pinned, good=pinned)}
            ours = [s for s in steps if s not in deleted]
            assert ours == _stock_rotation(tmp_path, steps, limit, best), (steps, best)


@pytest.mark.timeout(300)
def test_rotation_keeps_what_the_stock_trainer_keeps(tmp_path: Path) -> None:
    """save_total_limit=2 with load_best_model_at_end and a best that is not among the two
    newest: the stock Trainer keeps two (the best and the newest), and so do we (once, 3)."""
    args: dict[str, Any] = {
        "save_total_limit": 2,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "save_steps": 2,
        "max_steps": 10,
        "load_best_model_at_end": True,
        "metric_for_best_model": "loss",
        "greater_is_better": True,  # the worst loss "best": an early step, deterministically
        "learning_rate": 1.0,
    }
    stock = _trainer(transformers.Trainer, tmp_path / "stock", **args)
    stock.train()
    kept = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "stock").glob("checkpoint-*"))
    best = stock.state.best_global_step
    assert best < 8 and kept == [best, 10], (best, kept)  # the case this test is about
    ours = _trainer(AsyncCkptTrainer, tmp_path / "ours", **args)
    ours.train()
    assert ours.state.best_global_step == best
    assert ours.checkpointer.versions() == kept


@pytest.mark.parametrize("name", OVERRIDDEN)
def test_every_overridden_method_still_exists_in_transformers(name: str) -> None:
    """A later transformers that renames one of these would bypass the integration."""
    stock = getattr(transformers.Trainer, name, None)
    assert callable(stock), f"transformers.Trainer.{name} is gone"
    ours = getattr(AsyncCkptTrainer, name)
    assert ours is not stock
    stock_params = list(inspect.signature(stock).parameters)
    our_params = [
        p.name
        for p in inspect.signature(ours).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    assert our_params == stock_params, f"Trainer.{name}{inspect.signature(stock)} changed"


@pytest.mark.timeout(300)
def test_resuming_from_an_older_checkpoint_rewinds_as_the_stock_trainer_overwrites(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rolling back after a loss spike: the stock Trainer trains 4..8 again and overwrites
    checkpoint-6 and -8; ours rewinds the newer versions at the start and says so."""
    results = []
    for cls, name in ((transformers.Trainer, "stock"), (AsyncCkptTrainer, "ours")):
        _trainer(cls, tmp_path / name).train()
        again = _trainer(cls, tmp_path / name)
        with caplog.at_level("WARNING", logger="asyncckpt"):
            again.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-3"))
        results.append(again)
    stock, ours = results
    _assert_same_training_state(ours, stock)
    assert ours.checkpointer.versions() == [3, 6, 8]
    assert get_last_checkpoint(str(tmp_path / "ours")) == str(tmp_path / "ours" / "checkpoint-8")
    rewound = [r.getMessage() for r in caplog.records if "rewound" in r.getMessage()]
    assert len(rewound) == 1 and "8, 6" in rewound[0], rewound


@pytest.mark.timeout(300)
def test_training_over_newer_versions_it_cannot_rewind_is_refused_at_the_start(
    tmp_path: Path,
) -> None:
    _trainer(AsyncCkptTrainer, tmp_path).train()
    fresh = _trainer(AsyncCkptTrainer, tmp_path)
    with pytest.raises(ConflictError, match="resume_from_checkpoint=True") as info:
        fresh.train()  # from scratch: step 3 would collide with the committed one
    assert "checkpoint-N" in str(info.value) and "(3, 6, 8)" in str(info.value)
    assert fresh.state.global_step == 0  # refused before the first step
    with asyncckpt.Checkpointer(tmp_path / ROOT_NAME, read_only=True) as ckpt:
        assert ckpt.versions() == [3, 6, 8]  # nothing deleted


def test_settings_reach_the_checkpointer_the_trainer_builds(tmp_path: Path) -> None:
    trainer = _trainer(AsyncCkptTrainer, tmp_path, settings={"chunk_bytes": 4096})
    assert trainer.checkpointer._settings.chunk_bytes == 4096
    with pytest.raises(ValueError, match="chunk_bytes"):
        _trainer(AsyncCkptTrainer, tmp_path, settings={"chunk_bytes": 0})


def _tokenizer() -> Any:
    """A tiny word-level tokenizer built here (no download)."""
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(63)} | {"[UNK]": 63}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


#: What the stock Trainer writes in checkpoint-N that a version holds instead.
_HEAVY = {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt"}


@pytest.mark.timeout(300)
def test_a_committed_folder_is_a_pretrained_model_after_one_command(tmp_path: Path) -> None:
    """Issue 31 item 2: checkpoint-N holds the stock Trainer's small files (config,
    generation config, tokenizer, training args), so that after the documented export of
    the weights ``from_pretrained(get_last_checkpoint(out))`` loads the model."""
    from asyncckpt import cli

    folders = {}
    for cls, name in ((transformers.Trainer, "stock"), (AsyncCkptTrainer, "ours")):
        trainer = _trainer(cls, tmp_path / name)
        trainer.processing_class = _tokenizer()
        trainer.train()
        folders[name] = {p.name for p in (tmp_path / name / "checkpoint-8").iterdir()}
    small = folders["stock"] - _HEAVY
    assert "config.json" in small and "tokenizer.json" in small  # the case this is about
    assert small <= folders["ours"], small - folders["ours"]
    out = tmp_path / "ours"
    last = get_last_checkpoint(str(out))
    assert last == str(out / "checkpoint-8")
    # The one command (also in the folder's marker file), run from output_dir.
    marker = json.loads((out / "checkpoint-8" / "asyncckpt.json").read_text())
    command = marker["export_weights_from_output_dir"].split()[1:]
    assert command[0] == "convert"
    argv = [str(out / a) if "@" in a or "/" in a else a for a in command]
    assert cli.main(argv) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(last)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert transformers.AutoTokenizer.from_pretrained(last).get_vocab() == _tokenizer().get_vocab()
    # Rotation deletes our folder with its version, exported weights included.
    with asyncckpt.Checkpointer(out / ROOT_NAME) as ckpt:
        ckpt.rewind(3)
    _trainer(AsyncCkptTrainer, out)._rotate(str(out))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]


class _Committed(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.saved: list[int] = []
        self.committed: list[tuple[int, str, bool]] = []

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.saved.append(state.global_step)

    def on_checkpoint_committed(
        self, args: Any, state: Any, control: Any, checkpoint: str, step: int, **kwargs: Any
    ) -> None:
        # Durable: the version is committed and its folder complete.
        with asyncckpt.Checkpointer(Path(checkpoint).parent / ROOT_NAME, read_only=True) as c:
            durable = step in c.versions()
        self.committed.append((step, checkpoint, durable and Path(checkpoint).is_dir()))


@pytest.mark.timeout(300)
def test_callbacks_hear_when_a_checkpoint_is_committed(tmp_path: Path) -> None:
    """on_save fires at the snapshot; on_checkpoint_committed once the version is durable."""
    callback = _Committed()
    trainer = _trainer(AsyncCkptTrainer, tmp_path)
    trainer.add_callback(callback)
    trainer.train()
    assert callback.saved == [3, 6, 8]
    expected = [(s, str(tmp_path / f"checkpoint-{s}"), True) for s in (3, 6, 8)]
    assert callback.committed == expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["every_save", "checkpoint"])
def test_push_to_hub_during_training_is_said_not_done(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    strategy: str,
) -> None:
    """The stock Trainer uploads at each save with these hub strategies; ours holds no
    weights in checkpoint-N, so it uploads nothing and says so once (hub calls mocked)."""
    from unittest import mock

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    uploads: dict[str, list[Any]] = {}
    for name, cls in (("stock", transformers.Trainer), ("ours", AsyncCkptTrainer)):
        api = mock.MagicMock()
        api.create_repo.return_value.repo_id = "user/model"
        monkeypatch.setattr("transformers.trainer.hf_api", lambda api=api: api)
        trainer = _trainer(cls, tmp_path / name, push_to_hub=True, hub_strategy=strategy)
        with caplog.at_level("WARNING", logger="asyncckpt"):
            trainer.train()
        uploads[name] = api.upload_folder.call_args_list
    assert uploads["stock"], "the stock Trainer pushes at each save"
    assert uploads["ours"] == []
    said = [r.getMessage() for r in caplog.records if "push_to_hub" in r.getMessage()]
    assert len(said) == 1 and "trainer.push_to_hub()" in said[0], said
