"""What a rank tells about itself on request: its Python stacks and torch's flight record.

Runs in the rank. The launcher (``supervisor/hangs/stack_dumps.py``) sends ``FR_SIGNAL``: a thread of
this module writes the stacks to stderr and beats "T", then writes the flight record to the file
``FR_DUMP_ENV`` names and beats "F". To a rank without that thread, or whose thread does not answer, it sends
``DUMP_SIGNAL``, which faulthandler's C handler answers with the stacks alone. The dump format is read back by
``contract/flight_dump.py``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
from pathlib import Path

from multigpu.contract.beats import DUMPED, STACKS
from multigpu.contract.flight_dump import load_dump
from multigpu.contract.names import FR_DUMP_ENV
from multigpu.contract.signals import DUMP_SIGNAL, FR_SIGNAL
from multigpu.rank.progress import DONE_WAIT_S, send


def register_stack_dumps() -> None:
    """faulthandler for crashes, and for ``DUMP_SIGNAL``: its C handler writes the stacks even while
    a thread holds the GIL forever, where no Python code of ours can run."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def arm_dumps() -> None:
    """With ``FR_DUMP_ENV`` set, a thread answers the launcher's ``FR_SIGNAL``: it writes every
    thread's Python stacks to stderr and beats "T", then (where ``FR_DUMP_ENV`` names a prefix)
    writes torch's collective flight record to ``<prefix><rank>`` and beats "F".

    The beats are why: the launcher knows the stacks are complete the moment "T" arrives, instead of
    waiting for the rank's output to go quiet (a failed job's teardown waited ~45 ms for that). A
    thread, not a handler: a rank hung in a collective sits in C++ with the GIL released, where a
    Python signal handler would never run but another thread can. A rank whose thread does not
    answer (a thread holds the GIL) gets ``DUMP_SIGNAL``, faulthandler's C handler, instead. The
    signal is blocked first, before any other thread exists, so every thread inherits the block and
    only ``sigwait`` receives it.
    """
    prefix = os.environ.get(FR_DUMP_ENV)
    if prefix is None:
        return
    block_dump_requests()
    threading.Thread(target=_answer_dumps, args=(prefix,), name="multigpu-dumps", daemon=True).start()


def block_dump_requests() -> None:
    """Block ``FR_SIGNAL`` in the calling thread, and so in every thread it starts from now on.

    Its default action ends the process, and the kernel hands a process-directed signal to any thread
    that does not block it: one thread started before this (a forked rank's OpenMP or BLAS pool,
    sized before the bootstrap ran) and the launcher's dump request killed the rank with signal 47.
    A rank forked from the template calls this first thing (``template/child.py``), a fresh one in
    ``arm_dumps``, before any other thread exists."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {FR_SIGNAL})


def _answer_dumps(prefix: str) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {DUMP_SIGNAL})  # faulthandler's: taken by the other threads
    while True:
        signal.sigwait({FR_SIGNAL})
        with contextlib.suppress(Exception):  # a dump that fails must not take the rank down
            faulthandler.dump_traceback(file=sys.__stderr__ or sys.stderr, all_threads=True)
        send(STACKS, wait_s=DONE_WAIT_S)
        if prefix:
            with contextlib.suppress(Exception):
                write_dump(prefix)
            send(DUMPED, wait_s=DONE_WAIT_S)


def write_dump(prefix: str) -> Path | None:
    """Write this process's flight record to ``<prefix><RANK>``; None when torch is not in use here."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None

    c10d = getattr(torch._C, "_distributed_c10d", None)
    raw = None
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        data = dump(True, False, False)  # collectives, no C++ stacks (the report has Python's), all
        if raw is None or load_dump(data).get("entries"):
            raw = data
        if load_dump(raw).get("entries"):
            break
    if raw is None:
        return None
    path = Path(f"{prefix}{os.environ.get('RANK', '0')}")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
    return path
