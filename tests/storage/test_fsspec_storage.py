"""FsspecStorage on fake fsspec filesystems: which write and create paths it takes.

The fakes are MemoryFileSystem subclasses with their own stores: one whose files honour
``autocommit=False`` like gcsfs (nothing visible before ``commit()``) and whose
``pipe_file(mode="create")`` is a conditional write; one that cannot create conditionally.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
from fsspec.spec import AbstractBufferedFile

from asyncckpt._storage import FsspecStorage, Storage, fsspec_storage, resolve
from asyncckpt._storage.fsspec_storage import choose_write_strategy, has_conditional_create
from asyncckpt.errors import ConflictError, StorageError
from asyncckpt.testing import StorageConformanceSuite


class _Boom(Exception):
    pass


class DeferredFile(AbstractBufferedFile):  # type: ignore[misc]
    """A file that, like gcsfs's, stays invisible until ``commit()``."""

    def _initiate_upload(self) -> None:
        self.pending = bytearray()
        self.fs.calls.append(("initiate", self.path))

    def _upload_chunk(self, final: bool = False) -> bool:
        self.pending += self.buffer.getvalue()
        if final and self.autocommit:
            self.commit()
        return True

    def commit(self) -> None:
        self.fs.calls.append(("commit", self.path))
        self.fs.store[self.path] = MemoryFile(self.fs, self.path, bytes(self.pending))

    def discard(self) -> None:
        self.fs.calls.append(("discard", self.path))
        self.pending = bytearray()


class RecordingMemory(MemoryFileSystem):  # type: ignore[misc]
    """A private in-memory store that records the calls FsspecStorage makes."""

    protocol = "recmem"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(global_store=False, **kwargs)
        self.calls: list[tuple[str, str]] = []

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.calls.append(("mv", path2))
        super().mv(path1, path2, **kwargs)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self.calls.append((f"pipe_file:{mode}", path))
        super().pipe_file(path, value, mode=mode, **kwargs)

    def ops(self) -> list[str]:
        return [op for op, _ in self.calls]


class GcsLikeFS(RecordingMemory):
    """Deferred commits and a conditional create: the shape of gcsfs."""

    protocol = "gcslike"
    asyncckpt_write_strategy = "deferred"

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        # One request that the store applies only if the object is absent (ifGenerationMatch=0).
        self.calls.append((f"pipe_file:{mode}", path))
        path = self._strip_protocol(path)
        if mode == "create" and path in self.store:
            raise FileExistsError(path)
        self.store[path] = MemoryFile(self, path, value)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" not in mode:
            return super()._open(path, mode, **kwargs)
        return DeferredFile(
            self,
            self._strip_protocol(path),
            mode,
            block_size=kwargs.get("block_size") or 256 * 1024,
            autocommit=kwargs.get("autocommit", True),
        )


class NoCreateFS(RecordingMemory):
    """A filesystem whose ``pipe_file`` refuses ``mode="create"``."""

    protocol = "nocreate"

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self.calls.append((f"pipe_file:{mode}", path))
        if mode == "create":
            raise NotImplementedError("no conditional writes here")
        MemoryFileSystem.pipe_file(self, path, value, mode=mode, **kwargs)


class SwallowsModeFS(RecordingMemory):
    """A ``pipe_file`` without a ``mode`` parameter: it would overwrite, so is never tried."""

    protocol = "swallows"

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:  # type: ignore[override]
        self.calls.append(("pipe_file:?", path))
        MemoryFileSystem.pipe_file(self, path, value)


def _fresh(cls: type[RecordingMemory]) -> RecordingMemory:
    return cls(skip_instance_cache=True)


# -- the conformance suite on each fake ----------------------------------------------------


class TestGcsLikeConformance(StorageConformanceSuite):
    @pytest.fixture
    def storage_root(self) -> tuple[Storage, str]:
        storage = FsspecStorage(_fresh(GcsLikeFS))
        assert storage.write_strategy == "deferred" and storage.conditional_create
        return storage, "/root"


class TestNoCreateConformance(StorageConformanceSuite):
    @pytest.fixture
    def storage_root(self) -> tuple[Storage, str]:
        storage = FsspecStorage(_fresh(NoCreateFS))
        assert storage.write_strategy == "move"
        return storage, "/root"


# -- which path is taken -------------------------------------------------------------------


def test_strategy_choice() -> None:
    assert choose_write_strategy(_fresh(GcsLikeFS)) == "deferred"
    assert choose_write_strategy(_fresh(NoCreateFS)) == "move"
    memory, _ = resolve("memory://strategy/x", None)
    assert isinstance(memory, FsspecStorage) and memory.write_strategy == "move"

    class Gs(RecordingMemory):
        protocol = ("gs", "gcs")  # type: ignore[assignment]

    assert choose_write_strategy(_fresh(Gs)) == "deferred"  # gcsfs, by protocol

    class Bad(RecordingMemory):
        asyncckpt_write_strategy = "rename"

    with pytest.raises(ValueError, match="rename"):
        FsspecStorage(_fresh(Bad))


