"""The Lightning CheckpointIO plugin: real Trainers on the CPU, real files, a real SIGKILL."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import hashlib
import inspect
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from typing import Any, NamedTuple

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

import asyncckpt
from asyncckpt._storage import is_temp_name
from asyncckpt._versions.pending_record import PENDING_SUFFIX
from asyncckpt.errors import AsyncCkptWarning, FormatError, UnsupportedObjectError
from asyncckpt.lightning import (
    PROJECTION_KEY,
    AsyncCkptIO,
    from_plain,
    load_from_checkpoint,
    to_plain,
)
from asyncckpt.lightning import ModelCheckpoint as AckptModelCheckpoint


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Perm(enum.Flag):
    R = 1
    W = 2


class Color(str, enum.Enum):
    RED = "red"


@dataclasses.dataclass
class OptimConfig:
    lr: float = 0.05
    betas: tuple[float, float] = (0.9, 0.99)
    mode: Mode = Mode.FAST
    data: pathlib.Path = pathlib.Path("/data")


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: int
    b: list[int] = dataclasses.field(default_factory=list)
    derived: int = dataclasses.field(init=False, default=0)


class Point(NamedTuple):
    x: int
    y: int


class Tag(str):
    pass


# ---------------------------------------------------------------------------------------
# Helpers shared with the child process of the crash test (sent as source text).


def state_digest(*states: Any) -> str:
    """A SHA-256 over every tensor's dtype, shape and bytes and every other value's repr."""
    h = hashlib.sha256()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            h.update(b"{")
            for key in sorted(obj, key=repr):
                h.update(repr(key).encode())
                walk(obj[key])
            h.update(b"}")
        elif isinstance(obj, (list, tuple)):
            h.update(b"[")
            for item in obj:
                walk(item)
            h.update(b"]")
        else:
            h.update(repr(obj).encode())

    for state in states:
        walk(state)
    return h.hexdigest()


def assert_bitwise_equal(a: Any, b: Any, path: str = "state") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        bits_a = a.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(bits_a, b.detach().contiguous().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# ---------------------------------------------------------------------------------------
# A tiny model and data.


class TinyModule(pl.LightningModule):
    def __init__(
        self,
        width: int = 8,
        lr: float = 0.05,
        mode: Mode = Mode.FAST,
        root: pathlib.Path = pathlib.Path("/data"),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # enum and Path: exercised through the Trainer
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]


def loaders(width: int = 8) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, width, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    data = torch.utils.data.TensorDataset(x, y)
    # No shuffling: the batches are the same in every run, so runs can be compared bitwise.
    train = torch.utils.data.DataLoader(data, batch_size=8)
    val = torch.utils.data.DataLoader(data, batch_size=16)
    return train, val


def trainer(tmp: pathlib.Path, io: Any, max_epochs: int, callbacks: list[Any]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        plugins=[io],
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=tmp,
        deterministic=True,
    )


class RecordingIO(AsyncCkptIO):
    """Keeps a deep copy of what each save was given: the state at the save point."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.saved: dict[str, dict[str, Any]] = {}
        self.removed: list[str] = []

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        keep = ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "loops")
        self.saved[os.fspath(path)] = {k: _clone(checkpoint[k]) for k in keep}
        super().save_checkpoint(checkpoint, path, storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.removed.append(os.fspath(path))
        super().remove_checkpoint(path)


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = type(obj)((k, _clone(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


class CaptureAtStart(Callback):
    """The model and optimizer state once the Trainer has restored a checkpoint."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.global_step = trainer.global_step
        self.model_state = _clone(pl_module.state_dict())
        self.optim_states = [_clone(o.state_dict()) for o in trainer.optimizers]
        self.sched_states = [_clone(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]


# ---------------------------------------------------------------------------------------
# 1. ModelCheckpoint (top-k + last) and resume, bit for bit.


def test_model_checkpoint_topk_last_and_resume(tmp_path: pathlib.Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    train, val = loaders()
    torch.manual_seed(0)
    io = RecordingIO(classes=[Mode])
    mc = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2, save_last=True)
    first = trainer(tmp_path, io, max_epochs=5, callbacks=[mc])
    first.fit(TinyModule(), train, val)  # teardown waits for every save

    # What ModelCheckpoint expects: its top-2 and last.ckpt exist, the rest were removed.
    assert io.removed and not any(os.path.exists(p) for p in io.removed)
    expected = {os.path.basename(p) for p in mc.best_k_models} | {"last.ckpt"}
    assert len(mc.best_k_models) == 2
    assert set(os.listdir(ckpt_dir)) == expected  # removed ones gone, no temp files left
    assert os.path.basename(mc.last_model_path) == "last.ckpt"
    assert mc.best_model_path in mc.best_k_models
    for name in expected:
        loaded = AsyncCkptIO(classes=[Mode]).load_checkpoint(ckpt_dir / name)
        assert_bitwise_equal(loaded["state_dict"], io.saved[str(ckpt_dir / name)]["state_dict"])
        assert loaded["hyper_parameters"]["mode"] is Mode.FAST  # trusted: rebuilt
        assert loaded["hyper_parameters"]["root"] == pathlib.Path("/data")
        assert PROJECTION_KEY not in loaded

    # The same run with Lightning's default torch IO writes the same state bit for bit.
    ref_dir = tmp_path / "ref"
    torch.manual_seed(0)
    ref_mc = ModelCheckpoint(dirpath=ref_dir, monitor="val_loss", save_top_k=2, save_last=True)
    trainer(tmp_path, TorchCheckpointIO(), 5, [ref_mc]).fit(TinyModule(), train, val)
    assert set(os.listdir(ref_dir)) == expected
    ours = AsyncCkptIO(classes=[Mode]).load_checkpoint(ckpt_dir / "last.ckpt")
    theirs = torch.load(ref_dir / "last.ckpt", weights_only=False)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step"):
        assert_bitwise_equal(ours[key], theirs[key], key)
    assert ours["hyper_parameters"] == theirs["hyper_parameters"]

    # Resume from last.ckpt in a new Trainer: the restored state is the state at the save.
    last = str(ckpt_dir / "last.ckpt")
    capture = CaptureAtStart()
    mc2 = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2, save_last=True)
    second = trainer(tmp_path, AsyncCkptIO(classes=[Mode]), max_epochs=7, callbacks=[mc2, capture])
    second.fit(TinyModule(), train, val, ckpt_path=last)
    at_save = io.saved[last]
    assert capture.global_step == at_save["global_step"] == 20
    assert_bitwise_equal(capture.model_state, at_save["state_dict"], "state_dict")
    assert_bitwise_equal(capture.optim_states, at_save["optimizer_states"], "optimizer")
    assert_bitwise_equal(capture.sched_states, at_save["lr_schedulers"], "lr_schedulers")
    assert second.global_step == 28 and second.current_epoch == 7
    # ModelCheckpoint's own state came back through the callbacks entry, and it kept going.
    assert len(mc2.best_k_models) == 2
    assert set(os.listdir(ckpt_dir)) == {os.path.basename(p) for p in mc2.best_k_models} | {
        "last.ckpt"
    }

    # ...and training on from the resumed state matches an uninterrupted 7-epoch run.
    torch.manual_seed(0)
    straight = TinyModule()
    trainer(tmp_path / "straight", TorchCheckpointIO(), 7, []).fit(straight, train, val)
    assert_bitwise_equal(
        AsyncCkptIO().load_checkpoint(ckpt_dir / "last.ckpt")["state_dict"],
        _clone(straight.state_dict()),
    )


def test_trainer_save_checkpoint_and_validate_from_it(tmp_path: pathlib.Path) -> None:
    train, val = loaders()
    io = AsyncCkptIO()
    t = trainer(tmp_path, io, max_epochs=1, callbacks=[])
    model = TinyModule()
    t.fit(model, train, val)
    path = tmp_path / "sub" / "manual.ackpt"  # the extension is free; parents are created
    t.save_checkpoint(path)
    t2 = trainer(tmp_path, AsyncCkptIO(), max_epochs=1, callbacks=[])
    t2.validate(TinyModule(), val, ckpt_path=str(path), verbose=False)
    assert t2.callback_metrics["val_loss"] == t.callback_metrics["val_loss"]


# ---------------------------------------------------------------------------------------
# 2. SIGKILL in the middle of saving, then resume from what is on disk.

CHILD = """
import hashlib, os, sys
from typing import Any

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from asyncckpt.lightning import AsyncCkptIO

{state_digest}

torch.set_num_threads(1)  # the machine is shared; the saves run on their own threads
ckpt_dir, log_path = sys.argv[1], sys.argv[2]


class Wide(pl.LightningModule):
    def __init__(self):
        super().__init__()
        # ~2.4 M parameters, ~29 MB with Adam's state: every save takes a while, so the
        # kill lands in the middle of one most of the time.
        self.net = torch.nn.Sequential(*[torch.nn.Linear(400, 400) for _ in range(15)])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class LogDigest(Callback):
    # Runs before ModelCheckpoint (Lightning puts checkpoint callbacks last), with the
    # state the checkpoint of this step will hold.
    def on_train_batch_end(self, trainer, pl_module, *args):
        digest = state_digest(pl_module.state_dict(), trainer.optimizers[0].state_dict())
        line = f"{{trainer.global_step}} {{digest}}\\n"
        with open(log_path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 400))
trainer = pl.Trainer(
    accelerator="cpu", max_steps=100_000, logger=False, enable_progress_bar=False,
    enable_model_summary=False, plugins=[AsyncCkptIO(compression="zstd")],
    callbacks=[LogDigest(), ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1,
                                            save_top_k=1, save_last=True)],
)
trainer.fit(Wide(), torch.utils.data.DataLoader(data, batch_size=8))
"""


#: The seed of the kill's delay after the child's fourth save.
SIGKILL_SEED = 20261203


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_after_sigkill_mid_save(tmp_path: pathlib.Path) -> None:
    ckpt_dir, log_path = tmp_path / "ckpt", tmp_path / "digests.log"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(state_digest=textwrap.dedent(inspect.getsource(state_digest))))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ckpt_dir), str(log_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        # Let it save a few times, then kill it at a random moment.
        while not (log_path.exists() and len(log_path.read_text().splitlines()) >= 4):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.05)
        # Seeded: every run kills at the same delay after the fourth save, so a failure
        # reproduces (the delay is in the message).
        delay = random.Random(SIGKILL_SEED).uniform(0.0, 1.5)
        time.sleep(delay)
        assert proc.poll() is None, f"the child must still be training when killed ({delay:.3f} s)"
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    digests: dict[int, str] = {}
    for line in log_path.read_text().splitlines():
        if line.count(" ") == 1:  # the last line may be cut by the kill
            step, digest = line.split()
            digests[int(step)] = digest

    # Every checkpoint a loader can see is complete: the kill can only leave temp files, and
    # the marker of the save in flight (which load_checkpoint, resuming, passes over).
    names = os.listdir(ckpt_dir)
    visible = [n for n in names if not is_temp_name(n) and not n.endswith(PENDING_SUFFIX)]
    assert "last.ckpt" in visible
    io = AsyncCkptIO()
    for name in visible:
        loaded = io.load_checkpoint(ckpt_dir / name)  # checksums verified
        step = loaded["global_step"]
        assert digests[step] == state_digest(loaded["state_dict"], loaded["optimizer_states"][0]), (
            f"{name} does not hold the state of step {step}"
        )

    # Resume from last.ckpt: the restored model and optimizer are those of its step.
    last = io.load_checkpoint(ckpt_dir / "last.ckpt")
    step = last["global_step"]
    capture = CaptureAtStart()
    wide = _child_module()
    t = pl.Trainer(
        accelerator="cpu",
        max_steps=step + 2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        plugins=[AsyncCkptIO()],
        callbacks=[capture],
    )
    data = torch.utils.data.TensorDataset(torch.randn(64, 400))
    t.fit(wide, torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt_dir / "last.ckpt")
    assert capture.global_step == step
    assert state_digest(capture.model_state, capture.optim_states[0]) == digests[step]
    assert t.global_step == step + 2


def _child_module() -> pl.LightningModule:
    """The child's model class, rebuilt here from the same source."""
    source = CHILD.split("class Wide")[1].split("class LogDigest")[0]
    namespace: dict[str, Any] = {"torch": torch, "pl": pl}
    exec("class Wide" + source, namespace)
    return namespace["Wide"]()  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------
# 3. The projection of non-tensor values.


def roundtrip(obj: dict[str, Any], tmp: pathlib.Path, **kwargs: Any) -> dict[str, Any]:
    """Through a real file: the record itself must be storable."""
    io = AsyncCkptIO(**kwargs)
    path = tmp / f"r{len(os.listdir(tmp))}.ckpt"
    io.save_checkpoint(obj, path)
    try:
        return io.load_checkpoint(path)
    finally:
        io.teardown()


def test_enums(tmp_path: pathlib.Path) -> None:
    state = {"m": Mode.SLOW, "l": Level.HIGH, "p": Perm.R | Perm.W, "c": Color.RED}
    plain = to_plain(state)
    assert {k: plain[k] for k in state} == {"m": "slow", "l": 2, "p": 3, "c": "red"}
    assert all(type(plain[k]) in (str, int) for k in state)  # no enum reaches the file
    assert roundtrip(state, tmp_path) == {"m": "slow", "l": 2, "p": 3, "c": "red"}
    back = roundtrip(state, tmp_path, classes=[Mode, Level, Perm, Color])
    assert back == state and all(back[k] is state[k] for k in ("m", "l", "c"))
    assert type(back["p"]) is Perm


def test_paths(tmp_path: pathlib.Path) -> None:
    state = {
        "path": pathlib.Path("/runs/a"),
        "posix": pathlib.PurePosixPath("a/b"),
        "win": pathlib.PureWindowsPath("C:/x/y"),
    }
    assert to_plain(state)["win"] == "C:\\x\\y"
    back = roundtrip(state, tmp_path)
    assert back == state
    assert type(back["path"]) is type(pathlib.Path())
    assert type(back["posix"]) is pathlib.PurePosixPath
    assert type(back["win"]) is pathlib.PureWindowsPath


def test_attribute_dicts_namespaces_sets_and_dict_subclasses(tmp_path: pathlib.Path) -> None:
    from lightning.pytorch.utilities.parsing import AttributeDict as PLAttributeDict

    state = {
        "hyper_parameters": AttributeDict(
            lr=0.1, inner=PLAttributeDict(root=pathlib.Path("/d"), mode=Mode.FAST)
        ),
        "ns": argparse.Namespace(batch=8, tags={"a", "b"}),
        "frozen": frozenset({1, 2}),
        "counts": collections.Counter(a=2),
        "dd": collections.defaultdict(list, {"k": [1]}),
    }
    plain = to_plain(state)
    assert type(plain["hyper_parameters"]) is dict and type(plain["ns"]) is dict
    back = roundtrip(state, tmp_path)
    hp = back["hyper_parameters"]
    assert type(hp) is AttributeDict and hp.lr == 0.1
    assert type(hp.inner) is PLAttributeDict and hp.inner.root == pathlib.Path("/d")
    assert hp.inner.mode == "fast"  # Mode not trusted here
    assert back["ns"] == argparse.Namespace(batch=8, tags={"a", "b"})
    assert type(back["frozen"]) is frozenset and back["frozen"] == {1, 2}
    assert type(back["counts"]) is collections.Counter and back["counts"]["a"] == 2
    assert type(back["dd"]) is dict and back["dd"] == {"k": [1]}  # not trusted: plain


def test_dataclasses_namedtuples_scalars_and_classes(tmp_path: pathlib.Path) -> None:
    frozen = Frozen(1, [2])
    object.__setattr__(frozen, "derived", 7)
    state = {
        "cfg": OptimConfig(lr=0.2, mode=Mode.SLOW),
        "frozen": frozen,
        "pt": Point(1, 2),
        "tag": Tag("x"),
        "type": OptimConfig,
    }
    plain = to_plain(state)
    assert plain["cfg"] == {"lr": 0.2, "betas": (0.9, 0.99), "mode": "slow", "data": "/data"}
    assert plain["pt"] == (1, 2) and type(plain["pt"]) is tuple
    assert type(plain["tag"]) is str
    assert plain["type"] == f"{__name__}.OptimConfig"

    untrusted = roundtrip(state, tmp_path)
    assert untrusted["cfg"] == {
        "lr": 0.2,
        "betas": (0.9, 0.99),
        "mode": "slow",
        "data": pathlib.Path("/data"),  # a Path is always rebuilt, even inside a plain dict
    }
    assert untrusted["type"] == f"{__name__}.OptimConfig"

    trusted = roundtrip(state, tmp_path, classes=[OptimConfig, Mode, Frozen, Point, Tag])
    assert trusted == state
    assert trusted["frozen"].derived == 7 and type(trusted["pt"]) is Point
    assert type(trusted["tag"]) is Tag and trusted["type"] is OptimConfig


def test_nested_and_plain_values_pass_through(tmp_path: pathlib.Path) -> None:
    sd = torch.nn.Linear(2, 2).state_dict()
    state = {
        "state_dict": sd,
        "deep": [({"p": pathlib.Path("/x"), "e": [Mode.FAST, (Level.LOW, None)]},)],
        "none": None,
        "float": 1.5,
        "bytes": b"\x00",
        "int_keys": {1: pathlib.Path("/one"), 2.5: "f"},
        "dtype": torch.float16,
    }
    plain = to_plain(state)
    assert plain["state_dict"] is not sd and plain["state_dict"]["weight"] is sd["weight"]
    assert plain["state_dict"]._metadata == sd._metadata  # type: ignore[attr-defined]
    back = roundtrip(state, tmp_path, classes=[Mode, Level])
    assert_bitwise_equal(back["state_dict"], sd)
    assert back["deep"] == state["deep"] and back["deep"][0][0]["e"][0] is Mode.FAST
    assert back["int_keys"] == state["int_keys"]
    assert {k: back[k] for k in ("none", "float", "bytes", "dtype")} == {
        "none": None,
        "float": 1.5,
        "bytes": b"\x00",
        "dtype": torch.float16,
    }


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "key_path", "hint"),
    [
        (
            {"hyper_parameters": {"fn": lambda x: x}},
            "checkpoint['hyper_parameters']['fn']",
            "save_hyperparameters(ignore",
        ),
        (
            {"hyper_parameters": {"net": torch.nn.Linear(1, 1)}},
            "checkpoint['hyper_parameters']['net']",
            "a module (Linear)",
        ),
        ({"callbacks": {"x": [1, Opaque()]}}, "checkpoint['callbacks']['x'][1]", "Opaque"),
        ({"hp": {Mode.FAST: 1}}, "checkpoint['hp'][<Mode.FAST: 'fast'>]", "dict keys"),
        ({"hp": OptimConfig(mode=Opaque())}, "checkpoint['hp']['mode']", "never pickles"),
        ({PROJECTION_KEY: 1}, f"checkpoint['{PROJECTION_KEY}']", "reserved"),
    ],
)
def test_unsupported_values_are_named(
    tmp_path: pathlib.Path, value: dict[str, Any], key_path: str, hint: str
) -> None:
    io = AsyncCkptIO()
    with pytest.raises(UnsupportedObjectError) as info:
        io.save_checkpoint(value, tmp_path / "bad.ckpt")
    assert info.value.key_path == key_path
    assert hint in str(info.value)
    io.teardown()
    assert os.listdir(tmp_path) == []  # refused before anything was written


