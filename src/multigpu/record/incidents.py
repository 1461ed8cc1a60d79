"""The run's incidents: every attempt that did not succeed (an elastic round ended by a membership
change included), with when each phase of it happened.
Runs in the launcher; kept in ``run.json`` (``incidents``) and read by ``multigpu report``.

After a night of restarts and requeues, the attempts say what failed; the incidents say where the
time went. Each has the time the rank failed (its own clock, from its error record; else when it
was reaped), when the launcher learned of it, when every rank of that attempt was stopped, when
the next attempt's ranks were starting (its rendezvous done), and when the first rank of the next
attempt reported its first step (``multigpu.heartbeat``; ranks that report no steps leave it empty).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multigpu.contract.failure import FailureKind
from multigpu.contract.signals import signal_name
from multigpu.supervisor.states import RunResult, RunStatus

PHASES = (
    ("failed_time", "detected_time", "detect"),
    ("detected_time", "stopped_time", "stop"),
    ("stopped_time", "next_attempt_time", "meet again"),
    ("next_attempt_time", "next_first_step_time", "first step"),
)
"""(from, to, the column's name): the intervals ``multigpu report`` shows."""


def incident(attempt: int, result: RunResult, now: float) -> dict[str, Any] | None:
    """The incident an attempt's result makes; None for a success."""
    if result.status is RunStatus.SUCCEEDED:
        return None
    root = result.root_cause
    if root is not None:
        what = root.describe()
    elif result.signal is not None:
        what = f"stopped by {signal_name(result.signal)}"
    else:
        what = result.status.value
    detected = result.detected_time or now
    failed = root.time if root is not None and root.time else detected
    # An elastic round that ended for a node joining or leaving failed nothing: its own kind.
    kind = (
        "membership change"
        if root is not None and root.kind is FailureKind.MEMBERSHIP_CHANGE
        else result.status.value
    )
    return {
        "attempt": attempt,
        "kind": kind,
        "rank": root.rank if root else None,
        "what": what,
        "failed_time": min(failed, detected),
        "detected_time": detected,
        "stopped_time": now,
        "next_attempt_time": None,
        "next_first_step_time": None,
    }


def next_attempt_began(incidents: list[dict[str, Any]], now: float) -> None:
    if incidents and incidents[-1]["next_attempt_time"] is None:
        incidents[-1]["next_attempt_time"] = now


def progress_seen(incidents: list[dict[str, Any]], progress: Mapping[str, Mapping[str, Any]]) -> None:
    """The first step of the attempt after the last incident, from the progress book's snapshot."""
    if not incidents or incidents[-1]["next_attempt_time"] is None:
        return
    firsts = [t for p in progress.values() if (t := p.get("first_step_time")) is not None]
    if firsts and incidents[-1]["next_first_step_time"] is None:
        incidents[-1]["next_first_step_time"] = min(firsts)


def phase_seconds(item: Mapping[str, Any]) -> list[float | None]:
    """Each phase's length in seconds (None where a phase did not happen)."""
    out: list[float | None] = []
    for start, end, _ in PHASES:
        a, b = item.get(start), item.get(end)
        out.append(b - a if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None)
    return out
