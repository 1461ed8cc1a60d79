"""Stragglers from collective entry times: the rank the others wait for, named with no script change.

Every rank's progress thread (``rank/progress.py``) notes, on the node's CLOCK_MONOTONIC, when it first
saw the world group's collective count reach n (to within its 5 ms look) and beats ``K<n>@<t>;``. On one
node every process reads that same clock, so the times compare across the node's ranks; across hosts
they would not (clocks differ by as much as the lateness sought), so each launcher judges its own node's
ranks only. A rank's lateness at collective n is its entry time minus the median of the other ranks';
its lateness is the median over the last ``WINDOW`` collectives every rank here entered, past the
first ``WARMUP`` (start-up). The ranks' indices may stop naming the same collectives (a send or recv on
the world group counts on its two ranks only): the others cannot enter the next collective before the
last rank entered this one, so lateness of a whole step (``ALIGNED``), or lateness that drifts by a
step from the window's first half to its second, says so, and nothing is judged. The median keeps
out what happens in a few steps only (a rank-0-only log line, a checkpoint one rank writes while the
others wait); a pause on every rank moves no rank against the others. A rank slowed in bursts (a cgroup
CPU quota: it runs 80 ms, then waits 20 ms, whatever its steps) is late in one collective of several:
its median stays small while the job loses a quarter of its time to it. So the time lost counts too:
the mean lateness, each collective's clipped at ``CLIP_S`` or a step, whichever is longer, so that one
rank's checkpoint or evaluation (seconds, once in many steps) counts as a step at most.

Lateness is set against the others' own step: the job's step (the median step interval where the
script reports steps, else measured from the entry times) less the lateness, the time they wait.
A rank late by more than ``threshold`` of that (``--straggler-threshold``, 0.2: the job runs 20%
slower for it) and by ``STRAGGLER_MIN_GAP_S`` is a straggler, until it falls under half of that.

Runs in the launcher (and OTX's caller), inside ``book.ProgressBook``; pure arithmetic.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from multigpu.supervisor.hangs.stragglers import STRAGGLER_MIN_GAP_S, find_stragglers
from multigpu.supervisor.states import RankProgress, rounded

WINDOW = 300
"""Collectives judged: the latest this many that every rank here entered."""
MIN_COLLECTIVES = 50
"""No judgement on fewer: the job's normal spread is not known yet."""
WARMUP = 20
"""The job's first collectives (its start-up, the first steps) are never judged."""
ALIGNED = 0.9
"""Lateness over this share of the step is an index off by one, not a rank (it would be 10x slower)."""
EVERY_S = 1.0
"""How often the launcher looks for stragglers (each look costs ~1 ms per rank pair on 300 collectives)."""
KEEP = 4 * WINDOW
"""Entry times kept per rank."""
PAUSE = 10.0
"""A gap this many times the usual step is a pause (a checkpoint, an evaluation): not part of a step."""
CLIP_S = 0.1
"""The time lost counts one collective's lateness up to a step or this, whichever is longer: a CPU
quota's burst (the default period is 100 ms) counts whole, a one-off of seconds does not."""


def step_from_entries(times: list[float]) -> float | None:
    """The job's step from the times (in order) at which collectives were entered: the span over the
    number of step-sized gaps (at least half the 90th percentile), so that several collectives in
    one step (DDP's buckets) count once, and pauses left out."""
    return step_from_gaps([b - a for a, b in itertools.pairwise(times)])


def step_from_gaps(gaps: list[float]) -> float | None:
    """``step_from_entries`` from the gaps between collectives that follow each other (the ranks
    sample one second in three: a gap across the seconds not sampled is no step)."""
    if not gaps:
        return None
    high = sorted(gaps)[int(0.9 * (len(gaps) - 1))]
    steps = [g for g in gaps if g >= 0.5 * high]
    usual = statistics.median(steps) if steps else 0.0
    if usual <= 0:
        return None
    kept = [g for g in gaps if g <= PAUSE * usual]
    return sum(kept) / sum(1 for g in kept if g >= 0.5 * high)


