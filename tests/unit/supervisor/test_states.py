"""``Worker.to``, the one writer of a rank's state: every move ``MOVES`` allows goes through, any other
raises ``IllegalMove`` (a bug of the supervisor's) and leaves the state as it was."""

from __future__ import annotations

import itertools

import pytest

from multigpu.supervisor.states import MOVES, IllegalMove, Worker, WorkerSpec, WorkerState

PENDING, RUNNING = WorkerState.PENDING, WorkerState.RUNNING
SUCCEEDED, FAILED, STOPPED = WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED
LEGAL = [(PENDING, RUNNING), (RUNNING, SUCCEEDED), (RUNNING, FAILED), (RUNNING, STOPPED)]
ILLEGAL = [pair for pair in itertools.product(WorkerState, repeat=2) if pair not in LEGAL]


def worker(state: WorkerState) -> Worker:
    return Worker(WorkerSpec(rank=3, local_rank=1, argv=[], env={}), state=state)


def test_the_table_names_every_state_and_exactly_the_documented_moves() -> None:
    assert set(MOVES) == set(WorkerState)
    assert sorted((a, b) for a, targets in MOVES.items() for b in targets) == sorted(LEGAL)


@pytest.mark.parametrize(("start", "end"), LEGAL)
def test_a_legal_move_changes_the_state(start: WorkerState, end: WorkerState) -> None:
    w = worker(start)
    w.to(end)
    assert w.state is end


@pytest.mark.parametrize(("start", "end"), ILLEGAL)
def test_an_illegal_move_raises_and_changes_nothing(start: WorkerState, end: WorkerState) -> None:
    w = worker(start)
    with pytest.raises(IllegalMove, match=f"rank 3: {start.value} -> {end.value}"):
        w.to(end)
    assert w.state is start


def test_a_rank_goes_through_its_life_by_moves_only() -> None:
    w = worker(PENDING)
    assert w.state is PENDING and not w.alive
    w.to(RUNNING)
    assert w.alive
    w.to(STOPPED)
    assert not w.alive
    with pytest.raises(IllegalMove):  # the final states are final: a second verdict is a bug
        w.to(FAILED)
