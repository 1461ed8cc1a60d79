"""Stragglers from collective entry times (``lateness.py``, through ``book.ProgressBook``): synthetic
jobs whose ranks enter each collective when their own work is done, the collective ending when the
last one enters, their entries seen by a 5 ms look, as the rank's thread sees them. A 40% straggler
is named with its numbers and its span recorded; a healthy job with noisy steps, checkpoint pauses or
rank-0-only logging in a few steps is not. No processes."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable

import pytest

from helpers import logged
from multigpu.contract.beats import Beat, BeatDecoder
from multigpu.supervisor.hangs.book import HangPolicy, ProgressBook
from multigpu.supervisor.hangs.lateness import (
    Lateness,
    LatenessWatch,
    _median_without,
    lateness,
    step_from_entries,
)

Work = Callable[[int, int, random.Random], float]
"""(rank, collective index, random) -> the rank's seconds of work before it enters that collective."""

LOOK_S = 0.005


def entries(work: Work, ranks: int, count: int, seed: int = 0, start: float = 100.0) -> list[list[float]]:
    """Each rank's entry time of each collective, as its thread saw it (the first look after it)."""
    rng = random.Random(seed)
    phases = [rng.uniform(0, LOOK_S) for _ in range(ranks)]
    seen: list[list[float]] = [[] for _ in range(ranks)]
    done = start
    for k in range(count):
        entered = [done + work(r, k, rng) for r in range(ranks)]
        for r, t in enumerate(entered):
            seen[r].append(math.ceil((t - phases[r]) / LOOK_S) * LOOK_S + phases[r])
        done = max(entered) + 0.0002
    return seen


def feed_and_check(
    caplog: pytest.LogCaptureFixture,
    seen: list[list[float]],
    threshold: float = 0.2,
    every: int = 20,
    indices: list[int] | None = None,
) -> tuple[ProgressBook, list[str]]:
    """The book fed every rank's beats as they would come, judged once a second of the job; the lines
    it logged meanwhile (``indices``: each entry's collective index, where not 1, 2, 3...)."""
    caplog.clear()
    clock = [seen[0][0]]
    b = ProgressBook(
        HangPolicy(straggler_threshold=threshold),
        range(len(seen)),
        clock=lambda: clock[0],
        wall=lambda: clock[0] + 1e9,
    )
    for r in range(len(seen)):
        b.started(r, clock[0], pid=40 + r, node=0)
    for k in range(len(seen[0])):
        for r, times in enumerate(seen):
            index = k + 1 if indices is None else indices[k]
            b.feed(r, [Beat("entered", value=times[k], index=index)], times[k])
        clock[0] = max(t[k] for t in seen)
        if k % every == every - 1:
            b.check(list(range(len(seen))), clock[0] + 1.0)
    return b, logged(caplog)


def healthy(r: int, k: int, rng: random.Random) -> float:
    return max(0.001, rng.gauss(0.05, 0.01))


def test_a_rank_40_percent_slower_is_named_with_its_numbers(caplog: pytest.LogCaptureFixture) -> None:
    b, notes = feed_and_check(
        caplog, entries(lambda r, k, rng: healthy(r, k, rng) + (0.02 if r == 1 else 0), 2, 600)
    )
    assert len(notes) == 1, notes
    assert notes[0].startswith("rank 1 (node 0, pid 41) is a straggler: it enters collectives 2")
    assert re.search(
        r"after the others, over the last (\d+); the job runs at the pace of its slowest rank$", notes[0]
    )
    assert int(re.findall(r"over the last (\d+)", notes[0])[0]) <= 100, "named as soon as it can be"
    share = int(notes[0].split("(")[2].split("%")[0])
    assert 30 <= share <= 50, notes[0]
    record = b.snapshot()["1"]
    assert record["straggler"] == notes[0]
    span = record["straggling"][0]
    assert span["end_time"] is None and span["start_time"] > 1e9 and 0.015 < span["late_s"] < 0.025
    assert "straggling" not in b.snapshot()["0"] and b.snapshot()["0"]["collective_late_s"] < 0
    assert b.ranks[1].straggling and not b.ranks[0].straggling


