"""Preemption: turn SLURM's or Kubernetes' SIGTERM into a flag the training loop checks.

Without a handler, SIGTERM ends Python at once: a background write in flight is cut off
(its step never commits, the previous version stays the newest, which is safe but loses
the work since). With :meth:`Checkpointer.on_preemption` the signal only sets
:attr:`Preemption.requested`; the write in flight goes on, and the loop saves one last
version and waits for it within the grace period (SLURM's ``--signal``/``KillWait``,
Kubernetes' ``terminationGracePeriodSeconds``). Nothing is saved from inside the handler:
it runs between two bytecodes of the main thread, perhaps in the middle of a ``save``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)


class Preemption:
    """A preemption request flag set by a signal (see the module).

    A second signal restores the handler that was there before and delivers the signal
    again, so a second SIGTERM (or Ctrl-C twice) ends the process as it would have.

    Args:
        signals: the signals to catch (default: SIGTERM).
        where: what to name in the log line (the Checkpointer's root).

    Raises:
        ValueError: not called from the main thread (Python only lets it set handlers).

    Example:
        >>> import signal
        >>> stop = Preemption([signal.SIGUSR1])
        >>> stop.requested
        False
        >>> signal.raise_signal(signal.SIGUSR1)
        >>> stop.requested, stop.signal
        (True, 'SIGUSR1')
        >>> stop.remove()
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,), where: str = "") -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("on_preemption() must be called from the main thread")
        self._event = threading.Event()
        self._where = where
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}
        for number in signals:
            self._previous[number] = signal.signal(number, self._handle)

    @property
    def requested(self) -> bool:
        """Whether a preemption signal arrived."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a preemption signal arrives (or ``timeout``); whether one did."""
        return self._event.wait(timeout)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self._event.is_set():  # the second one: behave as without us
            signal.signal(number, self._previous.get(number, signal.SIG_DFL))
            os.kill(os.getpid(), number)
            return
        self.signal = signal.Signals(number).name
        log.warning(
            "%s received: preemption requested%s; pending saves go on",
            self.signal,
            f" for {self._where}" if self._where else "",
        )
        self._event.set()

    def remove(self) -> None:
        """Put back the handlers that were there before."""
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()
