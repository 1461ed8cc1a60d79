"""The fault campaign's pure parts (benchmarks/campaign_stats.py, issue 41): the Llama 3 mix's seeded
draw, the time a fault cost read from step logs, the mix-weighted quantiles and the projection."""

from __future__ import annotations

from collections import Counter

import pytest
from benchmarks.campaign_stats import (
    MIX,
    Step,
    effective_share,
    lost_after,
    mix_weighted,
    weighted_quantile,
)
from benchmarks.campaign_stats import draw as draw_faults

HOSTS = "ABCD"


def steps(first: int, last: int, t0: float, hosts: str = HOSTS, period: float = 0.1) -> list[Step]:
    """Every host of a round of len(hosts) logging steps first..last, one each ``period`` from t0."""
    return [
        Step(t0 + (s - first) * period + 0.001 * i, h, s, len(hosts), 100 + i)
        for s in range(first, last + 1)
        for i, h in enumerate(hosts)
    ]


def test_the_draw_is_seeded_and_has_every_class_once_the_rest_by_weight() -> None:
    first = draw_faults(41, 10)
    assert first == draw_faults(41, 10) and first != draw_faults(42, 10)
    assert len(first) == 10 and set(first) == set(MIX)
    many = Counter(draw_faults(7, 2000))
    assert many.most_common(1)[0][0] == "gpu"  # 268 of 420
    assert 0.55 < many["gpu"] / 2000 < 0.72 and many["hang"] < many["network"]
    few = draw_faults(3, 4)
    assert len(few) == len(set(few)) == 4


def test_a_restart_costs_the_time_until_every_rank_is_past_the_last_step() -> None:
    """Steps 0-10 until t=1.0, a fault at 1.05, every rank again from the checkpoint (step 10) at 3.0."""
    log = steps(0, 10, 0.0) + steps(10, 15, 3.0)
    lost = lost_after(log, 1.05)
    assert lost.last_step == 10 and lost.rolled_back == 1
    assert lost.stall_t == 1.05
    assert lost.lost_s == pytest.approx(3.1 + 0.003 - 1.05)  # step 11 by the last of the four hosts


def test_a_round_of_three_counts_once_its_three_ranks_are_past() -> None:
    log = steps(0, 20, 0.0) + steps(20, 25, 5.0, hosts="ACD")
    lost = lost_after(log, 2.02)
    assert lost.last_step == 20 and lost.rolled_back == 1
    assert lost.lost_s == pytest.approx(5.1 + 0.002 - 2.02)


def test_the_stall_starts_where_training_stopped_not_at_the_fault() -> None:
    """A node's launcher killed at 1.05 while its rank trains on to step 15 (t=1.5): the job stalls
    there, and it is step 15 that must be passed again."""
    log = steps(0, 15, 0.0) + steps(10, 20, 4.0, hosts="ABC")
    lost = lost_after(log, 1.05)
    assert lost.stall_t == pytest.approx(1.503) and lost.last_step == 15
    assert lost.rolled_back == 6
    assert lost.lost_s == pytest.approx(4.6 + 0.002 - 1.503)


def test_training_that_goes_straight_on_loses_one_step_and_rolls_back_nothing() -> None:
    lost = lost_after(steps(0, 50, 0.0), 2.05)
    assert lost.rolled_back == 0 and lost.last_step == 20
    assert lost.lost_s == pytest.approx(2.1 + 0.003 - 2.05)


def test_a_job_that_never_comes_back_has_no_lost_time() -> None:
    lost = lost_after(steps(0, 10, 0.0), 1.05)
    assert lost.back_t is None and lost.lost_s is None and lost.last_step == 10
    two = [Step(3.0, "A", 11, 4, 1), Step(3.0, "B", 11, 4, 2), Step(3.1, "B", 12, 4, 2)]
    partly = steps(0, 10, 0.0) + two  # two of a round of four past step 10: not back
    assert lost_after(partly, 1.05).back_t is None


def test_quantiles_follow_the_mix_not_the_draw() -> None:
    """One gpu sample and three store samples: the gpu fault is 268 of 420 of the mix, so it is the
    median whatever the campaign drew."""
    weighted = mix_weighted({"gpu": [2.0], "store": [0.1, 0.1, 0.1]}, never_s=30.0)
    assert weighted_quantile(weighted, 0.5) == 2.0
    assert weighted_quantile([(1.0, 1.0), (2.0, 1.0), (3.0, 2.0)], 0.5) == 2.0
    assert weighted_quantile([], 0.5) is None
    never = mix_weighted({"hang": [None]}, never_s=30.0)
    assert never == [(30.0, 7.0)]


def test_the_projection_at_two_and_a_half_hours() -> None:
    assert effective_share(0.0) == 1.0
    assert effective_share(9.0) == pytest.approx(9000 / 9009)
    assert effective_share(30.0, mtbi_s=30.0) == 0.5


def test_a_stall_still_going_on_counts_from_its_last_step() -> None:
    """Read 3 s after a fault (the harness waits that long after a launcher's kill -9 or a store cut)
    while the faulted node's rank took one more step just after it: the silence since that step is the
    stall, not a recovery (once read as one, a 6.3 s outage came out as 0.02 s lost)."""
    log = steps(0, 10, 0.0)
    lost = lost_after(log, 0.95, now=4.0)
    assert lost.stall_t == pytest.approx(1.003) and lost.last_step == 10 and lost.back_t is None
    assert lost_after(log, 0.95, now=1.5).back_t is not None  # too soon to call it a stall
