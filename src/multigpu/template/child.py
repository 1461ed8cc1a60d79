"""A rank forked from the template, made indistinguishable from a freshly started one, then bootstrapped.

What a fresh ``python -m multigpu.rank`` would have and a fork would not, set right here, before
the normal bootstrap (``rank/bootstrap.main``) runs: its own session and process group; stdin on /dev/null,
stdout and stderr on its own pipes, and no other descriptor than the ones its spec passes (at the
numbers the spec's environment names); exactly its spec's environment (``os.environ`` is edited in
place, so C code's ``getenv`` sees it too: CUDA reads ``CUDA_VISIBLE_DEVICES`` only at its first use,
which comes later), its working directory, ``sys.argv`` and ``sys.path[0]`` as ``-m`` sets them;
stdout/stderr buffered as a fresh interpreter would buffer them; Python's signal dispositions;
NumPy's and torch's default random state drawn anew (Python's own ``random`` is reseeded by its
at-fork hook), a new multiprocessing auth key, and its thread pools sized by its own environment
(``pools.py``: the template's are held to one thread). The template had one thread, so nothing
inherited runs. The parent watchdog is the bootstrap's own, pointed at the launcher, once the
kernel has re-parented this process there (the middle process exits right after forking it).

Known differences: the objects the template made before forking are frozen out of the garbage
collector (``gc.freeze``: ``gc.get_freeze_count()`` is not 0), and the string hash seed
(``PYTHONHASHSEED``) is the template's, fixed at interpreter start; every rank of a node shares it,
as ranks under ``PYTHONHASHSEED=0`` do.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, NoReturn

from multigpu.rank.dump_signal import block_dump_requests
from multigpu.template.pools import Pools

REPARENT_WAIT_S = 5.0


def become_rank(
    request: dict[str, Any], fds: list[int], control: socket.socket, middle: int, pools: Pools
) -> NoReturn:
    """Turn this fresh fork of ``middle`` into the rank ``request`` describes and run it; never returns.

    ``middle`` comes from the middle process itself: read here with ``getppid()`` it would already be
    the launcher's pid whenever the middle exited first, and the rank would wait for a re-parenting
    that had already happened (the 5 s stall some starts showed).
    """
    code = 1
    try:
        block_dump_requests()  # before any thread starts here (the pools below start some)
        os.setsid()
        place_descriptors(fds, list(request["fds"]), control.detach())
        reset_signals()
        replace_environment(request["env"])
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]
        reopen_std_streams()
        reseed()
        pools.apply(os.environ)
        disown_template_finalizers()
        wait_for_launcher(middle)
        code = run_program(list(request["argv"]))
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        finish(code)
    raise AssertionError("unreachable")  # finish() never returns


def place_descriptors(received: list[int], targets: list[int], control_fd: int) -> None:
    """stdin on /dev/null; each received descriptor at its target number; nothing else open."""
    os.close(control_fd)
    floor = max([*targets, *received, 2]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in received]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, target in zip(high, targets, strict=True):
        os.dup2(fd, target)  # inheritable, as Popen's pass_fds leaves them
    keep = {0, 1, 2, *targets}
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def reset_signals() -> None:
    """What a fresh interpreter installs: Python's SIGINT handler and the default for the rest."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)


def replace_environment(env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)


def reopen_std_streams() -> None:
    """New text streams on 0/1/2, buffered as interpreter start-up would choose for these files."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))

    def stream(fd: int, old: Any, line_buffering: bool) -> io.TextIOWrapper:
        writing = fd != 0
        raw = io.FileIO(fd, "w" if writing else "r", closefd=False)
        binary: Any = (
            raw
            if (unbuffered and writing)
            else (io.BufferedWriter(raw) if writing else io.BufferedReader(raw))
        )
        return io.TextIOWrapper(
            binary,
            encoding=getattr(old, "encoding", None),
            errors=getattr(old, "errors", None),
            line_buffering=line_buffering,
            write_through=unbuffered and writing,
        )

    for name, fd, line_buffering in (("stdin", 0, False), ("stdout", 1, os.isatty(1)), ("stderr", 2, True)):
        new = stream(fd, getattr(sys, f"__{name}__"), line_buffering)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def reseed() -> None:
    """Random state a fresh process would have drawn for itself (Python's ``random`` is reseeded by
    its own at-fork hook)."""
    if "numpy" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["numpy"].random.seed()
    import multiprocessing.process

    multiprocessing.process.current_process().authkey = os.urandom(32)
    import torch

    torch.default_generator.seed()


def disown_template_finalizers() -> None:
    """The template's ``weakref.finalize`` callbacks stay the template's: they are for its objects
    (torch.library's op registrations; a ``--preload`` module's temporary folder, which a rank's exit
    must not delete while the template and the other ranks use it). Run at each rank's exit they also
    cost about 30 ms of CPU and 7,000 copied pages per rank (two seconds of a 64-rank job's two cores),
    for registrations that end with the process anyway. Finalizers the rank makes itself still run."""
    import weakref

    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.atexit = False


def wait_for_launcher(middle: int) -> None:
    """Wait until the middle process is gone and this one is the launcher's child, so the
    bootstrap's watchdog finds the parent it expects (or, if the launcher died, ends the rank)."""
    deadline = time.monotonic() + REPARENT_WAIT_S
    while os.getppid() == middle:
        if time.monotonic() >= deadline:
            print(
                f"multigpu: the rank's middle process {middle} did not exit within {REPARENT_WAIT_S:g} s;"
                " starting anyway",
                file=sys.stderr,
                flush=True,
            )
            return
        time.sleep(0.0005)


def run_program(argv: list[str]) -> int:
    """What ``argv`` (``python -m MODULE ...``) would run: the node's preflight check, or a rank."""
    if argv[2] == "multigpu.preflight":
        from multigpu.preflight.check import main

        sys.argv = ["-m", *argv[3:]]
        return main(argv[3:])
    return run_bootstrap(argv[3:])


def run_bootstrap(argv: list[str]) -> int:
    from multigpu.rank import bootstrap

    sys.argv = [os.path.join(os.path.dirname(bootstrap.__file__), "__main__.py"), *argv]  # as a fresh rank's
    bootstrap.main(argv)
    return 0


def exit_code(exc: SystemExit) -> int:
    """The status ``SystemExit`` ends a fresh interpreter with (a message is printed, then 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def finish(code: int) -> NoReturn:
    """Leave as interpreter exit would for the user's code (threads joined, atexit run, files
    flushed), without returning into the template's loop."""
    import atexit

    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
        from multigpu.rank.exiting import flush_open_files

        flush_open_files()
    finally:
        os._exit(code)
