"""Object stores: the s3fs filesystem as :class:`~asyncckpt._storage.S3Storage` uses it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from asyncckpt._settings import Settings
    from asyncckpt._storage.s3retry import Attempts
    from asyncckpt.errors import AsyncCkptError

T = TypeVar("T")

#: fsspec protocols that :func:`asyncckpt._storage.resolve` routes to an object store.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a"})


class ObjectClient(Protocol):
    """What the store's helpers (listing, multipart upload, ranged reads) call back into:
    :class:`~asyncckpt._storage.s3.S3Storage`, which they would otherwise import in a circle.
    """

    fs: Any
    settings: Settings

    @staticmethod
    def split(path: str) -> tuple[str, str]: ...

    def describe(self, path: str) -> str: ...

    def request(
        self, action: str, path: str, fn: Callable[[], T], attempts: Attempts | None = None
    ) -> T: ...

    def call(
        self, action: str, path: str, method: str, attempts: Attempts | None = None, **kwargs: Any
    ) -> dict[str, Any]: ...

    def put(
        self, path: str, data: bytes | bytearray, attempts: Attempts | None = None, **kwargs: Any
    ) -> dict[str, Any]: ...

    def head(self, path: str) -> dict[str, Any] | None: ...

    def not_found(self, path: str) -> AsyncCkptError: ...

    def abort_uploads(self, path: str, *, exact: bool = False, keep: str | None = None) -> int: ...


def is_object_store(fs: Any) -> bool:
    """Whether ``fs`` is (or wraps, like ``faulty::s3``) an S3-API object store."""
    wraps = getattr(fs, "wraps_object_store", None)
    if wraps is not None:
        return bool(wraps)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & OBJECT_STORE_PROTOCOLS) and callable(getattr(fs, "call_s3", None))


def single_retry_layer(fs: Any) -> None:
    """Switch off s3fs's own retry loop (``retries``) under this module's.

    Two layers of retries hide lost responses from the one that decides: a ``PutObject``
    whose response was lost and that s3fs retried returns 412 to us as if another writer
    had won. With one layer, :meth:`S3Storage.request` sees every try.
    """
    current, depth = fs, 0
    while current is not None and depth < 4:
        if type(getattr(type(current), "retries", None)) is int:
            current.retries = 1
        current, depth = getattr(current, "fs", None), depth + 1


def prepare_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Storage options for ``url`` with asyncckpt's defaults for S3 filled in: botocore's
    retries off unless the caller configured them (:class:`S3Storage`'s policy alone
    decides), a connection pool sized for parallel parts and reads."""
    chain = [p.split("://", 1)[0] for p in url.split("::")]
    protocol = chain[-1] if len(chain) > 1 else chain[0]
    if protocol not in OBJECT_STORE_PROTOCOLS:
        return options
    out = dict(options)
    if len(chain) > 1:
        target = dict(out.get(protocol) or {})
        out[protocol] = target
    else:
        target = out
    kwargs = dict(target.get("config_kwargs") or {})
    kwargs.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    kwargs.setdefault("max_pool_connections", 64)
    target["config_kwargs"] = kwargs
    return out
