"""Fate sharing across nodes: beat counters, one watcher and one abort record in the job's c10d store.

A node's cost is constant in the number of nodes. Every launcher adds 1 to its own beat counter per
``BEAT_S`` (a counter: clocks need not agree) and blocks in one ``wait`` on its own wake key, answered
the moment the key is set. One launcher (the store's server) reads every counter with one ``multi_get``
per beat and publishes a node whose counter stopped for longer than its own pace allows
(``latency.BeatWatch``). The first failure anywhere is written once (compare-and-set, earliest wins),
every waiter is woken with one ``multi_set``, and every node reports that root cause. A store call is
late, not lost, for a bounded time (``latency``); a node that lost the store leaves without a store call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from multigpu.contract.errors import STORE_HOST_ENDED, STORE_SERVER_ENDED, StoreLostError
from multigpu.contract.failure import LEARNED_FROM_SILENCE, NO_NODE, FailureKind, Subject, WorkerFailure
from multigpu.contract.signals import signal_name
from multigpu.rendezvous.job import JobStore, named_lost
from multigpu.rendezvous.latency import STILL_LOST_S, BeatWatch, Latency
from multigpu.rendezvous.store import STORE_NOTES
from multigpu.rendezvous.store_threads import PUBLISH_TIMEOUT_S, Stopped, bounded, store_thread
from multigpu.supervisor.hangs.verdict import JobProgress
from multigpu.supervisor.states import RunResult, RunStatus

logger = logging.getLogger(__name__)

BEAT_S = 0.2
T = TypeVar("T")

_LOST_STORES: weakref.WeakSet[JobStore] = weakref.WeakSet()  # this launcher lost their store


def lost_the_store(job: JobStore | None) -> bool:
    """Whether this launcher lost ``job``'s store: its way out then makes no store call (it could block
    over a dead link) and leaves the rendezvous open for the nodes that still reach the store."""
    return job is not None and job in _LOST_STORES


def failure_record(failure: WorkerFailure) -> dict[str, Any]:
    return failure.to_dict(log_tail_lines=10)


def failure_from_record(record: dict[str, Any]) -> WorkerFailure:
    if "reason" in record:  # an inconsistent layout refused at the rendezvous
        return node_lost(int(record.get("node", NO_NODE)), str(record["reason"]), FailureKind.REFUSED)
    return WorkerFailure.from_dict(record)


def node_lost(
    node: int, why: str, kind: FailureKind = FailureKind.NODE_LOST, at: float | None = None
) -> WorkerFailure:
    """A failure of node ``node`` (lost, refused, stopped: ``kind``), ``at`` when it was seen."""
    return WorkerFailure.launcher_named(Subject.NODE, kind, why, node=node, at=at)


def node_interrupted(node: int, signum: int) -> WorkerFailure:
    """This node's launcher was told to stop (``signum``): the other nodes hear it at once, not from
    its silence a beat later, while their ranks' collectives fail on its closed connections."""
    failure = node_lost(node, f"its launcher received {signal_name(signum)}", FailureKind.INTERRUPTED)
    failure.signal = signal_name(signum)
    return failure


def share_interrupt(job: JobStore, signum: int) -> None:
    """Publish that this node was told to stop, before its ranks are (bounded: the store may be gone)."""
    bounded(lambda: job.publish_abort(failure_record(node_interrupted(job.node, signum))))


def store_lost(why: str | None = None, host: int | None = 0) -> WorkerFailure:
    """The job's store is gone: its host (node 0 of a static job, the hosting launcher of an elastic
    one) or, with ``host`` None, a store no launcher of the job served (``multigpu store``), which a
    restart loses too; ``why`` completes "node 0, the store's host, ..." or "the rendezvous store ...".
    The one record of a lost store, however it was learned (a failed call: ``StoreLostError``; a call
    that never returned: the deadman)."""
    if why is None:
        why = STORE_HOST_ENDED if host is not None else STORE_SERVER_ENDED
    return WorkerFailure.launcher_named(
        Subject.STORE, FailureKind.STORE_LOST, why, node=NO_NODE if host is None else host
    )


