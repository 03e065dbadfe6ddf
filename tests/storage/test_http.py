"""Loading over HTTP(S) (fsspec's ``http://``, a read-only store), and backend errors of
HTTP-based filesystems (``hf://``) as :class:`StorageError`.

Every server here is started by the test on 127.0.0.1 (port 0): ``http.server`` in a
thread, answering ranged GETs (206) as web servers, S3 presigned URLs and the Hugging Face
Hub do.
"""

from __future__ import annotations

import http.server
import os
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt.errors import CheckpointNotFoundError, StorageError


@dataclass
class Served:
    """A server started by the test: its base URL, the folder it serves, the methods of the
    requests it got (no write may ever reach a read-only store), whether it answers
    ``Range`` (a server that does not sends the whole file with a 200)."""

    base: str
    folder: Path
    methods: list[str] = field(default_factory=list)
    ranges: bool = True


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the server's folder, with ``Range: bytes=A-B`` answered by a 206."""

    served: Served

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep the test output clean

    def send_head(self) -> Any:
        self.served.methods.append(self.command)
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if wanted is None or not self.served.ranges or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        start = int(wanted.group(1))
        end = min(int(wanted.group(2)) if wanted.group(2) else size - 1, size - 1)
        if start >= size:
            self.send_error(416)
            return None
        file = open(path, "rb")  # noqa: SIM115 (SimpleHTTPRequestHandler closes it)
        file.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        return _Slice(file, end - start + 1)

    def do_PUT(self) -> None:
        self.served.methods.append(self.command)
        self.send_error(405)

    do_POST = do_DELETE = do_PUT


class _Slice:
    """The part of a file a ranged GET sends (``copyfile`` reads until empty)."""

    def __init__(self, file: Any, length: int) -> None:
        self.file, self.left = file, length

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data: bytes = self.file.read(n)
        self.left -= len(data)
        return data

    def close(self) -> None:
        self.file.close()


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that closes a connection early (a refused load) is no error here


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server of a fresh folder on 127.0.0.1."""
    folder = tmp_path / "www"
    folder.mkdir()
    served = Served("", folder)

    class Handler(_Handler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.served = served
            super().__init__(*args, directory=str(folder), **kwargs)

    server = _Server(("127.0.0.1", 0), Handler)
    served.base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


_STATE = {"w": torch.arange(300_000, dtype=torch.float32), "step": 7, "b": torch.ones(3)}


def test_a_file_served_over_http_loads(served: Served) -> None:
    asyncckpt.save(_STATE, served.folder / "model.ackpt").result()
    loaded = asyncckpt.load(f"{served.base}/model.ackpt")
    assert loaded["step"] == 7 and torch.equal(loaded["w"], _STATE["w"])
    assert torch.equal(loaded["b"], _STATE["b"])
    assert set(served.methods) <= {"GET", "HEAD"}


def test_a_missing_file_over_http_is_not_found(served: Served) -> None:
    with pytest.raises(CheckpointNotFoundError, match=re.escape(f"{served.base}/nothing.ackpt")):
        asyncckpt.load(f"{served.base}/nothing.ackpt")


def test_a_server_without_range_requests_is_a_storage_error(served: Served) -> None:
    asyncckpt.save(_STATE, served.folder / "model.ackpt").result()
    served.ranges = False
    with pytest.raises(StorageError, match="range") as caught:
        asyncckpt.load(f"{served.base}/model.ackpt")
    assert f"{served.base}/model.ackpt" in str(caught.value)
    assert isinstance(caught.value.__cause__, ValueError)  # fsspec's own


def test_saving_to_http_is_refused_at_once(served: Served) -> None:
    url = f"{served.base}/model.ackpt"
    with pytest.raises(StorageError, match="read-only") as caught:
        asyncckpt.save({"w": torch.ones(2)}, url)
    assert url in str(caught.value)
    with (
        pytest.raises(StorageError, match="read-only"),
        asyncckpt.Checkpointer(f"{served.base}/run") as ckpt,
    ):
        ckpt.save(1, {"w": torch.ones(2)}).result()
    assert not {"PUT", "POST", "DELETE"} & set(served.methods)  # nothing was sent
    assert not list(served.folder.iterdir())


def test_a_transport_error_of_hf_is_a_storage_error() -> None:
    pytest.importorskip("huggingface_hub")
    # A port on 127.0.0.1 that is bound and not listening: every connection is refused.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(StorageError, match=r"hf://datasets/someone/data/x\.ackpt") as caught:
            asyncckpt.load(
                "hf://datasets/someone/data/x.ackpt", storage_options={"endpoint": endpoint}
            )
    # The client's own error (httpx's ConnectError; hf's OSError in offline mode).
    assert caught.value.__cause__ is not None
