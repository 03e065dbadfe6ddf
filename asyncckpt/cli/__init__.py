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
values are parsed as JSON when they can be, dotted keys nest), ``--json`` for
machine-readable output, ``-v`` for the library's log and ``--debug`` for tracebacks.

Exit status: 0 when the command did what was asked (and, for ``verify``, everything is
sound); 1 when it failed or found damage; 2 for a usage error. Errors are one line on
stderr.

Modules, each importing only those listed after it: :mod:`~asyncckpt.cli.main` (parser and
entry point); one per command group (:mod:`~asyncckpt.cli.ls`, :mod:`~asyncckpt.cli.inspect`,
:mod:`~asyncckpt.cli.verify`, :mod:`~asyncckpt.cli.gc`, :mod:`~asyncckpt.cli.convert`,
:mod:`~asyncckpt.cli.bench`); the file formats (:mod:`~asyncckpt._convert.safetensors`,
:mod:`~asyncckpt.cli.formats`); and :mod:`~asyncckpt.cli.common` (errors, options, output,
locating checkpoints).
"""

from asyncckpt._convert.safetensors import read_safetensors, write_safetensors
from asyncckpt.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    FileRef,
    RootRef,
    locate,
    parse_storage_options,
    plural,
)
from asyncckpt.cli.formats import FORMATS, format_of, load_ackpt, load_torch, save_ackpt, save_torch
from asyncckpt.cli.main import build_parser, main
from asyncckpt.cli.verify import BadChunk, FileReport, verify_file
from asyncckpt.errors import CommandFailed, SafetensorsError, UsageError

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
