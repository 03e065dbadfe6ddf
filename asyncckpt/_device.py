"""The device seam: where loaded tensors go, and every CUDA call asyncckpt makes.

Two parts. :class:`Placement` decides where each loaded storage goes (``map_location``
rules, including asyncckpt's default). :class:`Cuda` is the only place the package calls
``torch.cuda`` (device choice, streams, events, page-locking, error clearing): the rest of
the package asks :func:`cuda` for it, and tests swap in a recording fake with
:func:`use_cuda` (``tests/fake_cuda.py``), which makes the ordering of a save's copies
observable without a GPU.

The default placement differs from ``torch.load`` on purpose. ``torch.load`` puts a tensor
saved from ``cuda:3`` back on ``cuda:3``; in data-parallel training every rank saved from its
own GPU, so all ranks loading rank 0's file pile onto rank 0's GPU. asyncckpt's default puts
CUDA tensors on the loading process's *own* device (:meth:`Cuda.own_device`), CPU tensors on
the CPU, and CUDA tensors on the CPU (warned once) where there is no CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeAlias

import torch
import torch.distributed as dist

from asyncckpt import _threads as workers
from asyncckpt.errors import AsyncCkptWarning, DeviceUnavailableError

log = logging.getLogger(__name__)

MapLocation: TypeAlias = (
    str | torch.device | Mapping[str, str | torch.device] | Callable[..., Any] | None
)


#: Device types a file may name. Each is a real torch device type; the accelerator
#: modules among them (``torch.cuda``, ``torch.mps``, ``torch.xpu``...) are looked up by
#: name, so a name outside this set must never reach ``getattr(torch, ...)``.
DEVICE_TYPES: Final = frozenset(
    {"cpu", "cuda", "mps", "xpu", "meta", "hpu", "mtia", "xla", "privateuseone"}
)


def device_types() -> frozenset[str]:
    """:data:`DEVICE_TYPES` plus the name a PrivateUse1 backend registered in this process.

    Example:
        >>> "cuda" in device_types() and "_dynamo" not in device_types()
        True
    """
    return DEVICE_TYPES | {torch._C._get_privateuse1_backend_name()}


def known_device(saved: str) -> bool:
    """Whether a device string read from a file, ``type`` or ``type:index``, names a type
    from :func:`device_types`.

    Example:
        >>> known_device("cuda:1"), known_device("_dynamo:0"), known_device("cpu:x")
        (True, False, False)
    """
    kind, _, index = saved.partition(":")
    return kind in device_types() and (not index or (index.isdigit() and index.isascii()))


def _check_targets(map_location: MapLocation) -> None:
    """Refuse at once a destination that is no device, or a single one that is not here.

    A dict's destinations are checked for availability only when a storage maps there
    (:meth:`Placement.device_for`): ``torch.load`` ignores entries no tensor uses, and a
    job's ``{"cuda:1": "cuda:0"}`` must still load CPU tensors on a machine without CUDA.
    """
    if isinstance(map_location, (str, torch.device)):
        check_available(map_location)
    elif isinstance(map_location, Mapping):
        for where in map_location.values():
            if isinstance(where, (str, torch.device)):
                _parse_device(where)


def check_available(where: str | torch.device) -> None:
    """Refuse a ``map_location`` destination this machine cannot put tensors on.

    Raises:
        DeviceUnavailableError: its type is an accelerator that is not available here, or
            its index is past the devices there are; the message says how to load to CPU.
        ValueError: ``where`` is not a device at all.

    Example:
        >>> check_available("cpu")
        >>> check_available("gpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: map_location='gpu' is not a device: ...
    """
    device = _parse_device(where)
    kind = device.type
    if kind in ("cpu", "meta") or kind not in DEVICE_TYPES:
        return  # always there, or a backend (PrivateUse1, XLA) that torch itself checks
    module = getattr(torch, kind, None)
    available = getattr(module, "is_available", None)
    if not callable(available):
        return
    label = "CUDA" if kind == "cuda" else kind
    fix = "load to the CPU with map_location='cpu'"
    if not available():
        build = (
            " (this torch build has no CUDA)" if kind == "cuda" and not torch.version.cuda else ""
        )
        raise DeviceUnavailableError(
            f"map_location={where!r}: {label} is not available on this machine{build}; {fix}"
        )
    count = getattr(module, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise DeviceUnavailableError(
            f"map_location={where!r}: this machine has {count()} {label} device(s), "
            f"{kind}:0 to {kind}:{count() - 1}; pick one of them, or {fix}"
        )


def _parse_device(where: str | torch.device) -> torch.device:
    """``torch.device(where)``, or a ValueError naming ``map_location``."""
    try:
        return torch.device(where)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"map_location={where!r} is not a device: {exc}") from None


# ------------------------------------------------------------------ the CUDA seam


class Cuda:
    """Every ``torch.cuda`` call asyncckpt makes, and the own-device rule built on them.

    The methods are primitives (one CUDA runtime call each, no policy), so that a fake
    (``tests/fake_cuda.py``) can record them in order and fail any of them, while the policy
    (:meth:`own_device`, ``_engine/snapshot.py``, ``_engine/arena.py``) runs unchanged.

    Example:
        >>> cuda().device_of(torch.zeros(1))
        device(type='cpu')
    """

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    # -- devices ----------------------------------------------------------------------

    def in_use(self) -> bool:
        """Whether this process has initialized CUDA (it holds CUDA tensors if it has
        any); unlike ``is_available`` this never initializes the driver."""
        return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]

    def available(self) -> bool:
        """Whether a CUDA device can be used (initializes the driver: not on CPU paths).

        False in a child forked from a process that had initialized CUDA: CUDA cannot be
        re-initialized there ("Cannot re-initialize CUDA in forked subprocess")."""
        if torch.cuda._is_in_bad_fork():  # type: ignore[no-untyped-call]
            return False
        return bool(torch.cuda.is_available())

    def device_count(self) -> int:
        """How many CUDA devices this process sees."""
        return int(torch.cuda.device_count())

    def current_device(self) -> int:
        """The calling thread's current device (0 unless ``set_device`` chose another)."""
        return int(torch.cuda.current_device())

    def bound_device(self) -> int | None:
        """The device ``init_process_group(device_id=...)`` bound the default group to, if any."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
        return None if bound is None or bound.index is None else int(bound.index)

    def group_rank(self) -> int | None:
        """This process's rank in the default process group (None: no group)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return int(dist.get_rank())

    def device_of(self, t: torch.Tensor) -> torch.device:
        """The device ``t``'s data lives on."""
        return t.device

    def on_device(self, index: int) -> contextlib.AbstractContextManager[Any]:
        """Make ``index`` the calling thread's current device for a block."""
        return torch.cuda.device(index)

    def own_device(self) -> int:
        """This process's own CUDA device: the rule of every default placement.

        In order: the process group's bound device; one set with ``torch.cuda.set_device``
        (not 0); ``LOCAL_RANK``; the group rank modulo the device count (``mp.spawn`` on one
        node, as the DDP tutorial does: warned, as it assumes one node); the current device.
        """
        bound = self.bound_device()
        if bound is not None:
            return bound
        current = self.current_device()
        count = self.device_count()
        if count <= 1 or current != 0:
            return current
        local = os.environ.get("LOCAL_RANK", "")
        if local.isdigit() and local.isascii():
            if int(local) < count:
                return int(local)
            self._warn_once(
                "local",
                f"LOCAL_RANK={local} but {count} CUDA devices are visible; using "
                f"cuda:{int(local) % count}; call torch.cuda.set_device to choose",
            )
            return int(local) % count
        rank = self.group_rank()
        if rank is not None:
            self._warn_once(
                "rank",
                f"no CUDA device chosen (torch.cuda.set_device) and no LOCAL_RANK: "
                f"asyncckpt takes cuda:{rank % count} (process-group rank {rank} modulo "
                f"{count} devices), which assumes one node; call torch.cuda.set_device(...) "
                "to choose",
            )
            return rank % count
        self._warn_once(
            "current",
            f"{count} CUDA devices, none chosen (torch.cuda.set_device, "
            "LOCAL_RANK, a process group): asyncckpt uses the current device, cuda:0",
        )
        return current

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, AsyncCkptWarning, stacklevel=3)

    # -- streams and events -----------------------------------------------------------

    def current_stream(self, index: int) -> Any:
        """The current stream of device ``index`` (where the caller's kernels run)."""
        return torch.cuda.current_stream(index)

    def copy_stream(self, index: int) -> Any:
        """asyncckpt's one copy stream on device ``index``, created once per process: pool
        streams are shared round-robin with other libraries (NCCL among them)."""
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = self.new_stream(index)
            return stream

    def new_stream(self, index: int) -> Any:
        """A new stream on device ``index`` (only :meth:`copy_stream` makes one)."""
        return torch.cuda.Stream(index)  # type: ignore[no-untyped-call]

    def wait_stream(self, stream: Any, producer: Any) -> None:
        """Make ``stream`` wait (on the device) for the work queued on ``producer``."""
        stream.wait_stream(producer)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` without waiting for it."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def clone_async(self, src: torch.Tensor, stream: Any) -> torch.Tensor:
        """A copy of the 1-D ``src`` in memory of its own device, queued on ``stream`` (and
        allocated for it: only that stream uses it)."""
        with torch.cuda.stream(stream):
            out = torch.empty(src.numel(), dtype=src.dtype, device=src.device)
            out.copy_(src, non_blocking=True)
        return out

    def free_memory(self, index: int) -> int:
        """Bytes free on device ``index`` (``cudaMemGetInfo``: outside torch's cache)."""
        return int(torch.cuda.mem_get_info(index)[0])

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """Keep the allocator from reusing ``t``'s memory before ``stream``'s queued work."""
        t.record_stream(stream)

    def record_event(self, stream: Any) -> Any:
        """An event marking the end of the work queued on ``stream`` so far."""
        return stream.record_event()

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait (on the device, the host goes on) for ``event``."""
        stream.wait_event(event)

    def synchronize_event(self, event: Any) -> None:
        """Block the host until ``event`` has happened."""
        event.synchronize()

    def synchronize(self, index: int) -> None:
        """Block the host until device ``index`` is idle."""
        torch.cuda.synchronize(index)

    # -- host memory ------------------------------------------------------------------

    def to_device(self, data: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of host ``data`` on ``device`` (asynchronous from pinned memory)."""
        return data.to(device, non_blocking=data.is_pinned())

    def copy_into(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)``: host to device, asynchronous from pinned memory."""
        target.copy_(source, non_blocking=source.is_pinned())

    def register(self, address: int, size: int) -> bool:
        """Page-lock host memory for the current device (``cudaHostRegister``, exact size:
        not the caching host allocator, which rounds up to a power of two and keeps it).

        A failure leaves the runtime's last error set, which the next kernel launch of
        the caller's training would raise as its own: it is cleared here.
        """
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        if int(cudart.cudaHostRegister(address, size, 0)) == 0:
            return True
        self.clear_error()
        return False

    def unregister(self, address: int) -> None:
        """Undo :meth:`register` (on the device it was registered on)."""
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        if int(cudart.cudaHostUnregister(address)) != 0:
            self.clear_error()

    def clear_error(self) -> int:
        """Reset this thread's last CUDA runtime error (``cudaGetLastError``); returns it,
        or -1 where the runtime library is not loaded."""
        library = _cudart_library()
        return -1 if library is None else int(library.cudaGetLastError())

    def empty(self, shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``torch.empty`` on ``device`` (any device; the fake makes its CUDA ones).

        Made as bytes and viewed: under ``torch.use_deterministic_algorithms(True)``
        ``torch.empty`` fills the tensor, which torch cannot do for every dtype (float4).
        """
        size = torch.Size(shape)
        raw = torch.empty(size.numel() * dtype.itemsize, dtype=torch.uint8, device=device)
        return raw.view(dtype).reshape(size)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer from torch's caching host allocator (the fallback)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


def _cudart_library() -> Any:
    """The CUDA runtime torch has loaded (``RTLD_NOLOAD``: never a second copy), or None."""
    mode = getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL
    for name in _CUDART_NAMES:
        try:
            return ctypes.CDLL(name, mode=mode)
        except OSError:
            continue
    log.debug("no CUDA runtime library loaded: the last CUDA error is left as it is")
    return None


_cuda: Cuda = Cuda()


def cuda() -> Cuda:
    """The process's CUDA seam (a fake one in tests: :func:`use_cuda`).

    Example:
        >>> isinstance(cuda(), Cuda)
        True
    """
    return _cuda


def use_cuda(backend: Cuda) -> Cuda:
    """Make ``backend`` the process's CUDA seam; return the previous one (to restore).

    Example:
        >>> previous = use_cuda(Cuda())
        >>> _ = use_cuda(previous)
    """
    global _cuda
    previous, _cuda = _cuda, backend
    return previous


@workers.after_fork_in_child
def _forget_parent_streams() -> None:
    """A forked child cannot use its parent's CUDA streams (nor CUDA at all)."""
    global _cuda
    if type(_cuda) is Cuda:
        _cuda = Cuda()


class Placement:
    """Decides the device of each storage from its saved device string.

    Example:
        >>> Placement("cpu").device_for("cuda:1")
        device(type='cpu')
    """

    def __init__(self, map_location: MapLocation) -> None:
        if not (
            map_location is None
            or isinstance(map_location, (str, torch.device, Mapping))
            or callable(map_location)
        ):
            raise TypeError(
                "map_location must be None, a str, a torch.device, a dict of locations or a "
                f"callable, not {type(map_location).__qualname__}"
            )
        _check_targets(map_location)
        self.map_location = map_location
        self._warned = False
        self._cuda_devices: set[torch.device] = set()
        self._checked: set[str | torch.device] = set()  # dict destinations found here

    def device_for(self, saved: str) -> torch.device:
        """The device a storage saved on ``saved`` goes to (callables aside)."""
        loc = self.map_location
        if isinstance(loc, Mapping):
            loc = loc.get(saved)
            if isinstance(loc, (str, torch.device)) and loc not in self._checked:
                check_available(loc)  # only now: torch ignores the entries nothing uses
                self._checked.add(loc)
        if isinstance(loc, (str, torch.device)):
            return torch.device(loc)
        return self._default(saved)

    def _default(self, saved: str) -> torch.device:
        kind = saved.split(":")[0]
        if kind == "cpu":
            return torch.device("cpu")
        if kind == "cuda" and cuda().available():
            return torch.device("cuda", cuda().own_device())
        if kind != "cuda" and known_device(saved):
            module = getattr(torch, kind, None)  # only allow-listed names: never torch._dynamo
            available = getattr(module, "is_available", None)
            current = getattr(module, "current_device", None)
            if callable(available) and callable(current) and available():
                return torch.device(kind, current())
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"tensors saved on {saved} are loaded on the CPU because {kind} is not "
                "available here; pass map_location to choose explicitly",
                AsyncCkptWarning,
                stacklevel=4,
            )
        return torch.device("cpu")

    def _is_callable(self) -> bool:
        return callable(self.map_location) and not isinstance(self.map_location, Mapping)

    def wants_pinned(self, saved: str) -> bool:
        """Whether a storage saved on ``saved`` should be read into pinned memory."""
        return not self._is_callable() and self.device_for(saved).type == "cuda"

    def place(self, data: torch.Tensor, saved: str) -> torch.Tensor:
        """Move a CPU uint8 storage buffer to its target device.

        Copies from pinned buffers are asynchronous; call :meth:`synchronize` before use.
        """
        if self._is_callable():
            result = self.map_location(data.untyped_storage(), saved)  # type: ignore[operator,misc]
            if isinstance(result, torch.UntypedStorage):
                return torch.empty(0, dtype=torch.uint8, device=result.device).set_(result)
            if result is None and saved.startswith("cuda") and cuda().available():
                return self._to_cuda(data, torch.device(saved))  # torch.load: where saved
            return data
        device = self.device_for(saved)
        if device.type == "cpu":
            return data
        if device.type == "cuda":
            return self._to_cuda(data, device)
        return data.to(device)

    def _to_cuda(self, data: torch.Tensor, device: torch.device) -> torch.Tensor:
        self._cuda_devices.add(device)
        return cuda().to_device(data, device)

    def copy_into(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)``; from host memory into a CUDA ``target`` directly, and
        asynchronously from pinned memory (call :meth:`synchronize` before use)."""
        device = cuda().device_of(target)
        if device.type == "cuda" and cuda().device_of(source).type == "cpu":
            self._cuda_devices.add(device)
            cuda().copy_into(target, source)
            return
        target.copy_(source)

    def synchronize(self) -> None:
        """Wait for the host-to-device copies that :meth:`place` and :meth:`copy_into` started."""
        for device in self._cuda_devices:
            cuda().synchronize(device.index if device.index is not None else 0)
        self._cuda_devices.clear()
