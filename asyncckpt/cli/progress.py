"""A small progress bar for long operations: bytes done, throughput, percentage.

It draws on stderr, and only when stderr is a terminal: redirected to a file, piped into
another program or captured by a test, it writes nothing at all. The library itself never
draws one; the ``asyncckpt`` command line uses it for verify, convert, bench and loads.

Example:
    >>> import io
    >>> out = io.StringIO()                  # not a terminal: nothing is drawn
    >>> with Progress(1024, "reading", stream=out) as bar:
    ...     bar.update(512)
    ...     bar.update(512)
    >>> out.getvalue(), bar.done
    ('', 1024)
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, three significant figures or so.

    Example:
        >>> format_bytes(0), format_bytes(1536), format_bytes(256 << 20)
        ('0 B', '1.5 KiB', '256.0 MiB')
    """
    value = float(n)
    for unit in _UNITS[:-1]:
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} {_UNITS[-1]}"


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (False when closed or replaced)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):
        return False


class Progress:
    """A progress bar for ``total`` bytes (None: unknown total, no percentage).

    :meth:`update` is thread-safe and cheap; the bar is redrawn at most every
    ``interval`` seconds, and once more (with a newline) by :meth:`close`. ``label`` is
    shown before the bar; ``stream`` defaults to ``sys.stderr`` (looked up when created);
    ``enabled`` forces drawing on or off (None: only when ``stream`` is a terminal).
    """

    def __init__(
        self,
        total: int | None,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        interval: float = 0.1,
    ) -> None:
        self.total = total
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = is_terminal(self.stream) if enabled is None else enabled
        self.interval = interval
        self.done = 0
        self._started = time.monotonic()
        self._drawn_at = 0.0
        self._width = 0
        self._closed = False
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        """Count ``n`` more bytes done."""
        with self._lock:
            self.done += n
            if not self.enabled or self._closed:
                return
            now = time.monotonic()
            if now - self._drawn_at >= self.interval:
                self._drawn_at = now
                self._draw(now, final=False)

    def relabel(self, label: str) -> None:
        """Change what the bar says."""
        with self._lock:
            self.label = label

    def close(self) -> None:
        """Draw the final state and end the line (nothing if not drawing)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.enabled:
                self._draw(time.monotonic(), final=True)

    def render(self, now: float | None = None) -> str:
        """The bar's text as it would be drawn now (without carriage return)."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._started, 1e-9)
        rate = f"{format_bytes(self.done / elapsed)}/s"
        if self.total:
            fraction = min(1.0, self.done / self.total)
            filled = int(fraction * 24)
            bar = "#" * filled + "." * (24 - filled)
            return (
                f"{self.label} [{bar}] {100 * fraction:5.1f}%  "
                f"{format_bytes(self.done)} / {format_bytes(self.total)}  {rate}"
            )
        return f"{self.label}  {format_bytes(self.done)}  {rate}"

    def _draw(self, now: float, final: bool) -> None:
        text = self.render(now)
        pad = " " * max(0, self._width - len(text))
        self._width = len(text)
        try:
            self.stream.write(f"\r{text}{pad}" + ("\n" if final else ""))
            self.stream.flush()
        except (ValueError, OSError):  # stream closed under us: stop drawing
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