def test_cycle_and_tensor_subclass_errors(tmp_path: pathlib.Path) -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(UnsupportedObjectError, match="reference cycle"):
        to_plain({"x": loop})

    class Sub(torch.Tensor):
        pass

    io = AsyncCkptIO()
    with pytest.raises(UnsupportedObjectError) as info:
        io.save_checkpoint({"state_dict": {"w": torch.ones(1).as_subclass(Sub)}}, tmp_path / "t")
    # asyncckpt.save's own refusal, renamed to the checkpoint's key path
    assert info.value.key_path == "checkpoint['state_dict']['w']"
    assert "tensor subclass" in str(info.value)


def test_bad_records_raise_format_errors() -> None:
    plain = to_plain({"m": Mode.FAST})
    plain[PROJECTION_KEY]["version"] = 99
    with pytest.raises(FormatError, match="version 99"):
        from_plain(plain)
    with pytest.raises(FormatError, match="invalid"):
        from_plain({PROJECTION_KEY: {"version": 1, "conversions": [{"path": "x"}]}})

    class Shrunk(enum.Enum):  # same name as a class whose member "fast" was removed
        SLOW = "slow"

    Shrunk.__qualname__ = Mode.__qualname__
    Shrunk.__module__ = Mode.__module__
    with pytest.raises(FormatError, match="Did the class change"):
        from_plain(to_plain({"m": Mode.FAST}), classes=[Shrunk])
    assert from_plain({"a": 1}) == {"a": 1}  # a file not written by the plugin


