"""The signals the launcher and its ranks agree on, and their names.

Shared by every process: the launcher sends them, the rank's bootstrap arms them. Standard library only.
"""

from __future__ import annotations

import signal

DUMP_SIGNAL = signal.SIGURG
"""Sent by the launcher to make a rank write the Python stacks of all its threads to stderr.

SIGURG is ignored by default, so a rank that has not registered the dump yet, or is already shutting
down, is left alone rather than killed."""


FR_SIGNAL = signal.SIGRTMIN + 13
"""A real-time signal nothing else uses; only a rank whose bootstrap armed the recorder thread gets it
(its default action would end the process)."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)
"""Signals that stop the run; the others the launcher catches (SIGHUP, SIGUSR1/2) go to the ranks."""
CAUGHT = (*STOP_SIGNALS, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""Every signal the launcher catches, and the ones a ``--no-python`` rank's parent passes to PROGRAM by
ignoring them (the launcher signals the whole group)."""


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number that names no signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
