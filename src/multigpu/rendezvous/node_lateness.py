"""Slow nodes and slow links, named while the job runs: when each node's ranks enter the collectives,
compared across nodes through the job's store.

Each launcher judges its own node's ranks against each other (``supervisor/hangs/lateness.py``); a node
whose ranks are all slow, or whose link is, moves none of them against the others. So every node also
publishes, once per ``PUBLISH_S``, when its ranks entered the world group's latest collectives (the
median of its ranks', per collective, on its own CLOCK_MONOTONIC) and its clock calls: each beat adds
1 to one counter of the job's (``clock``) and notes its own times before and after (``ClockCall``).
The store answers the adds in one order, so a call answered before another's began earlier than that
one ended: from the two nodes' calls, bounds on the offset between their clocks (to within the round
trips and the gaps between calls; ``clock_offset``). The watcher (``JobStore.is_watcher``) reads every
node's record, sets their arrivals on its own clock and judges the nodes as ranks are judged
(``lateness.lateness``: the median lateness, and the time the job loses to a node, whatever its
rhythm); a node late past ``--straggler-threshold`` of the step is slow. A node whose round trips to
the store are many times the others' (``LINK_RATIO``, at least ``LINK_GAP_S`` more) has a slow link:
that is said instead, since its ranks compute at the pace of the others while its data arrives late.
The watcher writes the verdict once (``slow``); every node reads it and logs that same line.

Runs in every launcher of a job of several nodes, in its fate monitor's beat thread (each call is
bounded there: ``failure_sharing.FateMonitor._timed`` and its deadman); never in the loop.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from multigpu.config.run import RendezvousConfig
from multigpu.rendezvous.elastic import local_address
from multigpu.rendezvous.failure_sharing import lost_the_store
from multigpu.rendezvous.job import JobStore
from multigpu.supervisor.hangs.book import ProgressBook
from multigpu.supervisor.hangs.lateness import Lateness, lateness
from multigpu.supervisor.hangs.stragglers import STRAGGLER_MIN_GAP_S
from multigpu.supervisor.hangs.verdict import JobProgress

logger = logging.getLogger(__name__)

PUBLISH_S = 1.0
"""How often a node publishes its record, and the watcher judges."""
ARRIVALS = 150
"""The latest collectives a node publishes (its record stays a few KB)."""
CALLS = 64
"""Clock calls a node keeps and publishes: ~13 s of beats."""
LINK_GAP_S, LINK_RATIO = 0.02, 5.0
"""A link is slow when its node's round trips to the store take this much longer than the other
nodes' (median) and this many times as long: a loaded machine's jitter is neither."""
MIN_CALLS = 5
"""A node's round trips are compared once it has made this many clock calls (its first are slower)."""
STOP_WAIT_S = 1.0
"""How long the attempt's end waits for a call of ours in flight (a slow link's round trip or two)."""
MAX_NODES = 64
"""The watcher compares at most this many nodes (its reads grow with the job)."""
STAMPED_ERROR_S = 0.002
"""The uncertainty taken for two nodes' wall clocks that agree with their clock calls."""
"""The watcher compares at most this many nodes (its reads grow with the job)."""

ClockCall = tuple[int, float, float]
"""(the counter's answer: its order at the store, this node's clock before the call, after it)."""


@dataclass(frozen=True)
class NodeTimes:
    """One node's record: where it is, when its ranks entered collectives, its clock calls."""

    node: int
    addr: str
    arrivals: dict[int, float]
    calls: list[ClockCall]
    wall: float = 0.0
    """Its wall clock less its monotonic clock, when it published (``stamped_offset``)."""

    def dumps(self) -> str:
        arrivals = [[k, round(t, 6)] for k, t in sorted(self.arrivals.items())]
        calls = [[n, round(a, 6), round(b, 6)] for n, a, b in self.calls]
        return json.dumps([self.node, self.addr, arrivals, calls, self.wall])

    @classmethod
    def loads(cls, text: str) -> NodeTimes:
        node, addr, arrivals, calls, wall = json.loads(text)
        times = {int(k): float(t) for k, t in arrivals}
        return cls(
            int(node), str(addr), times, [(int(n), float(a), float(b)) for n, a, b in calls], float(wall)
        )

    def rtt(self) -> float | None:
        """The median round trip of its clock calls."""
        return statistics.median(b - a for _, a, b in self.calls) if self.calls else None


def node_arrivals(entries: Mapping[int, Mapping[int, float]], keep: int = ARRIVALS) -> dict[int, float]:
    """Per collective every rank here entered, the median of its ranks' entry times: when the node
    arrived (one slow rank of several is the rank detector's, not the node's)."""
    ranks = [dict(times) for times in list(entries.values())]  # copies: the loop adds meanwhile
    if not ranks:
        return {}
    common = sorted(set.intersection(*(set(times) for times in ranks)))[-keep:]
    return {k: statistics.median(times[k] for times in ranks) for k in common}