# ---------------------------------------------------------------------------------------
# Background failures, waiting, options.


def test_background_failure_raised_at_teardown_once(tmp_path: pathlib.Path) -> None:
    (tmp_path / "afile").write_text("")
    io = AsyncCkptIO()
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "afile" / "x.ckpt")  # returns
    with pytest.raises(asyncckpt.AsyncCkptError, match="afile"):
        io.teardown()
    io.teardown()  # raised once
    asyncckpt.wait()  # and not again by asyncckpt itself


def test_background_failure_raised_at_next_save_or_remove(tmp_path: pathlib.Path) -> None:
    (tmp_path / "afile").write_text("")
    io = AsyncCkptIO()
    bad = tmp_path / "afile" / "x.ckpt"
    io.save_checkpoint({"w": torch.ones(2)}, bad)
    with pytest.raises(asyncckpt.AsyncCkptError):
        io.remove_checkpoint(bad)  # waits for that save, so its failure is known
    io.save_checkpoint({"w": torch.ones(2)}, bad)
    while not all(h.done() for h in io._pending[os.fspath(bad)]):
        time.sleep(0.01)  # let it fail without observing it: the plugin must report it
    with pytest.raises(asyncckpt.AsyncCkptError):
        io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "good.ckpt")
    io.teardown()
    assert (tmp_path / "good.ckpt").exists()


