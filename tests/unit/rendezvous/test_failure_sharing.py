"""Fate sharing at scale, on a fake c10d store and an injectable clock: the watcher's one read, the
latency-relative loss threshold, the done flag, the abort that wakes a blocked waiter, the deadman."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from multigpu.contract.errors import StoreLostError
from multigpu.contract.failure import WorkerFailure
from multigpu.rendezvous.failure_sharing import (
    FateMonitor,
    failure_from_record,
    failure_record,
    finish_job,
    leave_job,
    lost_the_store,
    node_lost,
    outlive_readers,
    serve_until_all_done,
    store_lost,
)
from multigpu.rendezvous.job import DONE, JobStore
from multigpu.rendezvous.latency import BeatWatch, Latency
from multigpu.rendezvous.store import STORE_NOTES

WAIT_S = 10.0  # a bound on waiting for a thread to act: reached only when the behaviour is broken


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeStore:
    """torch's c10d store semantics that fate sharing uses, in memory; every call is logged, and ``add``
    can be made to hang (a cut link) until released."""

    def __init__(
        self,
        shared: dict[str, bytes] | None = None,
        log: list[tuple[str, Any]] | None = None,
        cond: threading.Condition | None = None,
    ) -> None:
        self.data = {} if shared is None else shared
        self.log = [] if log is None else log
        self.cond = cond or threading.Condition()
        self.hang = threading.Event()
        self.hanging = threading.Event()
        self.release = threading.Event()

    def clone(self) -> FakeStore:
        twin = FakeStore(self.data, self.log, self.cond)
        twin.release = self.release
        return twin

    def _op(self, name: str, arg: Any) -> None:
        self.log.append((name, arg))

    def add(self, key: str, value: int) -> int:
        self._op("add", key)
        if self.hang.is_set():
            self.hanging.set()
            self.release.wait(WAIT_S)
            raise ConnectionError("the link is down")
        with self.cond:
            new = int(self.data.get(key, b"0")) + value
            self.data[key] = str(new).encode()
            self.cond.notify_all()
            return new

    def set(self, key: str, value: str) -> None:
        self.multi_set([key], [value])

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self._op("multi_set", keys)
        with self.cond:
            self.data.update((k, v.encode()) for k, v in zip(keys, values, strict=True))
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        self._op("get", key)
        return self.data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._op("multi_get", keys)
        return [self.data[k] for k in keys]

    def check(self, keys: list[str]) -> bool:
        self._op("check", keys)
        return all(k in self.data for k in keys)

    def append(self, key: str, value: str) -> None:
        self._op("append", key)
        self.data[key] = self.data.get(key, b"") + value.encode()

    def delete_key(self, key: str) -> bool:
        self._op("delete_key", key)
        with self.cond:
            return self.data.pop(key, None) is not None

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._op("compare_set", key)
        with self.cond:
            current = self.data.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self.data[key] = desired.encode()
                self.cond.notify_all()
            return self.data[key]

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._op("wait", keys)
        with self.cond:
            if not self.cond.wait_for(lambda: all(k in self.data for k in keys), WAIT_S):
                raise TimeoutError("wait timeout")


def job_of(store: FakeStore, nodes: int) -> list[JobStore]:
    """``nodes`` launchers of one nproc each, joined to run "r" on ``store``."""
    jobs = [JobStore(store, node=n, base_rank=n, nproc=1, world_size=nodes) for n in range(nodes)]
    for job in jobs:
        job.run_id = "r"
        job.store.compare_set(job.key("world_size"), "", str(nodes))
        job.store.add(job.key("beat", job.base_rank), 0)
        job.store.append(job.key("members"), f"{job.base_rank}:{job.node},")
        job.member = True
    return jobs


def calls(store: FakeStore, start: int) -> list[str]:
    return [name for name, _ in store.log[start:]]


# ---- the latency-relative threshold and the beat watch -----------------------------------------------


def test_the_loss_threshold_follows_the_measured_p99_between_floor_and_cap() -> None:
    latency = Latency(floor_s=1.0, factor=20.0, cap_s=30.0)
    assert latency.threshold() == 1.0, "nothing measured yet: the floor"
    for _ in range(200):
        latency.record(0.001)
    assert latency.threshold() == 1.0, "a fast store: the floor"
    for _ in range(100):
        latency.record(0.2)
    assert latency.p99() == pytest.approx(0.2) and latency.threshold() == pytest.approx(4.0)
    latency.record(100.0)
    assert latency.threshold() == pytest.approx(4.0), "one outlier in 256 is above the p99"
    for _ in range(10):
        latency.record(5.0)
    assert latency.threshold() == 30.0, "however slow the store, the cap"


def test_a_store_call_in_flight_is_allowed_a_short_outage_however_fast_the_store() -> None:
    """Issue 41: with 20% of a node's frames lost, one call in a hundred waits for TCP's third
    retransmission (200 + 400 + 800 ms), and a store cut off for 5 s is to be ridden out: late, not
    lost. A slow store's own threshold still rules."""
    latency = Latency(floor_s=1.0, factor=20.0)
    assert latency.threshold() == 1.0 and latency.call_limit() == 8.0
    for _ in range(100):
        latency.record(0.5)
    assert latency.call_limit() == pytest.approx(10.0)


