"""The restart policy: restart after a failure, unless it is a crash loop.

``--max-restarts K`` restarts the whole group after a failure. A failure whose root cause is the same
on two attempts in a row (the same exception type raised at the same place: the innermost frame of the
user's code, file and line, in the traceback the rank recorded; or the same sender of a fatal signal the
launcher named: the OOM killer, one file timer's scope) will not go away by itself: the
launcher stops restarting, says so in one line, and exits with ``EXIT_CRASH_LOOP``, a "do not
requeue" code. A failure that changes, or one that names no place (a rank killed by a signal, an exit
code without a traceback, a hang, a lost node or store), keeps its restarts: those are what restarts
are for. On several nodes every node reads the same job-wide root cause (the store's abort record),
so all of them come to the same decision; where the nodes change between attempts (elastic rounds), the
signatures are kept in the job's store (``StoreFailures``), so a node that joined since decides as the
others do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from multigpu.contract.exitcodes import EXIT_CRASH_LOOP
from multigpu.contract.failure import WorkerFailure
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
    if failure is not None and failure.killed_by is not None:  # OOM, a file timer: one failure, any rank
        return Signature(f"{failure.signal} from {failure.killed_by.split(' (')[0]}", "")
    if failure is None or not failure.error_type or not failure.traceback:
        return None
    if failure.kind is not None:  # named by the launcher: no exception was raised, even with a dump
        return None
    frames = _FRAME.findall(failure.traceback)
    if not frames:
        return None
    user = [f"{path}:{line}" for path, line in frames if not library_file(path)]
    return Signature(failure.error_type, user[-1] if user else f"{frames[-1][0]}:{frames[-1][1]}")


class FailureMemory(Protocol):
    """Each failed attempt's signature (``str(Signature)``, or ``""`` when it names no place)."""

    def agree(self, attempt: int, text: str) -> str:
        """Keep ``text`` for ``attempt`` unless one is kept already; the one kept."""
        ...

    def recall(self, attempt: int) -> str | None:
        """The text kept for ``attempt``; None when none was."""
        ...


class LocalFailures:
    """The memory of a node that saw every attempt of its job (one node, a fixed set of nodes)."""

    def __init__(self) -> None:
        self._texts: dict[int, str] = {}

    def agree(self, attempt: int, text: str) -> str:
        return self._texts.setdefault(attempt, text)

    def recall(self, attempt: int) -> str | None:
        return self._texts.get(attempt)


class StoreFailures:
    """The memory in the job's store, under ``prefix``: the first node to write an attempt's signature
    (compare-and-set) is the word of every node, the ones that joined later included."""

    NONE = "-"
    """Stored for a failure that names no place (an empty value would read as unset)."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store, self.prefix = store, prefix

    def agree(self, attempt: int, text: str) -> str:
        kept = self.store.compare_set(f"{self.prefix}/{attempt}", "", text or self.NONE).decode()
        return "" if kept == self.NONE else str(kept)

    def recall(self, attempt: int) -> str | None:
        key = f"{self.prefix}/{attempt}"
        if not self.store.check([key]):
            return None
        kept = self.store.get(key).decode()
        return "" if kept == self.NONE else str(kept)


class CrashLoopPolicy:
    """``check`` tells when an attempt's root cause repeats the one of the attempt before."""

    def __init__(self, memory: FailureMemory | None = None) -> None:
        self._memory = memory if memory is not None else LocalFailures()
        self._next = 0

    def check(self, root_cause: WorkerFailure | None, attempt: int | None = None) -> str | None:
        """None to go on restarting; else the one line that says why not. ``attempt``: the job-wide
        restart count of the failed attempt (default: one more than the last call's)."""
        attempt = self._next if attempt is None else attempt
        self._next = attempt + 1
        current = signature(root_cause)
        text = self._memory.agree(attempt, str(current) if current is not None else "")
        previous = self._memory.recall(attempt - 1) if attempt > 0 else None
        if not text or text != previous or root_cause is None:
            return None
        return (
            f"crash loop: rank {root_cause.rank} failed with {text} on two attempts in a row; "
            f"not restarting (exit {EXIT_CRASH_LOOP}: do not requeue until the cause is fixed)"
        )
