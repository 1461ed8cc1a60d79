"""Which rank holds a hung job up, read from the stacks every rank dumped. Runs in the launcher.

When a collective hangs, every rank but the culprit waits inside ``torch.distributed`` (a collective, a
barrier, a store wait); the culprit is elsewhere: sleeping, in a data loader, in its own loop. The
progress book only says who stopped beating first, and in the simplest hang (one rank sleeps while
the other waits for it in ``all_reduce``) both stop on the same step, so it cannot tell them apart.
The stacks can, on CPU and GPU alike, with no flight recorder: the main thread of each rank's dump
(faulthandler's format) either has a ``torch/distributed`` frame or not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from multigpu.contract.frames import library_file, own_file

FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')
THREAD = re.compile(r"^\s*(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):")
WAITING = "/torch/distributed/"


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.function})"


def main_thread(dump: Sequence[str]) -> list[Frame]:
    """The frames of the dump's main thread, innermost first: the thread whose outermost frame is not
    ``threading``'s bootstrap (every other thread starts there)."""
    threads: list[list[Frame]] = []
    for line in dump:
        if THREAD.match(line):
            threads.append([])
        elif threads and (m := FRAME.search(line)):
            threads[-1].append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    for frames in threads:
        if frames and not frames[-1].path.endswith("threading.py"):
            return frames
    return []


def waiting_in(frames: Sequence[Frame]) -> str | None:
    """The ``torch.distributed`` call the thread waits in, or None: the innermost frame of
    ``distributed_c10d.py`` (``all_reduce``, ``barrier``), else the innermost torch.distributed one."""
    inside = [f for f in frames if WAITING in f.path.replace("\\", "/")]
    named = [f for f in inside if f.path.endswith("distributed_c10d.py")] or inside
    return named[0].function if named else None


def where(frames: Sequence[Frame]) -> Frame | None:
    """The innermost frame of the user's own code (the top frame where there is none)."""
    return next(
        (
            f
            for f in frames
            if not library_file(f.path) and not own_file(f.path) and not f.path.startswith("<")
        ),
        frames[0] if frames else None,
    )


@dataclass(frozen=True)
class Culprits:
    """Ranks outside ``torch.distributed`` while the others wait in it; the report's line."""

    ranks: list[int]
    line: str


def find_culprits(dumps: Mapping[int, Sequence[str]]) -> Culprits | None:
    """None unless some ranks wait in torch.distributed and others (with a readable stack) do not."""
    stacks = {rank: main_thread(dump) for rank, dump in dumps.items()}
    stacks = {rank: frames for rank, frames in stacks.items() if frames}
    calls = {rank: waiting_in(frames) for rank, frames in stacks.items()}
    waiting = sorted(r for r, call in calls.items() if call is not None)
    outside = sorted(r for r, call in calls.items() if call is None)
    if not waiting or not outside:
        return None
    names = sorted({call for r in waiting if (call := calls[r]) is not None})
    each = "; ".join(f"rank {r} is in {where(stacks[r])}" for r in outside)
    who = "rank" if len(outside) == 1 else "ranks"
    they = f"rank {waiting[0]} waits" if len(waiting) == 1 else f"ranks {', '.join(map(str, waiting))} wait"
    line = (
        f"{who} {', '.join(map(str, outside))} never reached the {' / '.join(names)} that {they} in: {each}"
    )
    return Culprits(outside, line)