def test_a_watcher_cut_off_from_the_store_takes_no_node_for_lost_when_it_comes_back() -> None:
    """Issue 41, case 4: the store's link down 5 s. Every counter stood still, the watcher's own
    included: when its calls return, nobody's silence is evidence; a node silent from then on is
    found as before."""
    store, clock = FakeStore(), Clock()
    jobs = job_of(store, 3)
    seen: list[WorkerFailure] = []
    watcher = FateMonitor(jobs[0], seen.append, beat_s=0.2, clock=clock, latency=Latency(floor_s=1.0))

    def beats(times: int) -> None:
        for _ in range(times):
            for job in jobs[1:]:
                job.beat()
            clock.now += 0.2
            assert not watcher.beat_once()

    beats(3)
    real_add = store.add

    def cut_off(key: str, value: int) -> int:
        if key == jobs[0].key("beat", 0):
            clock.now += 5.0  # our own beat waited 5 s for the store
        return real_add(key, value)

    store.add = cut_off  # type: ignore[method-assign]
    assert not watcher.beat_once() and seen == []
    store.add = real_add  # type: ignore[method-assign]
    beats(3)
    clock.now += 1.5
    assert watcher.beat_once()
    assert [(f.error_type, f.node) for f in seen] == [("NodeLost", 1)]


def test_a_counter_that_stopped_is_silent_a_finished_one_never_and_a_first_beat_gets_grace() -> None:
    clock = Clock()
    watch = BeatWatch(clock, first_beat_grace_s=5.0)
    assert watch.silent({1: 0, 2: 4, 3: 7}, threshold=1.0) is None
    clock.now += 0.2
    assert watch.silent({1: 0, 2: 5, 3: 7 + DONE}, threshold=1.0) is None
    clock.now += 0.2
    assert watch.silent({1: 0, 2: 6, 3: 7 + DONE}, threshold=1.0) is None, "node 3 finished; node 1 starts"
    clock.now += 1.2
    found = watch.silent({1: 0, 2: 6, 3: 7 + DONE}, threshold=1.0)
    assert found is not None and found[0] == 2 and found[1] == pytest.approx(1.2)
    clock.now += 3.7
    late = watch.silent({1: 0, 2: 7, 3: 7 + DONE}, threshold=1.0)
    assert late is not None and late[0] == 1 and late[1] == pytest.approx(5.3)


def test_a_node_that_beats_slowly_is_judged_by_its_own_pace_not_the_stores_threshold() -> None:
    """A node on a slow or lossy link (issue 41: 100 ms delay, 20% loss) beats every second or so;
    silent for 1.2 s it is late, not lost. Lost only after several of its own intervals; a node at the
    job's pace is found after the store's threshold, as before."""
    clock = Clock()
    watch = BeatWatch(clock, first_beat_grace_s=5.0)
    fast = iter(range(1, 1000))
    for count in range(1, 6):  # both at the job's pace
        assert watch.silent({1: count, 2: next(fast)}, threshold=1.0) is None
        clock.now += 0.2
    for count in range(6, 9):  # node 1's link slows: a beat a second
        for _ in range(4):
            assert watch.silent({1: count, 2: next(fast)}, threshold=1.0) is None
            clock.now += 0.25
    assert watch.allowance(1, 1.0) == pytest.approx(4.0) and watch.allowance(2, 1.0) == 1.0
    assert watch.limit(1.0) == pytest.approx(4.0), "the longest allowance: how long a verdict can take"
    clock.now += 2.5
    last = next(fast)
    assert watch.silent({1: 8, 2: last}, threshold=1.0) is None, "3.5 s: late, within 4 of its beats"
    clock.now += 0.6
    lost = watch.silent({1: 8, 2: last}, threshold=1.0)
    assert lost is not None and lost[0] == 1 and lost[1] == pytest.approx(4.1)


