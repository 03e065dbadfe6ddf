"""``compression="auto"``: the decision rule as a pure function, and the writer around it.

The rule (``asyncckpt._engine.autocompress.choose_planes``) is tested with injected rates.
The writer tests inject the encoders' speeds and the spare cores too (their measurement is
switched off) and let only the storage be measured: a link throttled by ``FaultPlan`` can
only be slower than its limit, and an in-memory filesystem is far faster than the rates
injected, so no test depends on how fast or how busy this machine happens to be.
"""

from __future__ import annotations

import collections
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncckpt
from asyncckpt import _cpu as cpu
from asyncckpt._api.checkpointer import Checkpointer
from asyncckpt._api.dropin import write_options
from asyncckpt._engine import autocompress
from asyncckpt._engine.autocompress import Rates, choose_planes
from asyncckpt._format.codec import INCOMPRESSIBLE, EncodeReport, decode_chunk, encode_chunk
from asyncckpt._format.container import FOOTER_SIZE, Manifest, decode_footer, decode_manifest
from asyncckpt._settings import Settings
from asyncckpt._storage import resolve
from asyncckpt.cli.verify import verify_file
from asyncckpt.testing.faults import FaultPlan

MIB = 1 << 20
#: The smallest fp32 chunk whose byte planes are long enough to be probed (512 KiB each).
CHUNK = 2 * MIB


class _LinkClock:
    """The time that write measurements see: it moves only when a throttled link sleeps, so
    a write to a throttled link takes exactly its bytes over the bandwidth and any other
    write takes no time, however busy this machine is. (On the real clocks a test of what
    ``"auto"`` measures failed without a defect both ways on a loaded machine: the save
    thread's run-queue wait covered a throttled write's sleep, and without that subtraction
    writes to memory looked slow.)"""

    def __init__(self) -> None:
        self.t = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.t += seconds

    def thread_clock(self) -> cpu.ThreadClock:
        return cpu.ThreadClock(self.t, 0.0, 0.0)


