"""The incident an attempt makes (``record/incidents.py``), and its phases as ``multigpu report``
shows them."""

from __future__ import annotations

from multigpu.contract.failure import WorkerFailure
from multigpu.record.incidents import incident, next_attempt_began, phase_seconds, progress_seen
from multigpu.supervisor.states import RunResult, RunStatus


def test_a_failed_attempt_becomes_an_incident_with_every_phase() -> None:
    failure = WorkerFailure(
        rank=1, local_rank=1, pid=7, exit_code=1, error_type="ValueError", message="loss is NaN", time=100.0
    )
    found = incident(0, RunResult(RunStatus.FAILED, [failure], detected_time=100.5), now=101.0)
    assert found is not None and found["rank"] == 1 and "ValueError: loss is NaN" in found["what"]
    items = [found]
    next_attempt_began(items, 101.25)
    progress_seen(items, {"0": {"first_step_time": 102.0}, "1": {"first_step_time": 101.75}})
    assert phase_seconds(found) == [0.5, 0.5, 0.25, 0.5]


def test_a_success_is_no_incident_and_an_interrupt_names_its_signal() -> None:
    assert incident(0, RunResult(RunStatus.SUCCEEDED), now=1.0) is None
    stopped = incident(2, RunResult(RunStatus.INTERRUPTED, [], 15, detected_time=5.0), now=6.0)
    assert stopped is not None and stopped["kind"] == "interrupted"
    assert stopped["what"] == "stopped by SIGTERM"
    assert phase_seconds(stopped) == [0.0, 1.0, None, None]  # no next attempt: those phases are empty