# ---- the watcher: one read of every counter per beat ------------------------------------------------


def test_the_watcher_reads_every_counter_in_one_call_and_publishes_a_silent_node() -> None:
    store, clock = FakeStore(), Clock()
    jobs = job_of(store, 4)
    seen: list[WorkerFailure] = []
    watcher = FateMonitor(jobs[0], seen.append, beat_s=0.2, clock=clock, latency=Latency(floor_s=1.0))
    assert watcher.watcher
    watcher.beat_once()  # the first round also reads the members, once
    for step in range(4):
        clock.now += 0.3
        for job in jobs[1:] if step < 3 else jobs[1:3]:  # node 3 stops after three beats (its pace)
            job.beat()
        start = len(store.log)
        assert not watcher.beat_once() and not seen
        assert calls(store, start) == ["add", "multi_get"], "constant per round, whatever the node count"
    clock.now += 1.0  # node 3 silent 1.3 s > 0.2 s beat + 1.0 s threshold (and 4 of its 0.3 s beats)
    assert watcher.beat_once()
    assert [(f.error_type, f.node) for f in seen] == [("NodeLost", 3)]
    assert seen[0].describe() == (
        "node 3 was lost: its launcher stopped beating for 1.3s (killed, or its network is down)"
    )  # no claim in this fake job to name its host
    record = jobs[1].read_abort()
    assert record is not None and record["error_type"] == "NodeLost" and record["node"] == 3
    assert all(store.data.get(job.key("wake", job.base_rank)) == b"1" for job in jobs), "every waiter woken"


def test_a_node_that_finished_is_never_taken_for_lost() -> None:
    store, clock = FakeStore(), Clock()
    jobs = job_of(store, 3)
    seen: list[WorkerFailure] = []
    watcher = FateMonitor(jobs[0], seen.append, clock=clock)
    jobs[2].beat()
    jobs[2].mark_done()
    assert jobs[2].beats_of(2) >= DONE and jobs[1].beats_of(1) < DONE and not jobs[0].all_done()
    for _ in range(50):
        clock.now += 0.5
        jobs[1].beat()
        assert not watcher.beat_once()
    assert not seen and jobs[0].read_abort() is None
    jobs[1].mark_done()
    jobs[0].mark_done()
    assert jobs[0].all_done()


def test_a_non_watcher_makes_one_call_per_beat_and_watches_a_watcher_that_does_not_host_the_store() -> None:
    store, clock = FakeStore(), Clock()
    jobs = job_of(store, 3)
    seen: list[WorkerFailure] = []
    static = FateMonitor(jobs[1], seen.append, clock=clock)
    static.beat_once()
    start = len(store.log)
    static.beat_once()
    assert calls(store, start) == ["add"], "the watcher serves the store: its death is the store's"
    jobs[2].watcher_hosts_store = False  # an elastic round whose store is served elsewhere
    elastic = FateMonitor(jobs[2], seen.append, clock=clock, latency=Latency(floor_s=1.0))
    for _ in range(3):
        jobs[0].beat()
        clock.now += 0.25  # the job's pace: the store's threshold (1.2 s) is the allowance
        start = len(store.log)
        assert not elastic.beat_once()
    assert calls(store, start) == ["add", "multi_get"]
    clock.now += 1.5
    assert elastic.beat_once()
    assert [(f.error_type, f.node) for f in seen] == [("NodeLost", 0)]


# ---- the waiter: an abort wakes it, with no polling -------------------------------------------------


