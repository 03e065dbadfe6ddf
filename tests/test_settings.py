"""asyncckpt._settings: one frozen object, argument > environment > default."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest

from asyncckpt import _settings
from asyncckpt._settings import NAMES, Settings
from asyncckpt.errors import AsyncCkptWarning


def test_precedence_argument_environment_default() -> None:
    env = {"ASYNCCKPT_CHUNK_BYTES": "4096", "ASYNCCKPT_THREADS": "3"}
    s = Settings.resolve(env, threads=5)
    assert s.chunk_bytes == 4096  # environment
    assert s.threads == 5  # argument beats environment
    assert s.zstd_level == Settings().zstd_level  # default


def test_frozen_and_replace_validates() -> None:
    s = Settings.resolve({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.threads = 9  # type: ignore[misc]
    assert s.replace(threads=7, chunk_bytes=None).threads == 7
    assert s.replace(threads=7).chunk_bytes == s.chunk_bytes
    with pytest.raises(ValueError, match="threads must be a positive integer, got 0"):
        s.replace(threads=0)
    with pytest.raises(TypeError, match="unknown tunables"):
        s.replace(thread=2)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ASYNCCKPT_THREADS": "two"}, "ASYNCCKPT_THREADS='two' is not an integer"),
        ({"ASYNCCKPT_THREADS": "0"}, "from environment variable ASYNCCKPT_THREADS"),
        ({"ASYNCCKPT_WRITER_PROCESSES": "2"}, "writer_processes must be at most 1"),
        ({"ASYNCCKPT_WRITER_NICE": "-1"}, "writer_nice must be a non-negative integer"),
    ],
)
def test_bad_environment_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings.resolve(env)


def test_zero_allowed_only_where_meaningful() -> None:
    s = Settings.resolve({"ASYNCCKPT_WRITEBACK_MIB": "0", "ASYNCCKPT_WRITER_PROCESSES": "0"})
    assert (s.writeback_mib, s.writer_processes) == (0, 0)
    with pytest.raises(ValueError, match="threads must be an integer"):
        Settings.resolve(threads=True)


def test_unknown_keyword_refused() -> None:
    with pytest.raises(TypeError, match="chunk_byte"):
        Settings.resolve({}, chunk_byte=1)


def test_misspelled_variable_warns_once_with_closest_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_settings, "_warned", set())
    env = {"ASYNCCKPT_CHUNK_BYTE": "5"}
    with pytest.warns(AsyncCkptWarning, match="did you mean ASYNCCKPT_CHUNK_BYTES"):
        s = Settings.resolve(env)
    assert s.chunk_bytes == Settings().chunk_bytes  # ignored, not half-applied
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Settings.resolve(env)  # once per process


def test_help_covers_every_field() -> None:
    assert tuple(Settings.help()) == NAMES
    assert all(text for _, text in Settings.help().values())


def test_given_names_what_was_set_not_defaulted() -> None:
    s = Settings.resolve({"ASYNCCKPT_THREADS": "3"}, zstd_level=2)
    assert s.given == {"threads", "zstd_level"}
    assert s.replace(chunk_bytes=4096).given == {"threads", "zstd_level", "chunk_bytes"}
    assert Settings.resolve({}).given == frozenset()
    assert s == Settings(threads=3, zstd_level=2)  # where a value came from is not compared
    assert "given" not in NAMES and "given" not in Settings.help()


# -- every entry point takes them (issue 31 item 6) ---------------------------------------


def _chunks(path: str) -> int:
    from asyncckpt._storage import resolve
    from asyncckpt.cli.verify import verify_file

    return verify_file(*resolve(path, None)).chunks


@pytest.mark.parametrize(
    "given",
    [{"chunk_bytes": 4096}, Settings.resolve({}, chunk_bytes=4096)],
    ids=["dict", "object"],
)
def test_every_writing_entry_point_takes_settings_over_the_environment(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, given: Any
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    import asyncckpt
    from asyncckpt.dcp import Writer

    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", str(1 << 20))  # the argument wins
    state = {"w": torch.arange(16 << 10, dtype=torch.int32)}  # 64 KiB: 16 chunks of 4 KiB
    asyncckpt.save(state, tmp_path / "a.ackpt", settings=given).result()
    files = [str(tmp_path / "a.ackpt")]
    with asyncckpt.Checkpointer(tmp_path / "root", settings=given) as ckpt:
        ckpt.save(1, state).result()
    files += [str(p) for p in (tmp_path / "root").rglob("*.ackpt")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: single process"
        dcp.save(state, storage_writer=Writer(tmp_path / "dcp", settings=given))
    files += [str(p) for p in (tmp_path / "dcp").glob("*.ackpt")]
    assert len(files) == 3
    assert [_chunks(f) for f in files] == [16, 16, 16]


def test_every_entry_point_resolves_its_settings_argument(tmp_path: Any) -> None:
    import torch

    import asyncckpt
    from asyncckpt.dcp import Reader

    path = tmp_path / "a.ackpt"
    asyncckpt.save({"w": torch.ones(2)}, path).result()
    bad = {"chunk_bytes": 0}
    calls = {
        "save": lambda: asyncckpt.save({"w": torch.ones(2)}, tmp_path / "b.ackpt", settings=bad),
        "load": lambda: asyncckpt.load(path, settings=bad),
        "open": lambda: asyncckpt.open(path, settings=bad),
        "reserve": lambda: asyncckpt.reserve(1024, settings=bad),
        "Checkpointer": lambda: asyncckpt.Checkpointer(tmp_path / "root", settings=bad),
        "Reader": lambda: Reader(tmp_path, settings=bad),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="chunk_bytes"):
            call()
        print(name, "refused")
    with pytest.raises(TypeError, match="chunk_byte"):  # a misspelt tunable
        asyncckpt.load(path, settings={"chunk_byte": 4096})
    assert asyncckpt.Settings is Settings  # public, to build one object for many calls


def test_one_default_compression_everywhere() -> None:
    import inspect

    import asyncckpt
    from asyncckpt.dcp import Writer

    entry_points = [asyncckpt.save, asyncckpt.Checkpointer, Writer]
    lightning = pytest.importorskip("asyncckpt.lightning")
    entry_points.append(lightning.AsyncCkptIO)
    defaults = {
        getattr(e, "__qualname__", str(e)): inspect.signature(e).parameters["compression"].default
        for e in entry_points
    }
    assert set(defaults.values()) == {"auto"}, defaults
