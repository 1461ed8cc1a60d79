"""The beat protocol: the bytes a rank writes on its heartbeat pipe, and the launcher's one reader.

Shared by the rank (``rank/progress.py`` and the bootstrap write beats) and the launcher (the
supervisor reads them, ``supervisor/hangs/book.py`` decodes them), so it is standard library only. Each
report is a few bytes; a write under ``PIPE_BUF`` is atomic, so records never interleave::

    .            heartbeat()                      o    the rank wrote output (the bootstrap)
    S<n>;        heartbeat(step=n)                D    the script finished (the bootstrap)
    B<name>;     a section begins                 !    the rank is failing (function mode)
    E<name>=<s>; a section ended after s seconds  F    a flight-recorder dump was written
    C<n>;        n collectives entered so far     T    the stacks were written to stderr
    K<n>@<t>;    the world group's collective n was first seen entered at t (CLOCK_MONOTONIC seconds)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

HEARTBEAT, OUTPUT, DONE, FAILING, DUMPED, STACKS = b".", b"o", b"D", b"!", b"F", b"T"


STEP, BEGIN, END, COLLECTIVES, ENTERED = "S", "B", "E", "C", "K"


_SINGLE = {
    HEARTBEAT[0]: "beat",
    OUTPUT[0]: "output",
    DONE[0]: "done",
    FAILING[0]: "failing",
    DUMPED[0]: "dumped",
    STACKS[0]: "stacks",
}


_RECORD = {
    ord(STEP): "step",
    ord(BEGIN): "begin",
    ord(END): "end",
    ord(COLLECTIVES): "collectives",
    ord(ENTERED): "entered",
}


MAX_NAME = 64


MAX_RECORD = 128
"""A record longer than this without its ``;`` is garbage (a rank writing to the wrong descriptor)."""


_NAME_BAD = re.compile(r"[;=\x00-\x1f]")


def clean_name(name: str) -> str:
    return _NAME_BAD.sub("_", str(name))[:MAX_NAME] or "_"


@dataclass(frozen=True)
class Beat:
    """One decoded report: ``kind`` is beat, output, done, failing, dumped, stacks, step, begin, end,
    collectives or entered (``index``: the collective, ``value``: when)."""

    kind: str
    name: str = ""
    value: float = 0.0
    index: int = 0


class BeatDecoder:
    """Turns the bytes read from one rank's pipe into ``Beat`` records; a record cut by a read waits
    for the rest. Anything it cannot parse is skipped: a rank cannot break the launcher."""

    def __init__(self) -> None:
        self._pending = bytearray()

    def feed(self, data: bytes) -> list[Beat]:
        buf = self._pending + data
        beats: list[Beat] = []
        i = 0
        while i < len(buf):
            byte = buf[i]
            if byte in _SINGLE:
                beats.append(Beat(_SINGLE[byte]))
                i += 1
                continue
            if byte not in _RECORD:
                i += 1
                continue
            end = buf.find(b";", i, i + MAX_RECORD)
            if end < 0:
                if len(buf) - i >= MAX_RECORD:  # no record is this long: skip the byte, read on
                    i += 1
                    continue
                break
            beat = _record(_RECORD[byte], bytes(buf[i + 1 : end]).decode(errors="replace"))
            if beat is not None:
                beats.append(beat)
            i = end + 1
        self._pending = bytearray(buf[i:])
        return beats


def _record(kind: str, body: str) -> Beat | None:
    try:
        if kind in ("step", "collectives"):
            return Beat(kind, value=float(int(body)))
        if kind == "entered":
            index, _, when = body.partition("@")
            at = float(when)
            return Beat("entered", value=at, index=int(index)) if math.isfinite(at) else None
        if kind == "end":
            name, _, seconds = body.rpartition("=")
            return Beat("end", name, max(0.0, float(seconds)))
        return Beat("begin", body)
    except ValueError:
        return None
