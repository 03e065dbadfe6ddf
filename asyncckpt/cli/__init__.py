"""The ``asyncckpt`` command: look into, check, clean and convert checkpoints.

Subcommands (``asyncckpt COMMAND --help`` for each)::

    asyncckpt ls ROOT                            versions under a Checkpointer root
    asyncckpt inspect PATH | ROOT[@STEP]         keys, dtypes, shapes, sizes, devices, codecs
    asyncckpt verify PATH | ROOT[@STEP|--all]    read everything, check every checksum
    asyncckpt gc ROOT --keep-last N [--dry-run]  retention, as the Checkpointer applies it
    asyncckpt rewind ROOT STEP --yes             delete the versions newer than STEP
    asyncckpt convert SRC DST                    torch.save <-> asyncckpt <-> safetensors
    asyncckpt bench URL                          sync vs async save and load on your storage

Every command takes local paths or fsspec URLs, ``--storage-option key=value`` (repeatable;
values are parsed as JSON when they can be, dotted keys nest), ``--endpoint-url URL`` (the
aws CLI's flag, ``-o endpoint_url=URL``), ``--json`` for
machine-readable output, ``-v`` for the library's log and ``--debug`` for tracebacks.

Exit status: 0 when the command did what was asked (and, for ``verify``, everything is
sound); 1 when it failed or found damage; 2 for a usage error. Errors are one line on
stderr.

Modules: :mod:`~asyncckpt.cli.main` (parser and entry point), :mod:`~asyncckpt.cli.parsers`
(the parsers of the commands that import torch when they run), one per command, and
:mod:`~asyncckpt.cli.common` (errors, options, output, locating checkpoints).
"""

import importlib
from typing import TYPE_CHECKING, Any

from asyncckpt.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    FORMATS,
    CommandFailed,
    FileRef,
    RootRef,
    UsageError,
    locate,
    parse_storage_options,
    plural,
)
from asyncckpt.cli.main import build_parser, main
from asyncckpt.errors import SafetensorsError

if TYPE_CHECKING:
    from asyncckpt._convert.safetensors import read_safetensors, write_safetensors
    from asyncckpt.cli.formats import format_of, load_ackpt, load_torch, save_ackpt, save_torch
    from asyncckpt.cli.verify import BadChunk, FileReport, verify_file

#: Names whose modules import torch: imported on first use, so ``asyncckpt --help`` does not.
_LAZY = {
    **dict.fromkeys(("read_safetensors", "write_safetensors"), "asyncckpt._convert.safetensors"),
    **dict.fromkeys(
        ("format_of", "load_ackpt", "load_torch", "save_ackpt", "save_torch"),
        "asyncckpt.cli.formats",
    ),
    **dict.fromkeys(("BadChunk", "FileReport", "verify_file"), "asyncckpt.cli.verify"),
}


def __getattr__(name: str) -> Any:
    """The names of :data:`_LAZY`, imported when first used."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncckpt.cli' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "FORMATS",
    "BadChunk",
    "CommandFailed",
    "FileRef",
    "FileReport",
    "RootRef",
    "SafetensorsError",
    "UsageError",
    "build_parser",
    "format_of",
    "load_ackpt",
    "load_torch",
    "locate",
    "main",
    "parse_storage_options",
    "plural",
    "read_safetensors",
    "save_ackpt",
    "save_torch",
    "verify_file",
    "write_safetensors",
]
