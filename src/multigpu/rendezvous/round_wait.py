"""The line of an elastic node waiting for its rendezvous round: who joined, how many more it needs.

Runs in the launcher, on a thread of its own for the length of torch's ``next_rendezvous``
(``elastic.ElasticRendezvous``); it only reads the store. A node counts as joined only while it is
alive: a launcher killed after its round formed stays in torch's state until a sync sweeps it (up to
``keep_alive_interval * keep_alive_max_attempt``, 15 s by default, and with our eviction, seconds), and
listing it as joined for the whole ``last_call_timeout`` told the user a dead node was there. Its own
beats tell at once: every multigpu launcher adds 1 to its counter each 0.2 s (``Liveness``), so one
whose counter stood still since the last look is gone. A node that never beats (a torchrun among
us) is judged by torch's keep-alive.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from multigpu.config.run import RunConfig
from multigpu.contract.values import WAIT_LINE_EVERY_S, duration_text
from multigpu.rendezvous.store_threads import store_thread

logger = logging.getLogger(__name__)


class RoundWait:
    """A node waiting for a rendezvous round to form says who joined, how many more it needs and the
    time left (``join_timeout``): after ``first_s`` (a round that forms at once says nothing), then
    every ``WAIT_LINE_EVERY_S``. ``alive``: the ``Liveness`` whose beat keys it reads (None: torch's
    keep-alive alone) and torch's keep-alive limit, in seconds."""

    def __init__(
        self,
        backend: Any,
        config: RunConfig,
        timeout_s: float,
        alive: tuple[Any, float] = (None, 15.0),
        first_s: float = 2.0,
    ) -> None:
        self.backend, self.config, self.timeout_s = backend, config, timeout_s
        self.liveness, self.lost_s = alive
        self.first_s = first_s
        self.last: str | None = None
        """Who had joined at the last look, for a Ctrl-C's line."""
        self._beats: dict[Any, int] = {}
        self._stop = threading.Event()
        self._thread = store_thread(self._run, "multigpu-round-wait")

    def __enter__(self) -> RoundWait:
        self._deadline = time.monotonic() + self.timeout_s
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        with contextlib.suppress(Exception):
            self.joined()  # the beat counters' first look: the first line compares with it
        every = self.first_s
        while not self._stop.wait(every):
            every = WAIT_LINE_EVERY_S
            with contextlib.suppress(Exception):  # the store is gone: the rendezvous itself says so
                joined = self.joined()
                if not self._stop.is_set():
                    logger.info(round_wait_line(joined, self.config, self._deadline - time.monotonic()))

    def joined(self) -> list[str]:
        """The live nodes in the round being formed (and those waiting for the next), as ``host pid N``."""
        current = self.backend.get_state()
        state = pickle.loads(current[0]) if current is not None else None
        nodes = [*state.participants, *state.wait_list] if state is not None else []
        beats = state.last_heartbeats if state is not None else {}
        since = datetime.now(timezone.utc) - timedelta(seconds=self.lost_s)
        kept = [node for node in nodes if beats.get(node, since) >= since]
        silent = self._silent(kept)
        names = sorted(f"{node.addr} pid {node.pid}" for node in kept if node not in silent)
        self.last = f"joined: {', '.join(names)}" if names else None
        return names

    def _silent(self, nodes: list[Any]) -> set[Any]:
        """The nodes whose beat counter stood still since the last look (none at the first)."""
        if self.liveness is None or not nodes:
            return set()
        store = self.liveness.store
        keys = {node: self.liveness.key(node) for node in nodes}
        beating = [node for node in nodes if store.check([keys[node]])]
        values = store.multi_get([keys[node] for node in beating]) if beating else []
        counts = {node: int(value) for node, value in zip(beating, values, strict=True)}
        silent = {node for node, count in counts.items() if self._beats.get(node) == count}
        self._beats = counts
        return silent


def round_wait_line(joined: list[str], config: RunConfig, left_s: float) -> str:
    """``waiting for 1 more node(s) for the round (2:3 nodes; joined: n1 pid 7); 4m58s left
    (join_timeout)``; once the minimum is there, torch's last call waits for more."""
    low, high = config.rdzv.min_nodes, config.rdzv.max_nodes
    more = max(0, (low or 0) - len(joined))
    nodes = f"{low}:{high} nodes; joined: {', '.join(joined) or 'none'}"
    if not more:
        return f"the round has its {low} node(s); waiting for more up to last_call_timeout ({nodes})"
    return (
        f"waiting for {more} more node(s) for the round ({nodes}); {duration_text(left_s)} left "
        "(join_timeout)"
    )
