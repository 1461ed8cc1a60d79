"""The worker bootstrap: ``python -m multigpu.worker {script|module|function} TARGET [ARGS...]``.

Before any user code runs it (1) ties the worker's fate to its launcher, (2) registers faulthandler
for crashes and on-demand stack dumps, (3) serves the c10d store on rank 0 when asked to, and then
runs the target, recording an uncaught exception in a per-rank error file. No decorator needed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import runpy
import select
import signal
import sys
import threading
import time
from types import TracebackType
from typing import Any

DUMP_SIGNAL = signal.SIGURG
"""Sent by the launcher to make a rank write the Python stacks of all its threads to stderr.

SIGURG is ignored by default, so a rank that has not registered the dump yet, or is already shutting
down, is left alone rather than killed."""

_store: Any = None  # keeps rank 0's store server alive for the life of the process


def end_own_group() -> None:
    """SIGKILL this worker's process group: the worker and everything it started."""
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(137)


def _watch_parent(pidfd: int | None, parent: int) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])
    else:
        while os.getppid() == parent:
            time.sleep(0.1)
    end_own_group()


def guard_parent(expected_parent: int | None) -> None:
    """End the worker's whole group within moments of the launcher's death, whatever the worker is doing.

    A pidfd wakes a daemon thread the instant the launcher exits; checking the parent PID after opening
    it closes the race with a launcher that died while this process was starting. The thread, not a
    parent-death signal, does the killing, so the worker's own children go too: a SIGKILL from the
    kernel would end the worker before it could end them. Only across ``exec``, where the thread is
    gone, does the kernel's parent-death SIGKILL take over (``arm_pdeathsig_on_exec``).
    """
    global _guarded
    if expected_parent is None or _guarded:
        return
    _guarded = True
    arm_pdeathsig_on_exec(expected_parent)
    try:
        pidfd: int | None = os.pidfd_open(expected_parent)
    except (AttributeError, OSError):
        pidfd = None
    if os.getppid() != expected_parent:
        end_own_group()
    threading.Thread(target=_watch_parent, args=(pidfd, expected_parent), name="multigpu-parent-watch",
                     daemon=True).start()


_guarded = False
PR_SET_PDEATHSIG = 1


def set_pdeathsig(sig: int) -> bool:
    try:
        import ctypes

        return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def arm_pdeathsig_on_exec(expected_parent: int) -> None:
    """Wrap ``os.execv``/``os.execve`` so a worker that replaces itself keeps a parent-death signal."""
    def wrap(exec_function: Any) -> Any:
        def arming_exec(*args: Any) -> Any:
            set_pdeathsig(signal.SIGKILL)
            if os.getppid() != expected_parent:  # the launcher died just now: do not start the program
                end_own_group()
            return exec_function(*args)

        return arming_exec

    os.execv = wrap(os.execv)
    os.execve = wrap(os.execve)


def register_stack_dumps() -> None:
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def serve_store_if_asked() -> None:
    """Rank 0 serves the launcher's c10d store on the listening socket it inherited."""
    global _store
    fd = os.environ.pop("MULTIGPU_STORE_FD", None)
    if fd is None:
        return
    from .rendezvous import serve_store

    _store = serve_store(int(fd), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))


def user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop the bootstrap's own frames (this file and runpy) from the front of a traceback."""
    ours = os.path.dirname(os.path.abspath(__file__))
    start = tb
    while start is not None:
        filename = start.tb_frame.f_code.co_filename
        if not filename.startswith(ours) and "runpy" not in filename and filename != spawn_file():
            break
        start = start.tb_next
    return start or tb


def spawn_file() -> str:
    import multiprocessing.spawn

    return str(multiprocessing.spawn.__file__)


def write_error_file(path: str, exc: BaseException) -> None:
    """Record an uncaught exception for the launcher's report, in the one record format (errors.py).

    In function mode the parent is told at once: the record is all it needs to raise the typed error.
    """
    from .errors import WorkerFailure

    WorkerFailure.from_exception(exc).write(path)
    announce_failure()


def run_script(path: str, args: list[str]) -> None:
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    runpy.run_path(path, run_name="__main__")


def run_module(name: str, args: list[str]) -> None:
    sys.argv = [name, *args]
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def run_function(payload_path: str) -> None:
    """Function mode: spawn semantics (the parent's ``__main__`` re-imported as ``__mp_main__``)."""
    from multiprocessing import spawn

    with open(payload_path, "rb") as f:
        preparation = pickle.load(f)
        spawn.prepare(preparation)
        func, args = pickle.load(f)
    func(*args)


def run_target(mode: str, target: str, args: list[str]) -> None:
    if mode == "script":
        run_script(target, args)
    elif mode == "module":
        run_module(target, args)
    elif mode == "function":
        run_function(target)
    else:
        raise SystemExit(f"multigpu.worker: unknown mode {mode!r}")


FAILING_BEAT = b"!"
ANNOUNCE_ENV = "MULTIGPU_ANNOUNCE_FAILURE"
_announced = False


def announce_failure() -> None:
    """Function mode: tell the parent this rank failed, as early as possible, then go on exiting.

    The error file is already written, so the parent can raise the typed error from the beat alone;
    it does not need this rank to linger (rank 0 also learns of the death from the exit itself, and
    aborts its process group, so what it raises does not depend on who wins that race).
    """
    global _announced
    fd = os.environ.get("MULTIGPU_HEARTBEAT_FD")
    if _announced or os.environ.get(ANNOUNCE_ENV) != "1" or not fd:
        return
    _announced = True
    with contextlib.suppress(OSError):
        os.write(int(fd), FAILING_BEAT)


def exit_failed(code: int) -> None:
    """Leave at once after a recorded failure, the way the peers' launcher needs.

    The user's atexit handlers still run and output is flushed; what is skipped is interpreter
    finalization, where torch's C++ teardown (process groups, stores) takes most of a second after an
    error while the other ranks wait to be stopped.
    """
    import atexit

    announce_failure()
    try:
        atexit._run_exitfuncs()
    finally:
        flush_open_files()
        os._exit(code)


def flush_open_files() -> None:
    """Flush every open writable file object, as finalization would, so no buffered output is lost."""
    import gc
    import io

    buffered = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():
        if type(obj) in buffered:  # exact types: isinstance on the io ABCs is slow over every object
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        raise SystemExit("usage: python -m multigpu.worker {script|module|function} TARGET [ARGS...]")
    mode, target, *args = argv
    launcher = os.environ.get("MULTIGPU_LAUNCHER_PID")
    guard_parent(int(launcher) if launcher else None)
    register_stack_dumps()
    error_file = os.environ.get("MULTIGPU_ERROR_FILE")
    try:
        serve_store_if_asked()
        from .progress import heartbeat

        heartbeat()  # start-up (rank 0 imports torch to serve the store) is not a hang
        run_target(mode, target, args)
    except SystemExit:
        raise
    except BaseException as exc:
        exc.__traceback__ = user_frames(exc.__traceback__)
        if error_file:
            write_error_file(error_file, exc)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        exit_failed(130 if isinstance(exc, KeyboardInterrupt) else 1)


if __name__ == "__main__":
    main()
