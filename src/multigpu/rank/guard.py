"""The rank's fate tied to its launcher's: when the launcher dies, the rank and everything it started go.

Runs in the rank, started by the bootstrap before any user code. A pidfd wakes a thread the moment
the launcher exits; a sentinel process watches too, for a rank that is stopped or holds the GIL; and
across ``exec`` the kernel's parent-death signal takes over. The rank is a child subreaper, so a
descendant that left its process group and lost its parent (``setsid``, a double fork, a daemon) is
still in the rank's tree when the launcher dies, and is ended with the rest.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from typing import Any

from multigpu.contract.names import SENTINEL_ENV
from multigpu.contract.prctl import set_child_subreaper, set_pdeathsig


def end_tree(root: int) -> None:
    """SIGKILL every descendant of ``root``, those that left its process group included.

    Each is stopped (SIGSTOP) as it is found, so none can fork while the tree is walked again, and
    killed once a walk finds nothing new. ``root`` itself and its group are the caller's to end.
    """
    import psutil

    found: dict[int, Any] = {}
    with contextlib.suppress(psutil.Error):
        top = psutil.Process(root)
        while new := [p for p in top.children(recursive=True) if p.pid not in found]:
            for process in new:
                with contextlib.suppress(psutil.Error):
                    process.suspend()
                found[process.pid] = process
    for process in found.values():
        with contextlib.suppress(psutil.Error):
            process.kill()


ENDING = threading.Event()
"""Set once ``end_own_group`` began: the ``--no-python`` shim, whose program it just killed, then waits
for the group's SIGKILL rather than die first and leave the rest of the tree stopped (``program.py``)."""


def end_own_group() -> None:
    """SIGKILL everything this worker started (its tree and its process group), then the worker."""
    ENDING.set()
    try:
        with contextlib.suppress(Exception):
            end_tree(os.getpid())
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
    sentinel process watches too: it needs neither the rank's GIL nor its scheduling, and ends the same
    tree. Under ``multigpu run`` it is the node's one sentinel (``rank/sentinel.py``, which the
    launcher tells the rank of with ``SENTINEL_ENV``); elsewhere (function mode) the rank forks its own
    (``start_sentinel``).

    Once the sentinel is started (so that it is the launcher's to reap, not the rank's), the rank
    becomes a child subreaper: what its descendants orphan stays in its tree for the guard to find.
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
    if pidfd is not None and os.environ.pop(SENTINEL_ENV, None) is None:
        start_sentinel(pidfd)  # no node sentinel watches this rank (function mode): its own
    set_child_subreaper()
    threading.Thread(
        target=_watch_parent, args=(pidfd, expected_parent), name="multigpu-parent-watch", daemon=True
    ).start()


_guarded = False


def start_sentinel(launcher_pidfd: int) -> None:
    """Fork (twice, so the rank never has to reap it) a process that SIGKILLs the rank's tree and group
    when the launcher dies, and leaves quietly when the rank ends. Done before any thread or user code.

    It keeps only the two pidfds (no copy of the rank's pipes, so it never holds the launcher's
    output open) and runs nothing but select and kill.
    """
    rank = os.getpid()
    try:
        rank_pidfd = os.pidfd_open(rank)
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
            with contextlib.suppress(Exception):
                os.kill(rank, signal.SIGSTOP)  # the rank forks no more while its tree is ended
                end_tree(rank)
            with contextlib.suppress(OSError):  # before the group: a rank that left it is still ended
                os.kill(rank, signal.SIGKILL)
            with contextlib.suppress(OSError):  # this sentinel is in the group too: the last act
                os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(0)


PLAIN_EXECVE = os.execve
"""``os.execve`` as it was before ``arm_pdeathsig_on_exec`` wrapped it: the ``--no-python`` shim's child
execs with it (``program.py``), since the wrapper's parent check would take the shim for an orphan.
Taken when this module is imported, which the bootstrap does before it arms anything."""


def arm_pdeathsig_on_exec(expected_parent: int) -> None:
    """Wrap ``os.execv``/``os.execve`` so a worker that replaces itself keeps a parent-death signal.

    Only the rank's own process is armed: a child it forked (``os.fork`` then ``os.execvp``, as a
    daemonising helper does) has the rank, not the launcher, for parent, and execs untouched; the
    rank's tree is ended by the guard.
    """
    rank = os.getpid()

    def wrap(exec_function: Any) -> Any:
        def arming_exec(*args: Any) -> Any:
            if os.getpid() != rank:
                return exec_function(*args)
            set_pdeathsig(signal.SIGKILL)
            if os.getppid() != expected_parent:  # the launcher died just now: do not start the program
                end_own_group()
            return exec_function(*args)

        return arming_exec

    os.execv = wrap(os.execv)
    os.execve = wrap(os.execve)
