"""The worker bootstrap: ``python -m multigpu.worker {script|module|function|exec} TARGET [ARGS...]``.

Before any user code runs it (1) ties the worker's fate to its launcher, (2) registers faulthandler
for crashes and on-demand stack dumps, (3) takes the heartbeat descriptor out of the environment and
beats whenever the rank itself writes to stdout or stderr, (4) serves the c10d store when asked to
(``MULTIGPU_STORE_FD``; the launcher no longer asks: the node's template or store process serves it,
see ``template.py``), and then runs the target, recording an uncaught exception in a per-rank error file. No
decorator needed. When the target returns, the bootstrap finishes what interpreter exit would (non-
daemon threads, atexit handlers, file buffers) and only then tells the launcher "done": a crash after
that point (torch's C++ teardown aborting at exit) cannot undo finished work.
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
import warnings
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

    The thread cannot run in a rank that is stopped (SIGSTOP) or holds the GIL in a long C call, so a
    sentinel process (``start_sentinel``) watches too: it needs neither the rank's GIL nor its
    scheduling, and ends the same group.
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
    if pidfd is not None:
        start_sentinel(pidfd)
    threading.Thread(target=_watch_parent, args=(pidfd, expected_parent), name="multigpu-parent-watch",
                     daemon=True).start()


_guarded = False
PR_SET_PDEATHSIG = 1


def start_sentinel(launcher_pidfd: int) -> None:
    """Fork (twice, so the rank never has to reap it) a process that SIGKILLs the rank's group when
    the launcher dies, and leaves quietly when the rank ends. Done before any thread or user code.

    It keeps only the two pidfds (no copy of the rank's pipes, so it never holds the launcher's
    output open) and runs nothing but select and kill.
    """
    try:
        rank_pidfd = os.pidfd_open(os.getpid())
        middle = os.fork()
    except OSError:
        return
    if middle:
        os.close(rank_pidfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(middle, 0)
        return
    try:  # the middle process: fork the sentinel and leave at once
        if os.fork():
            os._exit(0)
        keep = {launcher_pidfd, rank_pidfd}
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd > 2 and fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        ready, _, _ = select.select([launcher_pidfd, rank_pidfd], [], [])
        if launcher_pidfd in ready and rank_pidfd not in ready:
            with contextlib.suppress(OSError):
                os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(0)


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


def arm_flight_recorder() -> None:
    """With ``MULTIGPU_FR_DUMP`` set, a thread waits for ``FR_SIGNAL`` and then writes torch's
    collective flight record to ``<MULTIGPU_FR_DUMP><rank>`` and beats "F".

    A thread, not a handler: a rank hung in a collective sits in C++ with the GIL released, where a
    Python signal handler would never run but another thread can. The signal is blocked first, before
    any other thread exists, so every thread inherits the block and only ``sigwait`` receives it.
    """
    from .flight_recorder import FR_ENV, FR_SIGNAL

    prefix = os.environ.get(FR_ENV)
    if not prefix:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {FR_SIGNAL})
    threading.Thread(target=_flight_recorder_loop, args=(prefix,), name="multigpu-flight-recorder",
                     daemon=True).start()


def _flight_recorder_loop(prefix: str) -> None:
    from .flight_recorder import FR_SIGNAL, write_dump
    from .progress import DUMPED, send

    signal.pthread_sigmask(signal.SIG_BLOCK, {DUMP_SIGNAL})  # stack dumps: taken by the other threads
    while True:
        signal.sigwait({FR_SIGNAL})
        with contextlib.suppress(Exception):  # a dump that fails must not take the rank down
            write_dump(prefix)
        send(DUMPED, wait_s=DONE_WAIT_S)


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


_EXECVE = os.execve
"""The plain ``execve``: ``arm_pdeathsig_on_exec`` wraps ``os.execve`` for the rank itself, and its
parent check would take the exec shim for an orphan."""
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


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
    for sig in PASSED_ON:
        signal.signal(sig, signal.SIG_IGN)
    faulthandler.unregister(DUMP_SIGNAL)
    faulthandler.disable()
    pid = os.fork()
    if pid == 0:  # the child: default signal handling (an ignored signal stays ignored across exec)
        try:
            for sig in PASSED_ON:
                signal.signal(sig, signal.SIG_DFL)
            set_pdeathsig(signal.SIGKILL)
            import shutil

            _EXECVE(shutil.which(program) or program, [program, *args], os.environ)
        except OSError as exc:
            print(f"multigpu: cannot run {program!r}: {exc}", file=sys.stderr, flush=True)
        finally:
            os._exit(127)
    status = os.waitpid(pid, 0)[1]
    flush_open_files()
    if os.WIFSIGNALED(status):
        died_of = os.WTERMSIG(status)
        signal.signal(died_of, signal.SIG_DFL)
        os.kill(os.getpid(), died_of)
    os._exit(os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 128 + os.WTERMSIG(status))


def run_target(mode: str, target: str, args: list[str]) -> None:
    if mode == "exec":
        run_program(target, args)
    elif mode == "script":
        run_script(target, args)
    elif mode == "module":
        run_module(target, args)
    elif mode == "function":
        run_function(target)
    else:
        raise SystemExit(f"multigpu.worker: unknown mode {mode!r}")


FAILING_BEAT = b"!"  # progress.py lists the whole beat protocol
DONE_BEAT = b"D"
DONE_WAIT_S = 1.0
NUMPY_WARNING = "Failed to initialize NumPy"


class _BeatingStream:
    """sys.stdout/sys.stderr as they were, plus a heartbeat (at most every 50 ms) on each write by
    this process: a rank's own output is progress (for ranks that report no steps), its children's
    output (same pipe) is not."""

    def __init__(self, stream: Any) -> None:
        object.__setattr__(self, "_stream", stream)
        object.__setattr__(self, "_next", 0.0)

    def _beat(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            object.__setattr__(self, "_next", now + 0.05)
            from .progress import output_beat

            output_beat()

    def write(self, text: str) -> int:
        self._beat()
        return int(self._stream.write(text))

    def writelines(self, lines: Any) -> None:
        self._beat()
        self._stream.writelines(lines)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._stream, name, value)


def take_heartbeat() -> None:
    """Own the heartbeat descriptor: out of the environment (grandchildren never see it), not
    inheritable, and output written by this process counts as progress."""
    from .progress import attach

    fd = os.environ.pop("MULTIGPU_HEARTBEAT_FD", None)
    if fd is None or not fd.isdigit():
        return
    attach(int(fd))
    sys.stdout = _BeatingStream(sys.stdout)  # type: ignore[assignment]
    sys.stderr = _BeatingStream(sys.stderr)  # type: ignore[assignment]


def quiet_numpy_warning() -> None:
    """torch installs without numpy and then warns "Failed to initialize NumPy" at import, once per
    rank. Nothing is lost by hiding exactly that warning, for every script: code that uses numpy
    fails at its own ``import numpy`` or gets torch's explicit "Numpy is not available" error."""
    warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)