class FateMonitor:
    """Beats for this node, waits for the job's abort, watches beats if this node is the watcher, and
    calls ``on_remote_failure`` once when the job dies. Three daemon threads: the beat (and watch)
    loop, the waiter blocked on the wake key, and the deadman that notices a store call that never
    returns (a cut link has no time-out)."""

    def __init__(
        self,
        job: JobStore,
        on_remote_failure: Callable[[WorkerFailure], None],
        *,
        beat_s: float = BEAT_S,
        watcher: bool | None = None,
        latency: Latency | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self.progress: JobProgress | None = None
        """This node's ranks' progress, shared with the job's once per beat
        (``hangs.verdict.JobProgress``): set before ``start`` by an attempt, which has ranks."""
        self.watcher = job.is_watcher if watcher is None else watcher
        self.latency = latency or Latency()
        self._on_failure = on_remote_failure
        self._beat_s, self._clock = beat_s, clock
        self._stop = threading.Event()
        self._fired = self._store_gone = False
        self.verdict: WorkerFailure | None = None
        """The job's failure as this monitor learned it (a peer's record, a lost node or store)."""
        self._verdict = threading.Event()
        self._lock = threading.Lock()
        self._watch = BeatWatch(clock)
        self._watched: dict[int, int] | None = None  # base rank -> node, read at the first beat
        self._in_call: float | None = None  # when the store call in flight began
        loops = (("beat", self._beat_loop), ("wait", self._wait_loop), ("deadman", self._deadman))
        self._threads = [store_thread(t, f"multigpu-fate-{n}") for n, t in loops]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop beating and release the waiter. A thread stuck in a store call over a dead link is
        left behind (daemon; the launcher's exit does not wait for it: ``store_threads.leave``);
        nothing is asked of a store known to be gone."""
        self._stop.set()
        waiter = self._threads[1]
        if waiter.is_alive() and waiter is not threading.current_thread() and not self._store_gone:
            bounded(self.job.wake_self)
            waiter.join(PUBLISH_TIMEOUT_S)
            if not waiter.is_alive():
                bounded(self.job.clear_wake)
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(self._beat_s)

    def _fire(self, failure: WorkerFailure) -> None:
        with self._lock:
            if self._fired or self._stop.is_set():
                return
            self._fired = True
            self._store_gone = failure.kind is FailureKind.STORE_LOST
            self.verdict = failure
        self._verdict.set()
        if self._store_gone:  # nobody else can tell this node: one line now, the summary after teardown
            _LOST_STORES.add(self.job)
            logger.warning(f"{failure.describe()}; stopping")
        self._on_failure(failure)

    def await_verdict(self) -> WorkerFailure | None:
        """Called by the launcher's main thread when its own rank failed only because a peer's connection
        closed: was that peer's whole node lost? Waits at most twice what this monitor needs to find a
        silent node (a beat to see its last beat, the beat and the allowed silence, a beat to check;
        twice, for a loaded machine whose threads run late; a node that never beat is allowed the
        first-beat grace); a peer node that is alive publishes its own failure at once, and that ends
        the wait as early."""
        if not self._stop.is_set():
            self._verdict.wait(2 * (3 * self._beat_s + self._watch.limit(self.latency.threshold())))
        return self.verdict

    def _lost_store(self, exc: BaseException) -> None:
        """A store call failed: the store's host is gone (``StoreLostError``; etcd's says why); anything
        else a store call raises is noted in the node's log and taken as the same loss."""
        if not isinstance(exc, StoreLostError):
            STORE_NOTES.note("call", exc)
        self._fire(store_lost(getattr(exc, "why", None), host=self.job.store_host))

    def _deadman(self) -> None:
        """A store call over a cut link blocks without a time-out; notice that from outside the call.

        Only a call in flight counts, and a tick that overslept (this process stalled: GC, a busy
        GIL, a stopped VM) checks nothing, so our own stall is never taken for the store's silence."""
        tick = self._beat_s / 2
        last = self._clock()
        while not self._stop.wait(tick):
            now = self._clock()
            overslept, last = now - last - tick, now
            began, allowed = self._in_call, self.latency.call_limit()
            if began is None or overslept > allowed / 2 or now - began <= allowed:
                continue
            self._fire(
                store_lost(
                    f"stopped answering for {now - began:.1f}s (allowed {allowed:.1f}s from "
                    "its measured latency; its launcher, or the network, is down)",
                    host=self.job.store_host,
                )
            )
            return

    def _timed(self, call: Callable[[], T], *, measure: bool = True) -> T:
        """A store call, watched by the deadman and (``measure``: one round trip) timed for the
        loss threshold; a call that waited past the threshold met an outage, not the store's latency,
        and is not a sample (a 5 s outage would stretch every later verdict to the 30 s cap). None
        after ``stop`` (``Stopped``): a beat makes several calls, and one begun after ``stop`` could
        still be inside torch's store client when the launcher exits (``store_threads``)."""
        if self._stop.is_set():
            raise Stopped
        self._in_call = began = self._clock()
        answer = call()
        self._in_call = None
        if measure and (took := self._clock() - began) <= self.latency.threshold():
            self.latency.record(took)
        return answer

    def _wait_loop(self) -> None:
        """Read the abort record, then block until woken; the writer of a record wakes every node after
        writing it, so a record written before our wait is read here first, and none is missed."""
        try:
            own = self.job.with_own_client()
            while not self._stop.is_set():
                record = own.read_abort()
                if record is not None:
                    self._fire(failure_from_record(record))
                    return
                own.wait_woken()
                if not self._stop.is_set() and own.read_abort() is None:
                    self._stop.wait(self._beat_s)  # woken with no record: our key was left set
        except Exception as exc:  # the store is gone: its host died or the network did
            if not self._stop.is_set():
                self._lost_store(exc)

    def _beat_loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self.beat_once():
                    return
                self._stop.wait(self._beat_s)
        except Exception as exc:
            if not self._stop.is_set():
                self._lost_store(exc)

    def beat_once(self) -> bool:
        """One interval's store calls: our beat; on the watcher, one read of every counter (and the
        elastic membership); on a node watching a watcher that does not serve the store, one read of
        that counter. True once this found the job dead (then it has published and fired)."""
        began = self._clock()
        self._timed(self.job.beat)
        self._share_progress()
        if self._watched is None:
            self._watched = self._timed(self._to_watch, measure=False)
        if self.watcher:
            change = self._timed(self.job.membership_change, measure=False)  # mostly no call at all
            if change is not None:  # published, so a peer whose ranks fail first restarts too
                return self._publish(
                    WorkerFailure.launcher_named(
                        Subject.JOB, FailureKind.MEMBERSHIP_CHANGE, change, node=NO_NODE
                    )
                )
        if not self._watched:
            return False
        watched = list(self._watched)
        counts = self._timed(lambda: self.job.beat_counts(watched))
        if self._clock() - began > self._beat_s + self.latency.threshold():
            self._watch.forgive()  # the store was out of our reach too: the others' silence is ours
            return False
        silent = self._watch.silent(counts, self._beat_s + self.latency.threshold())
        if silent is None:
            return False
        base, seconds = silent
        node = self._watched[base]
        launcher = self._timed(lambda: self.job.launcher_of(base), measure=False)
        why = (
            f"its launcher{f' ({launcher})' if launcher else ''} stopped beating for {seconds:.1f}s "
            "(killed, or its network is down)"
        )
        return self._publish(node_lost(node, why, at=time.time() - seconds))

    def _share_progress(self) -> None:
        """One more small call per beat: this node's progress into the job's counter, the others' out."""
        progress = self.progress
        if progress is not None:
            self._timed(lambda: progress.share(self.job.add_progress), measure=False)

    def _to_watch(self) -> dict[int, int]:
        members = self.job.members()
        me = self.job.base_rank
        if self.watcher:
            return {base: node for base, node in members.items() if base != me}
        if self.job.watcher_hosts_store or self.job.watcher_base == me:
            return {}
        return {base: node for base, node in members.items() if base == self.job.watcher_base}

    def _publish(self, failure: WorkerFailure) -> bool:
        """Publish a failure this node found (first failure anywhere wins) and act on the standing one."""
        standing = self._timed(lambda: self.job.publish_abort(failure_record(failure)), measure=False)
        self._fire(failure_from_record(standing))
        return True


def share_failure(job: JobStore, result: RunResult) -> RunResult:
    """Publish our first failure for the other nodes; whichever failure was first anywhere is the root."""
    root = result.root_cause
    assert root is not None
    if root.kind in LEARNED_FROM_SILENCE:
        return result  # learned from the store (or its silence): nothing new to tell it
    return _with_root(result, bounded(lambda: job.publish_abort(failure_record(root))))


def settle_root(job: JobStore, result: RunResult) -> RunResult:
    """After teardown, read the job's abort record once more: a peer may have failed earlier than us
    but published later."""
    root = result.root_cause
    if result.status not in (RunStatus.FAILED, RunStatus.HUNG) or root is None:
        return result
    if root.kind in LEARNED_FROM_SILENCE:
        return result  # a lost node or store: asking the store again would only wait
    return _with_root(result, bounded(job.read_abort))


def _with_root(result: RunResult, record: dict[str, Any] | None) -> RunResult:
    """``result`` with the job-wide first failure first, when the store's record is earlier than ours."""
    root = result.root_cause
    if record is None or "reason" in record or root is None:
        return result
    winner = failure_from_record(record)
    if (winner.node, winner.rank) == (root.node, root.rank):
        return result
    ours_first = root.time is not None and winner.time is not None and winner.time > root.time
    if ours_first and not winner.explains(root):  # a lost node explains a closed connection, whenever
        return result
    return RunResult(result.status, [winner, *result.failures], result.signal, result.detected_time)


def mark_done(job: JobStore) -> None:
    """Say this node finished well, before its monitor stops beating, so no peer takes it for lost."""
    with contextlib.suppress(Exception):  # a store that is gone cannot miss us
        job.mark_done()


READERS_WAIT_S = 5.0
"""How long the store's host waits, after its verdict, for every other node to make its last read."""


def leave_job(job: JobStore) -> None:
    """A node that does not serve the store says, as its very last store call, that it asks nothing
    more; a store that is gone (or a cut link) cannot miss it, so this never raises and is bounded."""
    bounded(lambda: job.leave())


def outlive_readers(
    job: JobStore, timeout_s: float = READERS_WAIT_S, poll_s: float = 0.02, still_s: float = STILL_LOST_S
) -> list[int]:
    """The store's host, about to exit (a refusal, a failure, the end): keep serving until every other
    joined node has left (``leave_job``), so none of them reads a verdict from a store that went away;
    bounded, since a node killed meanwhile never leaves, and not waiting at all for a node the job named
    lost once its beat counter has stood still ``still_s`` more. Returns the base ranks that had not left."""
    began, pending = time.monotonic(), []
    with contextlib.suppress(Exception):  # our own store: only a bug of ours raises here
        silent = job.beat_counts(named_lost(job))  # base rank -> its counter as this wait began
        while True:
            pending, waited = job.still_reading(), time.monotonic() - began
            if silent and waited >= still_s:  # a node named lost that beats again is waited for
                silent = {b: n for b, n in job.beat_counts(sorted(silent)).items() if n == silent[b]}
            if not pending or waited >= timeout_s or (waited >= still_s and set(pending) <= set(silent)):
                break
            time.sleep(poll_s)
    return pending


def finish_job(job: JobStore | None, hosts_store: bool) -> None:
    """This node's last act with the job's store: the host outlives the others' reads, the others
    leave. Runs in the launcher (and function mode's caller), after every attempt, whatever ended it."""
    if job is None or lost_the_store(job):
        return
    if hosts_store:
        outlive_readers(job)
    else:
        leave_job(job)


def serve_until_all_done(job: JobStore, poll_s: float = 0.2) -> None:
    """The store's host keeps serving until every node is done or the job died, and watches the nodes
    still running meanwhile (it is the watcher now, whoever watched during the attempt)."""
    lost: list[WorkerFailure] = []
    monitor = FateMonitor(job, lost.append, watcher=True)
    monitor.start()
    try:
        while not lost and not job.all_done() and job.read_abort() is None:
            time.sleep(poll_s)
    finally:
        monitor.stop()