def test_conditional_create_detection() -> None:
    assert has_conditional_create(_fresh(GcsLikeFS))
    assert has_conditional_create(_fresh(NoCreateFS))  # a candidate; the call decides
    assert not has_conditional_create(_fresh(SwallowsModeFS))

    from fsspec.implementations.http import HTTPFileSystem

    assert not has_conditional_create(HTTPFileSystem(skip_instance_cache=True))


def test_deferred_write_commits_in_place_without_a_move() -> None:
    fs = _fresh(GcsLikeFS)
    storage = FsspecStorage(fs)
    with storage.atomic_write("/d/f.bin") as out:
        out.write(b"x" * 600_000)  # more than one block: uploads before commit
        assert not fs.exists("/d/f.bin")
    assert fs.cat_file("/d/f.bin") == b"x" * 600_000
    assert "mv" not in fs.ops()
    assert fs.ops()[-1] == "commit"
    assert fs.calls[-1][1] == "/d/f.bin"  # at its final path: no temp name


def test_failed_deferred_write_leaves_nothing_and_keeps_the_old_file() -> None:
    fs = _fresh(GcsLikeFS)
    storage = FsspecStorage(fs)
    with pytest.raises(_Boom), storage.atomic_write("/d/new.bin") as out:
        out.write(b"y" * 600_000)
        raise _Boom
    assert not fs.exists("/d/new.bin")
    assert "discard" in fs.ops() and "commit" not in fs.ops()
    storage.write_bytes("/d/old.bin", b"version 1")
    with pytest.raises(_Boom), storage.atomic_write("/d/old.bin") as out:
        out.write(b"z" * 600_000)
        raise _Boom
    assert fs.cat_file("/d/old.bin") == b"version 1"
    assert storage.list_dir("/d") == ["old.bin"]


def test_failed_commit_discards() -> None:
    fs = _fresh(GcsLikeFS)
    storage = FsspecStorage(fs)

    def failing_commit(self: DeferredFile) -> None:
        raise OSError(5, "injected commit failure")

    writer = storage.open_atomic("/d/f.bin")
    writer.write(b"data")
    writer.file.commit = failing_commit.__get__(writer.file)  # type: ignore[attr-defined]
    with pytest.raises(StorageError, match=r"f\.bin"):
        writer.commit()
    assert not fs.exists("/d/f.bin")
    assert fs.ops()[-1] == "discard"
    writer.abort()  # idempotent after a failed commit
    assert fs.ops().count("discard") == 1


def test_move_strategy_uses_a_temp_and_mv() -> None:
    fs = _fresh(NoCreateFS)
    storage = FsspecStorage(fs)
    storage.write_bytes("/m/f", b"abc")
    assert fs.ops() == ["mv"]
    assert fs.cat_file("/m/f") == b"abc"


def test_create_uses_the_conditional_write() -> None:
    fs = _fresh(GcsLikeFS)
    storage = FsspecStorage(fs)
    storage.create_exclusive("/c/COMMIT", b"first")
    assert fs.ops() == ["pipe_file:create"]
    with pytest.raises(ConflictError, match="COMMIT"):
        storage.create_exclusive("/c/COMMIT", b"second")
    assert fs.cat_file("/c/COMMIT") == b"first"


def test_conflict_reported_by_the_store_itself() -> None:
    """Another process created the file between the check and the write: the store says so."""
    fs = _fresh(GcsLikeFS)
    storage = FsspecStorage(fs)
    fs.pipe_file("/c/COMMIT", b"theirs")
    storage.exists = lambda path: False  # type: ignore[method-assign]
    with pytest.raises(ConflictError, match="COMMIT"):
        storage.create_exclusive("/c/COMMIT", b"ours")
    assert fs.cat_file("/c/COMMIT") == b"theirs"


def test_create_falls_back_once_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    fsspec_storage._warned.discard(NoCreateFS)
    fs = _fresh(NoCreateFS)
    storage = FsspecStorage(fs)
    with caplog.at_level(logging.WARNING, logger="asyncckpt._storage.fsspec_storage"):
        storage.create_exclusive("/c/a", b"1")
        storage.create_exclusive("/c/b", b"2")
        FsspecStorage(_fresh(NoCreateFS)).create_exclusive("/c/a", b"3")
    warnings = [r for r in caplog.records if "NoCreateFS has no conditional create" in r.message]
    assert len(warnings) == 1
    assert "NotImplementedError" in warnings[0].message
    assert fs.ops() == ["pipe_file:create", "mv", "mv"]  # tried once, then check-then-move
    assert not storage.conditional_create
    with pytest.raises(ConflictError):
        storage.create_exclusive("/c/a", b"again")


def test_swallowed_mode_is_never_called() -> None:
    fs = _fresh(SwallowsModeFS)
    storage = FsspecStorage(fs)
    storage.create_exclusive("/c/a", b"1")
    assert fs.ops() == ["mv"]
    with pytest.raises(ConflictError):
        storage.create_exclusive("/c/a", b"2")
    assert fs.cat_file("/c/a") == b"1"
