"""Reading objects on S3 (moto and SeaweedFS over HTTP, through s3fs): a large ranged read is
several GETs sent at once on s3fs's event loop and streamed into the caller's buffer, pinned
to the ETag like every read of a handle, retried as one request, and finished (every GET)
before it returns or raises.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest

from asyncckpt._storage import resolve, s3read
from asyncckpt.errors import FileReplacedError, StorageError

PIECE = 64 << 10


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(s3read, "READ_PIECE_BYTES", PIECE)
    return PIECE


def _object(s3_root: str, s3_server: Any, size: int) -> tuple[Any, str, bytes]:
    storage, path = resolve(f"{s3_root}/blob.bin", s3_server.storage_options)
    data = os.urandom(size)
    storage.write_bytes(path, data)
    return storage, path, data


def _counting_gets(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count GETs in flight at once (they all run on s3fs's one event loop thread)."""
    seen = {"now": 0, "most": 0, "total": 0}
    real = s3read._get_into

    async def counted(*args: Any) -> str | None:
        seen["now"] += 1
        seen["total"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        try:
            await asyncio.sleep(0.01)  # let the others start
            return await real(*args)
        finally:
            seen["now"] -= 1

    monkeypatch.setattr(s3read, "_get_into", counted)
    return seen


def test_a_large_read_is_several_gets_at_once_into_the_buffer(
    s3_root: str, s3_server: Any, small_pieces: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 5 * small_pieces + 123
    storage, path, data = _object(s3_root, s3_server, size)
    seen = _counting_gets(monkeypatch)
    with storage.open_read(path) as handle:
        out = bytearray(size + 10)  # longer than the object: filled up to its end
        assert handle.read_into(0, memoryview(out)) == size
        assert bytes(out[:size]) == data
        part = bytearray(2 * small_pieces)
        assert handle.read_into(small_pieces // 2, memoryview(part)) == len(part)
        assert bytes(part) == data[small_pieces // 2 : small_pieces // 2 + len(part)]
        assert handle.read_into(size, memoryview(bytearray(8))) == 0  # at the end: nothing
    assert seen["most"] == 6  # the whole object: 6 pieces, all in flight together
    assert seen["total"] == 6 + 2


def test_a_streamed_read_of_a_replaced_object_raises_file_replaced(
    s3_root: str, s3_server: Any, small_pieces: int
) -> None:
    storage, path, _ = _object(s3_root, s3_server, 3 * small_pieces)
    with storage.open_read(path) as handle:
        storage.write_bytes(path, os.urandom(3 * small_pieces))
        with pytest.raises(FileReplacedError, match=r"blob\.bin"):
            handle.read_into(0, memoryview(bytearray(3 * small_pieces)))


def test_a_short_response_is_retried(
    s3_root: str, s3_server: Any, small_pieces: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_RETRY_BACKOFF_MS", "1")
    storage, path, data = _object(s3_root, s3_server, 3 * small_pieces)
    real, cut = s3read._stream_into, [1]

    async def short_once(body: Any, out: memoryview) -> int:
        got = await real(body, out)
        if cut[0]:
            cut[0] -= 1
            return got - 1  # as if the connection closed one byte early
        return got

    monkeypatch.setattr(s3read, "_stream_into", short_once)
    with storage.open_read(path) as handle:
        out = bytearray(len(data))
        assert handle.read_into(0, memoryview(out)) == len(data)
    assert bytes(out) == data and cut == [0]


def test_every_get_has_finished_when_a_failed_read_raises(
    s3_root: str, s3_server: Any, small_pieces: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, path, _ = _object(s3_root, s3_server, 3 * small_pieces)
    real, finished = s3read._get_into, threading.Event()

    async def first_fails(fs: Any, bucket: str, key: str, start: int, *rest: Any) -> Any:
        if start == 0:
            raise PermissionError("Access Denied")  # fatal: not retried
        await asyncio.sleep(0.05)
        result = await real(fs, bucket, key, start, *rest)
        if start == 2 * small_pieces:
            finished.set()
        return result

    monkeypatch.setattr(s3read, "_get_into", first_fails)
    with storage.open_read(path) as handle:
        with pytest.raises(StorageError, match=r"blob\.bin"):
            handle.read_into(0, memoryview(bytearray(3 * small_pieces)))
        assert finished.is_set()  # no GET is left writing into the caller's buffer


def test_tunables_come_from_the_settings_given_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tests.s3mem  # noqa: F401 (registers s3mem://)
    from asyncckpt._settings import Settings
    from asyncckpt._storage import S3Storage

    storage, _ = resolve("s3mem://settings-bucket/x", None)
    assert isinstance(storage, S3Storage)
    given = Settings.resolve(part_bytes=6 << 20, retry_attempts=3, retry_backoff_ms=7)
    ours = S3Storage(storage.fs, settings=given, retry_attempts=9)
    monkeypatch.setenv("ASYNCCKPT_PART_BYTES", str(7 << 20))  # after construction: ignored
    assert ours.settings.part_bytes == 6 << 20
    assert ours.open_atomic("settings-bucket/x").part_bytes == 6 << 20  # type: ignore[attr-defined]
    policy = ours.policy()
    assert (policy.attempts, policy.backoff_s) == (9, 0.007)  # the argument wins
    assert S3Storage(storage.fs).settings.part_bytes == 7 << 20  # None: the environment
    with pytest.raises(ValueError, match="part_concurrency"):
        S3Storage(storage.fs, part_concurrency=0)


def test_several_small_reads_are_sent_at_once_and_pinned(
    s3_root: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Opening a file reads its header and its tail: one round trip, not two.
    storage, path, data = _object(s3_root, s3_server, 1000)
    seen = {"now": 0, "most": 0}
    real = s3read._s3fs_ranged_get

    async def counted(*args: Any) -> tuple[bytes, str | None]:
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        try:
            await asyncio.sleep(0.01)  # let the other start
            return await real(*args)
        finally:
            seen["now"] -= 1

    monkeypatch.setattr(s3read, "_s3fs_ranged_get", counted)
    with storage.open_read(path) as handle:
        spans = [(0, 16), (900, 200), (2000, 5)]
        assert handle.read_ranges(spans) == [data[:16], data[900:], b""]
        assert seen["most"] == 2
        storage.write_bytes(path, os.urandom(1000))
        with pytest.raises(FileReplacedError, match=r"blob\.bin"):
            handle.read_ranges([(0, 16), (500, 10)])
