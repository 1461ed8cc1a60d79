"""The rank's own stdout and stderr, made progress: each write by this process is a beat.

Runs in the rank; the bootstrap installs it before user code.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from multigpu.contract.names import HEARTBEAT_FD_ENV
from multigpu.rank.progress import attach, output_beat


class _BeatingStream:
    """sys.stdout/sys.stderr as they were, plus a heartbeat (at most every 50 ms) on each write by
    this process: a rank's own output is progress (for ranks that report no steps), its children's
    output (same pipe) is not."""

    def __init__(self, stream: Any) -> None:
        object.__setattr__(self, "_stream", stream)
        object.__setattr__(self, "_next", 0.0)

    def _beat(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            object.__setattr__(self, "_next", now + 0.05)
            output_beat()

    def write(self, text: str) -> int:
        self._beat()
        return int(self._stream.write(text))

    def writelines(self, lines: Any) -> None:
        self._beat()
        self._stream.writelines(lines)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._stream, name, value)


def take_heartbeat() -> None:
    """Own the heartbeat descriptor: out of the environment (grandchildren never see it), not
    inheritable, and output written by this process counts as progress."""
    fd = os.environ.pop(HEARTBEAT_FD_ENV, None)
    if fd is None or not fd.isdigit():
        return
    attach(int(fd))
    sys.stdout = _BeatingStream(sys.stdout)  # type: ignore[assignment]
    sys.stderr = _BeatingStream(sys.stderr)  # type: ignore[assignment]
