"""asyncckpt: asynchronous, checksummed, atomic checkpoints for PyTorch.

``save`` returns once the state is copied into reused host memory; a background thread
compresses and writes it atomically through fsspec. ``load`` verifies every checksum and
never unpickles.

Example:
    >>> import torch, asyncckpt, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.ackpt")
    >>> handle = asyncckpt.save({"w": torch.ones(2)}, path)
    >>> asyncckpt.wait()
    >>> asyncckpt.load(path)["w"]
    tensor([1., 1.])
"""

import importlib
import logging
from typing import TYPE_CHECKING, Any

from asyncckpt._version import __version__
from asyncckpt.errors import AsyncCkptError

if TYPE_CHECKING:
    from asyncckpt._api.checkpointer import Checkpointer
    from asyncckpt._api.dropin import SaveHandle, SaveInfo, SaveStats, load, reserve, save, wait
    from asyncckpt._api.dropin import open_checkpoint as open
    from asyncckpt._api.jobs import InFlight, in_flight
    from asyncckpt._api.preemption import Preemption
    from asyncckpt._settings import Settings

#: Public names imported on first use: ``import asyncckpt.cli`` (``asyncckpt --help``) and
#: ``asyncckpt.errors`` then run without importing torch (seconds).
_LAZY = {
    "Checkpointer": ("asyncckpt._api.checkpointer", "Checkpointer"),
    "InFlight": ("asyncckpt._api.jobs", "InFlight"),
    "in_flight": ("asyncckpt._api.jobs", "in_flight"),
    "open": ("asyncckpt._api.dropin", "open_checkpoint"),
    "Preemption": ("asyncckpt._api.preemption", "Preemption"),
    "Settings": ("asyncckpt._settings", "Settings"),
    **{
        name: ("asyncckpt._api.dropin", name)
        for name in ("SaveHandle", "SaveInfo", "SaveStats", "load", "reserve", "save", "wait")
    },
}

# A library prints nothing unless the application configures logging.
logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    """``asyncckpt.save`` and the other public names, imported when first used."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'asyncckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(where[0]), where[1])
    globals()[name] = value  # later lookups skip this function
    return value


__all__ = [
    "AsyncCkptError",
    "Checkpointer",
    "InFlight",
    "Preemption",
    "SaveHandle",
    "SaveInfo",
    "SaveStats",
    "Settings",
    "__version__",
    "in_flight",
    "load",
    "open",
    "reserve",
    "save",
    "wait",
]
