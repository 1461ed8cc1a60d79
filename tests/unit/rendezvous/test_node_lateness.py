"""Slow nodes and links named across nodes (``rendezvous/node_lateness.py``), from synthetic jobs: each
node's ranks enter each collective when their work is done, the collective ends when the last node
entered; every node's clock is off the others' by seconds, and its clock calls on the job's counter
are answered in the order the store got them, each its round trip after it began. A slow node, a
node slow in bursts and a slow link are named; a healthy noisy job is not, whatever its clocks. Then
two nodes through torch's in-process store: one line, the same on both. No processes."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from helpers import logged
from multigpu.rendezvous.job import JobStore
from multigpu.rendezvous.node_lateness import (
    JobTiming,
    NodeTimes,
    SlowNodes,
    clock_offset,
    compare,
    node_arrivals,
    node_offset,
)
from multigpu.supervisor.hangs.book import HangPolicy, ProgressBook
from multigpu.supervisor.hangs.lateness import LatenessWatch

Work = Callable[[int, int, random.Random], float]
"""(node, collective index, random) -> the node's seconds of work before it enters that collective."""

BEAT_S = 0.2


def healthy(n: int, k: int, rng: random.Random) -> float:
    return max(0.001, rng.gauss(0.05, 0.01))


def job(
    work: Work,
    nodes: int = 3,
    count: int = 300,
    rtts: Sequence[float] = (),
    walls_off: Sequence[float] = (),
    seed: int = 0,
) -> list[NodeTimes]:
    """Every node's record after ``count`` collectives: node n's clock is the true time plus 1.7 n s;
    ``rtts``: its round trip to the store (0.2 ms if not given); ``walls_off``: how far its wall
    clock is set wrong."""
    rng = random.Random(seed)
    offs = [1.7 * n for n in range(nodes)]
    rtt = [rtts[n] if n < len(rtts) else 0.0002 for n in range(nodes)]
    arrivals: list[dict[int, float]] = [{} for _ in range(nodes)]
    done = 100.0
    for k in range(1, count + 1):
        entered = [done + work(n, k, rng) for n in range(nodes)]
        for n, t in enumerate(entered):
            arrivals[n][k] = t + offs[n]
        done = max(entered) + 0.001 + max(rtt)  # the data of the slowest link arrives last
    calls: list[list[tuple[float, int, float, float]]] = [[] for _ in range(nodes)]
    for n in range(nodes):
        t = 100.0 + rng.uniform(0, BEAT_S)
        while t < done:
            calls[n].append((t + rtt[n] / 2, n, t + offs[n], t + rtt[n] + offs[n]))
            t += BEAT_S + rng.uniform(0, 0.002)
    ordered = sorted(c for per in calls for c in per)
    made: list[list[tuple[int, float, float]]] = [[] for _ in range(nodes)]
    for order, (_, n, sent, answered) in enumerate(ordered, 1):
        made[n].append((order, sent, answered))
    wrong = [walls_off[n] if n < len(walls_off) else rng.uniform(-0.0005, 0.0005) for n in range(nodes)]
    return [
        NodeTimes(n, f"10.0.0.{n + 1}", arrivals[n], made[n][-64:], 1e9 - offs[n] + wrong[n])
        for n in range(nodes)
    ]


def test_the_clock_calls_bound_the_offset_and_the_wall_clocks_set_it() -> None:
    records = job(healthy)
    bounds = clock_offset(records[0].calls, records[2].calls)
    assert bounds is not None and abs(bounds[0] - 3.4) <= bounds[1] <= BEAT_S
    offset = node_offset(records[0], records[2])
    assert offset is not None and offset[0] == pytest.approx(3.4, abs=0.002)


def test_wall_clocks_set_wrong_fall_back_to_the_calls_bounds() -> None:
    records = job(healthy, walls_off=[0.0, 0.0, 2.5])
    offset = node_offset(records[0], records[2])
    assert offset is not None and abs(offset[0] - 3.4) <= offset[1] <= BEAT_S


def test_a_node_whose_ranks_are_all_slow_is_named_with_its_numbers() -> None:
    records = job(lambda n, k, rng: healthy(n, k, rng) + (0.03 if n == 1 else 0.0))
    found = compare(records, 0, 0.2)
    assert [(f.node, f.kind) for f in found] == [(1, "node")], found
    line = found[0].line
    assert re.fullmatch(
        r"node 1 \(10\.0\.0\.2\) is slow: its ranks enter the collectives 0\.0[23] s after the others' "
        r"median over the last \d+ steps \((\d+)% of the others' step\)",
        line,
    ), line


def test_the_watcher_being_the_slow_node_is_named_too() -> None:
    records = job(lambda n, k, rng: healthy(n, k, rng) + (0.03 if n == 0 else 0.0))
    assert [(f.node, f.kind) for f in compare(records, 0, 0.2)] == [(0, "node")]


def test_a_node_slow_in_bursts_is_named_by_the_time_the_job_loses_to_it() -> None:
    def bursts(n: int, k: int, rng: random.Random) -> float:
        return max(0.001, rng.gauss(0.02, 0.002)) + (0.02 if n == 2 and k % 4 == 0 else 0.0)

    found = compare(job(bursts), 0, 0.2)
    assert [(f.node, f.kind) for f in found] == [(2, "node")], found