def test_the_straggler_among_eight_ranks_is_the_one_named(caplog: pytest.LogCaptureFixture) -> None:
    _, notes = feed_and_check(
        caplog, entries(lambda r, k, rng: healthy(r, k, rng) + (0.02 if r == 5 else 0), 8, 400)
    )
    assert [n.split(" (")[0] for n in notes] == ["rank 5"], notes


def test_a_straggler_that_recovers_is_said_to_and_its_span_ends(caplog: pytest.LogCaptureFixture) -> None:
    def work(r: int, k: int, rng: random.Random) -> float:
        return healthy(r, k, rng) + (0.025 if r == 0 and k < 400 else 0)

    b, notes = feed_and_check(caplog, entries(work, 3, 1200))
    assert len(notes) == 2, notes
    assert "rank 0 (node 0, pid 40) is a straggler" in notes[0]
    assert notes[1].startswith("rank 0 (node 0, pid 40) is no longer a straggler")
    span = b.snapshot()["0"]["straggling"][0]
    assert span["end_time"] is not None and span["end_time"] > span["start_time"]
    assert not b.ranks[0].straggling


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_healthy_jobs_with_noisy_steps_are_not_named(
    seed: int, ranks: int, caplog: pytest.LogCaptureFixture
) -> None:
    def noisy(r: int, k: int, rng: random.Random) -> float:
        return max(0.001, rng.gauss(0.05, 0.02)) * (3 if rng.random() < 0.02 else 1)

    _, notes = feed_and_check(caplog, entries(noisy, ranks, 1000, seed=seed))
    assert notes == []


def test_checkpoint_pauses_on_every_rank_or_written_by_rank_0_are_not_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def checkpoints(r: int, k: int, rng: random.Random) -> float:
        pause = 2.0 if k % 50 == 49 else 0.0
        return healthy(r, k, rng) + pause + (1.5 if r == 0 and k % 50 == 49 else 0.0)

    _, notes = feed_and_check(caplog, entries(checkpoints, 2, 800))
    assert notes == []


def test_rank_0_logging_in_a_few_steps_is_not_named(caplog: pytest.LogCaptureFixture) -> None:
    def logging(r: int, k: int, rng: random.Random) -> float:
        return healthy(r, k, rng) + (0.04 if r == 0 and k % 10 == 0 else 0.0)

    _, notes = feed_and_check(caplog, entries(logging, 2, 800))
    assert notes == []


def test_a_small_lateness_under_the_threshold_is_not_named(caplog: pytest.LogCaptureFixture) -> None:
    work: Work = lambda r, k, rng: healthy(r, k, rng) + (0.005 if r == 1 else 0)  # noqa: E731
    _, notes = feed_and_check(caplog, entries(work, 2, 600))
    assert notes == []


def test_threshold_0_turns_detection_off(caplog: pytest.LogCaptureFixture) -> None:
    b, notes = feed_and_check(
        caplog, entries(lambda r, k, rng: 0.05 + (0.05 if r == 1 else 0), 2, 400), threshold=0
    )
    assert notes == [] and b.stragglers.lateness.entries == {}


def test_the_first_collectives_and_a_short_job_are_not_judged() -> None:
    seen = entries(lambda r, k, rng: 0.05 + (0.05 if r == 1 else 0), 2, 69)
    assert lateness({r: dict(enumerate(t, 1)) for r, t in enumerate(seen)}) is None  # 49 past the warm-up
    seen = entries(lambda r, k, rng: 0.05 + (0.05 if r == 1 else 0), 2, 70)
    found = lateness({r: dict(enumerate(t, 1)) for r, t in enumerate(seen)})
    assert isinstance(found, Lateness) and found.count == 50
    assert found.late[1] == pytest.approx(0.05, abs=0.006) and found.share(1) == pytest.approx(1.0, abs=0.15)


def test_only_collectives_every_rank_entered_are_compared() -> None:
    a = {k: 10.0 + k * 0.1 for k in range(1, 200)}
    b = {k: t + 0.03 for k, t in a.items() if k % 2}  # rank 1 saw only the odd ones (several per look)
    found = lateness({0: a, 1: b})
    assert found is not None and found.count == 90 and found.late[1] == pytest.approx(0.03)


