"""Function mode's caller lines: the caller is rank 0 and shares its console with its children.

Runs in function mode's caller (the OTX caller, ``MultiGPUManager``). ``CALLER_LOCK`` is held while
the caller's own line or a child's line (``ranks.PrefixedConsole`` without a writer) goes to the
shared descriptors, so neither lands inside the other.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

CALLER_LOCK = threading.Lock()
"""Held while the caller's own line or a child's line goes to the shared descriptors."""


class CallerLines:
    """Function mode's caller (rank 0) writes whole lines, so a child's line never lands inside one.

    ``print()`` writes its text and its newline separately (two writes when stdout is unbuffered, as
    with ``PYTHONUNBUFFERED``), and a block-buffered stream flushes at 8 KiB, mid-line; the children's
    lines come from another thread. This stand-in for ``sys.stdout``/``sys.stderr`` holds a partial
    line until its newline (or an explicit ``flush()``, as a progress bar's ``\r`` update does) and
    writes it under the lock the children's lines take. Everything else is the real stream's.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._partial = ""

    def write(self, text: str) -> int:
        with CALLER_LOCK:
            self._partial += text
            cut = self._partial.rfind("\n") + 1
            if cut:
                whole, self._partial = self._partial[:cut], self._partial[cut:]
                self._stream.write(whole)
                self._stream.flush()
        return len(text)

    def flush(self) -> None:
        with CALLER_LOCK:
            partial, self._partial = self._partial, ""
            if partial:
                self._stream.write(partial)
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def caller_lines() -> Iterator[None]:
    """Guard the caller's stdout and stderr while children share its console; put them back after."""
    guards = {name: CallerLines(getattr(sys, name)) for name in ("stdout", "stderr")}
    for name, guard in guards.items():
        setattr(sys, name, guard)
    try:
        yield
    finally:
        for name, guard in guards.items():
            with contextlib.suppress(OSError, ValueError):  # a closed console: nothing to save
                guard.flush()
            if getattr(sys, name) is guard:  # the caller may have replaced it since: theirs stays
                setattr(sys, name, guard._stream)
