"""Object stores: what a failed request means, how it is retried, and what a message may say."""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    ConflictError,
    RangeNotSatisfiable,
    StorageError,
)

_MAX_BACKOFF_S = 10.0

_RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ConditionalRequestConflict",
        "OperationAborted",
    }
)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_RETRY_ERRNOS = frozenset(
    {errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE}
    | ({errno.EREMOTEIO} if hasattr(errno, "EREMOTEIO") else set())
)


@dataclass(frozen=True)
class Failure:
    """What a backend exception means: its kind, S3 code and HTTP status if known."""

    kind: str  # retry | conflict | missing | no-bucket | range | fatal
    code: str | None
    status: int | None
    message: str


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 8:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _response(exc: BaseException) -> dict[str, Any] | None:
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):
            return response
    return None


@functools.cache
def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError, asyncio.TimeoutError]
    try:
        from botocore import exceptions as bce

        types += [bce.HTTPClientError, bce.IncompleteReadError]
        if hasattr(bce, "ResponseStreamingError"):
            types.append(bce.ResponseStreamingError)
    except ImportError:
        pass
    try:
        import aiohttp

        types.append(aiohttp.ClientError)
    except ImportError:
        pass
    return tuple(types)


def classify(exc: BaseException) -> Failure:
    """Decide what a backend exception means for the retry loop.

    Example:
        >>> classify(ConnectionResetError(104, "Connection reset by peer")).kind
        'retry'
        >>> classify(PermissionError("Access Denied")).kind
        'fatal'
    """
    response = _response(exc)
    if response is not None:
        error = response.get("Error") or {}
        code = error.get("Code") or None
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        message = str(error.get("Message") or exc)
        if code in _RETRY_CODES or status in _RETRY_STATUS:
            return Failure("retry", code, status, message)
        if code == "PreconditionFailed" or status == 412:
            return Failure("conflict", code, status, message)
        if code == "InvalidRange" or status == 416:
            return Failure("range", code, status, message)
        if code == "NoSuchBucket":
            return Failure("no-bucket", code, status, message)
        if code in ("NoSuchKey", "NoSuchUpload", "NotFound") or status == 404:
            return Failure("missing", code, status, message)
        return Failure("fatal", code, status, message)
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, _transient_types()):
        return Failure("retry", None, None, message)
    if isinstance(exc, FileNotFoundError):
        return Failure("missing", None, None, message)
    if isinstance(exc, FileExistsError):
        return Failure("conflict", None, None, message)
    if isinstance(exc, OSError) and exc.errno in _RETRY_ERRNOS:
        return Failure("retry", None, None, message)
    return Failure("fatal", None, None, message)


def is_denied(exc: BaseException) -> bool:
    """Whether a request failed with 403 Access Denied (as its chained cause says)."""
    cause = exc.__cause__
    return cause is not None and (
        isinstance(cause, PermissionError) or classify(cause).status == 403
    )


_CREDENTIAL_PATTERNS = (
    (re.compile(r"\b(AKIA|ASIA|AROA|AIDA)[A-Z0-9]{12,}\b"), r"\1****"),
    (re.compile(r"(Signature=)[0-9a-fA-F]{16,}"), r"\1****"),
    (re.compile(r"(Credential=)[^\s,/&]+"), r"\1****"),
    (re.compile(r"(X-Amz-Security-Token=)[^\s&]+", re.IGNORECASE), r"\1****"),
    (re.compile(r"(aws_secret_access_key\s*[=:]\s*)\S+", re.IGNORECASE), r"\1****"),
)
_SECRET_FIELD = re.compile(r"key|secret|token|password|credential", re.IGNORECASE)


def _collect_secrets(value: Any, out: set[str], field: str = "", depth: int = 0) -> None:
    if depth > 4:
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _collect_secrets(v, out, str(k), depth + 1)
    elif isinstance(value, str) and _SECRET_FIELD.search(field) and len(value) >= 4:
        out.add(value)


def secrets_of(fs: Any) -> tuple[str, ...]:
    """Credential strings that ``fs`` (or a filesystem it wraps) or the environment holds."""
    found: set[str] = set()
    current, depth = fs, 0
    while current is not None and depth < 4:
        for attr in ("key", "secret", "token"):
            value = getattr(current, attr, None)
            if isinstance(value, str) and len(value) >= 4:
                found.add(value)
        _collect_secrets(getattr(current, "storage_options", None), found)
        current, depth = getattr(current, "fs", None), depth + 1
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        value = os.environ.get(name, "")
        if len(value) >= 4:
            found.add(value)
    return tuple(sorted(found, key=len, reverse=True))


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with every secret and credential-shaped substring replaced by ``****``.

    Example:
        >>> redact("key AKIAABCDEFGHIJKLMNOP and hunter22", ("hunter22",))
        'key AKIA**** and ****'
    """
    for secret in secrets:
        text = text.replace(secret, "****")
    for pattern, replacement in _CREDENTIAL_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def leaks(exc: BaseException, secrets: tuple[str, ...]) -> bool:
    for e in _chain(exc):
        texts = [str(e), repr(getattr(e, "response", ""))]
        if any(redact(t, secrets) != t for t in texts):
            return True
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How a request is retried: at most ``attempts`` tries within ``deadline_s`` seconds.

    The delay before retry ``n`` (1-based) is drawn uniformly from ``[d/2, d]`` with
    ``d = min(10 s, backoff_s * 2**(n-1))`` ("equal jitter").
    """

    attempts: int
    deadline_s: float
    backoff_s: float

    def delay(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        cap = min(_MAX_BACKOFF_S, self.backoff_s * 2.0 ** (retry - 1))
        return cap / 2 + rng.uniform(0, cap / 2)


@dataclass(eq=False)
class Attempts:
    """Counts the tries of one logical request (to recognise an ambiguous retry)."""

    count: int = 0
    failed_transiently: bool = False


def request_error(
    where: str,
    bucket: str,
    key: str,
    action: str,
    exc: BaseException,
    failure: Failure,
    tries: int,
    secrets: tuple[str, ...],
) -> AsyncCkptError:
    """The asyncckpt error for a request that failed for good, naming ``where`` (the file
    as a user writes it), its bucket and key, and never a credential: a message that held
    one is redacted, and a cause that held one is not chained.
    """
    what = failure.code or ""
    if failure.status:
        what = f"{what} (HTTP {failure.status})".strip()
    detail = f"{what}: {failure.message}" if what else failure.message
    after = f" after {tries} attempts" if tries > 1 else ""
    err: AsyncCkptError
    if failure.kind == "no-bucket":
        err = StorageError(f"{where}: {action} failed: bucket {bucket!r} does not exist ({detail})")
    elif failure.kind == "missing":
        err = CheckpointNotFoundError(f"{where}: no such object ({detail})")
    elif failure.kind == "conflict":
        err = ConflictError(f"{where} already exists ({detail})")
    elif failure.kind == "range":
        err = RangeNotSatisfiable(f"{where}: {action}: {detail}")
    else:
        hint = ""
        if failure.status == 403 or isinstance(exc, PermissionError):
            hint = (
                f"; check the credentials and that they may {action.split()[0]} "
                f"key {key!r} in bucket {bucket!r}"
            )
        elif failure.kind == "retry":
            hint = " (transient errors persisted; see the retry_* tunables)"
        err = StorageError(f"{where}: {action} failed{after}: {detail}{hint}")
    message = redact(str(err), secrets)
    if message != str(err):
        err.args = (message,)
    if leaks(exc, secrets):
        err.__cause__ = None
        err.__suppress_context__ = True
    else:
        err.__cause__ = exc
    return err
