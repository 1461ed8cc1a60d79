"""The supervisor's event sources in one selector: rank exits (pidfds), pipes, beats, and a wake-up pipe.

Runs in the launcher (and in OTX's caller, on the supervisor's thread). ``wake()`` is safe
from a signal handler or another thread: it writes one byte to a non-blocking pipe, so a signal that
only records still makes the loop look at once. ``close()`` releases every descriptor it was given.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
from collections.abc import Iterator
from typing import Any


class Events:
    """A selector whose registrations carry ``(kind, object)``; the wake-up pipe is kind ``wake``."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._wake_lock = threading.RLock()  # a signal handler may run while the main thread holds it

    def watch(self, fd: int, kind: str, obj: Any) -> None:
        self._selector.register(fd, selectors.EVENT_READ, (kind, obj))

    def forget(self, fd: int, close: bool = False) -> None:
        """Stop watching ``fd`` (and close it, for descriptors the supervisor owns)."""
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)
        if close:
            os.close(fd)

    def ready(self, timeout: float | None) -> Iterator[tuple[str, Any]]:
        """What is ready now; a registration forgotten earlier in the same batch is skipped."""
        for key, _ in self._selector.select(timeout):
            if self._selector.get_map().get(key.fd) is not key:
                continue  # closed earlier in this batch (a failed rank's pipes are drained at once)
            kind, obj = key.data
            if kind == "wake":
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
                continue
            yield kind, obj

    def wake(self) -> None:
        with self._wake_lock:  # a late call from another thread must not write to a reused descriptor
            if self._wake_w < 0:
                return
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"\0")

    def close(self) -> None:
        self._selector.close()
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1


def read_ready(fd: int) -> bytes | None:
    """What a non-blocking pipe holds now: b"" at its end, None when nothing is there yet."""
    try:
        return os.read(fd, 4096)
    except BlockingIOError:
        return None
