"""A fake CUDA at asyncckpt's device seam (``asyncckpt._device.Cuda``), for tests without a GPU.

It records every call in order (``calls``: tuples whose first item is the method's name) and
can fail any of them. "CUDA tensors" are CPU tensors the fake was told live on a device
(:meth:`FakeCuda.put`): ``device_of`` answers ``cuda:N`` for them, so a save copies them
through the seam's streams and events, and the file records ``cuda:N``. Copies are done at
once (no kernels run), so the fake shows *that* and *in which order* the engine waits, not
races: a test asserts the order, e.g. the event waited for before ``save`` returned.

Example:
    >>> fake = FakeCuda(devices=4)
    >>> fake.device_of(fake.put(torch.zeros(2), 3))
    device(type='cuda', index=3)
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncckpt._device import Cuda


@dataclass(frozen=True)
class FakeStream:
    """A stream of the fake: which device, which one."""

    device: int
    ident: int


@dataclass(frozen=True)
class FakeEvent:
    """An event recorded on a fake stream."""

    stream: FakeStream
    ident: int


@dataclass
class FakeCuda(Cuda):
    """A recording, failure-injecting CUDA with ``devices`` devices.

    ``fail``: method name -> the exception that call raises. ``sticky``: once a call has
    failed, every later call of a device operation raises the same error (a sticky CUDA
    error: the context is unusable). ``register_fails``: ``register`` returns False (and
    the engine must clear the error). ``bound``: the process group's bound device, ``rank``
    its rank (None: no group). ``free_bytes``: what ``free_memory`` answers for each device
    (none by default: a save page-locks a new arena before copying, as on a full device).
    """

    devices: int = 1
    fail: dict[str, BaseException] = field(default_factory=dict)
    sticky: bool = False
    register_fails: bool = False
    bound: int | None = None
    rank: int | None = None
    free_bytes: int = 0
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        Cuda.__init__(self)
        self._on: dict[int, int] = {}  # storage address -> device index
        self._ids = itertools.count(1)
        self._local = threading.local()
        self._broken: BaseException | None = None
        self.registered: dict[int, tuple[int, int]] = {}  # address -> (size, device)
        self.record_lock = threading.Lock()

    # -- test helpers -----------------------------------------------------------------

    def put(self, t: torch.Tensor, index: int = 0) -> torch.Tensor:
        """Declare ``t`` (and every tensor over its storage) to live on ``cuda:index``."""
        self._on[t.untyped_storage().data_ptr()] = index
        return t

    def mark(self, what: str) -> None:
        """Put a test's own milestone (``"save returned"``) among the calls."""
        self._log(("mark", what))

    def names(self) -> list[str]:
        """The names of the calls so far, marks as ``mark:what``."""
        return [f"mark:{c[1]}" if c[0] == "mark" else c[0] for c in self.calls]

    def _log(self, call: tuple[Any, ...]) -> None:
        with self.record_lock:
            self.calls.append(call)

    def _op(self, name: str, *args: Any) -> None:
        """Record a device operation and raise its injected (or sticky) failure."""
        self._log((name, *args))
        if self._broken is not None:
            raise self._broken
        exc = self.fail.get(name)
        if exc is not None:
            if self.sticky:
                self._broken = exc
            raise exc

    # -- the seam -----------------------------------------------------------------------

    def in_use(self) -> bool:
        return True

    def available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return int(getattr(self._local, "device", 0))

    def bound_device(self) -> int | None:
        return self.bound

    def group_rank(self) -> int | None:
        return self.rank

    def device_of(self, t: torch.Tensor) -> torch.device:
        index = self._on.get(t.untyped_storage().data_ptr())
        return t.device if index is None else torch.device("cuda", index)

    @contextlib.contextmanager
    def _device_block(self, index: int) -> Iterator[None]:
        previous = self.current_device()
        self._local.device = index
        try:
            yield
        finally:
            self._local.device = previous

    def on_device(self, index: int) -> contextlib.AbstractContextManager[Any]:
        return self._device_block(index)

    def set_device(self, index: int) -> None:
        """``torch.cuda.set_device`` of the calling thread."""
        self._local.device = index

    def current_stream(self, index: int) -> FakeStream:
        return FakeStream(index, 0)

    def new_stream(self, index: int) -> FakeStream:
        stream = FakeStream(index, next(self._ids))
        self._log(("new_stream", stream))
        return stream

    def wait_stream(self, stream: Any, producer: Any) -> None:
        self._op("wait_stream", stream, producer)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        self._op("copy_async", stream, src.untyped_storage().data_ptr())
        dst.copy_(src)

    def clone_async(self, src: torch.Tensor, stream: Any) -> torch.Tensor:
        self._op("clone_async", stream, src.untyped_storage().data_ptr())
        return self.put(src.clone(), stream.device)

    def free_memory(self, index: int) -> int:
        self._log(("free_memory", index))
        return self.free_bytes

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        self._op("record_stream", stream, t.untyped_storage().data_ptr())

    def record_event(self, stream: Any) -> FakeEvent:
        self._op("record_event", stream)
        return FakeEvent(stream, next(self._ids))

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self._op("stream_wait_event", stream, event)

    def synchronize_event(self, event: Any) -> None:
        self._op("synchronize_event", event, threading.current_thread().name)

    def synchronize(self, index: int) -> None:
        self._op("synchronize", index)

    def to_device(self, data: torch.Tensor, device: torch.device) -> torch.Tensor:
        self._op("to_device", device, data.numel())
        return self.put(data.clone(), device.index or 0)

    def copy_into(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self._op("copy_into", self.device_of(target), source.numel())
        target.copy_(source)

    def register(self, address: int, size: int) -> bool:
        self._log(("register", self.current_device(), size))
        if self.register_fails:
            self.clear_error()
            return False
        self.registered[address] = (size, self.current_device())
        return True

    def unregister(self, address: int) -> None:
        self._log(("unregister", self.current_device()))
        self.registered.pop(address, None)

    def clear_error(self) -> int:
        self._log(("clear_error",))
        return 0

    def empty(self, shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return torch.empty(shape, dtype=dtype, device=device)
        self._log(("empty", device))
        return self.put(torch.empty(shape, dtype=dtype), device.index or 0)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self._log(("pinned_empty", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)
