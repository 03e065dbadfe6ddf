"""The ``asyncckpt`` parser and entry point: builds the parser from the command modules,
runs the chosen command, and turns every outcome into an exit status and one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pickle
import sys
import traceback
from collections.abc import Sequence
from typing import cast

from asyncckpt._settings import Settings
from asyncckpt._version import __version__
from asyncckpt.cli import gc, ls, parsers, rewind
from asyncckpt.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CommandFailed,
    Parser,
    Subparsers,
    UsageError,
    add_common_options,
    log,
    parse_storage_options,
)
from asyncckpt.cli.terminal import paint
from asyncckpt.errors import AsyncCkptError

#: The subcommands' parsers, in the order ``--help`` lists them. None imports torch (the
#: commands that need it import it when they run): ``--help`` returns at once.
COMMANDS = (
    ls.add_parser,
    parsers.add_inspect,
    parsers.add_verify,
    gc.add_parser,
    rewind.add_parser,
    parsers.add_convert,
    parsers.add_cp,
    parsers.add_bench,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``asyncckpt`` argument parser.

    Returns:
        A parser whose errors raise :class:`~asyncckpt.cli.common.UsageError`.

    Example:
        >>> build_parser().parse_args(["ls", "run"]).root
        'run'
    """
    parser = Parser(
        prog="asyncckpt",
        description="Look into, check, clean and convert asyncckpt checkpoints.",
        epilog="Exit status: 0 success, 1 failure or damage found, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"asyncckpt {__version__}")
    add_common_options(parser, suppress=False)
    # Subcommand parsers are plain ArgumentParsers (the type the command modules add to).
    sub = cast(Subparsers, parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    for add_parser in COMMANDS:
        add_parser(sub)
    return parser


class _LogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"asyncckpt: {record.levelname.lower()}: {record.getMessage()}"


def describe(exc: BaseException) -> str:
    """One line for an exception that is not an asyncckpt error.

    Example:
        >>> describe(ValueError("bad\\nvalue"))
        'bad value (ValueError)'
    """
    if isinstance(exc, pickle.UnpicklingError):
        return _describe_unpickling(exc)
    text = " ".join(str(exc).split()) or "(no message)"
    if isinstance(exc, (OSError, ValueError, TypeError, KeyError, RuntimeError, MemoryError)):
        return f"{text} ({type(exc).__name__})"
    return f"{type(exc).__name__}: {text} (a bug? rerun with --debug and report it)"


def _describe_unpickling(exc: pickle.UnpicklingError) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    anchor = "WeightsUnpickler error:"
    at = next((i for i, ln in enumerate(lines) if anchor in ln), len(lines) - 1)
    detail = lines[at].split(anchor)[-1].strip() if lines else ""
    if not detail and at + 1 < len(lines):
        detail = lines[at + 1]
    # torch goes on to suggest allowlisting the class "if you trust" it: the CLI does not
    # take that advice for a file it is handed, so it does not repeat it.
    detail = detail.split(" Please use", 1)[0].split(". Check the", 1)[0].rstrip(". ")
    return (
        f"torch.load(weights_only=True) refused the file: {detail}. It holds Python objects "
        "besides tensors and plain containers, and asyncckpt never unpickles those; where "
        "the file was made, save plain data instead (e.g. the state_dict() of each object)"
    )


def _fail(message: str, code: int, debug: bool, json_out: bool, report: bool = True) -> int:
    if debug and code != EXIT_USAGE:
        traceback.print_exc(file=sys.stderr)
    if json_out and report:
        print(json.dumps({"ok": False, "error": message, "exit_status": code}))
    print(paint(message.replace("\n", " "), "red", sys.stderr), file=sys.stderr)
    return code


def _run(args_list: list[str]) -> int:
    """Parse and run; exceptions go to :func:`main`."""
    try:
        args = build_parser().parse_args(args_list)
    except SystemExit as exc:  # --help and --version print, then "exit"
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    if args.verbose and not args.debug:
        log.setLevel(logging.INFO)
    args.options = parse_storage_options(args.storage_option, args.endpoint_url)
    args.settings = Settings.resolve()  # once per command: ASYNCCKPT_* > defaults
    return int(args.run(args))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
        The exit status (the console script exits with it): 0 success, 1 failure or damage
        found, 2 usage error, 130 interrupted.

    Example:
        >>> main(["--version"])
        asyncckpt ...
        0
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    json_out = "--json" in args_list
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormatter())
    saved = (log.level, log.propagate)
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.DEBUG if debug else logging.WARNING)
    try:
        return _run(args_list)
    except UsageError as exc:
        return _fail(str(exc), EXIT_USAGE, debug, json_out)
    except CommandFailed as exc:
        return _fail(f"asyncckpt: {exc}", EXIT_FAILURE, debug, json_out, report=False)
    except BrokenPipeError:  # e.g. `asyncckpt inspect ROOT | head`: stop quietly
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return _fail("asyncckpt: interrupted", 130, debug, json_out)
    except AsyncCkptError as exc:
        return _fail(f"asyncckpt: error: {exc}", EXIT_FAILURE, debug, json_out)
    except Exception as exc:
        return _fail(f"asyncckpt: error: {describe(exc)}", EXIT_FAILURE, debug, json_out)
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
