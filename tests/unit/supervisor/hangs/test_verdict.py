"""The job-wide hang decision (``supervisor/hangs/verdict.py``, ``rendezvous/hang_store.py``): progress
shared between nodes through one counter, a notice that names no rank, one verdict from every node's
stacks, the same failures on every node; the rank's collective counter and its beat. Pure bookkeeping
on injected clocks, and the real store exchange on torch's in-memory store (two nodes as two threads)."""

from __future__ import annotations

import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from helpers import PYTHON, assert_gone, clean_env, logged, supervisor_arguments, write_script
from multigpu.contract.beats import BeatDecoder
from multigpu.contract.failure import FailureKind, Subject, WorkerFailure
from multigpu.rank import progress
from multigpu.rendezvous.hang_store import Exchange, StoreHangs
from multigpu.rendezvous.job import JobStore
from multigpu.supervisor.hangs import verdict
from multigpu.supervisor.hangs.book import HangPolicy, ProgressBook
from multigpu.supervisor.hangs.verdict import HangWatch, JobProgress, RankState, Turns, decide, job_failures
from multigpu.supervisor.loop import Supervisor
from multigpu.supervisor.outcome import Outcome
from multigpu.supervisor.states import RunStatus, Worker, WorkerSpec, WorkerState

WAIT_S = 10.0  # a bound on a thread's work: reached only when the behaviour is broken


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Counter:
    """The job's progress counter in the store: ``add`` returns the new total."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, n: int) -> int:
        self.total += n
        return self.total


def book(clock: Clock, ranks: list[int], ceiling: float = 5.0) -> ProgressBook:
    return ProgressBook(HangPolicy(ceiling=ceiling, floor=1.0), ranks, clock=clock)


def test_another_nodes_progress_keeps_a_silent_node_from_calling_a_hang() -> None:
    """Case 1 of issue 31: node 1's rank prints nothing (rank 0 prints, on node 0) and must not be hung."""
    clock, counter = Clock(), Counter()
    node0, node1 = book(clock, [0]), book(clock, [1])
    share0, share1 = JobProgress(node0), JobProgress(node1)
    for _ in range(40):  # 10 s of training, rank 0 printing every second, rank 1 silent
        clock.now += 0.25
        if clock.now % 1.0 == 0:
            node0.output(0)
        share0.share(counter.add)
        share1.share(counter.add)
        assert node0.check([0]) is None and node1.check([1]) is None, clock.now
    assert node1.job_at == pytest.approx(clock.now, abs=1.0)
    assert node0.job_at <= 100.5, "node 1's start-up only: a node's own progress is not news from another"
    for _ in range(19):  # rank 0 falls silent too: the job is silent, on both nodes
        clock.now += 0.25
        share0.share(counter.add)
        share1.share(counter.add)
        assert node1.check([1]) is None
    clock.now += 0.5
    hang = node1.check([1])
    assert hang is not None and hang.notice.startswith("no progress for 5.")


def test_the_shared_counter_moves_only_with_progress() -> None:
    clock, counter = Clock(), Counter()
    quiet = JobProgress(book(clock, [0]))
    quiet.share(counter.add)  # start-up counts once
    before = counter.total
    for _ in range(10):
        quiet.share(counter.add)
    assert counter.total == before, "a silent node adds nothing: its write is an add of 0"


def test_a_collective_entered_is_progress_for_a_rank_that_reports_no_steps() -> None:
    clock = Clock()
    b = book(clock, [0, 1])
    for _ in range(30):
        clock.now += 0.5
        b.feed(0, BeatDecoder().feed(f"C{int(clock.now)};".encode()))
        b.feed(1, BeatDecoder().feed(f"C{int(clock.now)};".encode()))
        assert b.check([0, 1]) is None
    clock.now += 5.0
    assert b.check([0, 1]) is not None


