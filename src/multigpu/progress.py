"""Progress reports from the training loop, and the beat protocol that carries them to the launcher.

``multigpu.heartbeat()`` says "alive"; ``multigpu.heartbeat(step=N)`` says "step N is done", and
``with multigpu.section("forward"):`` times a part of a step. The launcher learns each rank's hang
timeout from these (``hang.py``) and names the rank that stopped first. Each report is one
non-blocking write of a few bytes on the rank's own heartbeat pipe: a full pipe drops the report
instead of blocking the step (the launcher has unread progress already, and the next step number
says where the rank is). Writes under ``PIPE_BUF`` are atomic, so records never interleave.

Progress is the rank's own. The bootstrap takes the heartbeat descriptor out of the environment and
makes it non-inheritable (``attach``), so nothing the rank starts can write into it, and a process
forked from the rank (a DataLoader worker) does not beat either: only the process that attached does.

The protocol (bytes on the pipe; ``BeatDecoder`` is its one reader)::

    .            heartbeat()                      o    the rank wrote output (the bootstrap)
    S<n>;        heartbeat(step=n)                D    the script finished (the bootstrap)
    B<name>;     a section begins                 !    the rank is failing (function mode)
    E<name>=<s>; a section ended after s seconds  F    a flight-recorder dump was written
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

_fd: int | None = None
_owner: int | None = None
_looked = False

HEARTBEAT, OUTPUT, DONE, FAILING, DUMPED = b".", b"o", b"D", b"!", b"F"
STEP, BEGIN, END = "S", "B", "E"
_SINGLE = {HEARTBEAT[0]: "beat", OUTPUT[0]: "output", DONE[0]: "done", FAILING[0]: "failing",
           DUMPED[0]: "dumped"}
_RECORD = {ord(STEP): "step", ord(BEGIN): "begin", ord(END): "end"}
MAX_NAME = 64
MAX_RECORD = 128
"""A record longer than this without its ``;`` is garbage (a rank writing to the wrong descriptor)."""
_NAME_BAD = re.compile(r"[;=\x00-\x1f]")


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


def heartbeat(step: int | None = None) -> None:
    """Cheap enough for every training step; does nothing outside a multigpu worker.

    With ``step``, the launcher learns this rank's step interval and times a hang from it (see
    ``--hang-timeout``); call it once per optimizer step, after the step, with a growing number.
    """
    if step is None:
        send(HEARTBEAT)
    else:
        send(f"{STEP}{int(step)};".encode())


def output_beat() -> None:
    """The bootstrap's beat when the rank writes output: progress only for ranks without steps."""
    send(OUTPUT)


def clean_name(name: str) -> str:
    return _NAME_BAD.sub("_", str(name))[:MAX_NAME] or "_"


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """Time a part of the step (``"forward"``, ``"checkpoint"``). Its duration is reported at its end.

    Per rank, section times show a straggler (synchronous collectives make every rank's step take
    the same time, but not the time spent before the collective). A section the launcher has not
    seen end yet gets the ceiling (``--hang-timeout``) as its timeout, so wrap rare long work such
    as saving a checkpoint in one.
    """
    label = clean_name(name)
    send(f"{BEGIN}{label};".encode())
    start = time.perf_counter()
    try:
        yield
    finally:
        send(f"{END}{label}={time.perf_counter() - start:.6f};".encode())


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


@dataclass(frozen=True)
class Beat:
    """One decoded report: ``kind`` is beat, output, done, failing, dumped, step, begin or end."""

    kind: str
    name: str = ""
    value: float = 0.0


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
            beat = _record(_RECORD[byte], bytes(buf[i + 1:end]).decode(errors="replace"))
            if beat is not None:
                beats.append(beat)
            i = end + 1
        self._pending = bytearray(buf[i:])
        return beats


def _record(kind: str, body: str) -> Beat | None:
    try:
        if kind == "step":
            return Beat("step", value=float(int(body)))
        if kind == "end":
            name, _, seconds = body.rpartition("=")
            return Beat("end", name, max(0.0, float(seconds)))
        return Beat("begin", body)
    except ValueError:
        return None