@dataclass(frozen=True)
class Lateness:
    """One judgement: every rank's median lateness (seconds), the step it is set against, over how
    many collectives; ``lost``: every rank's mean lateness, clipped (``CLIP_S``), the time the job
    loses to it a collective."""

    late: dict[int, float]
    step: float
    count: int
    lost: dict[int, float] = field(default_factory=dict)

    def share(self, rank: int) -> float:
        """The rank's lateness against the others' own step (their step less their wait)."""
        return self.share_of(self.late[rank])

    def share_of(self, late: float) -> float:
        own = self.step - late
        return late / own if own > 0 else float("inf")

    def bursts(self, rank: int, threshold: float) -> bool:
        """Whether the rank is named for the time lost to it where its median lateness is not: late in
        some collectives only, by enough in all (``threshold``, ``STRAGGLER_MIN_GAP_S``)."""
        lost = self.lost.get(rank, 0.0)
        return lost >= STRAGGLER_MIN_GAP_S and self.share_of(lost) > threshold


def lateness(entries: Mapping[int, Mapping[int, float]], step: float | None = None) -> Lateness | None:
    """Judge ``entries`` (rank -> collective index -> entry time); ``step`` where the script reports
    one; None with fewer than 2 ranks or ``MIN_COLLECTIVES`` collectives they all entered."""
    if len(entries) < 2:
        return None
    common = set.intersection(*(set(times) for times in entries.values()))
    window = sorted(k for k in common if k > WARMUP)[-WINDOW:]
    if len(window) < MIN_COLLECTIVES:
        return None
    ranks = list(entries)
    each: dict[int, list[float]] = {r: [] for r in ranks}
    medians = []
    for k in window:  # one sort per collective: O(W R log R), not a median of the others per rank
        column = sorted(entries[r][k] for r in ranks)
        medians.append(statistics.median(column))
        for r in ranks:
            mine = entries[r][k]
            each[r].append(mine - _median_without(column, mine))
    late, halves = {}, {}
    for r, diffs in each.items():
        late[r] = statistics.median(diffs)
        halves[r] = abs(
            statistics.median(diffs[: len(diffs) // 2]) - statistics.median(diffs[len(diffs) // 2 :])
        )
    if step is None:
        step = step_from_gaps(_near_gaps(window, medians))
    if step is None or max(halves.values()) > step or max(map(abs, late.values())) > ALIGNED * step:
        return None  # the ranks' indices do not name the same collectives
    return Lateness(late, step, len(window), {r: time_lost(d, step) for r, d in each.items()})


def time_lost(diffs: list[float], step: float) -> float:
    """The mean of a rank's lateness in each collective, each clipped at ``CLIP_S`` or ``step``
    (whichever is longer) either way: the time the job loses to it a collective, whatever its rhythm."""
    clip = max(CLIP_S, step)
    return sum(min(clip, max(-clip, d)) for d in diffs) / len(diffs)


def _near_gaps(indices: list[int], times: list[float]) -> list[float]:
    """The gaps between collectives judged one after the other, but for those across a jump of more
    than twice the usual number of indices: the seconds the ranks did not sample."""
    pairs = list(itertools.pairwise(zip(indices, times, strict=True)))
    if not pairs:
        return []
    usual = statistics.median(k - j for (j, _), (k, _) in pairs)
    return [b - a for (j, a), (k, b) in pairs if k - j <= 2 * usual]


def _median_without(column: list[float], value: float) -> float:
    """The median of sorted ``column`` with one occurrence of ``value`` left out: the others' median."""
    gone = bisect.bisect_left(column, value)
    n = len(column) - 1

    def at(j: int) -> float:
        return column[j if j < gone else j + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


@dataclass
class Straggle:
    """One span of a rank's straggling: when it began and ended (wall clock), how late it was."""

    start: float
    late_s: float
    share: float
    count: int
    end: float | None = None

    def record(self) -> dict[str, Any]:
        return {
            "start_time": self.start,
            "end_time": self.end,
            "late_s": rounded(self.late_s),
            "late_share": rounded(self.share),
            "collectives": self.count,
        }


@dataclass
class LatenessWatch:
    """Entry times of this node's ranks, and the straggles found in them (``threshold`` 0: none)."""

    threshold: float
    entries: dict[int, dict[int, float]] = field(default_factory=dict)
    straggles: dict[int, list[Straggle]] = field(default_factory=dict)
    _noted: int = 0
    _judged: int = -1
    """Entry times noted in all, and at the last judgement: with nothing new, nothing to judge again."""

    def note(self, rank: int, index: int, when: float) -> None:
        if self.threshold <= 0:
            return
        self._noted += 1
        times = self.entries.setdefault(rank, {})
        times[index] = when
        if len(times) > KEEP:
            del times[next(iter(times))]

    def check(
        self, ranks: Mapping[int, RankProgress], running: list[int], wall: float
    ) -> list[tuple[int, str]]:
        """Judge the running ranks' latest collectives; the lines to say (rank, line): a straggler
        found, or one no longer."""
        if self._noted == self._judged:
            return []  # the same entries judge the same: nothing to say again
        self._judged = self._noted
        here = {r: self.entries[r] for r in running if r in self.entries}
        steps = [m for r in running if (m := ranks[r].median_interval()) is not None]
        found = lateness(here, statistics.median(steps) if steps else None)
        if found is None:
            return []
        lines = []
        for r in found.late:
            ranks[r].late_s = found.late[r]
            line = self._judge(ranks[r], found, wall)
            if line is not None:
                lines.append((r, line))
        return lines

    def _judge(self, p: RankProgress, found: Lateness, wall: float) -> str | None:
        """One rank's judgement: the line when it becomes a straggler or stops being one."""
        r, late, share = p.rank, found.late[p.rank], found.share(p.rank)
        by_median = late >= STRAGGLER_MIN_GAP_S and share > self.threshold
        worst = max(late, found.lost.get(r, late))
        worst_share = found.share_of(worst)
        open_span = self.straggling(r)
        if open_span is None and (by_median or found.bursts(r, self.threshold)):
            self.straggles.setdefault(r, []).append(Straggle(wall, worst, worst_share, found.count))
            p.straggling = True
            if by_median:
                return (
                    f"{_who(p)} is a straggler: it enters collectives {_ms(late)} "
                    f"({share:.0%}) after the others, over the last {found.count}; the job runs "
                    f"at the pace of its slowest rank"
                )
            return (
                f"{_who(p)} is a straggler: the job waits {_ms(worst)} ({worst_share:.0%}) a "
                f"collective for it on average, in bursts, over the last {found.count}; the job runs "
                f"at the pace of its slowest rank"
            )
        if open_span is not None and (worst < STRAGGLER_MIN_GAP_S / 2 or worst_share < self.threshold / 2):
            open_span.end = wall
            p.straggling = False
            return (
                f"{_who(p)} is no longer a straggler: it enters collectives "
                f"{_ms(late)} ({share:.0%}) after the others, over the last {found.count} "
                f"(it was one for {wall - open_span.start:.0f}s)"
            )
        if open_span is not None:
            open_span.late_s = max(open_span.late_s, worst)
            open_span.share = max(open_span.share, worst_share)
        return None

    def straggling(self, rank: int) -> Straggle | None:
        spans = self.straggles.get(rank)
        return spans[-1] if spans and spans[-1].end is None else None


@dataclass
class StragglerWatch:
    """Both sources of a straggler, for ``book.ProgressBook``: step and section times the script
    reports (``stragglers.find_stragglers``) and collective entry times (``LatenessWatch``). ``lines``:
    each rank's straggler line, as run.json and the live view show it."""

    threshold: float
    window: int
    ratio: float
    lines: dict[int, str] = field(default_factory=dict)
    lateness: LatenessWatch = field(init=False)
    _at: float = -math.inf

    def __post_init__(self) -> None:
        self.lateness = LatenessWatch(self.threshold)

    def check(
        self, ranks: Mapping[int, RankProgress], running: list[int], now: float, wall: float
    ) -> list[str]:
        """At most once every ``EVERY_S``: the lines to say (a straggler found, or one no longer)."""
        if now - self._at < EVERY_S or len(running) < 2 or self.threshold <= 0:
            return []
        self._at = now
        said = []
        for rank, line in find_stragglers(dict(ranks), self.window, self.ratio).items():
            if rank not in self.lines:
                self.lines[rank] = line
                said.append(line)
        for rank, line in self.lateness.check(ranks, [r for r in running if not ranks[r].finished], wall):
            if self.lateness.straggling(rank) is not None:
                self.lines[rank] = line
            said.append(line)
        return said

    def fields(self, rank: int) -> dict[str, Any]:
        """What run.json's progress says of the rank's straggling."""
        data: dict[str, Any] = {}
        if rank in self.lines:
            data["straggler"] = self.lines[rank]
        if rank in self.lateness.straggles:
            data["straggling"] = [s.record() for s in self.lateness.straggles[rank]]
        return data


def _who(p: RankProgress) -> str:
    pid = f", pid {p.pid}" if p.pid is not None else ""
    return f"rank {p.rank} (node {p.node}{pid})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"
