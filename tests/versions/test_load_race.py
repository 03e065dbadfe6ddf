"""A load while the file is replaced returns one whole version, old or new, never an error.

* Deterministic: the file is replaced between the manifest read and the chunk reads. On
  local disk and ``memory://`` the load keeps the file it opened and returns the old state;
  on S3 (moto, SeaweedFS) every ranged GET carries ``If-Match`` with the ETag of the
  load's first response, the 412 restarts the load, which returns the new state.
* A race: one process saves one path over and over (states of different sizes, so the
  layouts differ), another loads it over and over; every load is a complete,
  self-consistent state, bounded by a count and a deadline.
* Handles are closed on every path: no descriptor survives a load, failed or not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import cli
from asyncckpt._engine import decode as reader
from asyncckpt._storage import resolve
from asyncckpt.errors import ChecksumError, FileReplacedError, FormatError
from asyncckpt.testing import FaultPlan

REPO = Path(__file__).resolve().parents[2]
#: The race: at most this many loads, and no more than this many seconds of them.
RACE_LOADS = 60
RACE_SECONDS = 20.0


def state(seed: int) -> dict[str, Any]:
    """A state whose size (and so chunk layout) depends on ``seed``: 0.2 to 0.5 MB."""
    g = torch.Generator().manual_seed(seed)
    n = 50_000 + 10_000 * (seed % 7)
    return {"seed": seed, "w": torch.randn(n, generator=g), "i": torch.arange(seed % 5 + 3)}


def assert_whole(got: Any) -> int:
    """``got`` is exactly ``state(seed)`` for the seed it says; returns the seed."""
    seed = got["seed"]
    want = state(seed)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["i"], want["i"]), seed
    return int(seed)


def replaced_before_chunks(
    monkeypatch: pytest.MonkeyPatch, replace: Callable[[], None], times: int = 1
) -> list[int]:
    """Run ``replace`` once the first ``times`` loads have read their manifest, before they
    read any chunk; returns the list the calls are counted in."""
    real = reader.read_storages
    calls: list[int] = []

    def read_storages(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) <= times:
            replace()
        return real(*args, **kwargs)

    monkeypatch.setattr(reader, "read_storages", read_storages)
    return calls


@pytest.fixture(params=["local", "memory"])
def local_url(request: pytest.FixtureRequest, tmp_path: Path, memory_root: str) -> str:
    return str(tmp_path / "m.ackpt") if request.param == "local" else f"{memory_root}/m.ackpt"


def test_a_file_replaced_under_a_load_gives_the_old_state(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncckpt.save(state(1), local_url).result()
    calls = replaced_before_chunks(
        monkeypatch, lambda: asyncckpt.save(state(2), local_url).result()
    )
    assert assert_whole(asyncckpt.load(local_url)) == 1  # the file it opened
    assert len(calls) == 1
    assert assert_whole(asyncckpt.load(local_url)) == 2


def test_an_object_replaced_under_a_load_restarts_it(
    s3_root: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts = f"{s3_root}/m.ackpt", s3_server.storage_options
    asyncckpt.save(state(1), url, storage_options=opts).result()
    calls = replaced_before_chunks(
        monkeypatch, lambda: asyncckpt.save(state(2), url, storage_options=opts).result()
    )
    assert assert_whole(asyncckpt.load(url, storage_options=opts)) == 2  # started over
    assert len(calls) == 2


def test_an_object_replaced_at_every_attempt_is_a_clear_error(
    s3_root: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts = f"{s3_root}/m.ackpt", s3_server.storage_options
    asyncckpt.save(state(0), url, storage_options=opts).result()
    seeds = iter(range(1, 100))
    calls = replaced_before_chunks(
        monkeypatch,
        lambda: asyncckpt.save(state(next(seeds)), url, storage_options=opts).result(),
        times=100,
    )
    with pytest.raises(FileReplacedError, match=r"m\.ackpt.*replaced .*5 times") as info:
        asyncckpt.load(url, storage_options=opts)
    assert len(calls) == reader.REPLACED_ATTEMPTS == 5
    assert "while it was being loaded" in str(info.value)
    assert not isinstance(info.value, ChecksumError)


@pytest.mark.s3_stores("moto")
def test_a_store_that_ignores_if_match_is_caught_by_the_etag(
    s3_root: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ranged response's ETag is compared with the pinned one as well."""
    plan = FaultPlan(ignore_conditional=True)
    url = f"faulty::{s3_root}/m.ackpt"
    opts = {"faulty": {"plan": plan}, "s3": s3_server.storage_options}
    asyncckpt.save(state(1), url, storage_options=opts).result()
    calls = replaced_before_chunks(
        monkeypatch, lambda: asyncckpt.save(state(2), url, storage_options=opts).result()
    )
    assert assert_whole(asyncckpt.load(url, storage_options=opts)) == 2
    assert len(calls) == 2


# -- the race -------------------------------------------------------------------------------

_OVERWRITER = (
    "import sys; from tests.versions.test_load_race import overwriter_main; "
    "overwriter_main(*sys.argv[1:5])"
)


def overwriter_main(url: str, options: str, stop: str, pause: str) -> None:
    """Save ``state(seed)`` to ``url`` for seed 1, 2, ... until the file ``stop`` exists
    (or 2,000 saves), ``pause`` seconds between saves; prints ``READY`` after the first."""
    opts = json.loads(options) or None
    seed = 1
    while seed <= 2000 and not os.path.exists(stop):
        asyncckpt.save(state(seed), url, storage_options=opts).result()
        if seed == 1:
            print("READY", flush=True)
        seed += 1
        time.sleep(float(pause))