def test_a_published_abort_wakes_every_blocked_waiter_and_the_earliest_failure_wins() -> None:
    store = FakeStore()
    jobs = job_of(store, 3)
    event = threading.Event()
    got: dict[int, WorkerFailure] = {}

    def on(node: int) -> Any:
        def call(failure: WorkerFailure) -> None:
            got[node] = failure
            if len(got) == 2:
                event.set()

        return call

    monitors = [FateMonitor(jobs[n], on(n), beat_s=0.01) for n in (0, 1)]
    for monitor in monitors:
        monitor.start()
    try:
        late = WorkerFailure(
            rank=2, local_rank=0, pid=7, node=2, error_type="OSError", message="late", time=200.0
        )
        early = WorkerFailure(
            rank=1, local_rank=0, pid=8, node=1, error_type="ValueError", message="first", time=100.0
        )
        jobs[2].publish_abort(failure_record(late))
        assert jobs[1].publish_abort(failure_record(early))["message"] == "first"
        assert jobs[2].publish_abort(failure_record(late))["message"] == "first"
        assert event.wait(WAIT_S)
    finally:
        for monitor in monitors:
            monitor.stop()
    assert {got[0].rank, got[1].rank} <= {1, 2}
    record = json.loads(store.data[jobs[0].key("abort")])
    assert record["rank"] == 1, "the earliest failure stands, whichever wrote last"
    abort_reads = [arg for name, arg in store.log if name == "check" and arg == [jobs[0].key("abort")]]
    assert len(abort_reads) <= 6, "the waiters read the record when woken, not once per beat"
    for thread in (t for m in monitors for t in m._threads):  # stop() waits one beat; a loaded machine
        thread.join(5.0)  # may take longer to schedule the thread's exit: bounded, not slept for
    assert not any(t.is_alive() for m in monitors for t in m._threads)


def test_stop_releases_the_waiter_and_leaves_the_wake_key_unset_for_the_next_monitor() -> None:
    store = FakeStore()
    jobs = job_of(store, 2)
    seen: list[WorkerFailure] = []
    first = FateMonitor(jobs[1], seen.append, beat_s=0.01)
    first.start()
    first.stop()
    assert not any(t.is_alive() for t in first._threads) and not seen
    assert jobs[1].key("wake", 1) not in store.data
    jobs[1].mark_done()
    jobs[0].mark_done()
    serve_until_all_done(jobs[0], poll_s=0.01)  # every node done: returns, its monitor stopped
    assert not seen and jobs[0].read_abort() is None


# ---- the deadman: a call that never returns, relative to the store's latency -------------------------


def test_the_deadman_fires_on_a_call_in_flight_past_the_latency_relative_threshold_only() -> None:
    store, clock = FakeStore(), Clock()
    jobs = job_of(store, 2)
    seen: list[WorkerFailure] = []
    event = threading.Event()
    latency = Latency(floor_s=1.0, factor=20.0)
    for _ in range(50):
        latency.record(0.5)  # a slow store: 10 s allowed

    def on(failure: WorkerFailure) -> None:
        seen.append(failure)
        event.set()

    monitor = FateMonitor(jobs[1], on, beat_s=0.01, clock=clock, latency=latency)
    monitor.start()
    try:
        clock.now += 100.0  # our own stall with no call in flight: not the store's silence
        assert not event.wait(0.1)
        store.hang.set()
        assert store.hanging.wait(WAIT_S)
        clock.now += 9.5  # in flight 9.5 s: a fixed 8 s would call the store lost; 10 s are allowed
        assert not event.wait(0.1)
        clock.now += 1.0
        assert event.wait(WAIT_S)
    finally:
        store.release.set()
        monitor.stop()  # asks nothing of a store known to be gone: its waiter is left blocked
        store.data[jobs[1].key("wake", 1)] = b"1"  # as a dead store's connection would end the wait
        with store.cond:
            store.cond.notify_all()
        for thread in monitor._threads:
            thread.join(WAIT_S)
    assert [f.error_type for f in seen] == ["StoreLost"]
    assert "stopped answering for 10.5s (allowed 10.0s" in str(seen[0].message)
    assert lost_the_store(jobs[1]) and not lost_the_store(jobs[0])


