"""Two defects of torch 2.13's elastic rendezvous handler, worked around on the job's store, not by a
new protocol: the workers' store of every round (``handler_class``) and the eviction of a silent node
(``Liveness``). Runs in the launcher of an elastic job (``elastic.py`` builds on both); nothing here
imports torch at module level.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from multigpu.config.endpoint import Endpoint
from multigpu.rendezvous.failure_sharing import BEAT_S
from multigpu.rendezvous.round_hold import RoundHold
from multigpu.rendezvous.store import bind_store_socket, serve_store_on
from multigpu.rendezvous.store_threads import store_thread

EVICT_AFTER_S = 3.0
"""A launcher silent this long is aged out of torch's state (torch alone would wait 15 s)."""
CLOSE_WAIT_S = 5.0
"""The longest a launcher waits for torch to close the job's rendezvous on its way out."""
SYNC_POLL_S = 0.1
"""How often a node waiting in torch's rendezvous reads the round's state, at most (torch: every 1 s)."""
POLLS_PER_S = 1000.0
"""The rendezvous reads the whole job may make of its store per second while nodes wait."""


def pace_polls(max_nodes: int) -> float:
    """Make torch's rendezvous poll its state every ``SYNC_POLL_S`` instead of every second, slower for
    a bigger job so that its nodes together read at most ``POLLS_PER_S`` times a second (1 s at 1,000
    nodes, torch's own pace); the poll in seconds, which the handler's state cache must not outlast.

    torch waits for the other nodes of a round by reading the state, which it reuses for 1 s
    (``cache_duration``), and sleeping 1 s (``_delay(seconds=1)``): each step of a round cost up to a
    second, 2.0-2.3 s from a rank's death to the next round on three nodes here, the largest share of
    a restart (issue 41's campaign); with 0.1 s, 0.4-0.5 s. Runs in the launcher, before each round;
    torch's other delays (the first round's skew) are kept, and a torch without ``_delay`` keeps 1 s."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    torch_rdzv: Any = dynamic_rendezvous  # its private names, as torch 2.1-2.13 have them
    original = getattr(torch_rdzv, "_multigpu_torch_delay", None) or getattr(torch_rdzv, "_delay", None)
    if original is None:
        return 1.0
    poll = min(1.0, max(SYNC_POLL_S, max_nodes / POLLS_PER_S))

    def delay(seconds: float | tuple[float, float]) -> None:
        original(poll if seconds == 1 else seconds)

    torch_rdzv._multigpu_torch_delay = original
    torch_rdzv._delay = delay
    return poll


def hold_completion(executor: Any, hold: RoundHold, poll: float) -> None:
    """torch's executor, made to complete a round only once ``hold`` lets it (``round_hold``): while
    it holds, the executor polls again instead (torch asks to complete at every poll past the last
    call), and keeps this node's keep-alive fresh, which torch would not refresh meanwhile (a hold
    longer than its eviction limit would drop a live participant). Installed once per executor."""
    if getattr(executor, "_multigpu_hold", None) is hold:
        return
    complete = executor._mark_rendezvous_complete
    settings = executor._settings
    kept = [time.monotonic()]

    def mark_complete() -> None:
        if not hold.holds(executor._state.participants, settings.max_nodes):
            complete()
            return
        if time.monotonic() - kept[0] >= settings.keep_alive_interval.total_seconds() / 2:
            executor._keep_alive()  # written back by the executor's next sync (``mark_dirty``)
            kept[0] = time.monotonic()
        time.sleep(poll)

    executor._mark_rendezvous_complete = mark_complete
    executor._multigpu_hold = hold


def close_rendezvous(handler: Any) -> None:
    """torch's close of the job's rendezvous (``handler.shutdown``: several store calls, none with a
    time-out), on a daemon thread waited for ``CLOSE_WAIT_S`` at most: over a cut link it held the
    launcher until the link came back (22-24 s of TCP backoff), then closed the job for every node.
    Runs in the launcher, on its way out."""
    done = store_thread(_close, "multigpu-rdzv-close", (handler,))
    done.start()
    done.join(CLOSE_WAIT_S)


def _close(handler: Any) -> None:
    # torch logs its own failure to close a rendezvous whose store is gone (a lost store is already
    # one line of ours): its logger is held to errors for the call.
    log = logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with contextlib.suppress(Exception):
            handler.shutdown()
    finally:
        log.setLevel(level)


def handler_class() -> Any:
    """torch's ``DynamicRendezvousHandler``, fixed (``ElasticHandler``): made at the first call, so
    that torch is imported only by an elastic job."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class ElasticHandler(DynamicRendezvousHandler):  # type: ignore[misc]
        """torch's handler, with the workers' store made per round and on our own socket.

        torch 2.13 keeps the bootstrap store info (MASTER_ADDR/PORT) of the first round it saw for
        good: a node that joins a later round as group rank > 0 waits for keys that round's rank 0
        never writes (``read_timeout``, 60 s, then the job fails), and the workers of every round
        would share one store, where torch's workers add no per-round prefix (gloo could read the
        last round's addresses). Forgetting it before each round makes rank 0 publish a fresh store;
        its server binds the node's own address, never every interface.
        """

        worker_store: Any = None
        hold: RoundHold | None = None
        """Set by ``elastic.ElasticRendezvous``: the round waits for live nodes of the last one."""

        def next_rendezvous(self) -> Any:
            # torch reuses a state read for 1 s (``cache_duration``): as long as a poll, no longer
            holder: Any = self._state_holder
            holder._cache_duration = poll = pace_polls(self._settings.max_nodes)
            if self.hold is not None:
                self.hold.begin(list(holder.state.participants))
                hold_completion(self._op_executor, self.hold, poll)
            self._bootstrap_store_info = None
            self._shared_tcp_store_server = None
            self.worker_store = None
            return super().next_rendezvous()

        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
            self.worker_store = serve_store_on(bind_store_socket(Endpoint(master_addr, 0)), master_addr)
            return self.worker_store

        def _wrap_store(self, store: Any) -> Any:
            """The round's keys: a store of ours that has its own prefix view (etcd's) gives it, the
            same keys as torch's ``PrefixStore`` but every call in Python."""
            if hasattr(store, "prefixed"):
                return store.prefixed(
                    f"torch.rendezvous.{self._settings.run_id}.{self._state_holder.state.round}"
                )
            return super()._wrap_store(store)

    return ElasticHandler