def finish_like_exit() -> None:
    """What interpreter exit does for the user's code, done now, then "done" to the launcher."""
    import atexit

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:  # exactly the interpreter's own step: threading atexits, then the joins
        shutdown()
    else:
        current = threading.current_thread()
        while waiting := [t for t in threading.enumerate()
                          if t is not current and not t.daemon and t.is_alive()]:
            for thread in waiting:
                thread.join()
    atexit._run_exitfuncs()
    flush_open_files()
    from .progress import send

    send(DONE_BEAT, wait_s=DONE_WAIT_S)
ANNOUNCE_ENV = "MULTIGPU_ANNOUNCE_FAILURE"
_announced = False


def announce_failure() -> None:
    """Function mode: tell the parent this rank failed, as early as possible, then go on exiting.

    The error file is already written, so the parent can raise the typed error from the beat alone;
    it does not need this rank to linger (rank 0 also learns of the death from the exit itself, and
    aborts its process group, so what it raises does not depend on who wins that race).
    """
    global _announced
    from .progress import send

    if _announced or os.environ.get(ANNOUNCE_ENV) != "1":
        return
    _announced = True
    send(FAILING_BEAT)


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
        raise SystemExit("usage: python -m multigpu.worker {script|module|function|exec} TARGET [ARGS...]")
    mode, target, *args = argv
    if mode != "exec":
        arm_flight_recorder()  # first: the signal must be blocked before any thread starts
    launcher = os.environ.get("MULTIGPU_LAUNCHER_PID")
    guard_parent(int(launcher) if launcher else None)
    from .numa import apply_affinity

    apply_affinity()  # --numa-binding: before user code, so its threads inherit it
    register_stack_dumps()
    from .preemption import install as record_preemption_warnings

    record_preemption_warnings()  # SLURM's warning signal: recorded for the loop, no longer fatal
    take_heartbeat()
    quiet_numpy_warning()
    error_file = os.environ.get("MULTIGPU_ERROR_FILE")
    try:
        serve_store_if_asked()
        from .progress import heartbeat

        heartbeat()  # start-up (rank 0 imports torch to serve the store) is not a hang
        run_target(mode, target, args)
    except SystemExit as exc:
        if exc.code in (0, None):
            finish_like_exit()
        raise
    except BaseException as exc:
        exc.__traceback__ = user_frames(exc.__traceback__)
        if error_file:
            write_error_file(error_file, exc)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        exit_failed(130 if isinstance(exc, KeyboardInterrupt) else 1)
    else:
        finish_like_exit()


if __name__ == "__main__":
    main()
