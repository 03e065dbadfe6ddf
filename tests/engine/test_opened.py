"""Opening a file: its header, footer and manifest read and checked, in few requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt._engine import opened as opened_mod
from asyncckpt._engine.opened import open_file
from asyncckpt._storage import resolve
from asyncckpt._storage.local import _LocalHandle


def _reads(monkeypatch: Any) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    real = _LocalHandle.read_range

    def counting(self: Any, start: int, length: int) -> bytes:
        seen.append((start, length))
        return real(self, start, length)

    monkeypatch.setattr(_LocalHandle, "read_range", counting)
    return seen


def test_the_footer_and_the_manifest_come_in_one_read(tmp_path: Path, monkeypatch: Any) -> None:
    # On an object store each read is a round trip a restart waits for.
    state = {f"w{i}": torch.full((4096,), float(i)) for i in range(50)}
    path = tmp_path / "x.ackpt"
    asyncckpt.save(state, path, compression="none").result()
    seen = _reads(monkeypatch)
    with open_file(*resolve(str(path), None)) as opened:
        assert len(opened.manifest.storages) == 50
    assert len(seen) == 2  # the header; the tail holding the manifest and the footer


def test_a_manifest_longer_than_the_tail_read_is_read_apart(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(opened_mod, "TAIL_BYTES", 64)  # shorter than this manifest
    path = tmp_path / "x.ackpt"
    asyncckpt.save({f"w{i}": torch.ones(3) for i in range(20)}, path).result()
    seen = _reads(monkeypatch)
    with open_file(*resolve(str(path), None)) as opened:
        assert len(opened.manifest.storages) == 20
    assert len(seen) == 3
    loaded = asyncckpt.load(path)
    assert all(torch.equal(v, torch.ones(3)) for v in loaded.values())


@pytest.mark.parametrize("cut", [1, 40, 100])
def test_a_truncated_file_still_fails_as_truncated_or_malformed(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "x.ackpt"
    asyncckpt.save({"w": torch.ones(1000)}, path).result()
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    with pytest.raises(asyncckpt.errors.AsyncCkptError):
        open_file(*resolve(str(path), None)).close()