@dataclass(frozen=True)
class LivenessPace:
    """``Liveness``'s times: how often a launcher beats, how long one may be silent before it is aged
    out, and the clock the silence is measured on (a test's own, to take no time)."""

    beat_s: float = BEAT_S
    lost_after_s: float = EVICT_AFTER_S
    clock: Callable[[], float] = time.monotonic


class Liveness:
    """Our launchers' own beats on the store, and the eviction of silent ones from torch's state.

    torch drops a participant only after ``keep_alive_interval * keep_alive_max_attempt`` (15 s by
    default) without its keep-alive, and until then the survivors of a lost node wait in the next
    round. A launcher here adds 1 to its counter every ``beat_s`` (one call, whatever the number of
    nodes); the launcher that serves the store (``evicts``; every launcher, where none does) reads the
    others' counters, with one ``multi_get``, and ages the keep-alive of one silent for
    ``lost_after_s`` on the store, so torch's own sanitizer removes it at its next sync. Nodes that
    never beat (a torchrun among us) are left to torch's rule.
    """

    def __init__(
        self,
        store: Any,
        backend: Any,
        run_id: str,
        me: Any,
        *,
        evicts: bool = True,
        pace: LivenessPace = LivenessPace(),
    ) -> None:
        self.store, self.backend, self.run_id = store, backend, run_id
        self.me, self.evicts = me, evicts
        self.beat_s, self.lost_after_s, self._clock = pace.beat_s, pace.lost_after_s, pace.clock
        self._seen: dict[str, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = store_thread(self._run, "multigpu-elastic-liveness")

    def key(self, node: Any) -> str:
        return f"multigpu/{self.run_id}/alive/{node.addr}|{node.pid}|{node.local_id}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.beat_s * 2)

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            with contextlib.suppress(Exception):  # the store is gone: fate sharing reports that
                began = self._clock()
                self.store.add(self.key(self.me), 1)
                if self._clock() - began > self.lost_after_s / 2:
                    self._seen.clear()  # the store was out of our reach: the others' silence is ours
                if self.evicts and not self._stop.is_set():  # stopped: no more calls (store_threads)
                    self.evict_silent()

    def counts(self, nodes: list[Any]) -> dict[Any, int]:
        """The beat counters of those of ``nodes`` that beat (``round_hold`` reads them)."""
        return self._counts(nodes)

    def _counts(self, nodes: list[Any]) -> dict[Any, int]:
        """The beat counters of the nodes that have one (a key seen once stays), in one read."""
        beating = [
            node for node in nodes if self.key(node) in self._seen or self.store.check([self.key(node)])
        ]
        values = self.store.multi_get([self.key(node) for node in beating]) if beating else []
        return {node: int(value) for node, value in zip(beating, values, strict=True)}

    def evict_silent(self) -> None:
        current = self.backend.get_state()
        if current is None:
            return
        state = pickle.loads(current[0])
        now = self._clock()
        silent = []
        for node, count in self._counts([n for n in state.last_heartbeats if n != self.me]).items():
            key = self.key(node)
            last, since = self._seen.get(key, (-1, now))
            if count != last:
                self._seen[key] = (count, now)
            elif now - since > self.lost_after_s:
                silent.append(node)
        if silent:
            for node in silent:
                state.last_heartbeats[node] = datetime.fromtimestamp(0, timezone.utc)
            self.backend.set_state(pickle.dumps(state), current[1])  # lost a race: next time