def test_remove_and_load_wait_for_the_save_in_flight(tmp_path: pathlib.Path) -> None:
    io = AsyncCkptIO()
    path = tmp_path / "big.ckpt"
    state = {"w": torch.randn(2_000_000)}
    io.save_checkpoint(state, path)
    state["w"].zero_()  # the save holds a snapshot
    assert io.load_checkpoint(path)["w"].abs().sum() > 0
    io.save_checkpoint({"w": torch.randn(2_000_000)}, path)
    io.remove_checkpoint(path)  # must not be undone by the pending write
    io.teardown()
    assert not path.exists()
    io.remove_checkpoint(path)  # a missing file is not an error


def test_urls_options_and_map_location(tmp_path: pathlib.Path) -> None:
    io = AsyncCkptIO(compression="none", map_location="cpu")
    url = "memory://asyncckpt-lightning-test/x.ckpt"
    io.save_checkpoint({"w": torch.arange(3)}, url, storage_options={})
    assert io.load_checkpoint(url)["w"].tolist() == [0, 1, 2]
    io.remove_checkpoint(url)
    with pytest.raises(asyncckpt.AsyncCkptError):
        io.load_checkpoint(url)
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"w": 1}, tmp_path / "o.ckpt", storage_options="nope")
    with pytest.raises(ValueError):
        AsyncCkptIO(compression="lz4")
    io.teardown()