def test_a_node_that_lost_the_store_leaves_without_a_store_call() -> None:
    """Issue 41: over a cut link every store call blocks until the link returns (TCP's backoff:
    20 s and more); a node that lost the store makes none on its way out, and when the link returns
    it says nothing the nodes that go on would read."""
    store, clock = FakeStore(), Clock()
    jobs = job_of(store, 2)
    monitor = FateMonitor(jobs[1], lambda failure: None, clock=clock)
    monitor._fire(store_lost("stopped answering", host=None))
    before = len(store.log)
    finish_job(jobs[1], hosts_store=False)
    assert store.log[before:] == [] and lost_the_store(jobs[1])
    finish_job(jobs[0], hosts_store=False)  # a node that still reaches the store says it left
    assert store.log[before:] == [("multi_set", [jobs[0].left_key(0)])]


def test_only_the_watcher_asks_about_membership_and_publishes_a_change_to_every_node() -> None:
    store, clock = FakeStore(), Clock()
    asked: list[int] = []

    class Elastic(JobStore):
        def membership_change(self) -> str | None:
            asked.append(self.base_rank)
            return "1 node(s) asked to join: a new rendezvous round"

    jobs = [Elastic(store, node=n, base_rank=n, nproc=1, world_size=3) for n in range(3)]
    for job in jobs:
        job.run_id = "r"
        job.store.add(job.key("beat", job.base_rank), 0)
        job.store.append(job.key("members"), f"{job.base_rank}:{job.node},")
    seen: list[WorkerFailure] = []
    assert not FateMonitor(jobs[1], seen.append, clock=clock).beat_once() and asked == []
    assert FateMonitor(jobs[0], seen.append, clock=clock).beat_once() and asked == [0]
    assert [f.error_type for f in seen] == ["MembershipChange"]
    record = jobs[2].read_abort()
    assert record is not None and record["error_type"] == "MembershipChange"
    assert all(store.data.get(job.key("wake", job.base_rank)) == b"1" for job in jobs)


def test_a_node_failure_reads_as_one_and_never_as_rank_minus_one() -> None:
    """A lost node, a lost store and a refused layout name a node, not "rank -1 (node 1, pid None)
    exited with code None" as the rank wording did."""
    lost = node_lost(
        1, "its launcher (host gpu2, pid 77) stopped beating for 1.2s (killed, or its network is down)"
    )
    assert lost.describe() == (
        "node 1 was lost: its launcher (host gpu2, pid 77) stopped beating for "
        "1.2s (killed, or its network is down)"
    )
    assert store_lost().describe() == "node 0, the store's host, ended (its launcher was killed?)"
    assert store_lost("stopped answering for 4.5s").describe() == (
        "node 0, the store's host, stopped answering for 4.5s"
    )
    # A store no launcher of the job serves (``multigpu store``) has no launcher to have been killed
    # (issue 43: its restart read "its launcher was killed?")
    assert store_lost(host=None).describe() == (
        "the rendezvous store went away (stopped or restarted? a restarted store has lost the job's state)"
    )
    refused = failure_from_record({"reason": "inconsistent layout: rank 1 is claimed by both", "node": 1})
    assert refused.describe() == (
        "the rendezvous refused a node: inconsistent layout: rank 1 is claimed by both"
    )
    assert not [f for f in (lost, refused) if "rank -1" in f.describe() or "None" in f.describe()]


def test_a_joined_launcher_is_named_by_host_and_pid() -> None:
    store = FakeStore()
    job = job_of(store, 2)[1]
    store.set(job.key("rank", job.base_rank), "node 1 (base rank 1, 1 worker(s), gpu2 pid 4242)")
    assert job.launcher_of(job.base_rank) == "host gpu2, pid 4242"
    assert job.launcher_of(7) is None


def test_a_node_that_never_beat_is_allowed_the_first_beat_grace_when_waiting_for_it() -> None:
    clock = Clock()
    watch = BeatWatch(clock, first_beat_grace_s=5.0)
    assert watch.limit(1.0) == 1.0  # nothing watched (not the watcher): the store's own threshold
    watch.silent({1: 0, 2: 3}, 1.0)
    assert watch.limit(1.0) == 5.0
    for count in (1, 2):
        clock.now += 0.2
        watch.silent({1: count, 2: 3 + count}, 1.0)
    assert watch.limit(1.0) == 2.5, "node 1 beat, but has not shown its pace yet: one interval"
    clock.now += 0.2
    watch.silent({1: 3, 2: 6}, 1.0)
    assert watch.limit(1.0) == 1.0


