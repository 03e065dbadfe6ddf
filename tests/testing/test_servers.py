"""The test servers themselves: each store's conditional writes, and the fault proxy.

Conditional writes are what asyncckpt's commit rests on, so each store the suite runs on
must have S3's semantics: of many concurrent ``If-None-Match: *`` puts of one key exactly
one succeeds, and ``If-Match`` with a stale ETag is refused (412). The fault proxy must be
transparent when it has no rules, hold a request until released, and lose a response
after the store performed the request.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("botocore")  # absent on a GPU image (scripts/gpu_check.sh collects this)

from botocore.config import Config
from botocore.exceptions import ClientError, ConnectionClosedError
from botocore.session import get_session

from tests.conftest import S3_BUCKET
from tests.proxy import FaultProxy
from tests.servers import FAKE_ACCESS_KEY, FAKE_SECRET_KEY, LocalS3Server, MotoServer, SeaweedServer

RACERS = 16


def client(endpoint_url: str) -> Any:
    """A plain botocore S3 client without retries: every request is sent exactly once."""
    return get_session().create_client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=FAKE_ACCESS_KEY,
        aws_secret_access_key=FAKE_SECRET_KEY,
        region_name="us-east-1",
        config=Config(
            max_pool_connections=RACERS * 2,
            retries={"total_max_attempts": 1},
            connect_timeout=10,
            read_timeout=60,
        ),
    )


def status(exc: ClientError) -> int:
    return int(exc.response["ResponseMetadata"]["HTTPStatusCode"])


@pytest.fixture
def key(s3_root: str) -> str:
    """A fresh key under this test's prefix."""
    return s3_root.removeprefix(f"s3://{S3_BUCKET}/") + "/object"


# -- each store's conditional writes ----------------------------------------------------------


def test_if_none_match_is_atomic(s3_server: Any, key: str) -> None:
    s3 = client(s3_server.endpoint_url)
    barrier = threading.Barrier(RACERS)

    def put(i: int) -> int:
        barrier.wait(30)
        try:
            s3.put_object(Bucket=S3_BUCKET, Key=key, Body=f"writer {i}".encode(), IfNoneMatch="*")
        except ClientError as exc:
            return status(exc)
        return 200

    with ThreadPoolExecutor(RACERS) as ex:
        codes = list(ex.map(put, range(RACERS)))
    assert sorted(codes) == [200] + [412] * (RACERS - 1), codes
    body = s3.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read()
    assert body == f"writer {codes.index(200)}".encode()


def test_if_match_with_a_stale_etag_is_refused(s3_server: Any, key: str) -> None:
    s3 = client(s3_server.endpoint_url)
    stale = s3.put_object(Bucket=S3_BUCKET, Key=key, Body=b"one")["ETag"]
    current = s3.put_object(Bucket=S3_BUCKET, Key=key, Body=b"two")["ETag"]
    assert stale != current
    with pytest.raises(ClientError) as info:
        s3.put_object(Bucket=S3_BUCKET, Key=key, Body=b"three", IfMatch=stale)
    assert status(info.value) == 412
    s3.put_object(Bucket=S3_BUCKET, Key=key, Body=b"four", IfMatch=current)
    assert s3.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read() == b"four"


def test_missing_bucket_is_not_created_on_upload(s3_server: Any) -> None:
    s3 = client(s3_server.endpoint_url)
    with pytest.raises(ClientError) as info:
        s3.put_object(Bucket="asyncckpt-no-such-bucket", Key="k", Body=b"x")
    assert status(info.value) == 404
    names = [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert "asyncckpt-no-such-bucket" not in names


def test_seaweed_server_reports_a_missing_binary() -> None:
    server = SeaweedServer(binary="/nonexistent/weed")
    with pytest.raises(FileNotFoundError, match="weed"):
        server.start()
    server.stop()  # idempotent, and nothing is left running
    assert server.port is None and server.workdir is None


@pytest.mark.timeout(120)
def test_moto_server_is_not_shadowed_by_a_moto_py_in_the_callers_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's script named moto.py (which would start a MotoServer itself: servers
    starting each other without end) is never imported by the server's child."""
    marker = tmp_path / "imported"
    (tmp_path / "moto.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with MotoServer() as server:
        server.create_bucket("shadow-check")
        assert server.filesystem().ls("shadow-check") == []
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moto.py"]  # the child left nothing


# -- the fault proxy --------------------------------------------------------------------------


@pytest.fixture
def proxy(s3_server: LocalS3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server, timeout=30, max_hold_s=60) as p:
        yield p


def exists(s3: Any, key: str) -> bool:
    try:
        s3.head_object(Bucket=S3_BUCKET, Key=key)
    except ClientError as exc:
        assert status(exc) == 404
        return False
    return True


def test_requests_pass_through_unchanged(proxy: FaultProxy, s3_server: Any, key: str) -> None:
    via = client(proxy.endpoint_url)  # signs Host: 127.0.0.1:<proxy port>, passed unchanged
    body = bytes(range(256)) * 4096  # 1 MiB, every byte value
    via.put_object(Bucket=S3_BUCKET, Key=key, Body=body)
    for _ in range(3):  # several requests on one keep-alive connection
        assert via.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read() == body
    ranged = via.get_object(Bucket=S3_BUCKET, Key=key, Range="bytes=10-19")["Body"].read()
    assert ranged == body[10:20]
    assert via.head_object(Bucket=S3_BUCKET, Key=key)["ContentLength"] == len(body)
    direct = client(s3_server.endpoint_url)
    assert direct.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read() == body
    upload = via.create_multipart_upload(Bucket=S3_BUCKET, Key=key + ".mp")["UploadId"]
    via.abort_multipart_upload(Bucket=S3_BUCKET, Key=key + ".mp", UploadId=upload)
    assert ("POST", f"/{S3_BUCKET}/{key}.mp?uploads") in proxy.requests


@pytest.mark.s3_stores("moto")  # unsigned requests: moto does not check signatures
def test_chunked_request_body_passes_byte_for_byte(
    proxy: FaultProxy, s3_server: Any, key: str
) -> None:
    import http.client

    pieces = [b"first piece ", b"", b"x" * 70_000, b"\r\n0\r\n in the data"]
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.putrequest("PUT", f"/{S3_BUCKET}/{key}")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for piece in pieces:
            if piece:  # an empty chunk would end the body
                conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        conn.send(b"0\r\n\r\n")
        response = conn.getresponse()
        response.read()
        assert response.status == 200
    finally:
        conn.close()
    direct = client(s3_server.endpoint_url)
    assert direct.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read() == b"".join(pieces)


def test_s3fs_through_the_proxy(proxy: FaultProxy, key: str) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **proxy.storage_options)
    fs.pipe_file(f"{S3_BUCKET}/{key}", b"through s3fs")
    assert fs.cat_file(f"{S3_BUCKET}/{key}") == b"through s3fs"