def test_torch_saved_file_is_refused_not_unpickled(tmp_path: pathlib.Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "torch.ckpt")
    with pytest.raises(FormatError):
        AsyncCkptIO().load_checkpoint(tmp_path / "torch.ckpt")


def test_import_asyncckpt_does_not_import_lightning() -> None:
    code = "import sys, asyncckpt; assert 'lightning' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------
# load_from_checkpoint: LightningModule.load_from_checkpoint for the plugin's files.


class HookedModule(TinyModule):
    """Adds a key of its own on save and reads it back in ``on_load_checkpoint``."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["my_note"] = {"seen": 7}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_keys = sorted(checkpoint)
        self.note = checkpoint.get("my_note")


class Bigger(TinyModule):
    """TinyModule with one parameter more: the saved weights miss it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = torch.nn.Parameter(torch.zeros(3))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """One fit with the plugin, saved by it and (the same state) by torch.save."""
    tmp = tmp_path_factory.mktemp("lfc")
    train, val = loaders()
    t = trainer(tmp, AsyncCkptIO(), max_epochs=1, callbacks=[])
    t.fit(HookedModule(width=8, lr=0.03, mode=Mode.SLOW, root=pathlib.Path("/x")), train, val)
    ours, stock = tmp / "ours.ckpt", tmp / "stock.ckpt"
    t.save_checkpoint(ours)
    t.strategy.checkpoint_io.teardown()
    checkpoint = t._checkpoint_connector.dump_checkpoint(weights_only=False)
    TorchCheckpointIO().save_checkpoint(checkpoint, stock)
    return {"ours": ours, "stock": stock}


