"""How a rank leaves: like interpreter exit after success, at once after a recorded failure.

Runs in the rank. "Done" goes to the launcher only after everything interpreter exit would do for the
user's code (non-daemon threads, atexit handlers, file buffers) is done, so a crash after that point
(torch's C++ teardown aborting at exit) cannot undo finished work.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import sys
import threading

from multigpu.contract.beats import DONE, FAILING
from multigpu.contract.names import ANNOUNCE_ENV
from multigpu.rank.progress import DONE_WAIT_S, send


def finish_like_exit() -> None:
    """What interpreter exit does for the user's code, done now, then "done" to the launcher."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:  # exactly the interpreter's own step: threading atexits, then the joins
        shutdown()
    else:
        current = threading.current_thread()
        while waiting := [
            t for t in threading.enumerate() if t is not current and not t.daemon and t.is_alive()
        ]:
            for thread in waiting:
                thread.join()
    atexit._run_exitfuncs()
    flush_open_files()
    send(DONE, wait_s=DONE_WAIT_S)


_announced = False


def announce_failure() -> None:
    """Function mode: tell the parent this rank failed, as early as possible, then go on exiting.

    The error file is already written, so the parent can raise the typed error from the beat alone;
    it does not need this rank to linger (rank 0 also learns of the death from the exit itself, and
    aborts its process group, so what it raises does not depend on who wins that race).
    """
    global _announced
    if _announced or os.environ.get(ANNOUNCE_ENV) != "1":
        return
    _announced = True
    send(FAILING)


def exit_failed(code: int) -> None:
    """Leave at once after a recorded failure, the way the peers' launcher needs.

    The user's atexit handlers still run and output is flushed; what is skipped is interpreter
    finalization, where torch's C++ teardown (process groups, stores) takes most of a second after an
    error while the other ranks wait to be stopped.
    """
    announce_failure()
    try:
        atexit._run_exitfuncs()
    finally:
        flush_open_files()
        os._exit(code)


def flush_open_files() -> None:
    """Flush every open writable file object, as finalization would, so no buffered output is lost."""
    buffered = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():
        if type(obj) in buffered:  # exact types: isinstance on the io ABCs is slow over every object
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
