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

import logging

from asyncckpt._api.checkpointer import Checkpointer
from asyncckpt._api.dropin import SaveHandle, SaveInfo, SaveStats, load, reserve, save, wait
from asyncckpt._api.dropin import open_checkpoint as open
from asyncckpt._version import __version__
from asyncckpt.errors import AsyncCkptError

# A library prints nothing unless the application configures logging.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AsyncCkptError",
    "Checkpointer",
    "SaveHandle",
    "SaveInfo",
    "SaveStats",
    "__version__",
    "load",
    "open",
    "reserve",
    "save",
    "wait",
]
