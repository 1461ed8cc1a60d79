"""What the console leaves to a rank's log: lines a rank wrote that tell the user nothing new there.

Runs in the launcher, on the console's side of one pipe (``output.WorkerOutput._emit``); the rank's
log always gets every byte. Three filters, each fed the pipe's whole lines as they arrive:

* ``CppStacks``: torch's C++ backtraces (``Exception raised from ... (most recent call first):`` and
  its ``frame #N:`` lines), which c10 appends to a warning or an error when a store or a collective
  fails (most often a consequence: a peer's node went away). The console keeps the message and one
  line saying where the stack is; a C++ frame is never on the first screen.
* ``InterruptTracebacks``: after the user's Ctrl-C, a rank's ``KeyboardInterrupt`` traceback (the
  report says where each rank was in one line).
"""

from __future__ import annotations

import re

from multigpu.contract.failure import PEER_LOST_MARKERS

TRACEBACK_HEAD = b"Traceback (most recent call last):"
TORCH_RANK_PREFIX = re.compile(rb"^\[rank\d+\]: ")
"""What torch.distributed's excepthook puts before each line of a rank's traceback."""
CHAINED = (
    b"During handling of the above exception, another exception occurred:",
    b"The above exception was the direct cause of the following exception:",
)
PEER_LOST = tuple(marker.encode() for marker in PEER_LOST_MARKERS)
CPP_STACK_MARK = b"Exception raised from "
"""What every line that begins a C++ backtrace holds (``CPP_STACK_HEAD``), found without a regex."""
CPP_STACK_HEAD = re.compile(rb"Exception raised from (?P<where>\S+) at .*\(most recent call first\):\s*$")
CPP_STACK_LINE = re.compile(rb"^\s*(frame #\d+: |<omitting python frames>)")


class CppStacks:
    """Folds each C++ backtrace into one line; the line that ends it (c10 ends it with an empty line)
    is dropped when it is empty, shown otherwise."""

    def __init__(self) -> None:
        self.inside = False

    def feed(self, lines: list[bytes]) -> list[bytes]:
        if not self.inside and not any(CPP_STACK_MARK in line for line in lines):
            return lines  # every line a rank writes passes here: no regex unless a stack begins
        shown: list[bytes] = []
        for line in lines:
            text = TORCH_RANK_PREFIX.sub(b"", line, count=1)
            if self.inside:
                if CPP_STACK_LINE.match(text):
                    continue
                self.inside = False
                if not text.strip():
                    continue
            head = CPP_STACK_HEAD.search(text)
            if head is None:
                shown.append(line)
                continue
            self.inside = True
            before = text[: head.start()].rstrip()
            if before:
                shown.append(before)
            where = head.group("where").decode(errors="replace")
            shown.append(f"(torch's C++ stack from {where}: in this rank's log)".encode())
        return shown


class HeldTracebacks:
    """A rank's tracebacks held off the console until each is whole, then shown or not as a whole
    (``settled``). A traceback's lines are held from its head on, through any chained tracebacks, until
    the line after its last exception's line (or the pipe's end: ``flush``)."""

    def __init__(self) -> None:
        self.held: list[bytes] | None = None
        self._last: bytes | None = None
        """The exception line of the chain held so far (None: still in its frames)."""

    def feed(self, lines: list[bytes]) -> list[bytes]:
        shown: list[bytes] = []
        for line in lines:
            text = TORCH_RANK_PREFIX.sub(b"", line, count=1)
            bare = text.rstrip()
            if (
                self.held is not None
                and self._last is not None
                and bare
                and bare not in CHAINED
                and bare != TRACEBACK_HEAD
            ):
                shown += self.flush()  # the chain is over: this line is the rank's next output
            if self.held is None:
                if bare == TRACEBACK_HEAD:
                    self.held, self._last = [line], None
                else:
                    shown.append(line)
                continue
            self.held.append(line)
            if bare == TRACEBACK_HEAD:
                self._last = None
            elif self._last is None and bare and not text[:1].isspace() and bare not in CHAINED:
                self._last = bare
        return shown

    def flush(self) -> list[bytes]:
        """End the chain held (the pipe ended, or other output followed): what the console shows of it."""
        held, last, self.held, self._last = self.held or [], self._last, None, None
        return self.settled(held, last)

    def settled(self, held: list[bytes], last: bytes | None) -> list[bytes]:
        """What the console shows of a whole chain ``held``, whose last exception line is ``last``."""
        return held


class InterruptTracebacks(HeldTracebacks):
    """After a Ctrl-C, a rank's ``KeyboardInterrupt`` traceback is for its log only: the report says
    where each rank was in one line (``report.interrupted_line``). Any other traceback still shows."""

    def settled(self, held: list[bytes], last: bytes | None) -> list[bytes]:
        return [] if last is not None and last.startswith(b"KeyboardInterrupt") else held


class PeerLostTracebacks(HeldTracebacks):
    """A job of several nodes: a rank's traceback whose last exception says a peer's connection closed
    under its collective (gloo's "Connection closed by peer") is a consequence when the attempt's root
    cause is another node's (that node lost, or its rank failed first): the root cause line names it,
    and the traceback is for the rank's log only. It waits aside until the launcher knows (``settle``);
    any other traceback shows at once."""

    def __init__(self) -> None:
        super().__init__()
        self.aside: list[bytes] = []
        self.fold: bool | None = None
        """Whether such a traceback is folded; None until the root cause is known."""

    def feed(self, lines: list[bytes]) -> list[bytes]:
        """As ``HeldTracebacks``, but a chain whose latest exception says nothing of a peer shows at
        once: a rank that logs a traceback and trains on is not held back until its next line."""
        shown = super().feed(lines)
        if self.held is not None and self._last is not None and not _peer_lost(self._last):
            shown += self.flush()
        return shown

    def settled(self, held: list[bytes], last: bytes | None) -> list[bytes]:
        if last is None or self.fold is False or not _peer_lost(last):
            return held
        if self.fold is None:
            self.aside += held
        return []

    def settle(self, *, fold: bool) -> list[bytes]:
        """The root cause is known: what was put aside, to show now ([] when ``fold``); a later such
        traceback is shown or folded the same way. The first call decides (the teardown's own call,
        ``WorkerOutput.close``, shows what no decision reached)."""
        if self.fold is not None:
            return []
        self.fold = fold
        aside, self.aside = self.aside, []
        return [] if fold else aside


COLLECTIVE_ERROR = re.compile(rb"^\s*(?:\[rank\d+\]:\s*)?(?:RuntimeError|torch\.distributed\.|Dist\w*Error)")
"""How a collective's error begins (gloo's through torch, behind torch's ``[rankN]:`` prefix if any):
a rank's own ``ConnectionResetError`` (a data loader's HTTP or S3 call) says "Connection reset by
peer" too, and is the user's to see."""


def _peer_lost(exception_line: bytes) -> bool:
    return bool(COLLECTIVE_ERROR.match(exception_line)) and any(m in exception_line for m in PEER_LOST)
