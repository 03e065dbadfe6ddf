"""Where loaded tensors go: ``map_location`` rules, including asyncckpt's default.

The default differs from ``torch.load`` on purpose. ``torch.load`` puts a tensor saved from
``cuda:3`` back on ``cuda:3``; in data-parallel training every rank saved from its own GPU, so
all ranks loading rank 0's file pile onto rank 0's GPU. asyncckpt's default places CPU tensors
on the CPU and accelerator tensors on the *loading* process's current device, which is what
each rank wants. Without CUDA, CUDA tensors load on the CPU with one warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeAlias

import torch

from asyncckpt.errors import AsyncCkptWarning, DeviceUnavailableError

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
    renamed = torch._C._get_privateuse1_backend_name()
    return DEVICE_TYPES | {renamed}


def known_device(saved: str) -> bool:
    """Whether a device string read from a file, ``type`` or ``type:index``, names a type
    from :func:`device_types`.

    Example:
        >>> known_device("cuda:1"), known_device("_dynamo:0"), known_device("cpu:x")
        (True, False, False)
    """
    kind, _, index = saved.partition(":")
    return kind in device_types() and (not index or (index.isdigit() and index.isascii()))


def _explicit_targets(map_location: MapLocation) -> list[str | torch.device]:
    """The devices ``map_location`` names as destinations (a callable names none)."""
    if isinstance(map_location, (str, torch.device)):
        return [map_location]
    if isinstance(map_location, Mapping):
        return [v for v in map_location.values() if isinstance(v, (str, torch.device))]
    return []


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
    try:
        device = torch.device(where)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"map_location={where!r} is not a device: {exc}") from None
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
        for where in _explicit_targets(map_location):
            check_available(where)
        self.map_location = map_location
        self._warned = False
        self._cuda_devices: set[torch.device] = set()

    def device_for(self, saved: str) -> torch.device:
        """The device a storage saved on ``saved`` goes to (callables aside)."""
        loc = self.map_location
        if isinstance(loc, Mapping):
            loc = loc.get(saved)
        if isinstance(loc, (str, torch.device)):
            return torch.device(loc)
        return self._default(saved)

    def _default(self, saved: str) -> torch.device:
        kind = saved.split(":")[0]
        if kind == "cpu":
            return torch.device("cpu")
        if kind == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
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
            return data
        device = self.device_for(saved)
        if device.type == "cpu":
            return data
        if device.type == "cuda":
            self._cuda_devices.add(device)
            return data.to(device, non_blocking=data.is_pinned())
        return data.to(device)

    def synchronize(self) -> None:
        """Wait for the asynchronous host-to-device copies started by :meth:`place`."""
        for device in self._cuda_devices:
            torch.cuda.synchronize(device)
        self._cuda_devices.clear()