def test_load_from_checkpoint_matches_lightnings(trained: dict[str, pathlib.Path]) -> None:
    from asyncckpt.lightning import load_from_checkpoint

    plugin = AsyncCkptIO(classes=[Mode])
    ours = load_from_checkpoint(HookedModule, trained["ours"], plugin=plugin)
    stock = HookedModule.load_from_checkpoint(trained["stock"], weights_only=False)
    assert type(ours) is HookedModule
    assert_bitwise_equal(ours.state_dict(), stock.state_dict())
    assert dict(ours.hparams) == dict(stock.hparams)
    assert ours.hparams.mode is Mode.SLOW and ours.hparams.root == pathlib.Path("/x")
    assert ours.training == stock.training
    assert ours.note == stock.note == {"seen": 7}
    # The hook sees every key but the training state (never read).
    skipped = {"optimizer_states", "lr_schedulers", "loops", "callbacks"}
    assert ours.loaded_keys == sorted(set(stock.loaded_keys) - skipped)
    # Without classes=, the enum comes back as its value (and the constructor gets that).
    plain = load_from_checkpoint(HookedModule, trained["ours"])
    assert plain.hparams.mode == "slow"


def test_load_from_checkpoint_reads_no_optimizer_state(
    trained: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncckpt._engine import decode_lazy
    from asyncckpt.lightning import load_from_checkpoint

    read: list[Any] = []
    original = decode_lazy.LazyCheckpoint.__getitem__

    def spy(self: Any, key: Any) -> Any:
        read.append(key)
        return original(self, key)

    monkeypatch.setattr(decode_lazy.LazyCheckpoint, "__getitem__", spy)
    load_from_checkpoint(HookedModule, trained["ours"])
    assert "state_dict" in read and "hyper_parameters" in read
    assert not {"optimizer_states", "lr_schedulers", "loops", "callbacks"} & set(read)


def test_load_from_checkpoint_kwargs_override_and_hparams_file(
    trained: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    from asyncckpt.lightning import load_from_checkpoint

    model = load_from_checkpoint(HookedModule, trained["ours"], lr=0.5, unknown=1)
    stock = HookedModule.load_from_checkpoint(
        trained["stock"], weights_only=False, lr=0.5, unknown=1
    )
    assert model.hparams.lr == stock.hparams.lr == 0.5
    assert "unknown" not in model.hparams  # the constructor does not take it: dropped
    hparams = tmp_path / "hp.yaml"
    hparams.write_text("width: 8\nlr: 0.25\n")
    from_file = load_from_checkpoint(HookedModule, trained["ours"], hparams_file=hparams)
    assert from_file.hparams.lr == 0.25 and from_file.hparams.mode == Mode.FAST  # replaced
    with pytest.raises(ValueError, match=r"hp\.json"):
        load_from_checkpoint(HookedModule, trained["ours"], hparams_file=tmp_path / "hp.json")


def test_load_from_checkpoint_strict(trained: dict[str, pathlib.Path]) -> None:
    from asyncckpt.lightning import load_from_checkpoint

    with pytest.raises(RuntimeError, match="extra"):
        load_from_checkpoint(Bigger, trained["ours"])
    with pytest.warns(UserWarning, match="extra"):
        model = load_from_checkpoint(Bigger, trained["ours"], strict=False)
    assert torch.equal(model.extra, torch.zeros(3))
    stock = TinyModule.load_from_checkpoint(trained["stock"], weights_only=False)
    assert_bitwise_equal(model.net.state_dict(), stock.net.state_dict())


def test_load_from_checkpoint_refuses_a_torch_file(trained: dict[str, pathlib.Path]) -> None:
    from asyncckpt.lightning import load_from_checkpoint

    with pytest.raises(FormatError):
        load_from_checkpoint(HookedModule, trained["stock"])


# ---------------------------------------------------------------------------------------
# Names: files that are not torch files do not look like torch files.


def test_asyncckpt_model_checkpoint_names_files_ackpt_and_resumes_from_last(
    tmp_path: pathlib.Path,
) -> None:
    from asyncckpt.lightning import ModelCheckpoint as AckptModelCheckpoint

    ckpt_dir = tmp_path / "ckpt"
    train, val = loaders()

    def callback() -> ModelCheckpoint:
        return AckptModelCheckpoint(
            dirpath=ckpt_dir, monitor="val_loss", save_top_k=2, save_last=True
        )

    first_mc = callback()
    assert isinstance(first_mc, ModelCheckpoint)  # Lightning's, every option kept
    with warnings.catch_warnings():
        warnings.simplefilter("error", AsyncCkptWarning)  # no '.ckpt' warning
        trainer(tmp_path, AsyncCkptIO(classes=[Mode]), 3, [first_mc]).fit(TinyModule(), train, val)
    names = sorted(os.listdir(ckpt_dir))
    assert len(names) == 3 and all(n.endswith(".ackpt") for n in names), names
    assert os.path.basename(first_mc.last_model_path) == "last.ackpt"
    assert first_mc.best_model_path.endswith(".ackpt")
    # ckpt_path="last" finds last.ackpt (Lightning looks for the callback's extension).
    second = trainer(tmp_path, AsyncCkptIO(classes=[Mode]), 4, [callback()])
    second.fit(TinyModule(), train, val, ckpt_path="last")
    assert second.global_step == 16
    model = load_from_checkpoint(TinyModule, first_mc.best_model_path)
    assert model.hparams.width == 8


def test_a_torch_name_for_asyncckpt_bytes_warns_once_with_how_to_read_it(
    tmp_path: pathlib.Path,
) -> None:
    io = AsyncCkptIO()
    state = {"state_dict": {"w": torch.ones(2)}, "epoch": 0}
    with pytest.warns(AsyncCkptWarning) as caught:
        io.save_checkpoint(state, tmp_path / "epoch=0.ckpt")
    text = str(caught[0].message)
    for hint in ("torch.load", "asyncckpt.lightning.ModelCheckpoint", "load_from_checkpoint"):
        assert hint in text, text
    assert "asyncckpt convert" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", AsyncCkptWarning)
        io.save_checkpoint(state, tmp_path / "epoch=1.ckpt")  # once per plugin
        AsyncCkptIO().save_checkpoint(state, tmp_path / ".temp.ckpt")  # Lightning's own temp
        AsyncCkptIO().save_checkpoint(state, tmp_path / "x.ackpt")
    io.teardown()


def test_on_durable_names_each_file_once_it_is_durable(tmp_path: pathlib.Path) -> None:
    """The commit hook loggers use: ModelCheckpoint's ``after_save_checkpoint`` fires at the
    snapshot; ``on_durable(path)`` once the file is complete, on the training thread."""
    durable: list[tuple[str, bool, bool]] = []

    def on_durable(path: str) -> None:
        whole = AsyncCkptIO().load_checkpoint(path)["epoch"] is not None  # checksums verified
        main = threading.current_thread() is threading.main_thread()
        durable.append((path, whole, main))

    train, val = loaders()
    mc = AckptModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    trainer(tmp_path, AsyncCkptIO(on_durable=on_durable), 3, [mc]).fit(TinyModule(), train, val)
    files = sorted(str(p) for p in (tmp_path / "ckpt").iterdir())
    assert len(files) == 3
    assert sorted(durable) == [(f, True, True) for f in files]
