"""The measured latency of the job's store, and the silence of a watched beat counter.

A fixed loss threshold is either too short for a loaded store (a healthy job aborted) or too long for an
idle one (a dead node found late). Every threshold here is ``max(floor, factor x p99)`` of the store
round trips this launcher has measured, so it follows the store: a slow store gets more time, a fast
one is declared lost soon after it stops answering.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Mapping

from multigpu.rendezvous.job import DONE

LOSS_FLOOR_S = 1.0
"""Never declare the store or a node lost after less silence than this (scheduling hiccups, GC)."""
LOSS_FACTOR = 10.0
LOSS_CAP_S = 30.0
"""However slow the store was, a store or node silent this long is lost."""
OUTAGE_S = 8.0
"""A store call in flight is late, not lost, for this long however fast the store was: a segment a
lossy link dropped waits for TCP's retransmission (200 ms, then doubling: five tries take 6.2 s), and
a store cut off for a few seconds (a link that flaps, a switch port that resets) is ridden out."""
STILL_LOST_S = 1.0
"""The store's host, on its way out, waits for the last read of a node named lost only while its beat
counter moves within this: a killed launcher never reads, and waiting the whole bound for it kept the
host of a two-node job 5 s past its rank's end (issue 41)."""
FIRST_BEAT_GRACE_S = 10.0
"""A node that has not beaten yet may still be starting its workers: it gets this long at least. On a
slow link it starts its attempt seconds after the others (every store call of the round's join is a
round trip: 4.8 s later at 100 ms, issue 41), so the grace is not 5 s."""


class Latency:
    """Recent round trips to the store, and the loss threshold they give. Thread-safe."""

    def __init__(
        self,
        *,
        floor_s: float = LOSS_FLOOR_S,
        factor: float = LOSS_FACTOR,
        cap_s: float = LOSS_CAP_S,
        window: int = 256,
    ) -> None:
        self.floor_s, self.factor, self.cap_s = floor_s, factor, cap_s
        self._samples: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def record(self, seconds: float) -> None:
        with self._lock:
            self._samples.append(max(0.0, seconds))

    def p99(self) -> float:
        with self._lock:
            samples = sorted(self._samples)
        if not samples:
            return 0.0
        return samples[max(0, math.ceil(0.99 * len(samples)) - 1)]

    def threshold(self) -> float:
        """How long the store may stay silent before it counts as lost."""
        return min(self.cap_s, max(self.floor_s, self.factor * self.p99()))

    def call_limit(self) -> float:
        """How long one store call may stay in flight before the store counts as lost: the threshold,
        and never less than a short outage (``OUTAGE_S``)."""
        return min(self.cap_s, max(OUTAGE_S, self.threshold()))


MISSED_BEATS = 4
"""A watched node is lost only after this many of its own beat intervals (the longest of the recent
ones) without a beat, whatever the threshold: a node on a slow or lossy link beats late, not never."""
INTERVALS = 32
"""How many of a node's recent beat intervals its allowance is taken from."""
PACE_BEATS = 2
"""How many intervals between a node's beats show its pace."""
UNPACED_S = 2.5
"""The allowance of a node that beat but has not shown its pace yet: a few beats on a slow link."""


class BeatWatch:
    """Which of the watched nodes' beat counters stopped moving (a node that finished never does).

    Each node's allowance is its own: the store's threshold, or ``MISSED_BEATS`` of the longest of its
    recent intervals between beats as this watcher saw them, whichever is longer. A node whose link is
    slow (its beats take round trips of 100 ms and more) or lossy (a lost segment waits for TCP's
    retransmission, 200 ms and doubling) beats at its own pace, and is judged by it; a node that
    beat at the job's pace and stopped is found as soon as before."""

    def __init__(self, clock: Callable[[], float], *, first_beat_grace_s: float = FIRST_BEAT_GRACE_S) -> None:
        self._clock = clock
        self._grace = first_beat_grace_s
        self._seen: dict[int, tuple[int, float]] = {}
        self._intervals: dict[int, deque[float]] = {}

    def limit(self, threshold: float) -> float:
        """The longest silence any watched node is allowed now (``allowance``): how long a verdict
        can take."""
        seen = list(self._seen)  # one copy: the watcher's beat thread updates it
        return max([threshold, *(self.allowance(base, threshold) for base in seen)])

    def forgive(self) -> None:
        """The store was out of this watcher's reach for a while (its own calls waited): every node's
        silence meanwhile is no evidence, so each one's silence counts from now."""
        now = self._clock()
        self._seen = {base: (count, now) for base, (count, _) in self._seen.items()}

    def allowance(self, base: int, threshold: float) -> float:
        """How long node ``base`` may stay silent: ``first_beat_grace_s`` before its first beat (a node
        still starting its workers), ``UNPACED_S`` until it has shown its pace (``PACE_BEATS``
        intervals), then ``threshold``, or several of its own longest recent intervals."""
        intervals = list(self._intervals.get(base, ()))
        if self._seen.get(base, (0, 0.0))[0] == 0:
            return max(threshold, self._grace)
        if len(intervals) < PACE_BEATS:
            return max(threshold, UNPACED_S)
        return max(threshold, MISSED_BEATS * max(intervals))

    def silent(self, counts: Mapping[int, int], threshold: float) -> tuple[int, float] | None:
        """(base rank, seconds of silence) of the first node whose counter has not moved for longer
        than its allowance (``first_beat_grace_s`` before its first beat), or None."""
        now = self._clock()
        for base, count in counts.items():
            if count >= DONE:
                continue
            last, since = self._seen.get(base, (-1, now))
            if count != last:
                if last > 0:
                    self._intervals.setdefault(base, deque(maxlen=INTERVALS)).append(now - since)
                self._seen[base] = (count, now)
                continue
            if now - since > self.allowance(base, threshold):
                return base, now - since
        return None