def test_held_put_is_not_in_the_store_until_released(
    proxy: FaultProxy, s3_server: Any, key: str
) -> None:
    via, direct = client(proxy.endpoint_url), client(s3_server.endpoint_url)
    rule = proxy.hold("PUT", f"/{key}")
    result: list[Any] = []
    put = threading.Thread(
        target=lambda: result.append(via.put_object(Bucket=S3_BUCKET, Key=key, Body=b"held"))
    )
    put.start()
    try:
        rule.wait_held(timeout=30)
        assert not exists(direct, key)  # the request has reached the proxy, not the store
        assert not result
    finally:
        rule.release()
        put.join(60)
    assert result and result[0]["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert direct.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read() == b"held"
    rule.wait_done(timeout=5)
    assert rule.matched == 1
    via.put_object(Bucket=S3_BUCKET, Key=key, Body=b"again")  # count=1: not held again


def test_hold_matches_query_strings(proxy: FaultProxy, key: str) -> None:
    via = client(proxy.endpoint_url)
    rule = proxy.hold("POST", "?uploads")
    upload: list[str] = []
    start = threading.Thread(
        target=lambda: upload.append(
            via.create_multipart_upload(Bucket=S3_BUCKET, Key=key)["UploadId"]
        )
    )
    start.start()
    try:
        rule.wait_held(timeout=30)
        assert rule.targets == [f"/{S3_BUCKET}/{key}?uploads"]
    finally:
        rule.release()
        start.join(60)
    assert upload
    via.abort_multipart_upload(Bucket=S3_BUCKET, Key=key, UploadId=upload[0])


def test_dropped_response_leaves_the_object_in_the_store(
    proxy: FaultProxy, s3_server: Any, key: str
) -> None:
    via, direct = client(proxy.endpoint_url), client(s3_server.endpoint_url)
    rule = proxy.drop_response("PUT", f"/{key}")
    with pytest.raises(ConnectionClosedError):
        via.put_object(Bucket=S3_BUCKET, Key=key, Body=b"performed, never answered")
    rule.wait_done(timeout=5)
    assert direct.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read() == (
        b"performed, never answered"
    )
    with pytest.raises(ClientError) as info:  # the client's retry would now find it there
        via.put_object(Bucket=S3_BUCKET, Key=key, Body=b"retry", IfNoneMatch="*")
    assert status(info.value) == 412


def test_stop_releases_nothing_and_closes_connections(s3_server: Any, key: str) -> None:
    direct = client(s3_server.endpoint_url)
    with FaultProxy(s3_server, timeout=30) as proxy:
        via = client(proxy.endpoint_url)
        rule = proxy.hold("PUT", f"/{key}")
        errors: list[BaseException] = []

        def put() -> None:
            try:
                via.put_object(Bucket=S3_BUCKET, Key=key, Body=b"never")
            except Exception as exc:
                errors.append(exc)

        thread = threading.Thread(target=put)
        thread.start()
        rule.wait_held(timeout=30)
    thread.join(60)  # stop() closed the held connection: the client is not stuck
    assert not thread.is_alive()
    assert errors and isinstance(errors[0], ConnectionClosedError)
    assert not exists(direct, key)  # a held request is never forwarded once stopped