def test_a_slow_link_is_named_as_the_link() -> None:
    records = job(healthy, rtts=[0.0002, 0.1, 0.0003])
    found = compare(records, 0, 0.2)
    assert found and (found[0].node, found[0].kind) == (1, "link"), found
    assert re.fullmatch(
        r"node 1 \(10\.0\.0\.2\) has a slow link: its round trips to the job's store take 100 ms against "
        r"0\.\d+ ms on the other nodes \(median of the last 64\); the collectives wait for its data",
        found[0].line,
    ), found[0].line
    first = [NodeTimes(r.node, r.addr, r.arrivals, r.calls[:4], r.wall) for r in records]
    assert compare(first, 0, 0.2) == [], "its first few round trips are not a slow link yet"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("nodes", [2, 4])
def test_a_healthy_noisy_job_names_no_node(seed: int, nodes: int) -> None:
    def noisy(n: int, k: int, rng: random.Random) -> float:
        stall = 0.03 if rng.random() < 0.1 else 0.0  # every node stalls now and then (hogs, GC)
        return max(0.001, rng.gauss(0.05, 0.015)) + stall

    rtts = [random.Random(seed).uniform(0.0001, 0.003) for _ in range(nodes)]  # loaded, not slow
    assert compare(job(noisy, nodes, rtts=rtts, seed=seed), 0, 0.2) == []
    # Wall clocks seconds wrong: the calls' bounds (a beat wide) set the clocks; nothing is named.
    assert compare(job(noisy, nodes, walls_off=[0, 2.0, -3.0, 5.0], seed=seed), 0, 0.2) == []


def test_a_node_named_is_said_to_recover_once_and_only_once() -> None:
    slow = SlowNodes(0.2)
    late = job(lambda n, k, rng: healthy(n, k, rng) + (0.03 if n == 1 else 0.0))
    assert slow.judge(late, 0) is not None
    assert slow.judge(late, 0) is None, "no word while it stays slow"
    well = job(healthy)
    assert slow.judge(well, 0) == "node 1 (10.0.0.2) is no longer slow"
    assert slow.judge(well, 0) is None


def test_a_node_arrives_when_the_median_of_its_ranks_does() -> None:
    entries = {0: {k: 1.0 * k for k in range(1, 9)}, 1: {k: k + 0.5 for k in range(3, 9)}, 2: {5: 9.0}}
    assert node_arrivals(entries) == {5: 5.5}
    assert node_arrivals({0: entries[0], 1: entries[1]}, keep=2) == {7: 7.25, 8: 8.25}
    assert node_arrivals({}) == {}


def test_a_record_reads_back_as_written_to_the_microsecond() -> None:
    record = job(healthy, nodes=2, count=60)[1]
    back = NodeTimes.loads(record.dumps())
    assert (back.node, back.addr, back.wall) == (record.node, record.addr, record.wall)
    assert back.arrivals == pytest.approx(record.arrivals, abs=1e-6)
    assert [c[0] for c in back.calls] == [c[0] for c in record.calls]
    assert [c[1:] for c in back.calls] == [pytest.approx(c[1:], abs=1e-6) for c in record.calls]


@pytest.mark.parametrize("seed", range(5))
def test_the_offset_bounds_are_those_of_every_pair_of_calls(seed: int) -> None:
    """``clock_offset`` sorts once; the bounds are those of the definition, pair by pair."""
    ref, other = (r.calls for r in job(healthy, nodes=2, count=200, seed=seed))
    upper = min(b1 - a0 for n, a0, _ in ref for m, _, b1 in other if n < m)
    lower = max(b0 - a1 for n, _, a1 in ref for m, b0, _ in other if m < n)
    assert clock_offset(ref, other) == pytest.approx(((upper + lower) / 2, (upper - lower) / 2))


# ---- two nodes through a real store ------------------------------------------------------------------


def store() -> Any:
    from torch.distributed import HashStore

    return HashStore()


def member(shared: Any, n: int) -> JobStore:
    job = JobStore(shared, node=n, base_rank=n, nproc=1, world_size=2)
    job.run_id = "test"
    shared.add(job.key("beat", n), 0)
    shared.append(job.key("members"), f"{n}:{n},")
    return job


def test_two_nodes_say_the_one_line_the_watcher_found(caplog: pytest.LogCaptureFixture) -> None:
    """Node 1's rank enters every collective 30 ms after node 0's: both launchers log the watcher's
    line once, the same on both; the clock calls ride on the fate beats (``share``)."""
    shared = store()
    now = [500.0]
    timings = []
    for n in (0, 1):
        book = ProgressBook(HangPolicy(), [n], clock=lambda: now[0])
        book.stragglers.lateness = LatenessWatch(0.2)
        timing = JobTiming(book, member(shared, n), f"10.0.0.{n + 1}", lambda: now[0], lambda: now[0] + 1e9)
        timings.append(timing)
    rng = random.Random(1)
    caplog.clear()
    for k in range(1, 301):
        now[0] += max(0.01, rng.gauss(0.05, 0.005))
        for n, timing in enumerate(timings):
            timing.book.stragglers.lateness.note(n, k, now[0] + 0.03 * n)
        if k % 4 == 0:
            for timing in timings:
                now[0] += 0.002  # each node's fate beat, one after the other
                timing.share(lambda count: int(shared.add("progress", count)))
    lines = logged(caplog)
    assert len(lines) == 2 and lines[0] == lines[1], lines
    assert lines[0].startswith("node 1 (10.0.0.2) is slow: its ranks enter the collectives 0.03 s after")


def test_threshold_0_makes_no_store_call_beyond_progress() -> None:
    shared = store()
    book = ProgressBook(HangPolicy(straggler_threshold=0), [0])
    timing = JobTiming(book, member(shared, 0), "10.0.0.1")
    timing.share(lambda count: int(shared.add("progress", count)))
    assert not shared.check([timing.job.key("clock")])
