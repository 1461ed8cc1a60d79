"""Progress reports: ``multigpu.heartbeat()`` tells the launcher a rank is alive (``--hang-timeout``).

Progress is the rank's own. The bootstrap takes the heartbeat descriptor out of the environment and
makes it non-inheritable (``attach``), so nothing the rank starts can write into it, and a process
forked from the rank (a DataLoader worker) does not beat either: only the process that attached does.
"""

from __future__ import annotations

import contextlib
import os
import time

_fd: int | None = None
_owner: int | None = None
_looked = False


def attach(fd: int) -> None:
    """The bootstrap hands over the descriptor the launcher passed in ``MULTIGPU_HEARTBEAT_FD``."""
    global _fd, _owner, _looked
    with contextlib.suppress(OSError):
        os.set_inheritable(fd, False)
    _fd, _owner, _looked = fd, os.getpid(), True


def heartbeat_fd() -> int | None:
    """This process's heartbeat descriptor, or None outside a rank (or in a process the rank forked)."""
    global _fd, _owner, _looked
    if not _looked:  # a worker not started by our bootstrap still has the variable
        _looked = True
        value = os.environ.get("MULTIGPU_HEARTBEAT_FD")
        _fd = int(value) if value and value.isdigit() else None
        _owner = os.getpid()
    return _fd if _owner == os.getpid() else None


def heartbeat() -> None:
    """Cheap enough for every training step; does nothing outside a multigpu worker."""
    send(b".")


def send(message: bytes, wait_s: float = 0.0) -> bool:
    """Write ``message`` to the launcher; with ``wait_s``, retry a full pipe that long (for "done")."""
    global _fd
    fd = heartbeat_fd()
    if fd is None:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.write(fd, message)
            return True
        except BlockingIOError:  # the launcher has unread beats already: progress is known
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        except OSError:
            _fd = None
            return False
