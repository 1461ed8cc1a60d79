"""The other nodes' launchers, watched while this node's check runs: a node whose launcher died is named
within ``LOST_AFTER_S``, not at the check's own time-out.

Runs in the launcher's main thread, between reads of the check's pipes (``preflight_child.collect``
ticks it). Its counters are the check's own, under the round's preflight keys, not the job's beat
counters: the attempt's fate monitor (``rendezvous/failure_sharing.py``) gives a node whose counter
never moved a first-beat grace while it starts its ranks, which counters moved by the check would take
away. The silence rule is the monitor's (``latency.BeatWatch``).
"""

from __future__ import annotations

import time

from multigpu.rendezvous.job import JobStore
from multigpu.rendezvous.latency import BeatWatch

BEAT_S = 0.5
LOST_AFTER_S = 10.0
"""A node whose launcher's beats stop this long during the check is lost (``PeerBeats``)."""
START_S = 30.0
"""How long a node may take to begin its check. Also added to the check's own time-out for the
launcher's bound (``runner/preflight.py``): a plain check process imports torch first."""


class NodeLost(Exception):
    """A node's launcher stopped beating during the check (its text says which, and for how long)."""


class PeerBeats:
    """Every launcher beats while its check runs and watches the other nodes' counters: one ``add`` and
    one ``check`` (then one ``multi_get``) per ``BEAT_S``, under the round's keys."""

    def __init__(self, job: JobStore, scope: object, nodes: int, me: int) -> None:
        self._store, self.me = job.store, me
        self._keys = [job.key("preflight", scope, "beat", n) for n in range(nodes)]
        self._watch = BeatWatch(time.monotonic)
        self._started = self._next = time.monotonic()

    def poll(self) -> None:
        """Beat when due, and raise ``NodeLost`` for a node silent too long (or never started)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + BEAT_S
        self._store.add(self._keys[self.me], 1)
        if not self._store.check(self._keys):  # a node has not begun its check yet
            if now - self._started > START_S:
                missing = next(n for n, key in enumerate(self._keys) if not self._store.check([key]))
                raise NodeLost(f"node {missing} never began the check within {START_S:g}s")
            return
        counts = dict(enumerate(int(value) for value in self._store.multi_get(self._keys)))
        del counts[self.me]
        silent = self._watch.silent(counts, LOST_AFTER_S)
        if silent is not None:
            raise NodeLost(
                f"node {silent[0]} was lost during the check: its launcher stopped beating for "
                f"{silent[1]:.1f}s (killed, or its network is down)"
            )

    def name_lost(self, within: float) -> str | None:
        """Keep beating for up to ``within`` seconds: the lost node's line, or None if none shows."""
        deadline = time.monotonic() + within
        try:
            while time.monotonic() < deadline:
                self.poll()
                time.sleep(BEAT_S / 5)
        except NodeLost as lost:
            return str(lost)
        return None
