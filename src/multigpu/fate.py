"""Fate sharing across nodes: heartbeats and one abort record in the job's c10d store.

Every launcher beats (a counter, so clocks need not agree) and watches the abort record and the other
nodes' beats. The first failure anywhere is written once (compare-and-set) and every node tears down
and reports it; a node whose beats stop, or a store that stops answering, counts as a failure too.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import WorkerFailure
from .rendezvous import JobStore
from .supervisor import RunResult, RunStatus

BEAT_S = 0.2
LOST_AFTER_S = 1.5


def failure_record(failure: WorkerFailure) -> dict[str, Any]:
    return failure.to_dict(log_tail_lines=10)


def failure_from_record(record: dict[str, Any]) -> WorkerFailure:
    return WorkerFailure.from_dict(record)


NODE_LOST, STORE_LOST, MEMBERSHIP_CHANGE = "NodeLost", "StoreLost", "MembershipChange"
LEARNED_FROM_SILENCE = (NODE_LOST, STORE_LOST)
"""Causes known from a peer's or the store's silence: nothing to publish, nothing to ask the store."""


def node_lost(node: int, why: str, kind: str = NODE_LOST) -> WorkerFailure:
    return WorkerFailure(rank=-1, local_rank=-1, pid=None, node=node, error_type=kind, message=why,
                         time=time.time())


def store_lost(why: str) -> WorkerFailure:
    """The store's host (node 0 of a static job, the hosting launcher of an elastic one) is gone."""
    return node_lost(0, why, STORE_LOST)


class FateMonitor:
    """A daemon thread that beats for this node and calls ``on_remote_failure`` once when the job dies."""

    def __init__(self, job: JobStore, on_remote_failure: Callable[[WorkerFailure], None], *,
                 beat_s: float = BEAT_S, lost_after_s: float = LOST_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.job = job
        self._on_failure = on_remote_failure
        self._beat_s, self._lost_after_s, self._clock = beat_s, lost_after_s, clock
        self._stop = threading.Event()
        self._fired = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="multigpu-fate", daemon=True)
        self._deadman = threading.Thread(target=self._watch_store, name="multigpu-fate-deadman",
                                         daemon=True)
        self._seen: dict[int, tuple[int, float]] = {}
        self._last_ok = clock()

    def start(self) -> None:
        self._last_ok = self._clock()
        self._thread.start()
        self._deadman.start()

    def _watch_store(self) -> None:
        """A store call over a cut link blocks without a time-out; notice that from outside the call."""
        while not self._stop.wait(self._beat_s):
            silent = self._clock() - self._last_ok
            if silent > self._lost_after_s:
                self._fire(store_lost(f"the rendezvous store stopped answering for {silent:.1f}s "
                                      "(the launcher that serves it, or the network, is down)"))
                return

    def stop(self) -> None:
        """Stop beating. A thread stuck in a store call over a dead link is left behind (daemon)."""
        self._stop.set()
        for thread in (self._thread, self._deadman):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(self._beat_s)

    def _fire(self, failure: WorkerFailure) -> None:
        with self._lock:
            if self._fired or self._stop.is_set():
                return
            self._fired = True
        self._on_failure(failure)

    def _run(self) -> None:
        while not self._stop.wait(self._beat_s):
            try:
                self.job.beat()
                record = self.job.read_abort()
                if record is not None:
                    self._fire(failure_from_record(record) if "reason" not in record
                               else node_lost(int(record.get("node", -1)), str(record["reason"])))
                    return
                change = self.job.membership_change()
                if change is not None:  # published, so a peer whose ranks fail first restarts too
                    failure = node_lost(-1, change, MEMBERSHIP_CHANGE)
                    self.job.publish_abort(failure_record(failure))
                    self._fire(failure)
                    return
                lost = self._lost_node()
                if lost is not None:
                    why = f"node {lost}'s launcher stopped beating for {self._lost_after_s:g}s " \
                          "(killed, or its network is down)"
                    self._fire(node_lost(lost, why))
                    return
                self._last_ok = self._clock()
            except Exception as exc:  # the store is gone: node 0's launcher died or the network did
                self._fire(store_lost(f"lost contact with the rendezvous store ({type(exc).__name__}); "
                                      "the launcher that serves it, or the network, is down"))
                return

    def _lost_node(self) -> int | None:
        now = self._clock()
        for base, node in self.job.members().items():
            if base == self.job.base_rank or self.job.is_done(base):
                continue
            count = self.job.beats_of(base)
            last_count, since = self._seen.get(base, (-1, now))
            if count != last_count:
                self._seen[base] = (count, now)
            elif now - since > self._lost_after_s:
                return node
        return None


PUBLISH_TIMEOUT_S = 1.0


def share_failure(job: JobStore, result: RunResult) -> RunResult:
    """Publish our first failure for the other nodes; whichever failure was first anywhere is the root."""
    root = result.root_cause
    assert root is not None
    if root.error_type in LEARNED_FROM_SILENCE:
        return result  # learned from the store (or its silence): nothing new to tell it
    return _with_root(result, _bounded(lambda: job.publish_abort(failure_record(root))))


def settle_root(job: JobStore, result: RunResult) -> RunResult:
    """After teardown, read the job's abort record once more: a peer may have failed earlier than us
    but published later."""
    root = result.root_cause
    if result.status not in (RunStatus.FAILED, RunStatus.HUNG) or root is None:
        return result
    if root.error_type in LEARNED_FROM_SILENCE:
        return result  # a lost node or store: asking the store again would only wait
    return _with_root(result, _bounded(job.read_abort))


def _bounded(call: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
    """A store call over a cut link blocks with no time-out, so it gets a thread and a bound."""
    answer: list[dict[str, Any] | None] = []

    def run() -> None:
        with contextlib.suppress(Exception):  # the store is gone too: what we know locally stands
            answer.append(call())

    thread = threading.Thread(target=run, name="multigpu-store-call", daemon=True)
    thread.start()
    thread.join(PUBLISH_TIMEOUT_S)
    return answer[0] if answer else None


def _with_root(result: RunResult, record: dict[str, Any] | None) -> RunResult:
    """``result`` with the job-wide first failure first, when the store's record is earlier than ours."""
    root = result.root_cause
    if record is None or "reason" in record or root is None:
        return result
    winner = failure_from_record(record)
    if (winner.node, winner.rank) == (root.node, root.rank):
        return result
    if root.time is not None and winner.time is not None and winner.time > root.time:
        return result
    return RunResult(result.status, [winner, *result.failures], result.signal)


def mark_done(job: JobStore) -> None:
    """Say this node finished well, before its monitor stops beating, so no peer takes it for lost."""
    with contextlib.suppress(Exception):  # a store that is gone cannot miss us
        job.mark_done()


def serve_until_all_done(job: JobStore, poll_s: float = 0.2) -> None:
    """The store's host (base rank 0) keeps serving until every node is done or the job died."""
    lost: list[WorkerFailure] = []
    monitor = FateMonitor(job, lost.append)
    monitor.start()
    try:
        while not lost and not job.all_done() and job.read_abort() is None:
            time.sleep(poll_s)
    finally:
        monitor.stop()