def test_the_first_line_names_no_rank_when_two_stopped_together() -> None:
    """Case 7 of issue 31: 'ranks 1, 0 stopped progressing first' then a verdict naming rank 1."""
    clock = Clock()
    b = book(clock, [0, 1])
    for step in range(1, 30):
        clock.now += 0.2
        for r in (0, 1):
            b.feed(r, BeatDecoder().feed(f"S{step};".encode()))
    clock.now += 5.0
    hang = b.check([0, 1])
    assert hang is not None
    assert "rank" not in hang.notice and hang.notice.startswith("no progress for 5.0s since step 29")


def test_the_collective_beat_decodes() -> None:
    beats = BeatDecoder().feed(b"C12;.C13;")
    assert [(b.kind, b.value) for b in beats] == [("collectives", 12.0), ("beat", 0.0), ("collectives", 13.0)]


def test_collectives_are_counted_over_every_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    class Group:
        def __init__(self, seq: int) -> None:
            self.seq = seq

        def _get_sequence_number_for_group(self) -> int:
            return self.seq

    c10d = types.SimpleNamespace(_world=types.SimpleNamespace(pg_map={}))
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", c10d)
    assert progress.collectives_entered() is None, "no process group yet: nothing to count"
    c10d._world.pg_map = {Group(3): None, Group(4): None}
    assert progress.collectives_entered() == 7
    monkeypatch.delitem(sys.modules, "torch.distributed.distributed_c10d")
    assert progress.collectives_entered() is None


STUCK = ["Thread 0x00007f0000000001 (most recent call first):", '  File "/x/train.py", line 10 in <module>']
WAITING = [
    "Thread 0x00007f0000000002 (most recent call first):",
    '  File "/v/torch/distributed/distributed_c10d.py", line 3252 in all_reduce',
    '  File "/x/train.py", line 7 in <module>',
]


def states() -> list[RankState]:
    return [
        RankState(0, 0, 0, 1000, True, None, 5.1, WAITING),
        RankState(1, 0, 1, 2000, True, None, 5.3, STUCK),
    ]


def notice(node: int = 0) -> WorkerFailure:
    return WorkerFailure.launcher_named(
        Subject.NODE, FailureKind.HANG, "no progress for 5.0s (--hang-timeout 5s)", node=node, at=1000.0
    )


def test_the_verdict_names_the_rank_outside_the_collective_with_file_and_line() -> None:
    verdict = decide(states(), notice())
    assert verdict["culprits"] == [1, 0]
    assert verdict["line"].startswith(
        "rank 1 never reached the all_reduce that rank 0 waits in: rank 1 is in /x/train.py:10 (<module>)"
    )
    assert verdict["line"].endswith("; no progress for 5.0s (--hang-timeout 5s)")
    assert verdict["time"] < notice().time  # the failures are dated before the notice: they win the record


def test_without_a_telling_stack_the_lowest_step_then_the_longest_silence_comes_first() -> None:
    quiet = [
        RankState(0, 0, 0, 1, True, 29, 5.0, STUCK),
        RankState(1, 0, 1, 2, True, 28, 5.0, STUCK),
        RankState(2, 0, 1, 3, True, 29, 6.0, STUCK),
        RankState(3, 1, 1, 4, False),
    ]
    verdict = decide(quiet, notice())
    assert verdict["culprits"] == [1, 2, 0]
    assert verdict["line"].startswith("rank 1 stopped progressing first (at step 28")


def worker(rank: int, node: int, tmp_path: Path) -> Worker:
    return Worker(
        WorkerSpec(
            rank=rank, local_rank=0, argv=[], env={}, node=node, log_path=tmp_path / f"rank_{rank}.log"
        )
    )


