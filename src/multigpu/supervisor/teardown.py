"""``Supervisor.close()``'s sequence: the stop signal to every group, one shared deadline, SIGKILL for
what is left, a bounded reap, and the ranks' last output.

Runs in the launcher (and function mode's caller). It drives the supervisor's own loop while it waits
(``Loop``), so output is still read, exits are still judged and a second Ctrl-C still cuts the grace
short; it never waits on a console or a rank without a deadline.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from multigpu.contract.signals import signal_name
from multigpu.supervisor import reaping
from multigpu.supervisor.events import Events
from multigpu.supervisor.output import WorkerOutput
from multigpu.supervisor.settings import SupervisorOptions
from multigpu.supervisor.states import Worker

ORPHAN_WAIT_S = 1.0
"""How long the groups of ranks that were killed may take to empty (their adopted orphans reaped)."""


class Loop(Protocol):
    """The part of the supervisor the teardown drives."""

    @property
    def kill_now(self) -> bool: ...

    def turn(self, timeout: float) -> None:
        """One turn of the event loop: output, exits, beats, signals."""

    def reap(self, worker: Worker) -> None: ...

    def changed(self, worker: Worker) -> None: ...


def stop_groups(workers: Sequence[Worker], sig: int, grace: float, loop: Loop, options: SupervisorOptions,
                spared: Callable[[], frozenset[int]], notify: Callable[[str], None]) -> None:
    """``sig`` to every group that may still hold a process; SIGKILL for what outlives ``grace``.

    ``spared``: the spawner's own processes (the template, its store), asked after the grace period."""
    clock = options.clock
    for pgid in reaping.open_groups(workers):
        reaping.signal_group(pgid, sig)
    deadline = clock() + grace
    while clock() < deadline and not loop.kill_now:
        if not any(w.alive for w in workers) and not reaping.open_groups(workers):
            break
        loop.turn(0.01)
        _reap_adopted(workers, options)
    stragglers = [w for w in workers if w.alive]
    groups = reaping.open_groups(workers)
    if stragglers:
        why = "after a second interrupt" if loop.kill_now else f"{grace:g}s after {signal_name(sig)}"
        ranks = ", ".join(f"rank {w.rank} (pid {w.pid})" for w in stragglers)
        notify(f"{ranks}: still running {why}; sending SIGKILL")
    for pgid in groups:
        reaping.signal_group(pgid, signal.SIGKILL)
    if options.reap_orphans:
        reaping.kill_escaped(workers, spared())
    for w in reaping.reap_killed(workers, notify):
        if w.unkillable:
            loop.changed(w)
        else:
            loop.reap(w)
    end = clock() + ORPHAN_WAIT_S
    while reaping.open_groups(workers) and clock() < end:
        _reap_adopted(workers, options)
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


def _reap_adopted(workers: Sequence[Worker], options: SupervisorOptions) -> None:
    if options.reap_orphans:
        reaping.reap_adopted(workers)
