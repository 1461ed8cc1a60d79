"""What the console leaves to a rank's log: lines a rank wrote that tell the user nothing new there.

Runs in the launcher, on the console's side of one pipe (``output.WorkerOutput._emit``); the rank's
log always gets every byte. Two filters, each fed the pipe's whole lines as they arrive:

* ``CppStacks``: torch's C++ backtraces (``Exception raised from ... (most recent call first):`` and
  its ``frame #N:`` lines), which c10 appends to a warning or an error when a store or a collective
  fails (most often a consequence: a peer's node went away). The console keeps the message and one
  line saying where the stack is; a C++ frame is never on the first screen.
* ``InterruptTracebacks``: after the user's Ctrl-C, a rank's ``KeyboardInterrupt`` traceback (the
  report says where each rank was in one line).
"""

from __future__ import annotations

import re

TRACEBACK_HEAD = b"Traceback (most recent call last):"
TORCH_RANK_PREFIX = re.compile(rb"^\[rank\d+\]: ")
"""What torch.distributed's excepthook puts before each line of a rank's traceback."""
CHAINED = (
    b"During handling of the above exception, another exception occurred:",
    b"The above exception was the direct cause of the following exception:",
)
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


class InterruptTracebacks:
    """After a Ctrl-C, a rank's ``KeyboardInterrupt`` traceback is for its log only: the report says
    where each rank was in one line (``report.interrupted_line``). Any other traceback still shows.

    A traceback's lines are held from its head on, through any chained tracebacks, until the line
    after its last exception's line; then the whole chain is dropped if that last exception is
    ``KeyboardInterrupt``, or shown, in order."""

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
        return [] if last is not None and last.startswith(b"KeyboardInterrupt") else held