def test_every_node_makes_the_same_failures_from_the_same_verdict(tmp_path: Path) -> None:
    verdict = decide(states(), notice())
    on0 = job_failures(verdict, states(), [worker(0, 0, tmp_path)])
    on1 = job_failures(verdict, states(), [worker(1, 1, tmp_path)])
    for failures in (on0, on1):
        assert [(f.rank, f.node, f.pid) for f in failures] == [(1, 1, 2000), (0, 0, 1000)]
        assert failures[0].message == verdict["line"] and failures[1].message == "no progress for 5.1s"
        assert all(f.kind is FailureKind.HANG for f in failures)
        assert failures[0].traceback is not None and 'train.py", line 10' in failures[0].traceback
        assert failures[0].time is not None and failures[1].time is not None
        assert failures[0].time < failures[1].time < (notice().time or 0)
    assert [f.to_dict()["message"] for f in on0] == [f.to_dict()["message"] for f in on1]
    assert on0[1].log_path == str(tmp_path / "rank_0.log"), "a local rank's failure keeps its log"


# ---- the exchange through a real store ---------------------------------------------------------------


def store() -> Any:
    from torch.distributed import HashStore

    return HashStore()


def node(shared: Any, n: int) -> JobStore:
    job = JobStore(shared, node=n, base_rank=n, nproc=1, world_size=2)
    job.run_id = "test"
    shared.add(job.key("beat", n), 0)
    shared.append(job.key("members"), f"{n}:{n},")
    return job


def test_two_nodes_exchange_their_stacks_and_settle_one_verdict() -> None:
    shared = store()
    jobs = [node(shared, 0), node(shared, 1)]
    mine = [[s for s in states() if s.node == n] for n in (0, 1)]
    exchanges: list[Exchange] = []
    for n in (1, 0):  # node 1 first: it waits for node 0's states
        exchanges.append(StoreHangs(jobs[n]).exchange(mine[n], notice(n)))
    for exchange in exchanges:
        assert exchange.wait(WAIT_S)
    answers = [e.result() for e in exchanges]
    assert all(a is not None for a in answers)
    (states1, verdict1), (states0, verdict0) = answers  # type: ignore[misc]
    assert verdict0 == verdict1, "the first verdict written stands on every node"
    assert [s.rank for s in states0] == [s.rank for s in states1] == [0, 1]
    assert verdict0["culprits"] == [1, 0]


def test_a_node_that_never_answers_costs_a_bounded_wait() -> None:
    shared = store()
    alone = node(shared, 0)
    node(shared, 1)  # a member that never publishes its states
    exchange = Exchange(alone, [states()[0]], notice(), gather_s=0.3)
    assert exchange.wait(WAIT_S)
    answer = exchange.result()
    assert answer is not None and [s.rank for s in answer[0]] == [0]


def test_the_notice_is_the_jobs_abort_record_and_the_earliest_stands() -> None:
    shared = store()
    jobs = [node(shared, 0), node(shared, 1)]
    StoreHangs(jobs[0]).declare("no progress for 5.0s (--hang-timeout 5s)")
    deadline = threading.Event()
    for _ in range(200):
        if jobs[1].read_abort() is not None:
            break
        deadline.wait(0.05)
    record = jobs[1].read_abort()
    assert record is not None and record["error_type"] == "Hang" and record["rank"] == -1
    assert record["message"] == "no progress for 5.0s (--hang-timeout 5s)" and record["node"] == 0


# ---- the supervisor's side, with real (tiny, torch-free) ranks and the store faked ---------------------


class Answer:
    """A ``Pending`` that is done at once: this node's states plus a remote rank's, and their verdict."""

    def __init__(self, mine: list[RankState], remote: RankState, notice: WorkerFailure) -> None:
        self.states = sorted([*mine, remote], key=lambda s: s.rank)
        self.verdict = decide(self.states, notice)

    def done(self) -> bool:
        return True

    def result(self) -> tuple[list[RankState], dict[str, Any]] | None:
        return self.states, self.verdict


