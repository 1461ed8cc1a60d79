"""``--no-python``: the bootstrap stays as a small parent of PROGRAM, so the rank's guarantees hold.

Runs in the rank, in place of a Python target.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import sys

from multigpu.contract.prctl import set_pdeathsig
from multigpu.contract.signals import CAUGHT, DUMP_SIGNAL
from multigpu.rank.exiting import flush_open_files
from multigpu.rank.guard import ENDING, PLAIN_EXECVE


def run_program(program: str, args: list[str]) -> None:
    """``--no-python``: run PROGRAM as a child and end the way it ends.

    Why not just ``exec``: a program that is not Python cannot keep this bootstrap's guarantees. The
    kernel's parent-death signal would kill PROGRAM if the launcher died, but not PROGRAM's own
    children. So the bootstrap stays as a small parent: its watchdog thread still ends the whole
    process group when the launcher dies. The launcher signals the group, so
    PROGRAM receives every signal directly; this parent ignores them (ignoring is process-wide, where a
    blocked mask would only cover this thread, not the watchdog's or the store's) and waits, then exits
    with PROGRAM's code, or dies of PROGRAM's signal, so the report reads as for a Python rank.
    """
    for sig in CAUGHT:
        signal.signal(sig, signal.SIG_IGN)
    faulthandler.unregister(DUMP_SIGNAL)
    faulthandler.disable()
    pid = os.fork()
    if pid == 0:  # the child: default signal handling (an ignored signal stays ignored across exec)
        try:
            for sig in CAUGHT:
                signal.signal(sig, signal.SIG_DFL)
            set_pdeathsig(signal.SIGKILL)
            PLAIN_EXECVE(shutil.which(program) or program, [program, *args], os.environ)
        except OSError as exc:
            print(f"multigpu: cannot run {program!r}: {exc}", file=sys.stderr, flush=True)
        finally:
            os._exit(127)
    status = os.waitpid(pid, 0)[1]
    flush_open_files()
    if os.WIFSIGNALED(status):
        died_of = os.WTERMSIG(status)
        if ENDING.is_set():  # the guard's SIGKILL (the launcher is gone): it ends this process too
            while True:
                signal.pause()
        with contextlib.suppress(OSError):  # SIGKILL (a file timer's, the OOM killer's) takes no handler
            signal.signal(died_of, signal.SIG_DFL)
        os.kill(os.getpid(), died_of)
    os._exit(os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 128 + os.WTERMSIG(status))