def _race(
    url: str, opts: dict[str, Any] | None, load: Callable[[], Any], pause: float
) -> list[int]:
    """Load ``url`` while another process overwrites it; returns the seeds loaded.

    On an object store a load that meets a newer object starts over, a bounded number of
    times: an overwriter that replaces the file faster than it can be read at all leaves
    nothing to load (``FileReplacedError``), so there it pauses between saves (a training
    job saving every few steps), while a save is in flight during most loads.
    """
    asyncckpt.save(state(0), url, storage_options=opts).result()
    stop = Path(os.environ.get("TMPDIR", "/tmp")) / f"stop-{os.getpid()}-{time.monotonic_ns()}"
    args = [url, json.dumps(opts or {}), str(stop), str(pause)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _OVERWRITER, *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    seeds: list[int] = []
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        deadline = time.monotonic() + RACE_SECONDS
        while len(seeds) < RACE_LOADS and time.monotonic() < deadline:
            seeds.append(assert_whole(load()))
    finally:
        stop.touch()
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            stop.unlink(missing_ok=True)
    assert proc.returncode == 0
    return seeds


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_loads_racing_an_overwriting_process_on_local_disk(tmp_path: Path) -> None:
    url = str(tmp_path / "m.ackpt")
    seeds = _race(url, None, lambda: asyncckpt.load(url), pause=0)
    assert len(seeds) > 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_loads_racing_an_overwriting_process_on_s3(s3_root: str, s3_server: Any) -> None:
    url, opts = f"{s3_root}/m.ackpt", s3_server.storage_options
    seeds = _race(url, opts, lambda: asyncckpt.load(url, storage_options=opts), pause=0.2)
    assert len(seeds) > 1 and len(set(seeds)) > 1  # it did load while the file changed


@pytest.mark.timeout(120)
def test_loads_racing_an_overwriting_thread_on_memory(memory_root: str) -> None:
    """``memory://`` lives in one process: the overwriter is a thread there."""
    url = f"{memory_root}/m.ackpt"
    asyncckpt.save(state(0), url).result()
    stop = threading.Event()
    errors: list[BaseException] = []

    def overwrite() -> None:
        seed = 1
        while not stop.is_set() and seed <= 2000:
            try:
                asyncckpt.save(state(seed), url).result()
            except BaseException as exc:  # reported below
                errors.append(exc)
                return
            seed += 1

    thread = threading.Thread(target=overwrite)
    thread.start()
    try:
        deadline = time.monotonic() + RACE_SECONDS
        seeds = []
        while len(seeds) < RACE_LOADS and time.monotonic() < deadline:
            seeds.append(assert_whole(asyncckpt.load(url)))
    finally:
        stop.set()
        thread.join(60)
    assert not errors and len(seeds) > 1


# -- every handle is closed -----------------------------------------------------------------

#: Rounds of loads per test below; a descriptor kept per load would show as at least this
#: many, while a few opened once by something else in the process (a pool, a client) stay
#: far below it.
ROUNDS = 20


@pytest.fixture
def fds() -> Callable[[], int]:
    """Counts this process's open descriptors."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc/self/fd here")
    return lambda: len(os.listdir("/proc/self/fd"))


def test_no_descriptor_outlives_a_load(tmp_path: Path, fds: Callable[[], int]) -> None:
    path = tmp_path / "m.ackpt"
    asyncckpt.save(state(3), path).result()
    damaged = tmp_path / "bad.ackpt"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # inside the first chunk
    damaged.write_bytes(bytes(data))
    truncated = tmp_path / "cut.ackpt"
    truncated.write_bytes(path.read_bytes()[:-7])

    def loads() -> None:
        assert_whole(asyncckpt.load(path))
        with pytest.raises(ChecksumError):
            asyncckpt.load(damaged)
        with pytest.raises(FormatError):
            asyncckpt.load(truncated)
        with pytest.raises(ValueError):
            asyncckpt.load(path, into={"w": torch.zeros(2)})
        with reader.open_file(*resolve(str(path), None)) as opened:
            assert opened.manifest.tensors

    loads()  # whatever the first load starts (thread pools) is there before counting
    before = fds()
    for _ in range(ROUNDS):
        loads()
    assert fds() - before < ROUNDS


def test_no_descriptor_outlives_a_checkpointer_load_or_a_command(
    tmp_path: Path, fds: Callable[[], int], capsys: pytest.CaptureFixture[str]
) -> None:
    with asyncckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(1, state(1)).result()
    reading = asyncckpt.Checkpointer(tmp_path / "root", read_only=True)
    (file,) = (tmp_path / "root" / "1").glob("*.ackpt")

    def loads() -> None:
        assert_whole(reading.load(1))
        for command in ("verify", "inspect"):
            assert cli.main([command, str(file)]) == 0
        assert cli.main(["ls", str(tmp_path / "root")]) == 0
        assert cli.main(["verify", str(file), "--max-bytes", "10"]) == 1

    loads()
    before = fds()
    for _ in range(ROUNDS):
        loads()
    capsys.readouterr()
    assert fds() - before < ROUNDS
