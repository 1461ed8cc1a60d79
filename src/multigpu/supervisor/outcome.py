"""An attempt's outcome as the supervisor's loop learns it: the failures seen, whether the attempt
hangs, and the ``RunResult`` they add up to, the root cause first (``by_time``).

Runs in the launcher (and OTX's caller), on the supervisor's loop thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from multigpu.contract.failure import WorkerFailure
from multigpu.supervisor.states import RunResult, RunStatus, Worker, WorkerState


class Outcome:
    """The failures of one attempt so far, and its result once it has one."""

    def __init__(self) -> None:
        self.failures: list[WorkerFailure] = []
        self.hung = False
        """A hang was called on this node: its stacks are being or were collected, the failures say
        who stopped first."""
        self._detected: float | None = None

    def first_time(self) -> float | None:
        """When the earliest failure of known time happened."""
        return min((f.time for f in self.failures if f.time is not None), default=None)

    def learned(self, at: float) -> None:
        """The launcher learned the outcome at ``at``, before its failures are made: a hang is called,
        then every rank's stacks are collected (the incident's detection is the call)."""
        if self._detected is None:
            self._detected = at

    def result(self, stop: int | None, workers: Sequence[Worker]) -> RunResult | None:
        """The result once the run has one: ``stop``, the stop signal handled; a failure; every rank
        succeeded. When the launcher first learned it (wall clock) is kept for the incident timeline."""
        if (stop is not None or self.failures) and self._detected is None:
            self._detected = time.time()
        if stop is not None:
            return RunResult(RunStatus.INTERRUPTED, by_time(self.failures), stop, self._detected)
        if self.failures:
            status = RunStatus.HUNG if self.hung else RunStatus.FAILED
            return RunResult(status, by_time(self.failures), detected_time=self._detected)
        if all(w.state is WorkerState.SUCCEEDED for w in workers):
            return RunResult(RunStatus.SUCCEEDED)
        return None

    def final(self, result: RunResult) -> RunResult:
        """``result`` again after the teardown: ranks that failed during it may have failed first."""
        if result.status in (RunStatus.FAILED, RunStatus.HUNG):
            return RunResult(result.status, by_time(self.failures), result.signal, result.detected_time)
        return result


def by_time(failures: Sequence[WorkerFailure]) -> list[WorkerFailure]:
    """The first failure in time first: the root cause (a failure of unknown time last).

    Cause before time in one case: a rank that failed only because a peer's connection closed comes
    after a lost node or store, whatever the clocks say. A lost node's time is when the watcher last
    saw its counter move, up to a beat after the node really died, so the peer's "Connection reset"
    can carry the earlier time although the loss caused it."""
    ordered = sorted(failures, key=lambda f: f.time if f.time is not None else float("inf"))
    lost = next((f for f in ordered if f.explains(ordered[0])), None) if ordered else None
    if lost is None:
        return ordered
    return [lost, *(f for f in ordered if f is not lost)]
