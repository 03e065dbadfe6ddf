"""What a storage backend says about itself (the engine and the protocol ask these, never
the backend's type): where a file is, whether its paths are this machine's files, whether
it is on a local disk."""

from __future__ import annotations

from typing import Any

import pytest

from asyncckpt._storage import local, resolve


def test_targets_are_devices_buckets_and_top_directories(tmp_path: Any) -> None:
    def key(url: str) -> tuple[str, ...]:
        storage, path = resolve(url, None)
        return storage.target(path)

    assert key(str(tmp_path / "a" / "b.ackpt")) == key(str(tmp_path / "c.ackpt"))
    assert key(str(tmp_path / "x.ackpt"))[0] == "local"
    assert key("memory://one/a/b.ackpt") == key("memory://one/c.ackpt")
    assert key("memory://one/a.ackpt") != key("memory://two/a.ackpt")
    assert key("memory://one/a.ackpt") != key(str(tmp_path / "one" / "a.ackpt"))


def test_local_disks_and_network_filesystems_are_told_apart(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, path = resolve(str(tmp_path / "x.ackpt"), None)
    assert storage.on_local_disk(path)
    monkeypatch.setattr(local, "filesystem_type", lambda path: "nfs4")
    assert not storage.on_local_disk(path)
    monkeypatch.setattr(local, "filesystem_type", lambda path: "fuse.s3fs")
    assert not storage.on_local_disk(path)
    assert not resolve("memory://x/y.ackpt", None)[0].on_local_disk("x/y.ackpt")
