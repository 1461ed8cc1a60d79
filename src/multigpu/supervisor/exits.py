"""What a rank's exit means: success, a failure with its own record, or the end the launcher asked for.

Runs in the launcher (and OTX's caller), on the supervisor's loop. A rank whose bootstrap
said "done" (its script returned, threads and atexit handlers finished) has succeeded even if the
process then dies in torch's exit-time teardown; that is a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time

from multigpu.contract.failure import FailureKind, WorkerFailure
from multigpu.contract.signals import STOP_SIGNALS, signal_name
from multigpu.supervisor.events import Events
from multigpu.supervisor.file_timer import TimerKills
from multigpu.supervisor.output import WorkerOutput
from multigpu.supervisor.states import Worker, WorkerState

logger = logging.getLogger(__name__)

STOP_RACE_S = 0.25
"""How long a rank that a stop signal killed, one the launcher did not send, waits for the launcher's
own before it counts as a failure. SLURM's scancel and time limit signal every process of the step,
sometimes a rank before its launcher: that is an interrupted run, not a rank that failed."""


@dataclasses.dataclass(frozen=True)
class Pending:
    """A rank killed by an outside stop signal, judged at ``until`` (loop clock) or when ours comes."""

    worker: Worker
    rc: int
    until: float


class StopRace:
    """The ranks killed by an outside stop signal, waiting for the launcher's own (``STOP_RACE_S``)."""

    def __init__(self) -> None:
        self._waiting: list[Pending] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def hold(self, worker: Worker, rc: int, now: float) -> None:
        self._waiting.append(Pending(worker, rc, now + STOP_RACE_S))

    def next_due(self) -> float | None:
        return min((p.until for p in self._waiting), default=None)

    def due(self, now: float, all_of_them: bool) -> list[Pending]:
        """The ranks to judge now: every one (``all_of_them``: ours came, or teardown), or those whose
        window closed."""
        ready = [p for p in self._waiting if all_of_them or now >= p.until]
        self._waiting = [p for p in self._waiting if p not in ready]
        return ready


def collect(worker: Worker, events: Events) -> int | None:
    """The exit status of a rank that exited, now collected (its end time noted, its pidfd closed);
    None when it was collected already or never started."""
    if worker.returncode is not None or worker.popen is None:
        return None
    rc = worker.returncode = worker.popen.wait()
    worker.end_time = time.time()
    if worker.pidfd is not None:
        events.forget(worker.pidfd, close=True)
        worker.pidfd = None
    return rc


def outside_stop(worker: Worker, rc: int) -> bool:
    """The rank died of SIGTERM, SIGINT or SIGQUIT (we had sent none) and recorded no error of its own."""
    return rc < 0 and -rc in STOP_SIGNALS and not worker.finished and worker.own_record() is None


@dataclasses.dataclass(frozen=True)
class Moment:
    """Where the attempt stands when a rank's exit is judged (``settle``)."""

    ending: bool
    """The launcher is stopping the ranks (a stop signal or teardown), so a non-zero exit is its doing,
    unless the rank wrote its own error record: then it failed on its own, perhaps first."""
    interrupted: bool
    """A stop signal came (or is recorded and not yet handled)."""
    first_failure: float | None = None
    """When the attempt's first failure happened; a rank whose own error came after it and only says a
    peer went away (gloo's "Connection closed by peer") raised because of it, so it counts as stopped,
    its error kept in ``worker.ending.failure`` for the report's line about it."""


def settle(
    worker: Worker, rc: int, moment: Moment, output: WorkerOutput, timer: TimerKills | None = None
) -> WorkerFailure | None:
    """Move ``worker`` to its final state from its exit status; its failure when the exit counts as one.

    ``timer``: the kills of the node's file timer (``file_timer.py``), when it hosts one.
    """
    ending = moment.ending
    if rc != 0 and worker.finished:
        how = signal_name(-rc) if rc < 0 else f"exit code {rc}"
        worker.ending.late_death = how
        logger.warning(
            f"rank {worker.rank} (pid {worker.pid}) ended with {how} after its script had finished "
            f"(an exit-time crash, e.g. in torch's C++ teardown); its work is done, so it counts as a "
            f"success"
        )
        rc = 0
    if rc == 0:
        worker.to(WorkerState.SUCCEEDED)
        return None
    record = worker.own_record()
    if ending and (moment.interrupted or record is None):
        worker.to(WorkerState.STOPPED)
        return None
    worker.ending.failure = failure_of(worker, rc, ending, output, timer)
    if _consequence(record, moment.first_failure):
        worker.to(WorkerState.STOPPED)
        return None
    worker.to(WorkerState.FAILED)
    return worker.ending.failure


def _consequence(record: WorkerFailure | None, first_failure: float | None) -> bool:
    if record is None or record.time is None or first_failure is None:
        return False
    return record.saw_a_peer_die and record.time > first_failure


def failure_of(
    worker: Worker, rc: int, ending: bool, output: WorkerOutput, timer: TimerKills | None = None
) -> WorkerFailure:
    # Read what the pipes hold now, so the tail and the traceback are complete; not a moment more: a
    # DataLoader-style child may keep them open long after the rank itself has gone.
    output.drain(output.of(worker))
    record = worker.own_record()
    if record is not None and rc < 0 and ending:
        rc = 1  # it raised, then our teardown cut its exit short: the exception is what it did
    failure = worker.ended_with(rc, record)
    kill = timer.of(worker.pid, -rc) if timer is not None and worker.pid is not None and rc < 0 else None
    if kill is not None:  # the file timer's signal, whatever else a SIGKILL might have been
        failure = dataclasses.replace(
            failure, error_type=FailureKind.TIMER_EXPIRED, message=kill.message, killed_by=kill.killer
        )
    killed_by = who_killed(worker, rc) if kill is None else None
    if killed_by is not None:
        failure = dataclasses.replace(failure, killed_by=killed_by)
    return failure if failure.time else dataclasses.replace(failure, time=worker.end_time)


NCCL_WATCHDOG = ("Watchdog caught collective operation timeout", "ProcessGroupNCCL's watchdog")


def who_killed(worker: Worker, rc: int) -> str | None:
    """Who sent a fatal signal, where the traces say: the kernel's OOM killer for a SIGKILL (its
    cgroup counter or its log line), NCCL's watchdog for a SIGABRT (its message in the log tail)."""
    if rc == -signal.SIGKILL and worker.oom is not None and worker.pid is not None:
        return worker.oom.explain(worker.pid)
    if rc == -signal.SIGABRT and any(mark in line for line in worker.lines.tail for mark in NCCL_WATCHDOG):
        return "NCCL's watchdog (a collective timed out; SIGABRT)"
    return None
