"""``asyncckpt convert``'s inputs fuzzed: safetensors headers and torch.save files.

Safetensors files are a real one's with its JSON header's fields replaced by arbitrary JSON
(or its bytes cut and spliced); torch.save files are a real one's bytes cut and spliced.
``read_header`` may raise only asyncckpt errors; the command must answer with an exit
status and a message, never with an error it did not expect (which it reports as "a
bug?"), and write no destination file when it fails. Under an address-space limit
(``tests/fuzzing.py``), with ``--max-bytes`` as a user bounding a conversion would pass.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save as safetensors_save

from asyncckpt._convert.safetensors import read_header
from asyncckpt._storage import LocalStorage
from asyncckpt.cli.main import main as cli_main
from tests.fuzzing import FUZZ, memory_limited, mutated_json, only_asyncckpt_errors

STATE = {
    "w": torch.arange(12.0).reshape(3, 4),
    "b": torch.ones(5, dtype=torch.bfloat16),
    "i": torch.arange(3, dtype=torch.int64),
}
SAFETENSORS = safetensors_save(STATE, metadata={"format": "pt"})
(_LENGTH,) = struct.unpack("<Q", SAFETENSORS[:8])
HEADER = json.loads(SAFETENSORS[8 : 8 + _LENGTH])
DATA = SAFETENSORS[8 + _LENGTH :]


def _torch_seed() -> bytes:
    buf = io.BytesIO()
    torch.save({"model": STATE, "step": 3}, buf)
    return buf.getvalue()


TORCH_FILE = _torch_seed()


def _with_header(header: Any) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + DATA


@st.composite
def _spliced(draw: st.DrawFn, seed: bytes) -> bytes:
    data = seed
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        cut = draw(st.integers(0, 16))
        data = data[:at] + draw(st.binary(max_size=16)) + data[at + cut :]
    return data


def _convert(src: Path, dst: Path) -> None:
    stderr = io.StringIO()
    with memory_limited(), contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(None):
        code = cli_main(["convert", str(src), str(dst), "--max-bytes", "64MiB"])
    err = stderr.getvalue()
    assert "a bug?" not in err, err
    if code != 0:
        assert err.strip(), "a failed conversion says why"
        assert not dst.exists(), "a failed conversion left its destination"
    dst.unlink(missing_ok=True)


TARGETS = st.sampled_from(["out.ackpt", "out.safetensors", "out.pt"])


@FUZZ
@given(
    data=mutated_json(HEADER, max_changes=3).map(_with_header) | _spliced(SAFETENSORS),
    target=TARGETS,
)
def test_safetensors_headers(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, target: str
) -> None:
    where = tmp_path_factory.mktemp("st")
    src = where / "in.safetensors"
    src.write_bytes(data)
    with memory_limited():
        only_asyncckpt_errors(lambda: read_header(LocalStorage(), str(src)))
    _convert(src, where / target)


@FUZZ
@given(data=_spliced(TORCH_FILE), target=TARGETS)
def test_torch_files(tmp_path_factory: pytest.TempPathFactory, data: bytes, target: str) -> None:
    where = tmp_path_factory.mktemp("pt")
    src = where / "in.pt"
    src.write_bytes(data)
    _convert(src, where / target)


#: Torch files that torch's unpickler chokes on (found by this file's fuzzer): what the
#: error must say, after the file's name.
_CHOKING_TORCH_FILES = {
    # The first opcode pops an empty stack: IndexError, not UnpicklingError.
    "empty stack": (b"\x80\x02\x86.", "torch.load cannot read it (IndexError"),
    # The first string says it is 2 GiB long: allocated before the 8-byte file runs out.
    "2 GiB string": (b"\x80\x02X\xff\xff\xff\x7f", "torch.load ran out of memory"),
}


@pytest.mark.parametrize("command", ["convert", "inspect"])
@pytest.mark.parametrize("case", sorted(_CHOKING_TORCH_FILES))
def test_a_torch_file_that_torch_load_chokes_on_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, case: str
) -> None:
    content, said = _CHOKING_TORCH_FILES[case]
    src = tmp_path / "in.pt"
    src.write_bytes(content)
    extra = [str(tmp_path / "out.ackpt")] if command == "convert" else []
    with memory_limited(256 << 20):
        code = cli_main([command, str(src), *extra])
    err = capsys.readouterr().err
    assert code != 0 and "a bug?" not in err
    assert f"{src}: {said}" in err
    assert not (tmp_path / "out.ackpt").exists()


def test_defect_10_an_expanded_tensor_is_charged_to_the_budget(tmp_path: Path) -> None:
    """A 400-byte torch file holding a 12 GiB zero-stride view, converted to safetensors
    under a 64 MiB budget: refused by the budget, not by running out of memory."""
    torch.save({"x": torch.zeros(1).expand(3 << 30)}, tmp_path / "in.pt")
    stderr = io.StringIO()
    with memory_limited(), contextlib.redirect_stderr(stderr):
        code = cli_main(
            [
                "convert",
                str(tmp_path / "in.pt"),
                str(tmp_path / "o.safetensors"),
                "--max-bytes",
                "64MiB",
            ]
        )
    err = stderr.getvalue()
    if "can't allocate memory" in err:  # defect 10: the budget let the allocation through
        raise MemoryError(err)
    assert code != 0 and "max_bytes budget" in err and "before allocating" in err, err


def test_the_seeds_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The unmutated seeds convert (else the fuzzing would test one rejection only)."""
    for name, data in (("a.safetensors", _with_header(HEADER)), ("b.pt", TORCH_FILE)):
        (tmp_path / name).write_bytes(data)
        assert cli_main(["convert", str(tmp_path / name), str(tmp_path / f"{name}.ackpt")]) == 0
        assert (tmp_path / f"{name}.ackpt").exists()
    capsys.readouterr()
