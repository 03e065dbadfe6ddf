"""The writer's CPU budget (``asyncckpt._cpu``), with injected clocks."""

from __future__ import annotations

import threading
import time

import pytest

from asyncckpt import _cpu as cpu
from asyncckpt import _threads as workers


class _Clocks:
    def __init__(self) -> None:
        self.wall = self.busy = self.writer = 0.0

    def meter(self, cores: float = 4.0) -> cpu.CpuMeter:
        return cpu.CpuMeter(
            lambda: self.writer, machine=lambda: self.busy, cores=cores, clock=lambda: self.wall
        )


def test_spare_cores_are_the_idle_ones_not_counting_the_writer() -> None:
    c = _Clocks()
    meter = c.meter()
    c.wall, c.busy, c.writer = 1.0, 3.0, 1.0  # three cores busy, one of them the writer's
    assert meter.read() == pytest.approx(2.0)
    c.wall, c.busy = 2.0, 3.0 + 4.0  # everything busy with other work
    assert meter.read() == pytest.approx(0.0)
    c.wall, c.busy = 3.0, 7.0  # idle
    assert meter.read() == pytest.approx(4.0)


def test_a_window_too_short_keeps_the_last_estimate() -> None:
    c = _Clocks()
    meter = c.meter()
    c.wall = 0.01
    assert meter.read() is None  # nothing measured yet
    c.wall, c.busy = 1.0, 1.0
    assert meter.read() == pytest.approx(3.0)
    c.wall, c.busy = 1.02, 1.08
    assert meter.read() == pytest.approx(3.0)


def test_spare_cores_stay_between_zero_and_the_cores() -> None:
    c = _Clocks()
    meter = c.meter(cores=2.0)
    c.wall, c.writer = 1.0, 5.0  # the writer's counter ran ahead of the machine's
    assert meter.read() == pytest.approx(2.0)
    c.wall, c.busy = 2.0, 50.0
    assert meter.read() == pytest.approx(0.0)


def test_the_machine_meter_reads_this_machine() -> None:
    value = cpu.CpuMeter(lambda: 0.0).read()
    assert value is None  # a fresh meter has no window yet
    meter = cpu.CpuMeter(lambda: 0.0)
    while (spare := meter.read()) is None:  # until its first window has passed
        time.sleep(0.01)
    assert 0.0 <= spare <= meter.cores


def test_a_thread_clock_separates_cpu_from_waiting() -> None:
    start = cpu.ThreadClock.now()
    time.sleep(0.05)  # blocked, not on the CPU: counts as busy (like I/O), not as waiting
    spent = cpu.ThreadClock.now() - start
    assert spent.wall >= 0.05 and spent.cpu < spent.wall
    assert 0.0 <= spent.waited <= spent.wall and spent.busy <= spent.wall


def test_writer_threads_count_their_cpu_time() -> None:
    before = workers.writer_cpu_seconds()
    done = threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        done.set()

    workers.pool("encode", 1).submit(spin).result()
    workers.pool("encode", 1).wait_idle(5.0)
    assert done.is_set() and workers.writer_cpu_seconds() - before >= 0.05


def test_a_write_that_mostly_waited_on_its_store_counts_its_whole_wall_time() -> None:
    # Seen on a loaded 2-core machine: a 0.482 s write to a 10 MB/s link whose wake-ups
    # queued for a core 0.475 s in all. The store was the bottleneck: all of it is the store's.
    spent = cpu.ThreadClock(wall=0.482, cpu=0.002, waited=0.475)
    assert spent.busy == pytest.approx(0.482)


def test_a_write_that_mostly_ran_leaves_out_its_wait_for_a_core() -> None:
    # A write to memory on a busy machine: it ran 40 ms and queued 60 ms for a core; the
    # queueing is the CPU's, not the store's.
    spent = cpu.ThreadClock(wall=0.100, cpu=0.040, waited=0.060)
    assert spent.busy == pytest.approx(0.040)
    assert cpu.ThreadClock(wall=0.1, cpu=0.1, waited=0.0).busy == pytest.approx(0.1)
