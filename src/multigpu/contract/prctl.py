"""The two ``prctl`` calls that tie process lifetimes together on Linux; used by every process.

``set_child_subreaper``: orphaned descendants (a double fork, a daemon) are re-parented to this
process instead of to PID 1, so they stay in its tree where they can be found and ended. The launcher
sets it (it ends and reaps every descendant at teardown), and so does every rank (its guard ends the
rank's whole tree when the launcher dies, ``rank/guard.py``). ``set_pdeathsig``: the kernel signals
this process when its parent thread exits. Standard library only (``ctypes``); both return False where
the call is not available, and callers go on without it.
"""

from __future__ import annotations

import signal

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        return bool(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def set_child_subreaper() -> bool:
    """Adopt orphaned descendants, so they stay in this process's tree (Linux 3.4+)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies."""
    return _prctl(PR_SET_PDEATHSIG, int(sig))
