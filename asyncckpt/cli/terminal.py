"""What the command line prints on a terminal: aligned tables whose key column is cut to
the terminal's width, and colour (only on a terminal, never with ``NO_COLOR`` set). Piped
output is never cut nor coloured, so scripts read every key as it is.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import TextIO

from asyncckpt.cli.progress import is_terminal

#: ANSI colours ``paint`` knows.
_COLOURS = {"green": "32", "red": "31", "yellow": "33"}


def colour_on(stream: TextIO) -> bool:
    """Whether to colour what goes to ``stream``: a terminal, and ``NO_COLOR`` not set
    (https://no-color.org: any non-empty value turns colour off)."""
    return is_terminal(stream) and not os.environ.get("NO_COLOR")


def paint(text: str, colour: str, stream: TextIO | None = None) -> str:
    """``text`` in ``colour`` when ``stream`` (default stdout) is a terminal, else as is.

    Example:
        >>> paint("OK", "green")  # doctest output is no terminal
        'OK'
    """
    if not colour_on(sys.stdout if stream is None else stream):
        return text
    return f"\033[{_COLOURS[colour]}m{text}\033[0m"


def terminal_width() -> int | None:
    """The width of the terminal stdout is, None when stdout is piped (nothing is cut)."""
    return shutil.get_terminal_size().columns if is_terminal(sys.stdout) else None


def cut(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, the cut marked with ``...``.

    Example:
        >>> cut("state['model']['layers'][0]['w']", 20), cut("short", 20)
        ("state['model']['...", 'short')
    """
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def table(
    headers: list[str], rows: list[list[str]], first_align: str = "<", fit: int | None = None
) -> list[str]:
    """Rows as aligned text columns; ``first_align=">"`` right-aligns the first column. With
    ``fit`` (the terminal's width) the first column (the keys) is cut to make the lines fit,
    down to 12 characters.

    Example:
        >>> table(["A", "BB"], [["1", "x"], ["22", "y"]], ">")
        [' A  BB', ' 1  x', '22  y']
    """
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    if fit is not None and sum(widths) + 2 * (len(widths) - 1) > fit:
        room = max(12, fit - sum(widths[1:]) - 2 * (len(widths) - 1))
        rows = [[cut(r[0], room), *r[1:]] for r in rows]
        widths[0] = min(widths[0], room)

    def line(cells: list[str]) -> str:
        out = [
            c.rjust(w) if i == 0 and first_align == ">" else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(out).rstrip()

    return [line(headers), *(line(r) for r in rows)]
