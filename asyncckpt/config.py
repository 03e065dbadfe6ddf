"""Tunables, in one place.

Each value is resolved as: explicit argument > ``ASYNCCKPT_<NAME>`` environment variable >
the default below. Resolution happens when a save or load starts, so changing the
environment between calls takes effect on the next call.

Example:
    >>> from asyncckpt.config import tunable
    >>> tunable("zstd_level", None)
    1
"""

from __future__ import annotations

import os
from typing import Final

#: name -> (default, help). Integers only: every tunable here is a count or a size.
DEFAULTS: Final[dict[str, tuple[int, str]]] = {
    "chunk_bytes": (16 << 20, "raw bytes per chunk; each chunk is compressed and checked alone"),
    "threads": (
        max(2, min(8, os.cpu_count() or 2)),
        "worker threads for compression, checksums and reads (zstd and I/O release the GIL)",
    ),
    "zstd_level": (
        1,
        "zstandard level; at 1, float byte planes use settings tuned for them (docs/FORMAT.md)",
    ),
    "inflight_chunks": (8, "chunks compressed ahead of the writer (bounds extra memory)"),
    "max_inflight": (1, "saves whose snapshots may be held at once; each holds one host arena"),
    "pin_budget_bytes": (
        1 << 30,
        "bytes of host memory one load may pin for copies to CUDA; storages past it are "
        "read into pageable memory",
    ),
    # The writer lease (docs/PROTOCOL.md, "Roles and the writer lease").
    "lease_renew_ms": (5_000, "how often a writer rewrites its lease record (its heartbeat)"),
    "lease_expiry_ms": (
        60_000,
        "a reader waiting for a step gives up when the writer's lease has not changed for "
        "this long (the writer died or froze)",
    ),
    "lock_timeout_ms": (
        60_000,
        "local and POSIX filesystems: how long to wait for the version file's lock",
    ),
    # Object stores (S3 through s3fs; see docs/s3.md).
    "part_bytes": (
        8 << 20,
        "object stores: bytes per multipart part (S3 needs at least 5 MiB); smaller files "
        "are one PUT",
    ),
    "part_concurrency": (
        8,
        "object stores: parts of one file uploaded in parallel; a writer buffers at most "
        "(part_concurrency + 1) x part_bytes",
    ),
    "retry_attempts": (
        6,
        "object stores: attempts per request on throttling (503 SlowDown), 5xx, resets and "
        "timeouts",
    ),
    "retry_deadline_s": (120, "object stores: stop retrying a request after this many seconds"),
    "retry_backoff_ms": (
        100,
        "object stores: delay before the first retry; doubles per attempt (at most 10 s), "
        "with jitter",
    ),
}


def tunable(name: str, value: int | None) -> int:
    """Resolve one tunable.

    Args:
        name: a key of :data:`DEFAULTS`.
        value: the caller's explicit value, or None to fall back to the environment
            variable ``ASYNCCKPT_<NAME>`` and then the default.

    Returns:
        The resolved positive integer.

    Raises:
        ValueError: the name is unknown, or the value is not a positive integer.
    """
    if name not in DEFAULTS:
        raise ValueError(f"unknown tunable {name!r}; known: {sorted(DEFAULTS)}")
    source = "argument"
    if value is None:
        env = os.environ.get(f"ASYNCCKPT_{name.upper()}")
        if env is None:
            return DEFAULTS[name][0]
        source = f"environment variable ASYNCCKPT_{name.upper()}"
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{source}={env!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"tunable {name} must be a positive integer, got {value} from {source}")
    return value
