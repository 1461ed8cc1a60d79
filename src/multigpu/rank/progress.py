"""Progress reports from the training loop, and the beat protocol that carries them to the launcher.

``multigpu.heartbeat()`` says "alive"; ``multigpu.heartbeat(step=N)`` says "step N is done", and
``with multigpu.section("forward"):`` times a part of a step. The launcher learns each rank's hang
timeout from these (``supervisor/hangs/book.py``) and names the rank that stopped first. Each report is one
non-blocking write of a few bytes on the rank's own heartbeat pipe: a full pipe drops the report
instead of blocking the step (the launcher has unread progress already, and the next step number
says where the rank is). Writes under ``PIPE_BUF`` are atomic, so records never interleave.

Progress is the rank's own. The bootstrap takes the heartbeat descriptor out of the environment and
makes it non-inheritable (``attach``), so nothing the rank starts can write into it, and a process
forked from the rank (a DataLoader worker) does not beat either: only the process that attached does.

A collective the rank enters is progress too, with no code in the user's loop: a thread of the rank
(``watch_collectives``) reads every process group's sequence number, which the backend (gloo and
NCCL alike) raises as each collective is entered, torch's C++ ones included (DDP's gradient
all-reduce never passes through Python), and beats the total when it moved. Reading a counter costs
a fraction of a microsecond per group per look and nothing per collective; gloo has no completion
hook, and its flight record has no completion times and costs ~22 ms to dump.

The same thread stamps when the rank enters collectives, for the launcher's straggler detection
(``supervisor/hangs/lateness.py``): it reads the world group's count every ``ENTRY_POLL_S`` during one
second in three (``SAMPLE_EVERY_S``) and, when it reached n, notes ``time.monotonic()`` (n was
entered since the previous look), sent with the next beat as ``K<n>@<t>;``. Every process on a node
reads the same CLOCK_MONOTONIC, so the launcher compares these times across its node's ranks; only the
world group's collectives have one index on every rank.

The bytes themselves are ``contract/beats.py``'s: that module is the protocol and its one reader.
Runs in the rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

from multigpu.contract.beats import BEGIN, COLLECTIVES, END, ENTERED, HEARTBEAT, OUTPUT, STEP, clean_name
from multigpu.contract.names import HEARTBEAT_FD_ENV

_fd: int | None = None
_owner: int | None = None
_looked = False


DONE_WAIT_S = 1.0
"""How long a beat that must arrive ("done", "dumped") may wait for room on a full pipe."""
COLLECTIVES_EVERY_S = 0.25
"""How often the rank's collective counter is beaten: well under the shortest hang timeout (a second)."""
ENTRY_POLL_S = 0.005
"""How often the world group's count is read: the resolution of a collective's entry time."""
SAMPLE_EVERY_S, SAMPLE_FOR_S = 3.0, 1.0
"""Entry times are taken in the first second of every 3 of the wall clock, the same seconds on every
rank of the node and on every node NTP keeps in step (``rendezvous/node_lateness.py`` compares the
nodes): a third of the looks (a 5 ms look costs ~40 us of a core). The times are monotonic."""
ENTRIES_PER_BEAT = 40
"""Entry times sent with one beat at most (the latest): one write stays far under ``PIPE_BUF``."""


def attach(fd: int) -> None:
    """The bootstrap hands over the descriptor the launcher passed in ``HEARTBEAT_FD_ENV``."""
    global _fd, _owner, _looked
    with contextlib.suppress(OSError):
        os.set_inheritable(fd, False)
    _fd, _owner, _looked = fd, os.getpid(), True
    watch_collectives()


def _groups() -> list[object]:
    """Every live process group; none before torch's process group exists (nothing is imported here:
    a rank without torch pays nothing)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    groups = getattr(getattr(c10d, "_world", None), "pg_map", None)
    return list(groups) if groups else []  # a copy: the main thread may add or destroy groups meanwhile


def _entered(group: object) -> int:
    return int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]


def collectives_entered() -> int | None:
    """The collectives this process has entered, over every live process group; None before torch's
    process group exists."""
    groups = _groups()
    if not groups:
        return None
    total = 0
    for group in groups:
        with contextlib.suppress(Exception):  # a group torn down under us counts nothing
            total += _entered(group)
    return total


def world_entered() -> int | None:
    """The collectives this process has entered in the world group; None without one (no copy of the
    group map: this runs every ``ENTRY_POLL_S`` while sampling)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(getattr(c10d, "_world", None), "default_pg", None)
    if world is None:
        return None
    try:
        return _entered(world)
    except Exception:  # torn down under us
        return None


def watch_collectives(every_s: float = COLLECTIVES_EVERY_S, poll_s: float = ENTRY_POLL_S) -> None:
    """Start the thread that beats ``C<n>;`` whenever the number of collectives entered changed, and the
    world group's entry times. Started by ``attach``, after the bootstrap blocked the dump signal, so
    the thread inherits the block."""
    threading.Thread(
        target=_watch_collectives, args=(every_s, poll_s), name="multigpu-collectives", daemon=True
    ).start()


def _watch_collectives(every_s: float, poll_s: float) -> None:
    last: int | None = None
    seen: int | None = None
    looked_at = beat_at = time.monotonic()
    entries: list[str] = []
    while heartbeat_fd() is not None:
        time.sleep(_pause(time.time(), every_s, poll_s))  # the wall clock's seconds: every node's
        now = time.monotonic()
        world = world_entered()
        if world is not None and world != seen:
            if seen is not None and now - looked_at <= 4 * poll_s:  # else: entered when, since long ago?
                entries.append(f"{ENTERED}{world}@{now:.6f};")
            seen = world
        looked_at = now
        if now - beat_at < every_s:
            continue
        beat_at = now
        count = collectives_entered()
        message = "".join(entries[-ENTRIES_PER_BEAT:])
        entries.clear()
        if count is not None and count != last:
            last = count
            message += f"{COLLECTIVES}{count};"
        if message:
            send(message.encode())


def _pause(now: float, every_s: float, poll_s: float) -> float:
    """``poll_s`` inside a sampling second (``SAMPLE_FOR_S`` of every ``SAMPLE_EVERY_S`` of the wall
    clock ``now``: every rank of every node samples the same collectives), else to the next beat or
    sampling second."""
    phase = now % SAMPLE_EVERY_S
    return poll_s if phase < SAMPLE_FOR_S else min(every_s, SAMPLE_EVERY_S - phase)


def heartbeat_fd() -> int | None:
    """This process's heartbeat descriptor, or None outside a rank (or in a process the rank forked)."""
    global _fd, _owner, _looked
    if not _looked:  # a worker not started by our bootstrap still has the variable
        _looked = True
        value = os.environ.get(HEARTBEAT_FD_ENV)
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
