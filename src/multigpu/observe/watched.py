"""What the launcher knows of its run, as the metrics and health servers read it. Runs in the launcher:
the run's attempts fill it (``attach``, once per attempt) on the main thread; the servers' threads
read it, never write it, and take no lock the supervisor's loop could wait on.

A reading copies what it walks first (``list(...)`` of a dict or deque is one step under the GIL), so
the loop may add a rank or an incident meanwhile; a value read a moment early is the price, never an
exception in the scrape.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from multigpu.record.incidents import phase_seconds
from multigpu.supervisor.hangs.book import ProgressBook
from multigpu.supervisor.states import Worker

LostSeconds = Callable[[], Mapping[str, float]]
"""Seconds of the run's wall time lost so far, by cause (``multigpu_lost_seconds_total{cause}``)."""


@dataclass(frozen=True)
class Attempt:
    """One attempt's ranks and their progress book, swapped in as one reference."""

    workers: Sequence[Worker]
    progress: ProgressBook


@dataclass
class Watched:
    """The run as the servers see it: its labels, its record's data, the current attempt."""

    run_id: str
    node: int
    record: Mapping[str, Any]
    """``run.json``'s data (``RunRecord.data``): attempts, incidents, preflight."""
    slurm_job_id: str | None = None
    lost_seconds: LostSeconds | None = None
    """None: ``lost_from_incidents`` of the record (what the incidents already tell)."""
    attempt: Attempt | None = None
    clock: Callable[[], float] = field(default=time.monotonic)
    health: object = field(default=None, repr=False, compare=False)
    """The run's one ``health.Health``, made at its first answer (``health.of``)."""

    def attach(self, workers: Sequence[Worker], progress: ProgressBook) -> None:
        """The attempt that starts now (the launcher's main thread, before its ranks start)."""
        self.attempt = Attempt(workers, progress)

    def node_label(self) -> str:
        """This node's index in the job: its ranks' once an attempt started (an elastic round assigns
        it), else the configured one."""
        attempt = self.attempt
        workers = list(attempt.workers) if attempt is not None else []
        return str(workers[0].spec.node if workers else self.node)

    def lost(self) -> Mapping[str, float]:
        if self.lost_seconds is not None:
            return self.lost_seconds()
        return lost_from_incidents(list(self.record.get("incidents", ())))

    def restarts(self) -> int:
        """Attempts begun after the first, an elastic round ended by a membership change not counted
        (torchrun counts only failures against ``--max-restarts``). Every attempt but the last ended in
        an incident, in order: the incidents an attempt followed are those before the last attempt's (a
        counter: the last attempt's own incident, recorded before the next begins, counts nothing yet)."""
        begun = len(self.record.get("attempts", ()))
        followed = list(self.record.get("incidents", ()))[: max(0, begun - 1)]
        return sum(1 for i in followed if i["kind"] != "membership change")


INCIDENT_CAUSES = (
    ("restarting", "hang_undetected"),
    ("restarting", "hang_handling"),
    ("restarting", "restarting"),
    ("restarting", "restarting"),
)
"""The cause each phase of an incident (``record/incidents.PHASES``, in order) loses its time to:
(a failure's, a hang's), in the ledger's words (``record/ledger.CAUSES``, docs/metrics.md): a
failure's time to the next first step is restarting."""


def lost_from_incidents(incidents: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The seconds the incidents' phases account for, by cause: a failure's detection and teardown
    and a hang's, the meeting again, the next attempt's start to its first step. Phases not over yet
    (or that did not happen) count nothing."""
    out: dict[str, float] = {}
    for item in incidents:
        hung = item.get("kind") == "hung"
        for (failed, hang), seconds in zip(INCIDENT_CAUSES, phase_seconds(item), strict=True):
            if seconds is not None and math.isfinite(seconds) and seconds > 0:
                cause = hang if hung else failed
                out[cause] = out.get(cause, 0.0) + seconds
    return out
