"""An HTTP proxy that breaks requests on the wire, in front of a local S3 server.

:class:`FaultProxy` is a forwarding HTTP/1.1 proxy (on ``127.0.0.1``) that holds chosen
requests until a test releases them, or performs them and never answers the client (the
response is lost on the wire), following its :class:`ProxyRule` list. Put it in front of a
:class:`~tests.servers.MotoServer` or
:class:`~tests.servers.SeaweedServer`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

from tests.servers import LocalS3Server

_MAX_HEAD_BYTES = 64 << 10


class PeerClosedError(Exception):
    """The peer closed the connection (or the proxy is stopping)."""


class _Reader:
    """Buffered reads from a socket that keep the exact bytes read, for passing them on."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise PeerClosedError
        self.buf += data

    def until(self, marker: bytes, limit: int = _MAX_HEAD_BYTES) -> bytes:
        while True:
            at = self.buf.find(marker)
            if at >= 0:
                out = bytes(self.buf[: at + len(marker)])
                del self.buf[: at + len(marker)]
                return out
            if len(self.buf) > limit:
                raise PeerClosedError
            self._fill()

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def rest(self) -> bytes:
        """Everything until the peer closes."""
        with contextlib.suppress(PeerClosedError):
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


def _read_body(reader: _Reader, fields: dict[str, str]) -> bytes:
    """The message body as sent (empty without a length or chunked encoding)."""
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
        >>> import threading, fsspec
        >>> from tests.servers import MotoServer
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
                except (PeerClosedError, OSError):
                    return  # the client closed its keep-alive connection, or went idle
                (method, target, *version), fields = _parse_head(head)
                if "100-continue" in fields.get("expect", "").lower():
                    # Answer the client ourselves, to have the whole request before deciding
                    # what to do with it; the store's own 100 Continue is skipped below.
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                request = head + _read_body(reader, fields)
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
        except (PeerClosedError, OSError, ValueError):
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
        if "content-length" not in fields and "transfer-encoding" not in fields:
            return head + reader.rest(), False  # delimited by the upstream closing
        return head + body, keep