def clock_offset(ref: list[ClockCall], other: list[ClockCall]) -> tuple[float, float] | None:
    """(the other clock less the reference's, its uncertainty either way) from both nodes' calls on
    one counter: a call the store answered first began before the later one ended. None until both
    bounds are known (each node's call has come first at least once). O(n log n): the watcher runs
    it for every node, every second."""
    mine = sorted(ref)
    orders = [n for n, _, _ in mine]
    began = list(itertools.accumulate((a0 for _, a0, _ in mine), max))  # latest start of calls <= i
    ended = list(itertools.accumulate((a1 for _, _, a1 in reversed(mine)), min))[::-1]  # earliest end >= i
    upper, lower = math.inf, -math.inf
    for m, b0, b1 in other:
        i = bisect.bisect_left(orders, m)
        if i > 0:  # ref's calls before this one: it ended after they began
            upper = min(upper, b1 - began[i - 1])
        if i < len(mine):  # ref's calls after it: it began before they ended
            lower = max(lower, b0 - ended[i])
    if math.isinf(upper) or math.isinf(lower) or lower > upper:
        return None
    return (upper + lower) / 2, (upper - lower) / 2


def node_offset(ref: NodeTimes, other: NodeTimes) -> tuple[float, float] | None:
    """``other``'s clock less ``ref``'s, and its uncertainty: the offset the nodes' wall clocks give
    (NTP keeps them within a millisecond or so) where it lies within the bounds their clock calls set
    (``clock_offset``), else those bounds' middle. Calls made on one beat period each bound the
    offset to about that period (their phases hardly drift), so the bounds check the wall clocks and
    stand in for them only where they are set wrong."""
    bounds = clock_offset(ref.calls, other.calls)
    if bounds is None:
        return None
    stamped = ref.wall - other.wall
    return (stamped, STAMPED_ERROR_S) if abs(stamped - bounds[0]) <= bounds[1] else bounds


@dataclass(frozen=True)
class Finding:
    """What the watcher found on one node: ``kind`` "node" (its ranks are late) or "link"."""

    node: int
    addr: str
    kind: str
    line: str

    def cleared(self) -> str:
        what = "is no longer slow" if self.kind == "node" else "no longer has a slow link"
        return f"node {self.node} ({self.addr}) {what}"


def compare(
    records: list[NodeTimes], ref: int, threshold: float, link_gap: float = LINK_GAP_S
) -> list[Finding]:
    """Every node found slow (slow links first, then the latest node), its arrivals set on node
    ``ref``'s clock."""
    by_node = {r.node: r for r in records}
    found = _links(records, link_gap)
    if ref not in by_node:
        return found
    shifted, worst_error = {}, 0.0
    for r in records:
        offset = (0.0, 0.0) if r.node == ref else node_offset(by_node[ref], r)
        if offset is not None:
            shifted[r.node] = {k: t - offset[0] for k, t in r.arrivals.items()}
            worst_error = max(worst_error, offset[1])
    judged = lateness(shifted) if len(shifted) >= 2 else None
    if judged is None:
        return found
    gap = max(STRAGGLER_MIN_GAP_S, 2 * worst_error)  # lateness within the clocks' error says nothing
    for node in sorted(judged.late, key=lambda n: -max(judged.late[n], judged.lost[n])):
        late = max(judged.late[node], judged.lost[node])
        if late >= gap and judged.share_of(late) > threshold and node not in {f.node for f in found}:
            record = by_node[node]
            found.append(Finding(node, record.addr, "node", _slow_line(record, judged, late)))
    return found


def _slow_line(record: NodeTimes, judged: Lateness, late: float) -> str:
    return (
        f"node {record.node} ({record.addr}) is slow: its ranks enter the collectives {late:.2f} s "
        f"after the others' median over the last {judged.count} steps ({judged.share_of(late):.0%} "
        "of the others' step)"
    )


def _links(records: list[NodeTimes], link_gap: float) -> list[Finding]:
    """The nodes whose round trips to the store are far above the other nodes' (median)."""
    rtts = {r.node: rtt for r in records if len(r.calls) >= MIN_CALLS and (rtt := r.rtt()) is not None}
    found = []
    for r in records:
        others = [t for n, t in rtts.items() if n != r.node]
        mine = rtts.get(r.node)
        if mine is None or not others:
            continue
        usual = statistics.median(others)
        if mine - usual >= link_gap and mine >= LINK_RATIO * usual:
            line = (
                f"node {r.node} ({r.addr}) has a slow link: its round trips to the job's store take "
                f"{mine * 1e3:.0f} ms against {usual * 1e3:.2g} ms on the other nodes (median of the "
                f"last {len(r.calls)}); the collectives wait for its data"
            )
            found.append(Finding(r.node, r.addr, "link", line))
    return sorted(found, key=lambda f: -rtts[f.node])


