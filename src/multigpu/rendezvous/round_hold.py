"""A new round of torch's rendezvous held for the nodes of the last round that are still alive.

When every node restarts (a rank failed, a node asked to join), each leaves the old round and joins
the next at its own moment: under load, or after its ranks took long to stop, one node arrives more
than ``last_call_timeout`` after the first two. torch then completes the round without it, the late
node lands on the wait list, its wish to join restarts the round again, and so on: on the namespace
cluster under load, a flapping or slow link kept the job re-forming for 45-120 s (issue 41). A node
of the last round whose launcher still beats (``elastic_fixes.Liveness``) is on its way: the round
waits for it, a little past its last call, and never longer than ``HOLD_CAP_S``. A node whose beats
stopped (killed, cut off) does not hold anyone: its counter is read when the round begins, and a
counter that has not moved for ``ALIVE_WITHIN_S`` is a dead node's.

Runs in the launcher of an elastic job, on its rendezvous thread (``next_rendezvous``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Protocol

HOLD_CAP_S = 10.0
"""The longest a round is held past its last call for live nodes of the last round."""
ALIVE_WITHIN_S = 1.0
"""A node of the last round is alive while its launcher's beat counter moved this recently."""


class Beats(Protocol):
    """What the hold reads: the launchers' beat counters (``elastic_fixes.Liveness``)."""

    me: Any

    def counts(self, nodes: list[Any]) -> Mapping[Any, int]: ...


class RoundHold:
    """Whether a round about to be completed should wait for a live node of the last round."""

    def __init__(self, beats: Beats, clock: Callable[[], float] = time.monotonic) -> None:
        self.beats, self._clock = beats, clock
        self._previous: list[Any] = []
        self._seen: dict[Any, tuple[int, float]] = {}
        self._first_hold: float | None = None
        self.held_for: list[Any] = []
        """The nodes the last ``holds`` waited for (empty: it did not hold)."""

    def begin(self, previous: Iterable[Any]) -> None:
        """A round begins; ``previous`` are the last round's participants. Their counters are read
        now, so that a dead node's is already still when the round would complete."""
        self._previous = [node for node in previous if node != self.beats.me]
        self._seen, self._first_hold, self.held_for = {}, None, []
        self._read(self._previous)

    def holds(self, participants: Collection[Any], max_nodes: int) -> bool:
        """True while a node of the last round is alive and not yet among ``participants``, for at most
        ``HOLD_CAP_S`` from the first time it held; never once the round is full (``max_nodes``): the
        late node would make it one too many, and torch completes no round over its maximum."""
        missing = [node for node in self._previous if node not in participants]
        now = self._clock()
        full = len(participants) >= max_nodes
        if full or not missing or (self._first_hold is not None and now - self._first_hold > HOLD_CAP_S):
            self.held_for = []
            return False
        self._read(missing)
        self.held_for = [n for n in missing if n in self._seen and now - self._seen[n][1] <= ALIVE_WITHIN_S]
        if self.held_for and self._first_hold is None:
            self._first_hold = now
        return bool(self.held_for)

    def _read(self, nodes: list[Any]) -> None:
        if not nodes:
            return
        try:
            counts = self.beats.counts(nodes)
        except Exception:  # the store failed: fate sharing says so; nobody is held for
            self._seen.clear()
            return
        now = self._clock()
        for node, count in counts.items():
            last = self._seen.get(node)
            if last is None or last[0] != count:
                self._seen[node] = (count, now if last is not None else now - ALIVE_WITHIN_S / 2)