def test_the_step_counts_several_collectives_in_a_step_once() -> None:
    buckets = [s * 0.1 + b * 0.002 for s in range(100) for b in range(4)]  # 4 all-reduces per 100 ms step
    assert step_from_entries(buckets) == pytest.approx(0.1, rel=0.05)
    with_pauses = [t + 5.0 * (t // 3.0) for t in (s * 0.1 for s in range(100))]  # a 5 s pause every 3 s
    assert step_from_entries(with_pauses) == pytest.approx(0.1, rel=0.05)
    assert step_from_entries([1.0]) is None


def test_reported_steps_set_the_step(caplog: pytest.LogCaptureFixture) -> None:
    seen = entries(lambda r, k, rng: 0.05 + (0.02 if r == 1 else 0), 2, 100)
    b = ProgressBook(HangPolicy(), range(2), clock=lambda: 0.0)
    for r in range(2):
        b.feed(r, [Beat("entered", value=t, index=k) for k, t in enumerate(seen[r], 1)], 0.0)
        b.feed(r, [Beat("step", value=1.0)], 0.0)
        b.feed(r, [Beat("step", value=2.0)], 0.2)  # the script says its step is 200 ms: 20 ms is 11%
    b.check([0, 1], 5.0)
    assert logged(caplog) == [] and b.ranks[1].late_s == pytest.approx(0.02, abs=0.004)


def test_the_entry_beat_decodes() -> None:
    beats = BeatDecoder().feed(b"K12@345.250000;C13;K13@nan;Kx@1;")
    assert beats == [Beat("entered", value=345.25, index=12), Beat("collectives", value=13.0)]


def test_the_live_view_shows_how_late_each_rank_enters(caplog: pytest.LogCaptureFixture) -> None:
    from rich.console import Console

    from multigpu.runner.live_view import LATE_COLUMN, status_table
    from multigpu.supervisor.states import Worker, WorkerSpec

    b, _ = feed_and_check(
        caplog, entries(lambda r, k, rng: healthy(r, k, rng) + (0.02 if r == 1 else 0), 2, 300)
    )
    workers = [Worker(WorkerSpec(rank=r, local_rank=r, argv=[], env={}), progress=b.ranks[r]) for r in (0, 1)]
    console = Console(width=200, record=True)
    console.print(status_table(workers, live=False))
    text = console.export_text()
    assert LATE_COLUMN in text
    assert re.search(r"\+(19|20|21)ms straggler", text) and re.search(r"-(19|20|21)ms", text), text
    b.ranks[0].late_s = b.ranks[1].late_s = None
    console.print(status_table(workers, live=False))
    assert LATE_COLUMN not in console.export_text()


def test_indices_that_stop_naming_one_collective_are_not_judged() -> None:
    """A send/recv on the world group counts on its two ranks only: rank 2's index runs ahead by one
    every 10 steps, and its "lateness" drifts instead of holding."""
    seen = entries(healthy, 3, 600)
    shifted = {k + k // 10: t for k, t in enumerate(seen[2], 1)}
    found = lateness({0: dict(enumerate(seen[0], 1)), 1: dict(enumerate(seen[1], 1)), 2: shifted})
    assert found is None


def test_an_index_off_by_one_on_some_ranks_is_not_a_straggler() -> None:
    """One send/recv between ranks 0 and 1 early on: their collective k is rank 2's k - 1."""
    seen = entries(healthy, 3, 400)
    found = lateness(
        {
            0: {k + 1: t for k, t in enumerate(seen[0], 1)},
            1: {k + 1: t for k, t in enumerate(seen[1], 1)},
            2: dict(enumerate(seen[2], 1)),
        }
    )
    assert found is None


def test_a_rank_three_times_slower_is_still_judged() -> None:
    found = lateness(
        {
            r: dict(enumerate(t, 1))
            for r, t in enumerate(entries(lambda r, k, rng: 0.05 * (3 if r == 1 else 1), 3, 200))
        }
    )
    assert found is not None and found.late[1] == pytest.approx(0.1, abs=0.006)


def test_the_others_median_from_one_sorted_column_is_the_median_of_the_others() -> None:
    """``lateness`` sorts each collective's entry times once and leaves each rank out of that column;
    the result equals the plain median of the other ranks', ties and odd or even counts included."""
    import statistics

    rng = random.Random(7)
    for size in range(2, 12):
        for _ in range(50):
            values = [rng.choice((0.0, 0.5, 1.0, rng.random())) for _ in range(size)]
            column = sorted(values)
            for i, mine in enumerate(values):
                others = values[:i] + values[i + 1 :]
                assert _median_without(column, mine) == statistics.median(others)


def test_nothing_new_is_not_judged_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop asks every second; with no entry time noted since, the judgement is not redone."""
    import multigpu.supervisor.hangs.lateness as module

    calls: list[int] = []
    monkeypatch.setattr(module, "lateness", lambda *a, **k: calls.append(1))
    watch = LatenessWatch(threshold=0.2)
    watch.note(0, 1, 1.0)
    watch.check({}, [], 0.0)
    watch.check({}, [], 1.0)
    watch.note(0, 2, 2.0)
    watch.check({}, [], 2.0)
    assert len(calls) == 2


def test_a_rank_slowed_in_bursts_is_named_by_the_time_the_job_loses_to_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cgroup CPU quota's rhythm (issue 41): rank 1 runs 80 ms of every 100, so one collective in
    four waits 20 ms for it and the others none; the job runs 25% slower. Its median lateness is 0."""

    def bursts(r: int, k: int, rng: random.Random) -> float:
        return max(0.001, rng.gauss(0.02, 0.002)) + (0.02 if r == 1 and k % 4 == 3 else 0.0)

    seen = entries(bursts, 3, 600)
    found = lateness({r: dict(enumerate(times, 1)) for r, times in enumerate(seen)})
    assert found is not None and found.late[1] < 0.005 and found.lost[1] > 0.004
    b, notes = feed_and_check(caplog, seen)
    assert len(notes) == 1, notes
    assert re.fullmatch(
        r"rank 1 \(node 0, pid 41\) is a straggler: the job waits (\d) ms \((\d+)%\) a collective for "
        r"it on average, in bursts, over the last \d+; the job runs at the pace of its slowest rank",
        notes[0],
    ), notes[0]
    assert b.ranks[1].straggling and "straggling" in b.snapshot()["1"]


@pytest.mark.parametrize("seed", range(3))
def test_a_noisy_job_whose_ranks_all_stall_in_bursts_is_not_named(
    seed: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Every rank stalls now and then (a shared machine, CPU hogs): none costs the job more than
    the others do."""

    def stalls(r: int, k: int, rng: random.Random) -> float:
        return max(0.001, rng.gauss(0.02, 0.004)) + (0.02 if rng.random() < 0.25 else 0.0)

    _, notes = feed_and_check(caplog, entries(stalls, 3, 800, seed=seed))
    assert notes == []


def test_the_step_is_not_taken_across_the_seconds_not_sampled(caplog: pytest.LogCaptureFixture) -> None:
    """Ranks stamp entries one second in three (``rank/progress.py``): with 100 ms steps, a tenth of
    the gaps between the stamped collectives span the 2 s not sampled; those are no step. Before,
    the step came out ~1.5 s and a rank 40 ms late a step (67%) went unnamed."""

    def slow_rank(r: int, k: int, rng: random.Random) -> float:
        return max(0.001, rng.gauss(0.06, 0.005)) + (0.04 if r == 1 else 0.0)

    seen = entries(slow_rank, 2, 1500)
    kept = [k for k, t in enumerate(seen[0]) if t % 3.0 < 1.0]
    found = lateness({r: {k + 1: times[k] for k in kept} for r, times in enumerate(seen)})
    assert found is not None and 0.09 < found.step < 0.11, found
    sampled = [[times[k] for k in kept] for times in seen]
    _, notes = feed_and_check(caplog, sampled, indices=[k + 1 for k in kept])
    assert len(notes) == 1 and notes[0].startswith("rank 1 (node 0, pid 41) is a straggler"), notes
