"""Background failures are never lost, never raised twice, and never damage the target.

Faults are injected where a real backend would fail: the local writer's ``open``/``os``
calls inside ``asyncckpt._storage.local``, and the methods of fsspec's (cached) memory filesystem.
So the library's own error translation (``OSError`` -> ``StorageError`` chained with
``from``) and clean-up run exactly as they would on a full disk or a failing server.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import asyncckpt
import asyncckpt._storage.local
from asyncckpt._storage import TEMP_MARK, is_temp_name
from asyncckpt.errors import AsyncCkptError, StorageError

REPO = Path(__file__).resolve().parents[2]


class Faults:
    """Switchable faults for one backend, plus helpers to look at what is stored."""

    def __init__(self, kind: str, root: str) -> None:
        self.kind = kind
        self.root = root
        self.mode: str | None = None  # None, "write" (ENOSPC after `budget` bytes), "commit"
        self.budget = 64
        self.release = threading.Event()  # a failing call waits for this before raising
        self.release.set()
        self.raised: list[OSError] = []

    def fail(self, what: str) -> OSError:
        assert self.release.wait(60), "test never released the fault"
        code = errno.ENOSPC if what == "write" else errno.EIO
        exc = OSError(code, f"{os.strerror(code)} (injected {what} fault)")
        self.raised.append(exc)
        return exc

    def path(self, name: str) -> str:
        return f"{self.root}/{name}" if self.kind == "memory" else os.path.join(self.root, name)

    def names(self) -> list[str]:
        if self.kind == "memory":
            fs, path = fsspec.core.url_to_fs(self.root)
            if not fs.exists(path):
                return []
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
        return sorted(os.listdir(self.root))

    def read(self, name: str) -> bytes:
        with fsspec.open(self.path(name), "rb") as f:
            return bytes(f.read())


class _FailingFile:
    """A real file whose writes fail with ENOSPC once ``faults.budget`` bytes are used."""

    def __init__(self, inner: Any, faults: Faults) -> None:
        self._inner = inner
        self._faults = faults
        self._written = 0

    def write(self, data: Any) -> Any:
        size = memoryview(data).nbytes
        if self._faults.mode == "write" and self._written + size > self._faults.budget:
            raise self._faults.fail("write")
        self._written += size
        return self._inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _OsProxy:
    """``os`` as seen by ``asyncckpt._storage.local``, with a rename that can fail."""

    def __init__(self, faults: Faults) -> None:
        self._faults = faults

    def replace(self, src: Any, dst: Any) -> None:
        if self._faults.mode == "commit":
            raise self._faults.fail("commit")
        os.replace(src, dst)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def _opens_temp_for_writing(path: Any, mode: str) -> bool:
    return (
        isinstance(path, (str, os.PathLike))
        and is_temp_name(os.fspath(path))
        and ("w" in mode or "x" in mode)
    )


@pytest.fixture(params=["local", "memory"])
def faults(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    memory_root: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Faults]:
    if request.param == "local":
        # The faults are injected into this process: its writes must run here, on threads.
        monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "0")
        f = Faults("local", str(tmp_path))

        def local_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            handle = builtins.open(file, mode, *args, **kwargs)  # noqa: SIM115
            return _FailingFile(handle, f) if _opens_temp_for_writing(file, mode) else handle

        monkeypatch.setattr(asyncckpt._storage.local, "open", local_open, raising=False)
        monkeypatch.setattr(asyncckpt._storage.local, "os", _OsProxy(f))
    else:
        f = Faults("memory", memory_root)
        fs = fsspec.filesystem("memory")  # the cached instance that memory:// URLs resolve to
        real_open, real_mv = fs.open, fs.mv

        def memory_open(path: Any, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
            handle = real_open(path, mode, *args, **kwargs)
            return _FailingFile(handle, f) if _opens_temp_for_writing(path, mode) else handle

        def memory_mv(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            if f.mode == "commit":
                raise f.fail("commit")
            return real_mv(src, dst, *args, **kwargs)

        monkeypatch.setattr(fs, "open", memory_open)
        monkeypatch.setattr(fs, "mv", memory_mv)
    yield f
    # Leave no failure behind for other tests.
    f.mode = None
    f.release.set()
    with contextlib.suppress(AsyncCkptError):
        asyncckpt.wait()


def _state(tag: float) -> dict[str, Any]:
    return {"tag": tag, "w": torch.full((64, 64), tag), "i": torch.arange(1000) * int(tag)}


def _assert_state(loaded: dict[str, Any], tag: float) -> None:
    assert loaded["tag"] == tag
    assert torch.equal(loaded["w"], torch.full((64, 64), tag))
    assert torch.equal(loaded["i"], torch.arange(1000) * int(tag))


def _wait_done(handle: asyncckpt.SaveHandle) -> None:
    """Wait for a handle to finish *without* observing its outcome."""
    for _ in range(6000):
        if handle.done():
            return
        time.sleep(0.01)
    raise AssertionError("save never finished")


def _old_file(faults: Faults, name: str = "ckpt.ackpt") -> tuple[str, bytes]:
    path = faults.path(name)
    asyncckpt.save(_state(1.0), path).result()
    return path, faults.read(name)


def _assert_old_intact(faults: Faults, path: str, old: bytes) -> None:
    name = path.rsplit("/", 1)[-1] if faults.kind == "memory" else os.path.basename(path)
    assert faults.names() == [name], "a temp file or partial file was left behind"
    assert faults.read(name) == old
    _assert_state(asyncckpt.load(path), 1.0)


def _assert_is_injected(exc: BaseException, faults: Faults) -> None:
    assert isinstance(exc, StorageError)
    assert isinstance(exc, AsyncCkptError) and isinstance(exc, OSError)
    assert faults.raised, "the fault never fired"
    assert exc.__cause__ is faults.raised[-1]
    assert "ckpt.ackpt" in str(exc)  # names the file


# --------------------------------------------------------------------------- result()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["write", "commit"])
def test_result_raises_chained_storage_error(faults: Faults, mode: str) -> None:
    path, old = _old_file(faults)
    faults.mode = mode
    handle = asyncckpt.save(_state(2.0), path)
    with pytest.raises(StorageError) as info:
        handle.result()
    _assert_is_injected(info.value, faults)
    # What the disk said, for code that tells a full disk (ENOSPC) from a failing one (EIO).
    assert info.value.errno == (errno.ENOSPC if mode == "write" else errno.EIO)
    assert handle.done()
    assert handle.exception() is info.value
    assert handle.stats.total_s is None and handle.stats.stored_bytes is None
    faults.mode = None
    _assert_old_intact(faults, path, old)
    # Observed through result(): nothing is raised again.
    asyncckpt.wait()
    # The arena was given back (with one arena, a leaked lease would block here for ever).
    asyncckpt.save(_state(3.0), path).result()
    _assert_state(asyncckpt.load(path), 3.0)
    asyncckpt.wait()


@pytest.mark.timeout(120)
def test_several_failures_in_a_row_then_recovery(faults: Faults) -> None:
    path, old = _old_file(faults)
    faults.mode = "write"
    for tag in (2.0, 3.0, 4.0):
        with pytest.raises(StorageError):
            asyncckpt.save(_state(tag), path).result()
    assert len(faults.raised) == 3
    _assert_old_intact(faults, path, old)
    faults.mode = None
    asyncckpt.save(_state(5.0), path).result()
    _assert_state(asyncckpt.load(path), 5.0)


# --------------------------------------------------------------------------- unobserved failures


@pytest.mark.timeout(120)
def test_unobserved_failure_raised_by_next_save_once(faults: Faults) -> None:
    path, old = _old_file(faults)
    faults.mode = "commit"
    failed = asyncckpt.save(_state(2.0), path)
    _wait_done(failed)
    faults.mode = None
    with pytest.raises(StorageError) as info:
        asyncckpt.save(_state(3.0), path)
    _assert_is_injected(info.value, faults)
    _assert_old_intact(faults, path, old)  # the save that raised wrote nothing
    # Exactly once: neither the next save nor wait raises it again.
    asyncckpt.save(_state(4.0), path).result()
    asyncckpt.wait()
    _assert_state(asyncckpt.load(path), 4.0)


@pytest.mark.timeout(120)
def test_every_unobserved_failure_is_raised_in_turn() -> None:
    import concurrent.futures
    import threading
    import time

    from asyncckpt._api import jobs

    gate = threading.Event()

    def failing(message: str) -> Any:
        def job() -> int:
            gate.wait()
            raise StorageError(message)

        return job

    # Both saves are queued before either fails, so neither save() call could raise.
    first = jobs.submit(failing("first"), "one", 0, time.perf_counter(), nice=0)
    second = jobs.submit(failing("second"), "two", 0, time.perf_counter(), nice=0)
    gate.set()
    concurrent.futures.wait([first, second])
    while first in jobs.pending() or second in jobs.pending():
        time.sleep(0.01)  # done-callbacks record the failures
    with pytest.raises(StorageError, match="first"):
        jobs.raise_unobserved_failure()
    with pytest.raises(StorageError, match="second"):
        asyncckpt.wait()
    asyncckpt.wait()  # each failure is raised once


@pytest.mark.timeout(120)
def test_unobserved_failure_raised_by_wait_once(faults: Faults) -> None:
    path, old = _old_file(faults)
    faults.mode = "write"
    failed = asyncckpt.save(_state(2.0), path)
    _wait_done(failed)
    faults.mode = None
    with pytest.raises(StorageError) as info:
        asyncckpt.wait()
    _assert_is_injected(info.value, faults)
    asyncckpt.wait()
    _assert_old_intact(faults, path, old)
    asyncckpt.save(_state(3.0), path).result()
    _assert_state(asyncckpt.load(path), 3.0)


@pytest.mark.timeout(120)
def test_wait_raises_failure_of_save_still_pending(faults: Faults) -> None:
    path, old = _old_file(faults)
    faults.mode = "commit"
    faults.release.clear()
    failed = asyncckpt.save(_state(2.0), path)
    assert not failed.done()  # the failing call is held until the timer below
    releaser = threading.Timer(0.2, faults.release.set)
    releaser.start()
    with pytest.raises(StorageError) as info:
        asyncckpt.wait()
    releaser.join()
    _assert_is_injected(info.value, faults)
    assert failed.done()
    faults.mode = None
    _assert_old_intact(faults, path, old)
    asyncckpt.wait()  # once only
    asyncckpt.save(_state(3.0), path).result()
    asyncckpt.wait()
    _assert_state(asyncckpt.load(path), 3.0)


@pytest.mark.timeout(120)
def test_failure_is_recorded_once_done_is_true(faults: Faults) -> None:
    """``done()`` is true as soon as the save failed, even while a slow log handler is still
    reporting the failure; a save made right then must already raise it."""

    entered, release, finished = threading.Event(), threading.Event(), threading.Event()

    class SlowHandler(logging.Handler):
        """Reports the failure only once the test lets it: it is provably still reporting
        while the test checks ``done()`` and saves."""

        def emit(self, record: logging.LogRecord) -> None:
            entered.set()
            release.wait(60)
            finished.set()

    logger = logging.getLogger("asyncckpt")
    handler = SlowHandler(logging.ERROR)
    logger.addHandler(handler)
    try:
        path, old = _old_file(faults)
        faults.mode = "write"
        failed = asyncckpt.save(_state(2.0), path)
        _wait_done(failed)
        assert entered.wait(60), "the failure was never reported"
        assert not finished.is_set() and failed.done()  # done while the report is held
        faults.mode = None
        with pytest.raises(StorageError) as info:
            asyncckpt.save(_state(3.0), path)
        _assert_is_injected(info.value, faults)
        _assert_old_intact(faults, path, old)
        release.set()  # the report ends now: the failure must not come back after it
        assert finished.wait(60), "the log handler never finished"
        asyncckpt.wait()
        asyncckpt.save(_state(4.0), path).result()
    finally:
        release.set()
        logger.removeHandler(handler)


@pytest.mark.timeout(120)
def test_failure_raised_once_across_result_and_wait(faults: Faults) -> None:
    path, _ = _old_file(faults)
    faults.mode = "write"
    first = asyncckpt.save(_state(2.0), path)
    _wait_done(first)
    with pytest.raises(StorageError) as info:
        first.result()
    assert first.exception() is info.value  # asking again is fine and returns the same error
    faults.mode = None
    asyncckpt.wait()
    asyncckpt.save(_state(3.0), path).result()


@pytest.mark.timeout(120)
def test_real_backend_error_without_injection(any_root: str) -> None:
    """A path below a regular file cannot be created: a real OSError from the backend."""
    blocker = f"{any_root}/blocker" if "://" in any_root else os.path.join(any_root, "blocker")
    with fsspec.open(blocker, "wb") as f:
        f.write(b"not a directory")
    path = f"{blocker}/ckpt.ackpt" if "://" in any_root else os.path.join(blocker, "ckpt.ackpt")
    handle = asyncckpt.save({"x": torch.ones(3)}, path)
    with pytest.raises(StorageError) as info:
        handle.result()
    assert isinstance(info.value.__cause__, OSError)
    assert "ckpt.ackpt" in str(info.value)
    asyncckpt.wait()


# --------------------------------------------------------------------------- interpreter exit

_EXIT_SCRIPT = textwrap.dedent(
    """
    import logging, sys, time
    import torch
    import asyncckpt
    import asyncckpt._engine.encode

    logging.basicConfig(level=logging.INFO)  # the library itself prints nothing

    real = asyncckpt._engine.encode.encode_chunk

    def slow(*args, **kwargs):  # keep the save pending when the interpreter exits
        time.sleep(0.2)
        return real(*args, **kwargs)

    asyncckpt._engine.encode.encode_chunk = slow
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(2_000_000, generator=g),
        "i": torch.arange(1_000_000),
        "step": 7,
    }
    handle = asyncckpt.save(state, sys.argv[1])
    print("pending" if not handle.done() else "finished", flush=True)
    if sys.argv[2] == "sys.exit":
        sys.exit(0)
    """
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["end-of-script", "sys.exit"])
def test_pending_save_completes_at_interpreter_exit(tmp_path: Path, how: str) -> None:
    path = tmp_path / "exit.ackpt"
    asyncckpt.save({"old": True}, path).result()
    env = dict(os.environ, ASYNCCKPT_CHUNK_BYTES=str(1 << 20), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(path), how],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "pending"
    assert "waiting for 1 pending checkpoint save" in proc.stderr
    loaded = asyncckpt.load(path)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(loaded["w"], torch.randn(2_000_000, generator=g))
    assert torch.equal(loaded["i"], torch.arange(1_000_000))
    assert loaded["step"] == 7
    assert sorted(os.listdir(tmp_path)) == ["exit.ackpt"]
    assert not any(TEMP_MARK in n for n in os.listdir(tmp_path))


def test_fault_fixture_really_injects(faults: Faults) -> None:
    """Guard for the tests above: without a fault the same calls succeed."""
    name = f"ok-{uuid.uuid4().hex[:6]}.ackpt"
    asyncckpt.save(_state(2.0), faults.path(name)).result()
    assert faults.raised == []
    assert faults.names() == [name]
