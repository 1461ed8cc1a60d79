"""What a rank tells about itself on request: its Python stacks and torch's flight record.

Runs in the rank. The launcher (``supervisor/dumps.py``) sends ``DUMP_SIGNAL`` for the stacks, which
faulthandler writes to stderr, and ``FR_SIGNAL`` for the flight record, which a thread of this module
writes to the file ``FR_DUMP_ENV`` names, then beats "F". The dump format is read back by
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

from multigpu.contract.beats import DUMPED
from multigpu.contract.flight_dump import load_dump
from multigpu.contract.names import FR_DUMP_ENV
from multigpu.contract.signals import DUMP_SIGNAL, FR_SIGNAL
from multigpu.rank.progress import DONE_WAIT_S, send


def register_stack_dumps() -> None:
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def arm_flight_recorder() -> None:
    """With ``FR_DUMP_ENV`` set, a thread waits for ``FR_SIGNAL`` and then writes torch's
    collective flight record to ``<FR_DUMP_ENV><rank>`` and beats "F".

    A thread, not a handler: a rank hung in a collective sits in C++ with the GIL released, where a
    Python signal handler would never run but another thread can. The signal is blocked first, before
    any other thread exists, so every thread inherits the block and only ``sigwait`` receives it.
    """
    prefix = os.environ.get(FR_DUMP_ENV)
    if not prefix:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {FR_SIGNAL})
    threading.Thread(target=_flight_recorder_loop, args=(prefix,), name="multigpu-flight-recorder",
                     daemon=True).start()


def _flight_recorder_loop(prefix: str) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {DUMP_SIGNAL})  # stack dumps: taken by the other threads
    while True:
        signal.sigwait({FR_SIGNAL})
        with contextlib.suppress(Exception):  # a dump that fails must not take the rank down
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
