"""When a hang was called (``hangs/verdict.HangWatch``): its incident's detection is the call, and its
failures' time the last progress, however long the stacks' collection that follows takes. The goodput
ledger counts that collection as ``hang_handling``, not as the hang going unnoticed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from multigpu.supervisor.hangs import verdict
from multigpu.supervisor.hangs.book import HangPolicy, ProgressBook
from multigpu.supervisor.hangs.verdict import HangWatch, Turns
from multigpu.supervisor.outcome import Outcome
from multigpu.supervisor.states import RunStatus, Worker, WorkerSpec, WorkerState


def test_the_verdict_is_the_detection_and_the_stacks_collection_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wall = {"now": 5000.0}
    monkeypatch.setattr(verdict, "time", SimpleNamespace(time=lambda: wall["now"]))
    clock = {"now": 100.0}
    book = ProgressBook(HangPolicy(ceiling=3.0), [0, 1], clock=lambda: clock["now"], wall=lambda: 4900.0)
    workers = []
    for r in (0, 1):
        worker = Worker(WorkerSpec(rank=r, local_rank=r, argv=[], env={}))
        worker.state = WorkerState.RUNNING
        workers.append(worker)
    book.ranks[0].last_progress = book.ranks[1].last_progress = 96.5  # 3.5 s quiet at 100

    def dump(targets: list[Worker]) -> None:
        wall["now"] += 10.0  # the stacks take 10 s to come back

    outcome = Outcome()
    HangWatch(book, None, dump, Turns(lambda _: None, lambda: clock["now"])).check(workers, outcome)
    result = outcome.result(None, workers)
    assert result is not None and result.status is RunStatus.HUNG
    assert result.detected_time == 5000.0  # called at 5000, before the collection
    assert result.root_cause is not None and result.root_cause.time == pytest.approx(5000.0 - 3.5)
