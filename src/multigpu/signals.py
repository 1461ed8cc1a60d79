"""Signal handling that only records: handlers hand the signal to the supervisor's loop, nothing more.

Previous handlers are restored afterwards. SIGHUP is left alone when it was ignored at start (nohup).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


@contextlib.contextmanager
def capture_signals(record: Callable[[int], None],
                    signals: tuple[int, ...] = FORWARDED) -> Iterator[None]:
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


def set_child_subreaper() -> bool:
    """Adopt orphaned descendants (Linux), so the launcher can reap every grandchild it ends."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_CHILD_SUBREAPER = 36
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False
