"""Test helpers that ship with asyncckpt: fault injection, local S3 servers, conformance.

Usable from any project's tests:

* :mod:`~asyncckpt.testing.faults` — :class:`FaultyFileSystem` (the ``faulty`` fsspec
  protocol) fails, slows or truncates chosen calls of any filesystem following a
  :class:`FaultPlan`; :class:`MemoryS3FileSystem` (``s3mem``) serves the S3 API from
  memory for link simulations.
* :mod:`~asyncckpt.testing.crashpoints` — :class:`CrashStorage` numbers every call through
  a storage and, following a :class:`CrashPlan`, fails one, or stops the process (in
  process, or with SIGKILL) just before one: crash-at-every-step tests.
* :mod:`~asyncckpt.testing.servers` — real S3 servers on loopback: :class:`MotoServer`
  and :class:`SeaweedServer`; :mod:`~asyncckpt.testing.proxy` — :class:`FaultProxy`, an
  HTTP proxy in front of either that holds requests or loses their responses on the wire.
* :mod:`~asyncckpt.testing.conformance` — :class:`StorageConformanceSuite`, the tests
  every :class:`~asyncckpt._storage.Storage` backend passes.

Modules depend downwards only: ``conformance`` and ``servers`` do not import each other,
``proxy`` imports ``servers``, ``faults`` imports ``s3mem`` (its S3 errors) only,
``crashpoints`` none of them.

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
from asyncckpt.testing.crashpoints import CrashPlan, CrashStorage
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
from asyncckpt.testing.proxy import FaultProxy, ProxyRule
from asyncckpt.testing.s3mem import MemoryS3FileSystem
from asyncckpt.testing.servers import (
    FAKE_ACCESS_KEY,
    FAKE_SECRET_KEY,
    LocalS3Server,
    MotoServer,
    SeaweedServer,
    fake_aws_environment,
    find_weed,
)

__all__ = [
    "FAKE_ACCESS_KEY",
    "FAKE_SECRET_KEY",
    "FAULT_KINDS",
    "S3_OPERATIONS",
    "TRANSIENT_KINDS",
    "CrashPlan",
    "CrashStorage",
    "Fault",
    "FaultEvent",
    "FaultPlan",
    "FaultProxy",
    "FaultyFileSystem",
    "LocalS3Server",
    "MemoryS3FileSystem",
    "MotoServer",
    "ProxyRule",
    "SeaweedServer",
    "StorageConformanceSuite",
    "fake_aws_environment",
    "find_weed",
    "random_faults",
]

# The test filesystems are fsspec protocols only where asyncckpt.testing is imported (a
# writer process unpickling one imports it too), not for every user of the package.
for _name, _cls in (("faulty", FaultyFileSystem), ("s3mem", MemoryS3FileSystem)):
    with contextlib.suppress(ValueError):
        fsspec.register_implementation(_name, _cls)
