"""What the command line prints on a terminal and through a pipe: long keys are cut to the
terminal's width and OK/BAD and errors are coloured on a terminal only (never when piped,
never with ``NO_COLOR`` set); piped output keeps every key whole.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt import cli

LONG = "a_rather_long_parameter_name_" * 4
RED, GREEN = "\033[31m", "\033[32m"


class Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def on_terminal(
    monkeypatch: pytest.MonkeyPatch, *args: object, columns: int = 80
) -> tuple[int, str, str]:
    out, err = Terminal(), Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    size = os.terminal_size((columns, 24))
    # any signature: pytest's own reporting calls it, with fallback=, while the patch is on
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a, **k: size)
    code = cli.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def long_keys(tmp_path: Path) -> Path:
    path = tmp_path / "m.ackpt"
    asyncckpt.save({"model": {LONG: torch.ones(2, 2), "b": torch.zeros(1)}}, path).result()
    return path


@pytest.mark.parametrize("fmt", ["ackpt", "torch", "safetensors"])
def test_long_keys_are_cut_to_the_terminal_width(
    long_keys: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """Whatever the file's format: the guide's promise is about the table, not the format."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    path = long_keys
    if fmt == "torch":
        path = tmp_path / "m.pt"
        torch.save(asyncckpt.load(long_keys), path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "m.safetensors"
        save_file({f"model.{k}": v for k, v in asyncckpt.load(long_keys)["model"].items()}, path)
    code, out, err = on_terminal(monkeypatch, "inspect", path, columns=80)
    assert code == 0, err
    rows = [line for line in out.splitlines() if "a_rather" in line]
    assert rows and all(len(line) <= 80 for line in rows)
    assert LONG not in out and "..." in out
    assert "float32 [2, 2]" in out  # the other columns are whole


def test_piped_output_keeps_every_key_whole(
    long_keys: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["inspect", str(long_keys)])
    out = capsys.readouterr().out
    assert code == 0 and LONG in out and "\033[" not in out


def test_ok_bad_and_errors_are_coloured_on_a_terminal_only(
    long_keys: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    code, out, _ = on_terminal(monkeypatch, "verify", long_keys)
    assert code == 0 and f"{GREEN}OK" in out
    damaged = tmp_path / "bad.ackpt"
    raw = bytearray(long_keys.read_bytes())
    raw[100] ^= 0xFF  # inside the data: a checksum no longer matches
    damaged.write_bytes(bytes(raw))
    code, out, err = on_terminal(monkeypatch, "verify", damaged)
    assert code == 1 and f"{RED}BAD" in out and f"{RED}asyncckpt:" in err
    code, _, err = on_terminal(monkeypatch, "inspect", tmp_path / "missing.ackpt")
    assert code == 1 and f"{RED}asyncckpt:" in err and "missing.ackpt" in err

    monkeypatch.setenv("NO_COLOR", "1")
    code, out, err = on_terminal(monkeypatch, "verify", damaged)
    assert code == 1 and "BAD" in out and "\033[" not in out + err

    monkeypatch.undo()
    monkeypatch.delenv("NO_COLOR", raising=False)
    code = cli.main(["verify", str(damaged)])  # piped (captured): no colour
    out, err = capsys.readouterr()
    assert code == 1 and "BAD" in out and "\033[" not in out + err
