"""Process groups and exits outside the pidfds: which groups may still be signalled, the exits only
polling finds, the SIGKILL wait at teardown, and orphans.

Each rank leads its own process group (its pid is the group id), so a signal to the group reaches
everything the rank started. These helpers hold the rules that keep that safe: a group whose members
are all gone is never signalled again (its id may be reused), the wait after SIGKILL is bounded (a
rank in uninterruptible sleep is named and left), and, as a child subreaper, the launcher ends and
reaps what its ranks started that left their groups, and nothing else: a process it was given at
its start (the ``tee`` of ``> >(tee run.log)``) is never signalled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from multigpu.contract.names import LAUNCHER_PID_ENV

if TYPE_CHECKING:
    from multigpu.supervisor.states import Worker

logger = logging.getLogger(__name__)

KILL_WAIT_S = 5.0
"""How long a rank may take to vanish after SIGKILL; longer means uninterruptible sleep (a driver)."""


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def forward(workers: Sequence[Worker], signum: int) -> None:
    """Pass a signal on to every live rank's group (SIGHUP, SIGUSR1/2: the ranks decide what it means)."""
    for worker in workers:
        if worker.alive and worker.pid is not None:
            signal_group(worker.pid, signum)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def proc_state(pid: int | None) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"


def open_groups(workers: Sequence[Worker]) -> list[int]:
    """Process groups that still have members. Once a group is empty its id (the rank's pid) may be
    reused by an unrelated process, so it is never signalled again."""
    for w in workers:
        if w.group_open and (w.pid is None or (w.returncode is not None and not group_alive(w.pid))):
            w.group_open = False
    return [w.pid for w in workers if w.group_open and w.pid is not None]


def close_emptied(workers: Sequence[Worker]) -> None:
    """Mark the groups of exited ranks that have emptied (``open_groups``), each loop turn."""
    if any(w.group_open and w.returncode is not None for w in workers):
        open_groups(workers)


def unwatched_exits(workers: Sequence[Worker]) -> Iterator[Worker]:
    """The running ranks without a pidfd (none on this kernel) whose process has exited, found by
    polling; checked one by one as the caller reaps them."""
    for w in workers:
        if w.pidfd is None and w.alive and w.popen and w.popen.poll() is not None:
            yield w


def reap_killed(workers: Sequence[Worker]) -> list[Worker]:
    """Wait for every rank after SIGKILL, all within KILL_WAIT_S; returns the ranks that ended or
    were given up on. One that survives (uninterruptible sleep) is marked, named, and left."""
    from multigpu.supervisor.states import WorkerState

    deadline = time.monotonic() + KILL_WAIT_S
    done = []
    for w in workers:
        if w.popen is None or w.returncode is not None:
            continue
        try:
            w.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.ending.unkillable = True
            w.to(WorkerState.STOPPED)
            w.returncode = None
            logger.warning(
                f"{w.title} (pid {w.pid}) did not end {KILL_WAIT_S:g}s after SIGKILL "
                f"(state {proc_state(w.pid)}: probably stuck in the kernel or a driver); "
                f"leaving it behind"
            )
        done.append(w)
    return done


def kill_escaped(workers: Sequence[Worker], spared: frozenset[int] = frozenset()) -> None:
    """As a subreaper, also end what the ranks started that left their groups (setsid, a double fork,
    a daemon): ``started_by_ranks``. Nothing else in this launcher's tree is signalled: not the
    ``spared`` processes (the node's template and its store, which outlive attempts) and, above all,
    not what the launcher was given at its start, such as the ``tee`` of ``> >(tee run.log)``, which
    the shell made a child of the process it then replaced with this launcher; ending that would cut
    the launcher's own last lines (the summary, the root cause) from the user's log."""
    import psutil

    for process in started_by_ranks({w.pid for w in workers if w.pid is not None}, spared):
        with contextlib.suppress(psutil.Error):
            process.kill()


def started_by_ranks(ranks: set[int], spared: frozenset[int] = frozenset()) -> list[Any]:
    """This launcher's descendants that its ranks started, as ``psutil.Process`` objects, the ranks
    themselves left out. Runs in the launcher.

    Found by what the ranks carry, never by "every child of mine": walked from the launcher down
    (a parent before its children), a process is a rank's if its session or its group is a rank's (a
    rank leads a session of its own), if it carries this launcher's mark (``launcher_marked``), or
    if its parent is a rank or one of these. A descendant that left its session and its parent, and
    also dropped the rank's environment, is not found here; the rank's own guard ends its tree when
    the launcher dies."""
    import psutil

    me, taken, found = os.getpid(), set(ranks), []
    for process in psutil.Process().children(recursive=True):
        pid = process.pid
        if pid in ranks or pid in spared:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if (
                process.ppid() in taken
                or {os.getsid(pid), os.getpgid(pid)} & ranks
                or (process.ppid() not in spared and launcher_marked(process, me))
            ):
                taken.add(pid)
                found.append(process)
    return found


def launcher_marked(process: Any, launcher: int) -> bool:
    """Whether ``process`` came from a rank of ``launcher``: its environment at exec names the
    launcher (``LAUNCHER_PID_ENV``, which every rank is given and what it runs inherits), or it is a
    fork of the launcher's template that never exec'd (a rank's forked child: its command line is the
    template's, ``--launcher-pid`` naming the launcher). Processes that cannot be read are not."""
    import psutil

    with contextlib.suppress(psutil.Error, OSError):
        if process.environ().get(LAUNCHER_PID_ENV) == str(launcher):
            return True
    with contextlib.suppress(psutil.Error, OSError):
        argv = process.cmdline()
        return "multigpu.template" in argv and argv[-2:] == ["--launcher-pid", str(launcher)]
    return False


def reap_adopted(workers: Sequence[Worker]) -> None:
    """Reap orphans re-parented to this launcher (it is a child subreaper in CLI mode)."""
    import psutil

    pids = {w.pid for w in workers if w.returncode is None}
    for child in psutil.Process().children():
        if child.pid in pids:
            continue
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(child.pid, os.WNOHANG)
