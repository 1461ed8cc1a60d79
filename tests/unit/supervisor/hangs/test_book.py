"""book.ProgressBook on a fake clock: learned timeouts, the ceiling, persistence and reuse, the
culprit named, stragglers. No processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import logged
from multigpu.contract.beats import Beat
from multigpu.supervisor.hangs.book import HangPolicy, ProgressBook
from multigpu.supervisor.hangs.learned import LEARNED_FILE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def step(n: int) -> list[Beat]:
    return [Beat("step", value=float(n))]


def book(policy: HangPolicy, ranks: int = 2, store: Path | None = None) -> tuple[ProgressBook, Clock]:
    clock = Clock()
    b = ProgressBook(policy, range(ranks), store=store, clock=clock, wall=lambda: 5000.0)
    return b, clock


def run_steps(
    b: ProgressBook, clock: Clock, steps: range, interval: float, ranks: tuple[int, ...] = (0, 1)
) -> None:
    for n in steps:
        clock.now += interval
        for r in ranks:
            b.feed(r, step(n), clock.now)


POLICY = HangPolicy(ceiling=600.0, factor=5.0, floor=2.0)


def test_ceiling_until_steps_are_known_then_learned() -> None:
    b, clock = book(POLICY)
    assert b.timeout(0).seconds == 600.0 and "no step" in b.timeout(0).why  # type: ignore[union-attr]
    run_steps(b, clock, range(1, 3), 1.0)  # one interval: still warming up
    assert b.timeout(0).seconds == 600.0  # type: ignore[union-attr]
    run_steps(b, clock, range(3, 6), 1.0)
    limit = b.timeout(0)
    assert limit is not None and limit.seconds == 5.0 and "learned" in limit.why
    clock.now += 4.9
    assert b.check([0, 1], clock.now) is None
    clock.now += 0.2
    assert b.check([0, 1], clock.now) is not None


def test_floor_and_ceiling_bound_the_learned_timeout() -> None:
    b, clock = book(HangPolicy(ceiling=10.0, factor=5.0, floor=2.0))
    run_steps(b, clock, range(1, 5), 0.01)
    assert b.timeout(0).seconds == 2.0  # type: ignore[union-attr]  # 5 x 0.01 is under the floor
    run_steps(b, clock, range(5, 7), 3.0)
    assert b.timeout(0).seconds == 10.0  # type: ignore[union-attr]  # 5 x 3 is over the ceiling


def test_the_slowest_interval_counts_not_the_last() -> None:
    b, clock = book(POLICY)
    run_steps(b, clock, range(1, 4), 1.0)
    run_steps(b, clock, range(4, 5), 3.0)  # an evaluation step
    run_steps(b, clock, range(5, 10), 1.0)
    assert b.timeout(0).seconds == 15.0  # type: ignore[union-attr]


def test_the_rank_that_stopped_first_is_named() -> None:
    b, clock = book(POLICY, ranks=3)
    run_steps(b, clock, range(1, 11), 0.5, ranks=(0, 1, 2))
    run_steps(b, clock, range(11, 13), 0.5, ranks=(0, 2))  # rank 1 stops after step 10
    clock.now += 0.4
    b.feed(0, [Beat("begin", "forward")], clock.now)  # rank 0 then waits in a collective
    clock.now += 3.0
    hang = b.check([0, 1, 2], clock.now)
    assert hang is not None
    assert hang.culprits[0] == 1
    assert hang.line.startswith("rank 1 stopped progressing first: last progress 4.4s ago at step 10")
    assert "timeout 2.5s" in hang.line and "learned: 5 x slowest step 0.5s" in hang.line
    assert "rank 2 at step 12" in hang.line


def test_a_silent_rank_without_steps_is_named_before_a_late_one_with_steps() -> None:
    """Only rank 0 reports steps; rank 1 went quiet first, then rank 0 waited for it."""
    b, clock = book(POLICY)
    b.feed(1, [Beat("output")], clock.now)
    run_steps(b, clock, range(1, 6), 0.1, ranks=(0,))
    clock.now += 2.5
    hang = b.check([0, 1], clock.now)
    assert hang is not None and hang.culprits == [1, 0]
    assert hang.line.startswith("rank 1 stopped progressing first: last progress 3.0s ago before any step")


def test_output_is_progress_only_for_ranks_without_steps() -> None:
    b, clock = book(POLICY)
    run_steps(b, clock, range(1, 5), 0.1, ranks=(0,))
    b.feed(1, [Beat("output")], clock.now)
    for _ in range(10):  # both print every second; rank 0 stopped stepping
        clock.now += 1.0
        b.feed(0, [Beat("output")], clock.now)
        b.feed(1, [Beat("output")], clock.now)
        b.output(1, clock.now)
        if b.check([0, 1], clock.now):
            break
    hang = b.check([0, 1], clock.now)
    assert hang is not None and hang.culprits[0] == 0
    assert clock.now - 1000.0 < 5.0  # the learned 2 s floor, far below the ceiling


def test_ranks_without_steps_hang_only_when_every_rank_is_silent_for_the_ceiling() -> None:
    b, clock = book(HangPolicy(ceiling=30.0))
    clock.now += 20
    b.feed(0, [Beat("beat")], clock.now)
    clock.now += 20
    assert b.check([0, 1], clock.now) is None  # rank 0 showed progress 20 s ago
    clock.now += 10
    hang = b.check([0, 1], clock.now)
    assert hang is not None and hang.culprits == [1, 0]
    assert "no rank has shown progress for 30.0s" in hang.line


def test_a_finished_rank_puts_the_others_back_on_the_ceiling() -> None:
    b, clock = book(POLICY)
    run_steps(b, clock, range(1, 6), 0.1)
    b.finished(0, clock.now)
    clock.now += 100  # rank 1 saves its final checkpoint: no hang, the loop is over
    assert b.check([1], clock.now) is None
    assert "finished" in b.timeout(1).why  # type: ignore[union-attr]


def test_sections_get_their_own_learned_timeout() -> None:
    b, clock = book(POLICY)
    run_steps(b, clock, range(1, 6), 0.1)
    for r in (0, 1):
        b.feed(r, [Beat("begin", "checkpoint")], clock.now)
    assert "never seen to end" in b.timeout(0).why  # type: ignore[union-attr]
    clock.now += 100.0
    assert b.check([0, 1], clock.now) is None  # a section never seen to end: the ceiling
    for r in (0, 1):
        b.feed(r, [Beat("end", "checkpoint", 100.0), Beat("begin", "checkpoint")], clock.now)
    assert b.timeout(0).seconds == 500.0  # type: ignore[union-attr]  # 5 x 100 s, seen once
    b.feed(0, [Beat("end", "checkpoint", 0.5)], clock.now)
    assert b.timeout(0).seconds == 2.0  # type: ignore[union-attr]  # out of it: the step's timeout
    clock.now += 2.5
    hang = b.check([0, 1], clock.now)
    assert hang is not None and hang.culprits == [0, 1]  # rank 1 is still within its section's time


def test_learned_numbers_are_kept_and_reused_after_a_restart(tmp_path: Path) -> None:
    store = tmp_path / LEARNED_FILE
    first, clock = book(POLICY, store=store)
    run_steps(first, clock, range(1, 8), 0.4)
    first.feed(0, [Beat("end", "forward", 0.25)], clock.now)
    first.maybe_save(clock.now, force=True)
    saved = json.loads(store.read_text())
    assert saved["slowest_step_s"] == pytest.approx(0.4) and saved["sections_s"] == {"forward": 0.25}
    again, clock = book(POLICY, store=store)  # the next attempt, same output folder
    assert again.timeout(0).seconds == 600.0  # type: ignore[union-attr]  # start-up: the ceiling
    clock.now += 30.0
    for r in (0, 1):
        again.feed(r, step(8), clock.now)  # the first step: the learned numbers apply at once
    assert again.timeout(0).seconds == 2.0  # type: ignore[union-attr]
    clock.now += 0.3
    again.feed(1, step(9), clock.now)
    clock.now += 1.8
    hang = again.check([0, 1], clock.now)
    assert hang is not None and hang.culprits == [0, 1]


def test_a_damaged_or_unwritable_store_is_ignored(tmp_path: Path) -> None:
    store = tmp_path / LEARNED_FILE
    store.write_text("{not json")
    b, clock = book(POLICY, store=store)
    assert b.learned.slowest_step is None
    gone = tmp_path / "no-such-folder" / LEARNED_FILE
    b, clock = book(POLICY, store=gone)
    run_steps(b, clock, range(1, 5), 0.1)
    b.maybe_save(clock.now, force=True)  # cannot be written: the run goes on
    assert not gone.exists() and b.learned.slowest_step == pytest.approx(0.1)


def test_straggler_warned_once_with_its_numbers(caplog: pytest.LogCaptureFixture) -> None:
    b, clock = book(HangPolicy(ceiling=None, straggler_window=10), ranks=3)
    for n in range(1, 30):
        clock.now += 0.5
        for r in range(3):
            b.feed(r, [Beat("end", "forward", 0.3 if r == 2 else 0.1), *step(n)], clock.now)
        assert b.check([0, 1, 2], clock.now) is None  # no ceiling: never a hang
    notes = logged(caplog)
    assert len(notes) == 1, notes
    assert notes[0] == (
        "rank 2 is a straggler: its section 'forward' takes 0.3s (median of the last 10) "
        "against 0.1s on the other ranks (3.0x)"
    )
    assert b.snapshot()["2"]["straggler"] == notes[0]


def test_equal_ranks_are_no_stragglers(caplog: pytest.LogCaptureFixture) -> None:
    b, clock = book(HangPolicy(straggler_window=5), ranks=2)
    for n in range(1, 20):
        clock.now += 0.5
        for r in range(2):
            b.feed(r, [Beat("end", "forward", 0.1 + 0.001 * (n % 3)), *step(n)], clock.now)
        b.check([0, 1], clock.now)
    assert logged(caplog) == []


def test_snapshot_has_step_times() -> None:
    b, clock = book(POLICY)
    run_steps(b, clock, range(1, 5), 0.5)
    run_steps(b, clock, range(5, 6), 1.5)
    snap = b.snapshot()
    assert snap["0"]["step"] == 5
    assert snap["0"]["median_step_s"] == 0.5 and snap["0"]["slowest_step_s"] == 1.5
    assert snap["0"]["hang_timeout_s"] == 7.5
    assert snap["0"]["last_step_time"] == pytest.approx(5000.0 + 0.5 * 4 + 1.5)


def test_live_view_cells() -> None:
    from multigpu.runner.live_view import step_cell

    b, clock = book(POLICY)
    assert step_cell(b.ranks[0]) == "-"
    run_steps(b, clock, range(1, 2), 0.5)
    assert step_cell(b.ranks[0]) == "1"
    run_steps(b, clock, range(2, 5), 0.25)
    run_steps(b, clock, range(5, 6), 2.0)
    assert step_cell(b.ranks[0]) == "5 (250ms/2.0s)"