def _peer_reset(at: float) -> WorkerFailure:
    return WorkerFailure(
        rank=0,
        local_rank=0,
        pid=11,
        exit_code=1,
        node=0,
        error_type="RuntimeError",
        message="Read error [127.0.0.1]:3: Connection reset by peer. GLHF!",
        time=at,
    )


def test_a_lost_node_comes_before_the_closed_connection_it_caused_whatever_the_clocks_say() -> None:
    """The watcher dates a lost node when it last saw the counter move, up to a beat after the node
    really died, so the peer rank's "Connection reset" can carry the earlier time (seen in the SLURM
    tier, one run in three). Cause wins over clock there, and only there: a rank's own error that came
    first stays first."""
    from multigpu.rendezvous.failure_sharing import _with_root
    from multigpu.supervisor.outcome import by_time
    from multigpu.supervisor.states import RunResult, RunStatus

    lost = node_lost(1, "its launcher stopped beating for 1.2s", at=100.1)
    reset = _peer_reset(100.0)
    assert by_time([reset, lost])[0] is lost
    own = WorkerFailure(
        rank=0,
        local_rank=0,
        pid=11,
        exit_code=1,
        node=0,
        error_type="ValueError",
        message="bad batch",
        time=100.0,
    )
    assert by_time([lost, own])[0] is own
    mine = RunResult(RunStatus.FAILED, [reset])
    settled = _with_root(mine, failure_record(lost))
    assert settled.root_cause is not None and settled.root_cause.error_type == "NodeLost"
    assert _with_root(RunResult(RunStatus.FAILED, [own]), failure_record(lost)).root_cause is own


def test_a_node_told_to_stop_is_one_record_with_its_signal_and_exit_code() -> None:
    import signal as signals

    from multigpu.contract.failure import LEARNED_FROM_SILENCE, FailureKind, Subject
    from multigpu.rendezvous.failure_sharing import failure_from_record, failure_record, node_interrupted

    told = failure_from_record(failure_record(node_interrupted(1, signals.SIGTERM)))
    assert told.kind is FailureKind.INTERRUPTED and told.signal == "SIGTERM" and told.node == 1
    assert told.subject is Subject.NODE and told.rank == -1
    assert told.describe() == "node 1 was stopped: its launcher received SIGTERM"
    assert told.launcher_exit_code == 143  # every node exits as the stopped one does
    assert FailureKind.INTERRUPTED in LEARNED_FROM_SILENCE  # the receivers publish nothing back


def test_a_static_job_stops_with_the_signal_an_elastic_one_takes_it_as_a_node_leaving() -> None:
    import signal as signals

    from multigpu.rendezvous.elastic import ElasticJobStore
    from multigpu.rendezvous.failure_sharing import node_interrupted, node_lost
    from multigpu.rendezvous.job import JobStore
    from multigpu.runner.attempt import _on_remote

    class Recorder:
        def __init__(self) -> None:
            self.signals: list[int] = []
            self.aborts: list[object] = []

        def request_signal(self, signum: int) -> None:
            self.signals.append(signum)

        def abort(self, failure: object) -> None:
            self.aborts.append(failure)

    told, lost = node_interrupted(1, signals.SIGTERM), node_lost(1, "silent")
    for job_type, stops in ((JobStore, True), (ElasticJobStore, False)):
        sup = Recorder()
        job = job_type.__new__(job_type)  # only the class's rule is read
        act = _on_remote(sup, job)  # type: ignore[arg-type]
        act(told)
        act(lost)
        assert sup.signals == ([signals.SIGTERM] if stops else [])
        assert sup.aborts == ([lost] if stops else [told, lost])


# ---- the end of the job: the store's host outlives every node's last read ----------------------------


def test_the_store_host_waits_for_every_node_to_leave_and_no_longer() -> None:
    store = FakeStore()
    host, *others = job_of(store, 3)
    assert host.still_reading() == [1, 2]
    others[0].leave()
    left = threading.Event()

    def last_node() -> None:
        left.set()
        leave_job(others[1])

    threading.Timer(0.2, last_node).start()
    assert outlive_readers(host, timeout_s=WAIT_S) == []
    assert left.is_set(), "returned before the last node left"
    assert host.still_reading() == []


