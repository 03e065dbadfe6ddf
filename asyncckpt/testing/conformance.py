"""The storage conformance suite: behaviour every asyncckpt storage backend must have.

Subclass :class:`StorageConformanceSuite` in a ``test_*.py`` module and provide a
``storage_root`` fixture returning ``(storage, root)``::

    class TestMyBackend(StorageConformanceSuite):
        @pytest.fixture
        def storage_root(self, tmp_path):
            return LocalStorage(), str(tmp_path)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from asyncckpt._storage import Storage
from asyncckpt.errors import CheckpointNotFoundError, ConflictError, FileReplacedError, FormatError

__all__ = ["StorageConformanceSuite"]


def _payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@contextlib.contextmanager
def _raises(kind: type[BaseException] | tuple[type[BaseException], ...]) -> Iterator[None]:
    try:
        yield
    except kind:
        return
    raise AssertionError(f"expected {kind}, nothing was raised")


class StorageConformanceSuite:
    """Behaviour every :class:`~asyncckpt._storage.Storage` backend must have.

    Subclass it in a ``test_*.py`` module and define a ``storage_root`` fixture that returns
    ``(storage, root)``: a backend and an empty directory (prefix) in it, unique per test.

    Class attributes a subclass may override:
        large_bytes: size of the "large" streamed file (make it span several multipart
            parts on an object store).
        racers: threads that race to create one file exclusively.
    """

    large_bytes = 1 << 20
    racers = 8

    # -- writes and reads ---------------------------------------------------------------

    def test_write_then_read(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "a.bin")
        data = _payload(10_000)
        storage.write_bytes(path, data)
        assert storage.exists(path)
        assert storage.size(path) == len(data)
        assert storage.read_bytes(path, 1 << 20) == data
        assert storage.read_range(path, 100, 50) == data[100:150]
        out = bytearray(300)
        assert storage.read_into(path, 9_800, memoryview(out)) == 200
        assert bytes(out[:200]) == data[9_800:]

    def test_streamed_large_write(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "large.bin")
        rng = random.Random(1)
        digest, total = hashlib.sha256(), 0
        with storage.atomic_write(path) as out:
            while total < self.large_bytes:
                piece = rng.randbytes(min(rng.randint(1, 300_000), self.large_bytes - total))
                out.write(piece if rng.random() < 0.5 else memoryview(piece))
                digest.update(piece)
                total += len(piece)
        assert storage.size(path) == total
        got = hashlib.sha256(storage.read_range(path, 0, total)).hexdigest()
        assert got == digest.hexdigest()
        assert len(storage.read_range(path, total // 2, 1000)) == 1000

    def test_empty_file(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "empty")
        storage.write_bytes(path, b"")
        assert storage.exists(path)
        assert storage.size(path) == 0
        assert storage.read_bytes(path, 10) == b""
        assert storage.read_range(path, 0, 10) == b""

    def test_overwrite_replaces(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "f")
        storage.write_bytes(path, b"old" * 1000)
        storage.write_bytes(path, b"new")
        assert storage.read_bytes(path, 1 << 20) == b"new"

    def test_invisible_until_commit(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "pending.bin")
        writer = storage.open_atomic(path)
        try:
            writer.write(_payload(1000))
            assert not storage.exists(path)
            assert "pending.bin" not in storage.list_dir(root)
            with _raises(CheckpointNotFoundError):
                storage.size(path)
        except BaseException:
            writer.abort()
            raise
        writer.commit()
        assert storage.exists(path)
        assert "pending.bin" in storage.list_dir(root)

    def test_abort_leaves_nothing(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "aborted.bin")
        writer = storage.open_atomic(path)
        writer.write(_payload(self.large_bytes))
        writer.abort()
        writer.abort()  # idempotent
        assert not storage.exists(path)
        assert storage.list_dir(root) == []

    def test_failure_keeps_previous_version(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "kept.bin")
        storage.write_bytes(path, b"version 1")

        class Boom(Exception):
            pass

        with _raises(Boom), storage.atomic_write(path) as out:
            out.write(_payload(self.large_bytes))
            raise Boom
        assert storage.read_bytes(path, 100) == b"version 1"
        assert storage.list_dir(root) == ["kept.bin"]

    def test_read_range_bounds(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "r")
        storage.write_bytes(path, b"0123456789")
        assert storage.read_range(path, 0, 0) == b""
        assert storage.read_range(path, 8, 10) == b"89"
        assert storage.read_range(path, 10, 5) == b""
        assert storage.read_range(path, 50, 5) == b""

    def test_missing_file(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "missing")
        assert not storage.exists(path)
        for call in (
            lambda: storage.size(path),
            lambda: storage.read_range(path, 0, 10),
            lambda: storage.read_bytes(path, 10),
        ):
            with _raises(CheckpointNotFoundError):
                call()
        assert issubclass(CheckpointNotFoundError, FileNotFoundError)

    def test_read_bytes_limit(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "big")
        storage.write_bytes(path, b"x" * 100)
        assert storage.read_bytes(path, 100) == b"x" * 100
        with _raises(FormatError):
            storage.read_bytes(path, 99)

    def test_parallel_reads(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "p")
        data = _payload(64_000)
        storage.write_bytes(path, data)
        ranges = [(i * 1000, 1000) for i in range(64)]
        with ThreadPoolExecutor(8) as ex:
            parts = list(ex.map(lambda r: storage.read_range(path, *r), ranges))
        assert b"".join(parts) == data

    # -- one version per read handle ----------------------------------------------------

    def test_a_read_handle_reads_one_version(self, storage_root: tuple[Storage, str]) -> None:
        """A file replaced under an open handle is read as it was, or not at all."""
        storage, root = storage_root
        path = storage.join(root, "pinned.bin")
        old, new = _payload(20_000, 1), _payload(30_000, 2)
        storage.write_bytes(path, old)
        handle = storage.open_read(path)
        try:
            assert handle.size == len(old)
            assert handle.read_range(0, 100) == old[:100]
            storage.write_bytes(path, new)
            try:
                got: bytes | None = handle.read_range(10_000, 20_000)
            except FileReplacedError:  # the backend cannot read the old version any more
                got = None
            assert got is None or got == old[10_000:]
        finally:
            handle.close()
        handle.close()  # idempotent
        with storage.open_read(path) as fresh:
            out = bytearray(40_000)
            assert fresh.read_into(29_000, memoryview(out)) == 1_000
            assert bytes(out[:1_000]) == new[29_000:]
            with ThreadPoolExecutor(8) as ex:
                parts = list(ex.map(lambda i: fresh.read_range(i * 1000, 1000), range(30)))
            assert b"".join(parts) == new
            assert fresh.read_range(30_000, 10) == b""
        with _raises(CheckpointNotFoundError):
            storage.open_read(storage.join(root, "missing"))

    # -- exclusive create ---------------------------------------------------------------

    def test_create_exclusive(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "sub", "COMMIT")
        storage.create_exclusive(path, b"first")
        with _raises(ConflictError):
            storage.create_exclusive(path, b"second")
        assert storage.read_bytes(path, 100) == b"first"

    def test_create_exclusive_race(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "race", "COMMIT")
        storage.create_exclusive(storage.join(root, "race", "warmup"), b"")  # probes, dirs
        won = self._race(lambda i: storage.create_exclusive(path, f"writer {i}".encode()))
        assert storage.read_bytes(path, 100) == f"writer {won}".encode()

    def _race(self, attempt: Callable[[int], object]) -> int:
        """Run ``attempt(i)`` on ``racers`` threads at once; exactly one may succeed (the
        others raise ConflictError). Returns the winner's ``i``."""
        barrier = threading.Barrier(self.racers)

        def one(i: int) -> bool:
            barrier.wait(30)
            try:
                attempt(i)
            except ConflictError:
                return False
            return True

        with ThreadPoolExecutor(self.racers) as ex:
            won = list(ex.map(one, range(self.racers)))
        assert won.count(True) == 1, won
        return won.index(True)

    # -- compare-and-swap (the version file; docs/PROTOCOL.md §0) ------------------------

    def test_read_tagged_and_replace_if(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "VERSION")
        assert storage.read_tagged(path, 100) is None
        first = storage.replace_if(path, b"one", None)  # None: only if it does not exist
        with _raises(ConflictError):
            storage.replace_if(path, b"again", None)
        found = storage.read_tagged(path, 100)
        assert found is not None and found == (b"one", first)
        second = storage.replace_if(path, b"two", first)
        assert second != first
        with _raises(ConflictError):  # a writer holding the old tag is fenced
            storage.replace_if(path, b"stale", first)
        assert storage.read_tagged(path, 100) == (b"two", second)

    def test_replace_if_race(self, storage_root: tuple[Storage, str]) -> None:
        """Writers that all read one tag: exactly one replaces the file."""
        storage, root = storage_root
        path = storage.join(root, "race", "VERSION")
        tag = storage.replace_if(path, b"start", None)
        won = self._race(lambda i: storage.replace_if(path, f"writer {i}".encode(), tag))
        found = storage.read_tagged(path, 100)
        assert found is not None and found[0] == f"writer {won}".encode()

    # -- listing and deleting -----------------------------------------------------------

    def test_list_dir(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        assert storage.list_dir(root) == []
        assert storage.list_dir(storage.join(root, "nope")) == []
        for name in ("b", "a", "d/x", "d/y/z", "dd/w"):
            storage.write_bytes(storage.join(root, *name.split("/")), name.encode())
        assert storage.list_dir(root) == ["a", "b", "d", "dd"]
        assert storage.list_dir(storage.join(root, "d")) == ["x", "y"]
        assert storage.exists(storage.join(root, "d"))

    def test_delete(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "gone")
        storage.delete(path)  # missing: fine
        storage.write_bytes(path, b"x")
        storage.delete(path)
        assert not storage.exists(path)
        assert storage.list_dir(root) == []

    def test_delete_tree(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        for name in ("1/a", "1/sub/b", "10/c", "2/d"):
            storage.write_bytes(storage.join(root, *name.split("/")), b"x")
        storage.delete_tree(storage.join(root, "1"))
        assert storage.list_dir(root) == ["10", "2"]
        assert storage.read_bytes(storage.join(root, "10", "c"), 10) == b"x"
        storage.delete_tree(storage.join(root, "missing"))  # missing: fine
        storage.delete_tree(storage.join(root, "1"))

    def test_describe_names_the_file(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        path = storage.join(root, "named.bin")
        assert "named.bin" in storage.describe(path)
        with _raises(CheckpointNotFoundError):
            try:
                storage.size(path)
            except CheckpointNotFoundError as exc:
                assert "named.bin" in str(exc)
                raise

    # -- capabilities: what the engine and the protocol ask of a backend ------------------

    def test_capabilities_say_what_the_backend_is(self, storage_root: tuple[Storage, str]) -> None:
        storage, root = storage_root
        a, b = storage.join(root, "dir", "a.bin"), storage.join(root, "dir", "b.bin")
        storage.write_bytes(a, b"a")
        assert storage.file_key(a) == storage.file_key(a)
        assert storage.file_key(a) != storage.file_key(b)
        # Two files of one directory are on one device or store.
        assert storage.target(a) == storage.target(b)
        if storage.local_paths:  # os calls work on the backend's paths
            assert os.path.isfile(a) and not os.path.exists(b)
        else:
            assert not storage.on_local_disk(a)  # only a local file can be on a local disk
        if not storage.process_local:  # a writer process is sent a copy
            assert pickle.dumps(storage)
