"""asyncckpt._settings: one frozen object, argument > environment > default."""

from __future__ import annotations

import dataclasses
import warnings

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