class FakeExchange:
    """The store as one node sees it: its own notice comes back to it (as the fate monitor would hand
    it over), and node 1's rank 1 answers from another node, stuck outside the collective."""

    def __init__(self) -> None:
        self.supervisor: Any = None
        self.notices: list[str] = []
        self.shared: list[RankState] = []

    def declare(self, notice: str) -> None:
        self.notices.append(notice)
        self.supervisor.abort(WorkerFailure.launcher_named(Subject.NODE, FailureKind.HANG, notice, node=0))

    def exchange(self, mine: list[RankState], notice: WorkerFailure) -> Answer:
        self.shared = mine
        return Answer(mine, RankState(1, 0, 1, 4242, True, None, 9.0, STUCK), notice)


@pytest.mark.integration
def test_the_supervisor_declares_once_dumps_its_ranks_and_takes_the_jobs_verdict(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = write_script(
        tmp_path,
        "waits.py",
        """
        import time

        def waiting_here():
            time.sleep(60)

        waiting_here()
    """,
    )
    rank0 = WorkerSpec(
        rank=0,
        local_rank=0,
        argv=[PYTHON, "-m", "multigpu.rank", "script", str(script)],
        env=clean_env({"RANK": "0", "WORLD_SIZE": "2"}),
        log_path=tmp_path / "rank_0.log",
    )
    exchange = FakeExchange()
    sup = Supervisor([rank0], **supervisor_arguments(hang_timeout=1.0, grace_period=0.3, job_hang=exchange))
    exchange.supervisor = sup
    try:
        sup.start()
        pid = sup.workers[0].pid
        result = sup.wait(timeout=20)
    finally:
        sup.close(grace_period=0)
    assert result is not None and result.status is RunStatus.HUNG
    assert len(exchange.notices) == 1 and exchange.notices[0].startswith("no progress for ")
    assert [n for n in logged(caplog) if n.startswith("hang: ")] == [
        f"hang: {exchange.notices[0]}; collecting every rank's stacks"
    ]
    assert [s.rank for s in exchange.shared] == [0] and "waiting_here" in "\n".join(exchange.shared[0].dump)
    root = result.root_cause
    assert root is not None and (root.rank, root.node, root.pid) == (1, 1, 4242)
    assert root.message is not None and root.message.startswith("rank 1 stopped progressing first")
    assert [f.rank for f in result.failures] == [1, 0]
    assert "waiting_here" in (tmp_path / "rank_0.log").read_text()
    assert pid is not None
    assert_gone([pid])


def test_the_verdict_is_the_detection_and_the_stacks_collection_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hang's incident is detected when the hang is called, and its failures' time is the last
    progress, however long the stacks' collection that follows takes: the goodput ledger counts that
    collection as ``hang_handling``, not as the hang going unnoticed."""
    wall = {"now": 5000.0}
    monkeypatch.setattr(verdict, "time", types.SimpleNamespace(time=lambda: wall["now"]))
    clock = {"now": 100.0}
    book = ProgressBook(HangPolicy(ceiling=3.0), [0, 1], clock=lambda: clock["now"], wall=lambda: 4900.0)
    workers = []
    for r in (0, 1):
        worker = Worker(WorkerSpec(rank=r, local_rank=r, argv=[], env={}))
        worker.state = WorkerState.RUNNING
        workers.append(worker)
    book.ranks[0].last_progress = book.ranks[1].last_progress = 96.5  # 3.5 s quiet at 100

    def dump(targets: list[Worker]) -> None:
        wall["now"] += 10.0  # the stacks take 10 s to come back

    outcome = Outcome()
    HangWatch(book, None, dump, Turns(lambda _: None, lambda: clock["now"])).check(workers, outcome)
    result = outcome.result(None, workers)
    assert result is not None and result.status is RunStatus.HUNG
    assert result.detected_time == 5000.0  # called at 5000, before the collection
    assert result.root_cause is not None and result.root_cause.time == pytest.approx(5000.0 - 3.5)