def test_the_store_hosts_wait_is_bounded_when_a_node_never_leaves() -> None:
    store = FakeStore()
    host, first, _silent = job_of(store, 3)
    first.leave()
    latecomer = JobStore(store, node=2, base_rank=2, nproc=1, world_size=3)  # refused, never a member
    latecomer.run_id = "r"
    leave_job(latecomer)  # writes nothing: base rank 2 is a live member's
    assert outlive_readers(host, timeout_s=0.3) == [2]
    assert outlive_readers(job_of(FakeStore(), 1)[0], timeout_s=WAIT_S) == []  # alone: nobody to wait for


def test_the_store_host_does_not_wait_for_a_node_the_job_named_lost_while_it_stays_silent() -> None:
    """Node 2's launcher was killed (named lost: its beats stopped): it will never leave, so the host
    stops waiting for it once its beat counter has stood still a moment, not after the whole bound
    (before: the store's host of a two-node job ended 5 s after its rank, issue 41)."""
    store = FakeStore()
    host, first, _killed = job_of(store, 3)
    host.publish_abort(failure_record(node_lost(2, "its launcher stopped beating")))
    first.leave()
    began = time.monotonic()
    assert outlive_readers(host, timeout_s=WAIT_S) == [2]
    assert time.monotonic() - began < WAIT_S / 2


def test_the_store_host_waits_for_a_node_named_lost_that_beats_again() -> None:
    """A node named lost that was only slow beats again: it reads the verdict and leaves like any other,
    so the host waits for it."""
    store = FakeStore()
    host, first, slow = job_of(store, 3)
    host.publish_abort(failure_record(node_lost(2, "its launcher stopped beating")))
    first.leave()
    left = threading.Event()

    def beat_then_leave() -> None:
        for _ in range(8):  # beats for 0.4 s, past the host's still_s, then leaves
            slow.store.add(slow.key("beat", slow.base_rank), 1)
            time.sleep(0.05)
        left.set()
        leave_job(slow)

    threading.Thread(target=beat_then_leave).start()
    assert outlive_readers(host, timeout_s=WAIT_S, still_s=0.2) == []
    assert left.is_set(), "returned before the slow node left"


def test_leaving_a_store_that_is_gone_raises_nothing_and_notes_torchs_words(tmp_path: Any) -> None:
    store = FakeStore()
    _, node = job_of(store, 2)
    store.hang.set()  # every add fails as a closed connection does
    store.release.set()

    def closed(key: str, value: str) -> None:
        raise ConnectionResetError("Connection reset by peer")

    store.set = closed  # type: ignore[method-assign]
    STORE_NOTES.attach(tmp_path / "store_node1.log")
    try:
        leave_job(node)  # no exception, bounded
        with pytest.raises(StoreLostError) as lost:
            node.beat()
    finally:
        STORE_NOTES.attach(None)
    assert str(lost.value) == "node 0, the store's host, ended (its launcher was killed?); stopping"
    notes = (tmp_path / "store_node1.log").read_text()
    assert "store.set failed: ConnectionResetError" in notes and "store.add failed" in notes


def test_a_monitor_stopped_during_a_beat_makes_no_further_store_call_in_it() -> None:
    """A beat makes several store calls; one begun after ``stop`` could still be inside torch's store
    client when the launcher exits (issue 41's SIGABRT): the beat ends at the next call instead."""
    from multigpu.rendezvous.store_threads import Stopped

    store = FakeStore()
    jobs = job_of(store, 3)
    watcher = FateMonitor(jobs[0], lambda failure: None, latency=Latency(floor_s=1.0))
    watcher.beat_once()  # the first beat reads the members
    beat = jobs[0].beat

    def beat_then_stopped() -> None:
        beat()
        watcher.stop()  # the launcher's main thread, while this beat's first call was in flight

    jobs[0].beat = beat_then_stopped  # type: ignore[method-assign]
    start = len(store.log)
    with pytest.raises(Stopped):
        watcher.beat_once()
    assert calls(store, start) == ["add"], "the counters' read never began"
