"""Signal handling that only records: handlers hand the signal to the supervisor's loop
(``StopRequests``), nothing more. Runs in the launcher.

Previous handlers are restored afterwards. SIGHUP is left alone when it was ignored at start (nohup).
SIGINT, SIGTERM and SIGQUIT stop the run (as torchrun does); SIGHUP and SIGUSR1/2 are forwarded to
the ranks, whose own outcome then ends the run. After a Ctrl-C, ``end_with_signal`` lets the
launcher die of SIGINT itself, so the shell sees an interrupted command and a ``for`` loop stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from multigpu.contract.signals import CAUGHT, STOP_SIGNALS

SAME_INTERRUPT_S = 0.3
"""Stop signals this close together are one interrupt: ``timeout -s INT`` signals the launcher, then
its whole process group, so two SIGINTs arrive from one event. A later SIGINT, after the ranks were
told to stop, is a person pressing Ctrl-C again."""


class StopRequests:
    """The signals handed to the supervisor's loop, and what they mean for the run: its stop signal,
    when the ranks were told to stop, and a second Ctrl-C (no more grace).

    ``record`` is all a signal handler (or another thread) calls; the loop calls ``take`` each turn.
    """

    def __init__(self, clock: Callable[[], float], wake: Callable[[], None]) -> None:
        self._clock, self._wake = clock, wake
        self._queue: deque[tuple[int, float]] = deque()
        self.signal: int | None = None
        """The signal that stops the run (the first stop signal before teardown), once handled."""
        self._at: float | None = None
        self.told_at: float | None = None
        """When the ranks were told to stop (the supervisor's teardown sets it)."""
        self.kill_now = False

    def record(self, signum: int) -> None:
        self._queue.append((signum, self._clock()))
        self._wake()

    def seen(self) -> bool:
        """A stop signal came: handled, or recorded by the handler and not yet handled. The queue is
        copied first, in one C call: a handler (or another thread) appending while a Python loop
        iterates it would raise "deque mutated during iteration" in the supervisor's loop."""
        return self.signal is not None or any(sig in STOP_SIGNALS for sig, _ in list(self._queue))

    def take(self, closing: bool) -> list[int]:
        """Handle what was recorded; the signals that are not stop signals, for the ranks."""
        forward = []
        while self._queue:
            signum, at = self._queue.popleft()
            if signum not in STOP_SIGNALS:
                forward.append(signum)
            elif self.signal is None and not closing:
                self.signal, self._at = signum, at
            elif signum == signal.SIGINT and self._second_press(at):
                self.kill_now = True
        return forward

    def _second_press(self, at: float) -> bool:
        """A SIGINT that came after the ranks were told to stop and not with the first stop signal."""
        told = self.told_at is not None and at >= self.told_at
        return told and (self._at is None or at - self._at >= SAME_INTERRUPT_S)


@contextlib.contextmanager
def capture_signals(record: Callable[[int], None], signals: tuple[int, ...] = CAUGHT) -> Iterator[None]:
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        record(signum)

    for sig in signals:
        current = signal.getsignal(sig)
        if sig == signal.SIGHUP and current is signal.SIG_IGN:
            continue
        previous[sig] = current
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def end_with_signal(sig: int) -> None:
    """Die of ``sig`` with its default action (everything is torn down and flushed by now)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
