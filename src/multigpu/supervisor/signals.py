"""Signal handling that only records: handlers hand the signal to the supervisor's loop, nothing more.

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
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from multigpu.contract.signals import CAUGHT


@contextlib.contextmanager
def capture_signals(record: Callable[[int], None],
                    signals: tuple[int, ...] = CAUGHT) -> Iterator[None]:
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
