"""The steps of ``Supervisor.close()`` that need no loop: the stop signal to every group, SIGKILL for
what is left, a bounded wait for emptied groups, and the descriptors released at the end.

Runs in the launcher (and OTX's caller). The wait between the stop signal and SIGKILL is
the supervisor's own (``Supervisor._stop_groups``): it keeps turning its loop, so output is still
read, exits are still judged and a second Ctrl-C still cuts the grace short. Nothing here waits on a
console or a rank without a deadline.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Sequence

from multigpu.supervisor import reaping
from multigpu.supervisor.events import Events
from multigpu.supervisor.output import WorkerOutput
from multigpu.supervisor.settings import SupervisorOptions
from multigpu.supervisor.states import Worker

logger = logging.getLogger(__name__)

ORPHAN_WAIT_S = 1.0
"""How long the groups of ranks that were killed may take to empty (their adopted orphans reaped)."""


def signal_groups(workers: Sequence[Worker], sig: int) -> None:
    """``sig`` to every group that may still hold a process (exited ranks' included)."""
    for pgid in reaping.open_groups(workers):
        reaping.signal_group(pgid, sig)


def all_gone(workers: Sequence[Worker]) -> bool:
    """No rank runs and no group holds a process any more: the grace can end early."""
    return not any(w.alive for w in workers) and not reaping.open_groups(workers)


def kill_rest(
    workers: Sequence[Worker],
    why: str,
    options: SupervisorOptions,
    spared: Callable[[], frozenset[int]],
) -> list[Worker]:
    """SIGKILL for every group still open (the ranks still running named, ``why``), the escaped
    descendants ended, then every rank waited for (``reaping.reap_killed``): the ranks to reap.

    ``spared``: the spawner's own processes (the template, its store), asked only now."""
    stragglers = [w for w in workers if w.alive]
    groups = reaping.open_groups(workers)
    if stragglers:
        ranks = ", ".join(f"{w.title} (pid {w.pid})" for w in stragglers)
        logger.warning(f"{ranks}: still running {why}; sending SIGKILL")
    for pgid in groups:
        reaping.signal_group(pgid, signal.SIGKILL)
    if options.reap_orphans:
        reaping.kill_escaped(workers, spared())
    return reaping.reap_killed(workers)


def wait_for_groups(workers: Sequence[Worker], options: SupervisorOptions) -> None:
    """Give the killed ranks' groups ``ORPHAN_WAIT_S`` to empty, reaping their adopted orphans."""
    end = options.clock() + ORPHAN_WAIT_S
    while reaping.open_groups(workers) and options.clock() < end:
        reap_adopted(workers, options)
        time.sleep(0.005)


def release(workers: Sequence[Worker], output: WorkerOutput, events: Events) -> None:
    """The end of ``close()``: the pipes, pidfds and wake-up pipe closed, the console writer no
    longer calling back into a loop that has stopped (``WorkerOutput.close``)."""
    output.close()
    for w in workers:
        for fd in (w.heartbeat_read_fd, w.pidfd):
            if fd is not None:
                events.forget(fd, close=True)
        w.heartbeat_read_fd = w.pidfd = None
    events.close()


def reap_adopted(workers: Sequence[Worker], options: SupervisorOptions) -> None:
    """Reap the orphans re-parented to the launcher, where it is a child subreaper."""
    if options.reap_orphans:
        reaping.reap_adopted(workers)
