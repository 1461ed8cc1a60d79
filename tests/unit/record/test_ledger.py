"""The goodput ledger (``record/ledger.py``): every second of a run attributed to one cause, on a fake
clock, so each sum is exact; and the record's, the report's and the console's lines made of it."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any

import pytest

from multigpu.record.ledger import CAUSES, Ledger, ledger_line
from multigpu.supervisor.hangs.book import HangPolicy, ProgressBook


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def incident(kind: str, failed: float, detected: float, stopped: float) -> dict[str, Any]:
    return {"kind": kind, "failed_time": failed, "detected_time": detected, "stopped_time": stopped}


def spent(ledger: Ledger) -> dict[str, float]:
    """The causes that took any time, rounded against float noise."""
    return {c: round(v, 9) for c, v in ledger.seconds_by_cause().items() if v}


def test_a_run_with_a_hang_and_a_restart_is_attributed_second_by_second() -> None:
    clock = Clock(1000.0)
    ledger = Ledger(1000.0, clock=clock)
    ledger.attempt_began(1002.0)
    ledger.first_step(1005.0)  # start-up: 5 s
    clock.now = 1030.0
    assert spent(ledger) == {"starting": 5.0, "training": 25.0}  # live: the hang is not known yet
    # the last progress at 1020, the hang called at 1028, every rank stopped at 1031
    ledger.attempt_ended(incident("hung", 1020.0, 1028.0, 1031.0), 1031.0)
    ledger.attempt_began(1032.0)
    ledger.first_step(1036.0)
    ledger.finish(1050.0)
    assert spent(ledger) == {
        "starting": 5.0,
        "training": 15.0 + 14.0,
        "hang_undetected": 8.0,
        "hang_handling": 3.0,
        "restarting": 5.0,  # every rank stopped at 1031 to the next first step at 1036
    }
    assert ledger.wall_seconds() == 50.0
    assert sum(ledger.seconds_by_cause().values()) == pytest.approx(50.0)
    clock.now = 2000.0  # once finished, nothing more is counted
    assert ledger.wall_seconds() == 50.0
    assert ledger.summary()["effective_training_percent"] == 58.0


def test_a_crash_restarts_from_its_failure_and_a_crash_with_no_restart_is_stopping() -> None:
    ledger = Ledger(0.0, clock=Clock(0.0))
    ledger.attempt_began(1.0)
    ledger.first_step(2.0)
    ledger.attempt_ended(incident("failed", 10.0, 10.5, 11.0), 11.0)
    ledger.attempt_began(12.0)
    ledger.first_step(13.0)
    ledger.attempt_ended(incident("failed", 20.0, 20.1, 21.0), 21.0)
    ledger.finish(22.0)
    assert spent(ledger) == {"starting": 2.0, "training": 8.0 + 7.0, "restarting": 3.0, "stopping": 2.0}


def test_the_waits_between_attempts_and_a_preemption_have_their_own_causes() -> None:
    clock = Clock(0.0)
    ledger = Ledger(0.0, clock=clock)
    clock.now = 1.0
    with ledger.phase("waiting_for_nodes"):
        clock.now = 4.0
    with ledger.phase("preflight"):
        clock.now = 6.0
    ledger.attempt_began(6.0)
    ledger.first_step(7.0)
    ledger.finish(20.0, preempted_at=15.0)
    assert spent(ledger) == {
        "starting": 1.0 + 1.0,
        "waiting_for_nodes": 3.0,
        "preflight": 2.0,
        "training": 8.0,
        "preemption": 5.0,
    }


def test_a_script_that_reports_no_step_trains_from_its_attempts_start() -> None:
    ledger = Ledger(0.0, clock=Clock(0.0))
    ledger.attempt_began(2.0)
    ledger.attempt_ended(None, 10.0)
    ledger.finish(10.5)
    assert spent(ledger) == {"starting": 2.0, "training": 8.5}


def test_an_attempt_that_never_reached_a_step_in_a_stepping_run_is_restarting() -> None:
    ledger = Ledger(0.0, clock=Clock(0.0))
    ledger.attempt_began(0.0)
    ledger.first_step(1.0)
    ledger.attempt_ended(incident("failed", 5.0, 5.0, 5.5), 5.5)
    ledger.attempt_began(6.0)  # it fails again before its first step
    ledger.attempt_ended(incident("failed", 8.0, 8.0, 8.5), 8.5)
    ledger.attempt_began(9.0)
    ledger.first_step(9.5)
    ledger.finish(12.0)
    assert spent(ledger) == {"starting": 1.0, "training": 4.0 + 2.5, "restarting": 4.5}


def test_an_elastic_round_ended_by_a_joining_node_and_an_interrupt() -> None:
    ledger = Ledger(0.0, clock=Clock(0.0))
    ledger.attempt_began(0.0)
    ledger.first_step(1.0)
    ledger.attempt_ended(incident("membership change", 4.0, 4.0, 5.0), 5.0)
    ledger.attempt_began(7.0)
    ledger.first_step(8.0)
    ledger.attempt_ended(incident("interrupted", 10.0, 10.0, 11.0), 11.0)
    ledger.finish(11.5)
    assert spent(ledger) == {
        "starting": 1.0,
        "training": 3.0 + 2.0,
        "waiting_for_nodes": 3.0,
        "restarting": 1.0,
        "stopping": 1.5,
    }


def test_times_outside_the_attempt_are_clamped_and_the_sum_stays_the_wall_time() -> None:
    ledger = Ledger(0.0, clock=Clock(0.0))
    ledger.attempt_began(5.0)
    ledger.first_step(3.0)  # another node's clock: before the attempt began here
    ledger.attempt_ended(incident("hung", 1.0, 12.0, 9.0), 9.0)  # detected after stopped
    ledger.finish(10.0)
    seconds = ledger.seconds_by_cause()
    assert set(seconds) == set(CAUSES)
    assert sum(seconds.values()) == pytest.approx(10.0)
    assert spent(ledger) == {"starting": 5.0, "hang_undetected": 4.0, "stopping": 1.0}


def test_a_snapshot_from_another_thread_always_sums_to_the_wall_time() -> None:
    clock = Clock(0.0)
    ledger = Ledger(0.0, clock=clock)
    done = threading.Event()
    bad: list[float] = []

    def read() -> None:
        while not done.is_set():
            seconds, wall = ledger._totals()
            if abs(sum(seconds.values()) - wall) > 1e-6:
                bad.append(sum(seconds.values()) - wall)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(200):
            clock.now = 10.0 * i + 10
            ledger.attempt_began(10.0 * i + 1)
            ledger.first_step(10.0 * i + 2)
            ledger.attempt_ended(incident("hung", 10.0 * i + 5, 10.0 * i + 8, 10.0 * i + 9), 10.0 * i + 9)
    finally:
        done.set()
        reader.join()
    assert bad == []


def test_progress_comes_from_the_attempts_book_with_the_steps_hint() -> None:
    ledger = Ledger(0.0, total_steps=100, clock=Clock(0.0))
    assert ledger.progress() == (None, 100, None)
    book = ProgressBook(HangPolicy(), [0, 1], clock=Clock(0.0))
    book.ranks[0].step, book.ranks[0].intervals = 40, deque([0.5, 0.5, 0.5])
    book.ranks[1].step, book.ranks[1].intervals = 38, deque([1.0, 2.0, 1.0])
    ledger.watch(book)
    assert ledger.progress() == (38, 100, 62.0)  # the slowest rank's step, at its median step time


def test_the_ledger_line_names_training_first_then_the_largest_losses() -> None:
    ledger = Ledger(0.0, clock=Clock(0.0))
    ledger.attempt_began(0.0)
    ledger.first_step(2.0)
    ledger.attempt_ended(incident("hung", 6.0, 9.0, 10.0), 10.0)
    ledger.finish(10.0)
    assert ledger_line(ledger.summary()) == (
        "effective training 40.0% of 10.0s; lost: hang_undetected 3.0s, starting 2.0s, hang_handling 1.0s"
    )
    assert ledger_line({}) is None  # a record an older multigpu wrote


def test_the_lost_seconds_for_counters_never_fall_back() -> None:
    """``lost_seconds`` feeds counters: an attempt's time before its first step is held back until the
    step (or the attempt's end) says what it was, so no cause ever shrinks between two reads."""
    clock = Clock(0.0)
    ledger = Ledger(0.0, clock=clock)
    seen: list[dict[str, float]] = []

    def look(at: float) -> None:
        clock.now = at
        seen.append(ledger.lost_seconds())

    look(1.0)
    ledger.attempt_began(2.0)  # a script that reports no step: its attempt is training, known at its end
    look(9.0)
    ledger.attempt_ended(incident("hung", 8.0, 11.0, 12.0), 12.0)
    look(12.5)
    ledger.attempt_began(13.0)
    look(15.0)
    ledger.first_step(14.0)
    look(16.0)
    ledger.attempt_ended(incident("failed", 20.0, 20.0, 21.0), 21.0)
    look(22.0)
    assert "training" not in seen[-1]
    for earlier, later in itertools.pairwise(seen):
        assert all(later[c] >= earlier[c] for c in earlier), (earlier, later)
    assert seen[1]["starting"] == 2.0  # the attempt from 2 s on was not counted while unknown
    assert seen[-1] == {
        **dict.fromkeys(seen[-1], 0.0),
        "starting": 2.0,
        "hang_undetected": 3.0,
        "hang_handling": 1.0,
        "restarting": 2.0 + 2.0,
    }
    assert ledger.seconds_by_cause()["starting"] == 2.0  # the full view: the same, settled


@pytest.mark.parametrize("preempted_at", [None, 18.0])
def test_the_lost_seconds_do_not_fall_when_the_runs_end_rewrites_its_last_failure(
    preempted_at: float | None,
) -> None:
    """At the run's end a failure no attempt followed turns from ``restarting`` into ``stopping``, and a
    preemption warning takes the time after it: a scrape between the failure and the end saw that time
    under its first cause, and a counter that fell would read as a reset (``increase()`` would count it
    all again)."""
    clock = Clock(0.0)
    ledger = Ledger(0.0, clock=clock)
    ledger.attempt_began(1.0)
    ledger.first_step(2.0)
    ledger.attempt_ended(incident("failed", 16.0, 16.5, 20.0), 20.0)
    clock.now = 21.0
    before = ledger.lost_seconds()
    assert before["restarting"] == 5.0
    ledger.finish(22.0, preempted_at=preempted_at)
    after = ledger.lost_seconds()
    assert all(after[c] >= before[c] for c in before), (before, after)
    assert ledger.seconds_by_cause()["restarting"] == 0.0  # run.json keeps the exact story
