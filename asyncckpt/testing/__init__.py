"""What a project that uses asyncckpt, or writes its own storage backend, tests with.

* :mod:`~asyncckpt.testing.faults` — :class:`FaultyFileSystem` (the ``faulty`` fsspec
  protocol) fails, slows or truncates chosen calls of any filesystem following a
  :class:`FaultPlan`.
* :mod:`~asyncckpt.testing.conformance` — :class:`StorageConformanceSuite`, the tests
  every :class:`~asyncckpt._storage.Storage` backend passes (and a new one must).

The local S3 servers, the HTTP fault proxy, the in-memory S3 and the crash-point storage
that asyncckpt's own tests use live with those tests (``tests/servers.py``,
``tests/proxy.py``, ``tests/s3mem.py``, ``tests/crashpoints.py``).
The modules here do not import each other.

Example:
    >>> from asyncckpt.testing import Fault, FaultPlan
    >>> plan = FaultPlan([Fault("put_object", nth=2, kind="slowdown")])
    >>> plan.fired()
    []
"""

from __future__ import annotations

import contextlib

import fsspec

from asyncckpt.testing.conformance import StorageConformanceSuite
from asyncckpt.testing.faults import (
    FAULT_KINDS,
    S3_OPERATIONS,
    TRANSIENT_KINDS,
    Fault,
    FaultEvent,
    FaultPlan,
    FaultyFileSystem,
    random_faults,
)

__all__ = [
    "FAULT_KINDS",
    "S3_OPERATIONS",
    "TRANSIENT_KINDS",
    "Fault",
    "FaultEvent",
    "FaultPlan",
    "FaultyFileSystem",
    "StorageConformanceSuite",
    "random_faults",
]

# The fault filesystem is an fsspec protocol only where asyncckpt.testing is imported (a
# writer process unpickling one imports it too), not for every user of the package.
with contextlib.suppress(ValueError):
    fsspec.register_implementation("faulty", FaultyFileSystem)
