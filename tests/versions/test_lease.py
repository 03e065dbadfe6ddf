"""Waiting for a step (``asyncckpt/_versions/lease.py``), in process on the fake clock:
a waiter never gives up on a writer that renews its lease, and gives up on one that stopped
once its lease record has not changed for ``lease_expiry_ms`` on the waiter's own clock.
The same across processes: ``tests/api/test_distributed.py`` (a writer rank SIGKILLed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncckpt._settings import Settings
from asyncckpt._storage import resolve
from asyncckpt._versions.lease import wait_for_step
from asyncckpt._versions.writing import RootWriter
from asyncckpt.errors import CheckpointTimeoutError
from tests.fake_clock import fake_clock


@pytest.mark.timeout(120)
def test_a_waiter_gives_up_one_expiry_after_the_writers_last_beat_and_never_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCCKPT_LEASE_RENEW_MS", "1000")
    storage, root = resolve(str(tmp_path / "ckpt"), None)
    with fake_clock() as clock:
        writer = RootWriter(storage, root, "a1", Settings.resolve())
        writer.acquire()  # its lease is renewed every second of the fake clock
        start = clock.now()
        clock.at(start + 60, writer.release)  # a minute of beats, then the writer freezes
        with pytest.raises(CheckpointTimeoutError, match=r"has not renewed its lease for 5\.0 s"):
            wait_for_step(storage, root, 2, timeout=None, expiry_s=5.0)
        waited = clock.now() - start
        assert writer._heartbeat is not None and not writer._heartbeat.is_alive()
    # Seen renewed until its last beat (at 60 s) within a poll (at most 3 s), then 5 s.
    assert 65.0 <= waited <= 68.0
