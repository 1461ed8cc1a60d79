"""The restart policy: restart after a failure, unless it is a crash loop.

``--max-restarts K`` restarts the whole group after a failure. A failure whose root cause is the same
on two attempts in a row (the same exception type raised at the same place: the innermost frame of the
user's code, file and line, in the traceback the rank recorded) will not go away by itself: the
launcher stops restarting, says so in one line, and exits with ``EXIT_CRASH_LOOP``, a "do not
requeue" code. A failure that changes, or one that names no place (a rank killed by a signal, an exit
code without a traceback, a hang, a lost node or store), keeps its restarts: those are what restarts
are for. On several nodes every node reads the same job-wide root cause (the store's abort record),
so all of them come to the same decision.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from multigpu.contract.errors import NAMED_BY_THE_LAUNCHER, WorkerFailure
from multigpu.contract.exitcodes import EXIT_CRASH_LOOP
from multigpu.contract.frames import library_file

_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)', re.MULTILINE)


@dataclass(frozen=True)
class Signature:
    """What makes two failures the same: the exception type and the innermost user frame."""

    error_type: str
    where: str
    """``file:line`` (or ``?`` when the traceback has no frame of the user's code)."""

    def __str__(self) -> str:
        return f"{self.error_type} at {self.where}" if self.where else self.error_type


def signature(failure: WorkerFailure | None) -> Signature | None:
    """The failure's signature, or None when it names no place (then it never counts as a loop)."""
    if failure is not None and failure.killed_by is not None:  # an OOM kill is one failure, whichever rank
        return Signature(f"{failure.signal} from {failure.killed_by.split(' (')[0]}", "")
    if failure is None or not failure.error_type or not failure.traceback:
        return None
    if failure.error_type in NAMED_BY_THE_LAUNCHER:
        return None
    frames = _FRAME.findall(failure.traceback)
    if not frames:
        return None
    user = [f"{path}:{line}" for path, line in frames if not library_file(path)]
    return Signature(failure.error_type, user[-1] if user else f"{frames[-1][0]}:{frames[-1][1]}")


class CrashLoopPolicy:
    """Remembers the last attempt's root cause; ``check`` tells when this one repeats it."""

    def __init__(self) -> None:
        self._last: Signature | None = None

    def check(self, root_cause: WorkerFailure | None) -> str | None:
        """None to go on restarting; else the one line that says why not."""
        current = signature(root_cause)
        repeated = current is not None and current == self._last
        self._last = current
        if not repeated or root_cause is None:
            return None
        return (f"crash loop: rank {root_cause.rank} failed with {current} on two attempts in a row; "
                f"not restarting (exit {EXIT_CRASH_LOOP}: do not requeue until the cause is fixed)")
