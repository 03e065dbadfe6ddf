"""``asyncckpt.save``/``load`` called the way ``torch.save``/``torch.load`` are.

File objects are written synchronously (the handle is done when ``save`` returns) and read
from their current position; torch's pickling arguments are accepted and ignored.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt.errors import ChecksumError, FormatError, StorageError


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    return {"model": model.state_dict(), "step": 7, "ids": torch.arange(100)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"]
    assert torch.equal(a["ids"], b["ids"])
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key


def test_bytesio_round_trip_positional() -> None:
    buffer = io.BytesIO()
    handle = asyncckpt.save(_state(), buffer)  # torch.save(obj, f)
    assert handle.done() and handle.observed
    info = handle.result()
    assert info.stats.stored_bytes == len(buffer.getvalue()) > 0
    assert info.stats.raw_bytes > 0 and info.stats.total_s is not None
    assert info.path == "<BytesIO>"
    buffer.seek(0)
    _same(asyncckpt.load(buffer), _state())


def test_open_binary_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "model.ackpt"
    with open(path, "wb") as f:
        asyncckpt.save(_state(), f)
        assert f.tell() == path.stat().st_size  # flushed, still open
    with open(path, "rb") as f:
        _same(asyncckpt.load(f, map_location="cpu"), _state())
    _same(asyncckpt.load(path), _state())  # the same bytes as a path


def test_torch_save_arguments_are_accepted_and_ignored(tmp_path: Path) -> None:
    path = tmp_path / "a.ackpt"
    asyncckpt.save(_state(), path, pickle, 2).result()
    asyncckpt.save(
        _state(),
        str(path),
        pickle_module=pickle,
        pickle_protocol=pickle.HIGHEST_PROTOCOL,
        _use_new_zipfile_serialization=False,
        _disable_byteorder_record=True,
        compression="none",
    ).result()
    _same(asyncckpt.load(path, pickle_module=pickle, weights_only=True), _state())
    buffer = io.BytesIO()
    asyncckpt.save(_state(), buffer, pickle, 4, True, False)
    _same(asyncckpt.load(io.BytesIO(buffer.getvalue())), _state())


def test_writes_and_reads_at_the_current_position() -> None:
    buffer = io.BytesIO()
    buffer.write(b"HEADER")
    asyncckpt.save({"x": torch.ones(3)}, buffer)
    buffer.seek(6)
    assert asyncckpt.load(buffer)["x"].tolist() == [1.0, 1.0, 1.0]


class _Unseekable(io.RawIOBase):
    def __init__(self, data: bytes) -> None:
        self._inner = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        return self._inner.readinto(b)


def test_load_from_an_unseekable_stream() -> None:
    buffer = io.BytesIO()
    asyncckpt.save(_state(), buffer)
    _same(asyncckpt.load(_Unseekable(buffer.getvalue())), _state())  # type: ignore[arg-type]


def test_damaged_buffer_is_caught() -> None:
    buffer = io.BytesIO()
    asyncckpt.save({"x": torch.arange(10_000)}, buffer, compression="none")
    data = bytearray(buffer.getvalue())
    data[len(data) // 3] ^= 0xFF
    with pytest.raises((ChecksumError, FormatError)):
        asyncckpt.load(io.BytesIO(bytes(data)))
    with pytest.raises(FormatError):
        asyncckpt.load(io.BytesIO(bytes(data[:-10])))


class _FailingBuffer(io.BytesIO):
    def __init__(self, fail_after: int) -> None:
        super().__init__()
        self.fail_after = fail_after

    def write(self, data: Any) -> int:
        if self.tell() + len(memoryview(data)) > self.fail_after:
            raise OSError(28, "injected: no space left")
        return super().write(data)


def test_failed_write_raises_at_once_and_truncates_back() -> None:
    buffer = _FailingBuffer(fail_after=2_000)
    buffer.write(b"keep")
    with pytest.raises(StorageError, match="injected"):
        asyncckpt.save({"x": torch.randn(10_000)}, buffer, compression="none")
    assert buffer.getvalue() == b"keep"
    asyncckpt.wait()  # nothing left behind for later saves to raise


def test_wrong_objects_get_a_remedy(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="mode 'wb'"):
        asyncckpt.save({"x": 1}, 12345)  # type: ignore[arg-type]
    path = tmp_path / "r.ackpt"
    path.write_bytes(b"")
    with open(path, "rb") as f, pytest.raises(TypeError, match="mode 'wb'"):
        asyncckpt.save({"x": 1}, f)
    with pytest.raises(TypeError, match="mode 'rb'"):
        asyncckpt.load(12345)  # type: ignore[arg-type]


def test_torch_save_into_bytesio_then_convert() -> None:
    """The usual migration: bytes from torch.save become an asyncckpt buffer."""
    old = io.BytesIO()
    torch.save(_state(), old)
    old.seek(0)
    new = io.BytesIO()
    asyncckpt.save(torch.load(old, weights_only=True), new)
    new.seek(0)
    _same(asyncckpt.load(new), _state())


def test_checkpointer_load_accepts_weights_only_as_load_does(tmp_path: Path) -> None:
    with asyncckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _state()).result()
        _same(ckpt.load(weights_only=True), _state())
        _same(ckpt.load(1, weights_only=False), _state())


@pytest.mark.parametrize("where", [".", ""], ids=["dot", "cwd-relative-dir"])
def test_saving_to_a_directory_fails_at_once_as_torch_save_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    monkeypatch.chdir(tmp_path)
    target = where or str(tmp_path)
    with pytest.raises(RuntimeError):  # the reference: torch.save refuses at the call
        torch.save(_state(), target)
    with pytest.raises(StorageError, match="is a directory") as caught:
        asyncckpt.save(_state(), target)  # not only at result()
    assert "model.ackpt" in str(caught.value)  # what to pass instead
    asyncckpt.wait()  # nothing was left pending