_link = _LinkClock()


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from a process that has learned nothing, with small chunks, and
    does not depend on how busy this machine is: the spare cores are unknown unless a test
    says otherwise, and writes are timed on :class:`_LinkClock`."""
    global _link
    _link = _LinkClock()
    monkeypatch.setenv("ASYNCCKPT_CHUNK_BYTES", str(CHUNK))
    monkeypatch.setattr(cpu, "spare_cores", lambda: None)
    monkeypatch.setattr(cpu.ThreadClock, "now", staticmethod(_link.thread_clock))
    autocompress.reset()
    yield
    autocompress.reset()


def _normal(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _manifest(url: str, **storage_options: Any) -> Manifest:
    with fsspec.open(url, "rb", **storage_options) as f:
        data = f.read()
    footer = decode_footer(data[-FOOTER_SIZE:], len(data), url)
    body = data[footer.manifest_offset : footer.manifest_offset + footer.manifest_length]
    return decode_manifest(body, footer, url)


def _codecs(url: str, **storage_options: Any) -> list[str]:
    return [c.codec for c in _manifest(url, **storage_options).chunks]


def _slow_encoders(monkeypatch: pytest.MonkeyPatch, seconds_per_byte: float) -> None:
    """Make the encoders look this slow, whatever they really measure."""
    monkeypatch.setenv("ASYNCCKPT_AUTO_PRIOR_ENCODE_MB_S", str(round(1e-6 / seconds_per_byte)))
    real = autocompress.AutoRun.encoded

    def ratios_only(self: autocompress.AutoRun, report: EncodeReport) -> None:
        real(self, EncodeReport(ratios=report.ratios))  # keeps the plane ratios, drops times

    monkeypatch.setattr(autocompress.AutoRun, "encoded", ratios_only)


# -- the rule, with injected rates -----------------------------------------------------------

FP32_NORMAL = [1.0, 1.0, 1.0, 0.34]  # three mantissa planes of noise, one exponent plane
SLOW_DISK = Rates(write_s=10e-9, compress_s=1e-9, group_s=0.25e-9, threads=2)  # 100 MB/s
FAST_DISK = Rates(write_s=0.2e-9, compress_s=1e-9, group_s=0.25e-9, threads=2)  # 5 GB/s


def _choose(
    ratios: Sequence[float | None],
    rates: Rates,
    previous: Sequence[bool] | None = None,
    margin: float = 0.25,
    always: float = 0.2,
) -> tuple[bool, ...]:
    before = [True] * len(ratios) if previous is None else previous
    return choose_planes(ratios, before, rates, margin=margin, always=always)


def test_slow_storage_compresses_the_planes_that_shrink() -> None:
    assert _choose(FP32_NORMAL, SLOW_DISK) == (False, False, False, True)
    assert _choose([0.5, 0.7, 0.95, 0.34], SLOW_DISK) == (True, True, False, True)


def test_fast_storage_or_slow_encoders_store_raw() -> None:
    assert _choose(FP32_NORMAL, FAST_DISK) == (False,) * 4
    slow_cpu = Rates(write_s=10e-9, compress_s=40e-9, group_s=10e-9, threads=2)
    assert _choose(FP32_NORMAL, slow_cpu) == (False,) * 4


def test_more_encoder_threads_make_compression_pay_sooner() -> None:
    rates = Rates(write_s=2e-9, compress_s=1e-9, group_s=0.25e-9, threads=1)
    assert _choose(FP32_NORMAL, rates) == (False,) * 4
    assert _choose(FP32_NORMAL, Rates(2e-9, 1e-9, 0.25e-9, threads=8))[3]


def test_break_even_counts_regrouping_only_for_grouped_chunks() -> None:
    rates = Rates(write_s=4e-9, compress_s=1e-9, group_s=0.25e-9, threads=2)
    assert rates.break_even(4) == pytest.approx(0.25)  # (1 + 4 * 0.25) / 2 / 4
    assert rates.break_even(2) == pytest.approx(0.1875)  # (1 + 2 * 0.25) / 2 / 4
    assert rates.break_even(1) == pytest.approx(0.125)  # plain zstd: nothing to regroup
    assert Rates(0.0, 1e-9, 0.0, 2).break_even(1) == float("inf")  # free storage: never


def test_incompressible_planes_are_never_compressed() -> None:
    hopeless = [INCOMPRESSIBLE + 0.001, 1.0]
    assert _choose(hopeless, Rates(1.0, 1e-9, 1e-9, 8)) == (False, False)


def test_planes_that_shrink_a_lot_are_compressed_whatever_the_rates() -> None:
    free_storage = Rates(write_s=0.0, compress_s=1.0, group_s=1.0, threads=1)
    assert _choose([0.2, 0.05, 0.21, 1.0], free_storage) == (True, True, False, False)
    assert _choose([0.3], free_storage, always=0.3) == (True,)


def test_hysteresis_keeps_the_previous_choice_near_break_even() -> None:
    rates = Rates(write_s=4e-9, compress_s=1e-9, group_s=0.25e-9, threads=2)
    assert rates.break_even(4) == pytest.approx(0.25)
    near = [1.0, 1.0, 0.77, 0.73]  # save 23 % and 27 %: within 25 % of the bar either way
    assert _choose(near, rates, previous=[True] * 4)[2:] == (True, True)
    assert _choose(near, rates, previous=[False] * 4)[2:] == (False, False)
    far = [1.0, 1.0, 0.85, 0.6]  # save 15 % and 40 %: beyond the margin, the choice flips
    assert _choose(far, rates, previous=[False, False, True, False])[2:] == (False, True)
    tight = _choose(near, rates, previous=[False, False, True, False], margin=0.01)
    assert tight[2:] == (False, True)


def test_an_unknown_ratio_keeps_the_previous_choice() -> None:
    assert _choose([None, None], FAST_DISK, previous=[True, False]) == (True, False)


@settings(max_examples=200, deadline=None)
@given(
    ratios=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),
    write=st.floats(1e-12, 1e-6),
    cpu=st.floats(1e-12, 1e-6),
    threads=st.integers(1, 16),
    margin=st.floats(0.0, 1.0),
)
def test_the_choice_is_consistent(
    ratios: list[float], write: float, cpu: float, threads: int, margin: float
) -> None:
    """Re-deciding from the choice just made never flips it (no oscillation), and storage
    that is slower never makes a plane go raw."""
    rates = Rates(write, cpu, cpu / 4, threads)
    first = _choose(list(ratios), rates, margin=margin)
    assert _choose(list(ratios), rates, list(first), margin=margin) == first
    slower = Rates(write * 2, cpu, cpu / 4, threads)
    again = _choose(list(ratios), slower, list(first), margin=margin)
    assert all(a or not f for f, a in zip(first, again))


# -- the codec with a chooser ----------------------------------------------------------------


def _encode(raw: bytes, choose: Any, *, itemsize: int = 4, is_float: bool = True) -> Any:
    report = EncodeReport()
    codec, stored = encode_chunk(
        memoryview(raw),
        itemsize=itemsize,
        is_float=is_float,
        compression="auto",
        level=1,
        choose=choose,
        report=report,
    )
    out = bytearray(len(raw))
    decode_chunk(bytes(stored), codec, itemsize, memoryview(out))
    assert bytes(out) == raw
    return codec, stored, report


def test_auto_chunk_stored_raw_is_neither_regrouped_nor_compressed() -> None:
    raw = _normal(CHUNK // 4).numpy().tobytes()
    seen = []

    def choose(width: int, ratios: tuple[float | None, ...]) -> tuple[bool, ...]:
        seen.append((width, ratios))
        return (False,) * width

    codec, stored, report = _encode(raw, choose)
    assert codec == "raw" and bytes(stored) == raw
    assert (report.grouped_bytes, report.compressed_bytes) == (0, 0)
    [(width, ratios)] = seen
    assert width == 4
    assert [r is not None and r > INCOMPRESSIBLE for r in ratios] == [True, True, True, False]
    assert ratios[3] is not None and 0.2 < ratios[3] < 0.5  # the exponent plane, probed
    assert report.ratios == ratios


def test_auto_compresses_only_the_chosen_planes() -> None:
    raw = _normal(CHUNK // 4).numpy().tobytes()
    codec, stored, report = _encode(raw, lambda width, ratios: (False, False, False, True))
    assert codec == "zstd-bytegroup"
    plane = CHUNK // 4
    assert struct.unpack_from("<4I", stored)[:3] == (plane,) * 3  # stored raw
    assert report.grouped_bytes == CHUNK and report.compressed_bytes == plane
    assert report.ratios[3] is not None and report.ratios[3] < 0.5


def test_auto_without_a_chooser_compresses_as_zstd() -> None:
    raw = memoryview(_normal(CHUNK // 4).numpy().tobytes())
    auto = encode_chunk(raw, itemsize=4, is_float=True, compression="auto", level=1)
    zstd = encode_chunk(raw, itemsize=4, is_float=True, compression="zstd", level=1)
    assert auto[0] == zstd[0] == "zstd-bytegroup"
    assert bytes(auto[1]) == bytes(zstd[1])


@pytest.mark.parametrize("wanted", [True, False])
def test_auto_probes_chunks_that_are_not_regrouped(wanted: bool) -> None:
    raw = (np.arange(CHUNK // 8, dtype=np.int64) % 1000).tobytes()
    seen = []

    def choose(width: int, ratios: tuple[float | None, ...]) -> tuple[bool, ...]:
        seen.append((width, ratios))
        return (wanted,)

    codec, _, report = _encode(raw, choose, itemsize=8, is_float=False)
    [(width, (ratio,))] = seen
    assert width == 1 and ratio is not None and ratio < 0.5
    assert codec == ("zstd" if wanted else "raw")
    assert report.compressed_bytes == (len(raw) if wanted else 0)


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(max_size=4096),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    is_float=st.booleans(),
    pattern=st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_auto_round_trips_whatever_is_chosen(
    data: bytes, itemsize: int, is_float: bool, pattern: list[bool]
) -> None:
    _encode(data, lambda width, ratios: pattern[:width], itemsize=itemsize, is_float=is_float)


# -- the writer: measured storage, injected encoders ------------------------------------------


def _throttled(bandwidth: float) -> dict[str, Any]:
    plan = FaultPlan(link_bandwidth=bandwidth, sleep=_link.sleep, clock=_link.now)
    return {"faulty": {"plan": plan}}


@pytest.mark.timeout(120)
def test_auto_compresses_on_slow_storage_once_it_has_measured_it(
    memory_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow_encoders(monkeypatch, 10e-9)  # 100 MB/s per thread, regrouping and compressing
    monkeypatch.setenv("ASYNCCKPT_AUTO_PRIOR_WRITE_MB_S", "100000")  # assumed fast at first
    monkeypatch.setenv("ASYNCCKPT_AUTO_WINDOW_MIB", "4")
    state = {"w": _normal(2 * MIB)}  # 8 MiB: four chunks
    options = _throttled(10e6)  # 10 MB/s: compressing the exponent plane saves far more
    url = "faulty::" + memory_root
    asyncckpt.save(state, f"{url}/a.ackpt", storage_options=options, compression="auto").result()
    asyncckpt.save(state, f"{url}/b.ackpt", storage_options=options, compression="auto").result()
    manifest = _manifest(f"{memory_root}/b.ackpt")
    assert [c.codec for c in manifest.chunks] == ["zstd-bytegroup"] * 4
    assert all(c.stored_len < 0.9 * c.raw_len for c in manifest.chunks)
    assert torch.equal(asyncckpt.load(f"{memory_root}/b.ackpt")["w"], state["w"])


@pytest.mark.timeout(120)
def test_auto_stores_raw_on_fast_storage_with_slow_encoders(
    memory_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow_encoders(monkeypatch, 10e-9)
    state = {"w": _normal(2 * MIB), "h": _normal(MIB, 1, torch.bfloat16)}
    for name in ("a", "b"):
        asyncckpt.save(state, f"{memory_root}/{name}.ackpt", compression="auto").result()
        assert set(_codecs(f"{memory_root}/{name}.ackpt")) == {"raw"}
        loaded: dict[str, Any] = asyncckpt.load(f"{memory_root}/{name}.ackpt")
        assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.timeout(120)
def test_each_storage_target_is_measured_apart(
    memory_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow_encoders(monkeypatch, 10e-9)
    monkeypatch.setenv("ASYNCCKPT_AUTO_WINDOW_MIB", "4")
    state = {"w": _normal(2 * MIB)}
    slow, fast = "faulty::" + memory_root, memory_root
    for _ in range(2):
        options = _throttled(10e6)
        asyncckpt.save(
            state, f"{slow}/x.ackpt", storage_options=options, compression="auto"
        ).result()
        asyncckpt.save(state, f"{fast}/y.ackpt", compression="auto").result()
    assert _codecs(f"{memory_root}/x.ackpt") == ["zstd-bytegroup"] * 4
    assert _codecs(f"{memory_root}/y.ackpt") == ["raw"] * 4


@pytest.mark.timeout(120)
def test_mixed_file_verifies_and_loads(memory_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fast storage and slow encoders: noise is stored raw, while planes that shrink to a
    # fifth or less (zeros, a constant) are compressed all the same.
    _slow_encoders(monkeypatch, 10e-9)
    state: dict[str, Any] = {
        "w": _normal(MIB),
        "zeros": torch.zeros(MIB),
        "ids": torch.zeros(MIB // 2, dtype=torch.int64),
        "ones": torch.ones(MIB, dtype=torch.bfloat16),
        "small": _normal(1000, 2, torch.float16),
        "step": 7,
    }
    url = f"{memory_root}/mixed.ackpt"
    asyncckpt.save(state, url, compression="auto").result()
    codecs = collections.Counter(_codecs(url))
    assert codecs["raw"] >= 2 and codecs["zstd-bytegroup"] >= 2 and codecs["zstd"] >= 1
    storage, path = resolve(url, None)
    report = verify_file(storage, path)
    assert report.ok, report
    loaded: dict[str, Any] = asyncckpt.load(url)
    assert loaded["step"] == 7
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if k != "step")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32]
)
def test_auto_round_trips_bit_exact(any_root: str, dtype: torch.dtype) -> None:
    base = torch.randn(5 * MIB // 8 + 5, generator=torch.Generator().manual_seed(3))
    t = base.to(dtype) if dtype.is_floating_point else (base * 1000).to(dtype)
    state = {"t": t, "nan": torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float32)}
    asyncckpt.save(state, f"{any_root}/t.ackpt", compression="auto").result()
    loaded = asyncckpt.load(f"{any_root}/t.ackpt")
    for key, value in state.items():
        assert torch.equal(loaded[key].view(torch.uint8), value.view(torch.uint8))


def test_checkpointer_accepts_auto(any_root: str) -> None:
    state: dict[str, Any] = {"w": _normal(MIB), "step": 3}
    with Checkpointer(any_root, compression="auto") as ckpt:
        ckpt.save(3, state)
        ckpt.wait()
        loaded = ckpt.load()
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3


def test_lightning_plugin_accepts_auto() -> None:
    pytest.importorskip("lightning")
    from asyncckpt.lightning import AsyncCkptIO

    assert AsyncCkptIO(compression="auto").compression == "auto"
    with pytest.raises(ValueError, match="compression must be one of"):
        AsyncCkptIO(compression="lz4")


# -- what the writer remembers ---------------------------------------------------------------


def test_rate_starts_at_its_prior_and_follows_measurements() -> None:
    rate = autocompress.Rate(window=100, prior=1.0)
    assert rate.value == 1.0
    rate.add(50.0, 10)  # one call 5x slower moves it by its share of the window only
    assert 1.0 < rate.value < 1.5
    for _ in range(100):
        rate.add(0.1 * 10, 10)
    assert rate.value == pytest.approx(0.1, rel=1e-3)
    assert autocompress.Rate(window=100).value == 0.0  # unmeasured, no prior: free


def test_auto_explores_one_chunk_per_explore_mib_held_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCCKPT_AUTO_EXPLORE_MIB", "8")
    options = write_options("auto", Settings.resolve())
    storage, path = resolve("memory://explore/x.ackpt", None)
    run = autocompress.for_write(storage, path, options.auto, options.threads)
    run.target.write = autocompress.Rate(1 << 20, prior=1e-12)  # storage as good as free
    ratios = (1.0, 1.0, 0.9, 0.34)
    picks = [run.choose(4, ratios, nbytes=2 * MIB) for _ in range(12)]
    picks += [run.choose(4, ratios, nbytes=MIB // 4) for _ in range(64)]
    explored = [i for i, p in enumerate(picks) if any(p)]
    assert explored == [3, 7, 11, 43, 75]  # after 8 MiB held back each time
    assert picks[3] == (False, False, True, True)  # what "zstd" would compress
    assert run.target.choices[(4, 3)] is False  # exploring does not move the choice
    assert run.choose(4, (1.0, 1.0, 1.0, 1.0), nbytes=64 * MIB) == (False,) * 4  # nothing to try


# -- the CPU budget: busy cores make compression pay only on slow storage ---------------------


def test_a_busy_cpu_counts_the_encoding_at_its_whole_cpu_time() -> None:
    idle = Rates(write_s=2e-9, compress_s=1e-9, group_s=0.25e-9, threads=2, spare_cores=2.0)
    busy = Rates(write_s=2e-9, compress_s=1e-9, group_s=0.25e-9, threads=2, spare_cores=0.0)
    assert idle.break_even(4) == pytest.approx(0.5)  # (1 + 4 * 0.25) / 2 / 2
    assert busy.break_even(4) == pytest.approx(1.0)  # the same, on one core's worth
    assert _choose(FP32_NORMAL, idle) == (False, False, False, True)
    assert _choose(FP32_NORMAL, busy) == (False,) * 4


def test_encoders_use_the_spare_cores_up_to_their_threads() -> None:
    def parallel(spare: float | None, threads: int = 4) -> float:
        return Rates(1e-9, 1e-9, 1e-9, threads, spare_cores=spare).parallel

    assert parallel(None) == 4.0  # unknown: every thread has a core
    assert parallel(2.5) == 2.5
    assert parallel(9.0) == 4.0
    assert parallel(0.3) == 1.0  # below one core: paid in full, never more


def test_a_slow_link_is_compressed_even_on_a_busy_cpu() -> None:
    link = Rates(write_s=10e-9, compress_s=1e-9, group_s=0.25e-9, threads=2, spare_cores=0.0)
    assert _choose(FP32_NORMAL, link) == (False, False, False, True)


@pytest.mark.timeout(120)
def test_auto_writes_raw_to_a_local_disk_it_has_not_measured_yet(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Encoders about as fast as real ones, and not measured: only the storage's prior decides.
    monkeypatch.setenv("ASYNCCKPT_WRITER_PROCESSES", "0")  # the encoders are patched here
    _slow_encoders(monkeypatch, 1e-9)
    state = {"w": _normal(2 * MIB)}
    asyncckpt.save(state, str(tmp_path / "a.ackpt"), compression="auto").result()
    assert _codecs(str(tmp_path / "a.ackpt")) == ["raw"] * 4
    # An object store or network filesystem is assumed slow until measured: compressed.
    asyncckpt.save(state, "memory://first/a.ackpt", compression="auto").result()
    assert _codecs("memory://first/a.ackpt") == ["zstd-bytegroup"] * 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("spare", "codec"), [(2.0, "zstd-bytegroup"), (0.0, "raw")])
def test_auto_compresses_only_while_the_cpu_has_room(
    memory_root: str, monkeypatch: pytest.MonkeyPatch, spare: float, codec: str
) -> None:
    _slow_encoders(monkeypatch, 1e-9)
    monkeypatch.setenv("ASYNCCKPT_AUTO_PRIOR_WRITE_MB_S", "200")  # 5 ns per byte
    monkeypatch.setenv("ASYNCCKPT_AUTO_WINDOW_MIB", "4096")  # the prior outweighs 8 MiB
    monkeypatch.setattr(cpu, "spare_cores", lambda: spare)
    asyncckpt.save({"w": _normal(2 * MIB)}, f"{memory_root}/a.ackpt", compression="auto").result()
    assert _codecs(f"{memory_root}/a.ackpt") == [codec] * 4
