"""The rank bootstrap: ``python -m multigpu.rank {script|module|function|exec} TARGET [ARGS...]``.

Runs in every rank, fresh (``rank/__main__.py``) or forked from the template (``template/child.py``).
Before any user code runs it (1) ties the rank's fate to its launcher (``guard``), (2) registers
faulthandler for crashes and the launcher's stack-dump and flight-record requests (``dumps``), (3)
takes the heartbeat descriptor out of the environment and beats whenever the rank itself writes to
stdout or stderr (``streams``), and then runs the target, recording an uncaught exception in the
rank's error file (``WorkerFailure``). No decorator needed. How the rank then leaves is ``exiting``'s.
"""

from __future__ import annotations

import os
import pickle
import runpy
import stat
import sys
import time
from types import TracebackType
from typing import BinaryIO

from multigpu.contract.names import AFFINITY_ENV, ERROR_FILE_ENV, LAUNCHER_PID_ENV, parse_cpulist
from multigpu.rank.debug_server import start_if_asked as start_debug_server
from multigpu.rank.dump_signal import arm_dumps, register_stack_dumps
from multigpu.rank.exiting import announce_failure, exit_failed, finish_like_exit
from multigpu.rank.guard import guard_parent
from multigpu.rank.preempted import install as record_preemption_warnings
from multigpu.rank.progress import heartbeat
from multigpu.rank.std_streams import take_heartbeat


def user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop the frames that started the user's code (ours, runpy's) from the front of a traceback."""
    from multigpu.contract.frames import starter_frame  # only on a failure: start-up stays lean

    start = tb
    while start is not None and starter_frame(start.tb_frame):
        start = start.tb_next
    return start or tb


def write_error_file(path: str, exc: BaseException) -> None:
    """Record an uncaught exception for the launcher's report, in the one record format (errors.py).

    In function mode the parent is told at once: the record is all it needs to raise the typed error.
    """
    from multigpu.contract.failure import WorkerFailure

    WorkerFailure.from_exception(exc).write(path)
    announce_failure()


PEER_LOST_QUIET_S = 3.0
"""Long enough for the launcher to learn that a peer's whole node is gone (a killed launcher is
found by its silence, a second or two on a loaded machine) and stop this rank. A peer rank that
died on a live node is reported by its launcher at once, so that stop comes in milliseconds."""


def quiet_if_stopping(exc: BaseException) -> None:
    """Before printing the traceback of a collective that failed because a peer's connection closed,
    wait a moment for SIGTERM. Most often that failure is the job being stopped: ``scancel`` or a
    time limit SIGTERMs every process of a step, one node a moment after another, and the launcher
    stops every rank after a peer's failure. SIGTERM's default action then ends this rank silently,
    its error record already written, instead of a traceback of a mere consequence on the console.
    A rank whose job is not being stopped prints it ``PEER_LOST_QUIET_S`` later."""
    from multigpu.contract.failure import PEER_LOST_MARKERS

    if any(marker in str(exc) for marker in PEER_LOST_MARKERS):
        time.sleep(PEER_LOST_QUIET_S)


def run_script(path: str, args: list[str]) -> None:
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    runpy.run_path(path, run_name="__main__")


def run_module(name: str, args: list[str]) -> None:
    sys.argv = [name, *args]
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def open_payload(path: str) -> BinaryIO:
    """Function mode's payload, opened only when it is still what the caller wrote: a file (not a link)
    of this user's that nobody else can read or write (0600). Whoever could swap it would run code as
    this user; a payload that fails the check is refused, naming what is wrong."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    wrong = (
        "is not a regular file"
        if not stat.S_ISREG(st.st_mode)
        else f"belongs to uid {st.st_uid}, not this user's {os.geteuid()}"
        if st.st_uid != os.geteuid()
        else f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0600"
        if st.st_mode & 0o077
        else None
    )
    if wrong is not None:
        os.close(fd)
        raise PermissionError(
            f"multigpu: refusing the function-mode payload {path}: it {wrong}; it is "
            f"not the file the caller wrote"
        )
    return os.fdopen(fd, "rb")


def run_function(payload_path: str) -> None:
    """Function mode: spawn semantics (the parent's ``__main__`` re-imported as ``__mp_main__``)."""
    from multiprocessing import spawn

    with open_payload(payload_path) as f:
        preparation = pickle.load(f)
        spawn.prepare(preparation)
        func, args = pickle.load(f)
    func(*args)


def run_target(mode: str, target: str, args: list[str]) -> None:
    if mode == "exec":
        from multigpu.rank.program import run_program

        run_program(target, args)
    elif mode == "script":
        run_script(target, args)
    elif mode == "module":
        run_module(target, args)
    elif mode == "function":
        run_function(target)
    else:
        raise SystemExit(f"multigpu.rank: unknown mode {mode!r}")


def apply_affinity(env: dict[str, str] | None = None) -> None:
    """Bind this process to the CPUs the launcher chose (``--numa-binding``), if it chose any."""
    text = (os.environ if env is None else env).get(AFFINITY_ENV)
    if text:
        os.sched_setaffinity(0, parse_cpulist(text))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        raise SystemExit("usage: python -m multigpu.rank {script|module|function|exec} TARGET [ARGS...]")
    mode, target, *args = argv
    if mode != "exec":
        arm_dumps()  # first: the signal must be blocked before any thread starts
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    guard_parent(int(launcher) if launcher else None)
    apply_affinity()  # --numa-binding: before user code, so its threads inherit it
    register_stack_dumps()
    record_preemption_warnings()  # SLURM's warning signal: recorded for the loop, no longer fatal
    take_heartbeat()
    error_file = os.environ.get(ERROR_FILE_ENV)
    try:
        heartbeat()  # start-up is not a hang
        start_debug_server()  # --debug-server only
        run_target(mode, target, args)
    except SystemExit as exc:
        if exc.code in (0, None):
            finish_like_exit()
        raise
    except BaseException as exc:
        exc.__traceback__ = user_frames(exc.__traceback__)
        if error_file:
            write_error_file(error_file, exc)
        quiet_if_stopping(exc)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        exit_failed(130 if isinstance(exc, KeyboardInterrupt) else 1)
    else:
        finish_like_exit()
