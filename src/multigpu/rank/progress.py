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

A collective the rank enters is progress too, with no code in the user's loop: a thread of the rank
(``watch_collectives``) reads every process group's sequence number, which the backend (gloo and
NCCL alike) raises as each collective is entered, torch's C++ ones included (DDP's gradient
all-reduce never passes through Python), and beats the total when it moved. Reading a counter costs
a fraction of a microsecond per group per look and nothing per collective; gloo has no completion
hook, and its flight record has no completion times and costs ~22 ms to dump.

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

from multigpu.contract.beats import BEGIN, COLLECTIVES, END, HEARTBEAT, OUTPUT, STEP, clean_name
from multigpu.contract.names import HEARTBEAT_FD_ENV

_fd: int | None = None
_owner: int | None = None
_looked = False


DONE_WAIT_S = 1.0
"""How long a beat that must arrive ("done", "dumped") may wait for room on a full pipe."""
COLLECTIVES_EVERY_S = 0.25
"""How often the rank's collective counter is read: well under the shortest hang timeout (a second)."""


def attach(fd: int) -> None:
    """The bootstrap hands over the descriptor the launcher passed in ``HEARTBEAT_FD_ENV``."""
    global _fd, _owner, _looked
    with contextlib.suppress(OSError):
        os.set_inheritable(fd, False)
    _fd, _owner, _looked = fd, os.getpid(), True
    watch_collectives()


def collectives_entered() -> int | None:
    """The collectives this process has entered, over every live process group; None before torch's
    process group exists (nothing is imported here: a rank without torch pays nothing)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    groups = getattr(world, "pg_map", None)
    if not groups:
        return None
    total = 0
    for group in list(groups):  # a copy: the main thread may add or destroy groups meanwhile
        with contextlib.suppress(Exception):  # a group torn down under us counts nothing
            total += int(group._get_sequence_number_for_group())
    return total


def watch_collectives(every_s: float = COLLECTIVES_EVERY_S) -> None:
    """Start the thread that beats ``C<n>;`` whenever the number of collectives entered changed. Started
    by ``attach``, after the bootstrap blocked the dump signal, so the thread inherits the block."""
    threading.Thread(target=_watch_collectives, args=(every_s,), name="multigpu-collectives",
                     daemon=True).start()


def _watch_collectives(every_s: float) -> None:
    last = None
    while heartbeat_fd() is not None:
        time.sleep(every_s)
        count = collectives_entered()
        if count is not None and count != last:
            last = count
            send(f"{COLLECTIVES}{count};".encode())


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