@dataclass
class SlowNodes:
    """The watcher's verdict over time: the node named (if any), until it is slow no longer (under
    half the threshold, or half the link's gap)."""

    threshold: float
    named: Finding | None = None

    def judge(self, records: list[NodeTimes], ref: int) -> str | None:
        """The line to publish when the verdict changes; None when it does not."""
        if self.named is None:
            found = compare(records, ref, self.threshold)
            if found:
                self.named = found[0]
                return found[0].line
            return None
        held = compare(records, ref, self.threshold / 2, LINK_GAP_S / 2)
        if any((f.node, f.kind) == (self.named.node, self.named.kind) for f in held):
            return None
        named, self.named = self.named, None
        return named.cleared()


class JobTiming(JobProgress):
    """``JobProgress`` and, once per ``PUBLISH_S``, this node's record in the job's store; on the
    watcher, every node's judged (``SlowNodes``); on every node, a new verdict logged once."""

    def __init__(
        self,
        book: ProgressBook,
        job: JobStore,
        addr: str,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(book)
        self.job, self.addr, self.clock, self.wall = job, addr, clock, wall
        self.calls: deque[ClockCall] = deque(maxlen=CALLS)
        self.slow = SlowNodes(book.policy.straggler_threshold)
        self._at = -math.inf
        self._said = 0
        self._seen: set[int] = set()
        self._stopped = False
        self._idle = threading.Event()
        self._idle.set()

    def stop(self) -> None:
        """The attempt ends: no more calls of ours on the beat thread, and the one in flight (over a
        slow link, a round trip or two) answered first, bounded: a daemon thread still inside torch's
        store client when the launcher exits aborts it. Runs on the launcher's main thread."""
        self._stopped = True
        if not lost_the_store(self.job):  # a call over a dead link is not waited for
            self._idle.wait(STOP_WAIT_S)

    def share(self, add: Callable[[int], int]) -> None:
        """Called once per fate beat (``FateMonitor._share_progress``): progress, a clock call, and
        every ``PUBLISH_S`` the record out and the verdict in."""
        super().share(add)
        if self.slow.threshold <= 0 or self._stopped:
            return
        self._idle.clear()
        try:
            began = self.clock()
            order = int(self.job.store.add(self.job.key("clock"), 1))
            self.calls.append((order, began, self.clock()))
            if began - self._at >= PUBLISH_S and not self._stopped:
                self._at = began
                self._publish()
        except (ValueError, TypeError, KeyError, ArithmeticError) as exc:  # a record we cannot read
            logger.debug(f"node lateness: {exc!r}")  # no verdict, no harm
        finally:
            self._idle.set()

    def _publish(self) -> None:
        entries = self.book.stragglers.lateness.entries
        wall = self.wall() - self.clock()
        own = NodeTimes(self.job.node, self.addr, node_arrivals(entries), list(self.calls), wall)
        self.job.store.set(self.job.key("timing", own.node), own.dumps())
        if self._stopped:
            return
        if self.job.is_watcher:
            line = self.slow.judge([own, *self._others(own.node)], own.node)
            if line is not None:
                self.job.store.set(self.job.key("slow"), line)
                self.job.store.add(self.job.key("slow_seq"), 1)
        if not self._stopped:
            self._hear()

    def _others(self, me: int) -> list[NodeTimes]:
        """The other nodes' latest records (those that have published one; a read never waits)."""
        nodes = sorted(set(self.job.members().values()) - {me})[:MAX_NODES]  # a slow node joins late
        for node in nodes:
            if node not in self._seen and self.job.store.check([self.job.key("timing", node)]):
                self._seen.add(node)
        known = [n for n in nodes if n in self._seen]
        if not known:
            return []
        values = self.job.store.multi_get([self.job.key("timing", n) for n in known])
        return [NodeTimes.loads(bytes(v).decode()) for v in values]

    def _hear(self) -> None:
        """The watcher's latest verdict, logged once on this node: one call (its count, which never
        waits) unless there is a new one."""
        seq = int(self.job.store.add(self.job.key("slow_seq"), 0))
        if seq > self._said:
            self._said = seq
            logger.info(bytes(self.job.store.get(self.job.key("slow"))).decode())


def node_address(config: RendezvousConfig) -> str:
    """How the job's lines name this node: ``--local-addr``, else the address it reaches the
    rendezvous at (``elastic.local_address``)."""
    if config.local_addr:
        return config.local_addr
    return "127.0.0.1" if config.endpoint is None else local_address(config.endpoint)
