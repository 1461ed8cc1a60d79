"""The one attempts loop (``runner/attempts.py``) over the membership interface (``runner/membership.py``):
what the loop decides after each attempt, whatever the mode, and the crash-loop memory an elastic job
keeps in its store. No processes: scripted attempt results, a membership that records what it was asked,
a real run record, torch's in-process ``HashStore``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from multigpu.config.run import RunConfig, SupervisionConfig
from multigpu.contract.exitcodes import EXIT_CRASH_LOOP
from multigpu.contract.failure import NO_NODE, FailureKind, WorkerFailure, subject_without_rank
from multigpu.record.run_json import RunRecord
from multigpu.rendezvous.job import JobStore
from multigpu.runner import attempts
from multigpu.runner.crash_loop import CrashLoopPolicy, FailureMemory, LocalFailures, StoreFailures
from multigpu.runner.membership import Meeting, Membership, StaticMembership
from multigpu.supervisor.states import RunResult, RunStatus, Worker, WorkerSpec

RUN_ID = "20261206-000000-abcdef"


def raised(rank: int = 1, line: int = 12, error: str = "ValueError") -> WorkerFailure:
    trace = (
        f'Traceback (most recent call last):\n  File "/w/train.py", line {line}, in <module>\n{error}: x\n'
    )
    return WorkerFailure(
        rank=rank, local_rank=0, pid=100 + rank, exit_code=1, error_type=error, message="x", traceback=trace
    )


def failed(failure: WorkerFailure) -> RunResult:
    return RunResult(RunStatus.FAILED, [failure])


def launcher_named(kind: FailureKind, message: str, node: int = NO_NODE) -> RunResult:
    failure = WorkerFailure.launcher_named(subject_without_rank(kind), kind, message, node=node)
    return RunResult(RunStatus.FAILED, [failure])


JOINED = launcher_named(FailureKind.MEMBERSHIP_CHANGE, "1 node(s) asked to join: a new rendezvous round")
LOST = launcher_named(FailureKind.NODE_LOST, "node 1 stopped beating", node=1)
STORE_GONE = launcher_named(FailureKind.STORE_LOST, "the store is gone", node=0)
OK = RunResult(RunStatus.SUCCEEDED, [])


@dataclass
class Scripted:
    """A membership of either kind, as the loop sees it: elastic rounds share a restart count until a
    restart is counted (a joining node ends a round without one); static attempts count every time."""

    config: RunConfig
    elastic: bool = True
    run_id: str = RUN_ID
    job: JobStore | None = None
    serves_store: bool = False
    spawner: Any = None
    failures: FailureMemory = field(default_factory=LocalFailures)
    record_name: str = "run.json"
    claim: int | str | None = None
    count: int = 0
    meetings: list[int] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)
    closed: list[bool] = field(default_factory=list)

    def opening(self, output_dir: Path) -> list[str]:
        return [f"run {self.run_id}"]

    def meet(self) -> Meeting:
        self.meetings.append(self.count)
        return Meeting(self.count, self.config, "127.0.0.1", 29400)

    def can_meet_again(self, result: RunResult) -> bool:
        gone = {FailureKind.STORE_LOST} if self.elastic else {FailureKind.NODE_LOST, FailureKind.STORE_LOST}
        return all(f.kind not in gone for f in result.failures)

    def restart(self, meeting: Meeting) -> str:
        self.count = meeting.attempt + 1
        self.restarts.append(self.count)
        return f"restarting: {self.count}"

    def leave(self) -> None:
        self.left = True

    def close(self, *, over: bool) -> None:
        self.closed.append(over)


def _config(max_restarts: int) -> RunConfig:
    return RunConfig(
        target="train.py", nproc=1, world_size=1, supervision=SupervisionConfig(max_restarts=max_restarts)
    )


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RunResult]]:
    """The results the attempts will have, in order; every one must be used."""
    results: list[RunResult] = []

    def run_attempt(
        config: RunConfig, specs: list[WorkerSpec], *args: Any, **kwargs: Any
    ) -> tuple[RunResult, list[Worker]]:
        assert results, "the loop started an attempt the test did not script"
        return results.pop(0), []

    monkeypatch.setattr(attempts, "run_attempt", run_attempt)
    monkeypatch.setattr(attempts, "set_child_subreaper", lambda: False)  # not for pytest itself
    yield results
    assert not results, "the loop ended before every scripted attempt ran"


def run_loop(tmp_path: Path, members: Scripted) -> tuple[int, attempts.Run, dict[str, Any]]:
    tmp_path.mkdir(exist_ok=True)
    record = RunRecord.create(tmp_path / members.record_name, members.config, RUN_ID, ["cpu"])
    run = attempts.Run(members.config, members, record, tmp_path, {}, None)
    code = attempts.run_attempts(run)
    return code, run, json.loads(record.path.read_text())


def test_both_memberships_have_everything_the_interface_names() -> None:
    """Methods on the class; attributes set by the constructor (mypy checks the types in src)."""
    import inspect

    from multigpu.runner.rounds import ElasticMembership

    methods = {n for n, v in vars(Membership).items() if callable(v) and not n.startswith("_")}
    fields = set(Membership.__annotations__)
    assert methods == {"opening", "meet", "can_meet_again", "restart", "leave", "close"}
    assert fields == {"run_id", "job", "serves_store", "spawner", "failures", "record_name", "claim"}
    for kind in (StaticMembership, ElasticMembership):
        assert all(callable(getattr(kind, name, None)) for name in methods), kind
        made = inspect.getsource(kind.__init__)  # type: ignore[misc]
        assert {f for f in fields if f"self.{f}" not in made} == set(), kind


@pytest.mark.parametrize("elastic", [True, False])
def test_the_same_failure_twice_is_a_crash_loop_in_every_mode(
    tmp_path: Path, script: list[RunResult], elastic: bool
) -> None:
    script += [failed(raised()), failed(raised())]
    members = Scripted(_config(5), elastic=elastic)
    code, run, record = run_loop(tmp_path, members)
    assert code == EXIT_CRASH_LOOP
    assert members.meetings == [0, 1] and members.restarts == [1]
    assert record["status"] == "failed" and record["exit_code"] == EXIT_CRASH_LOOP
    assert record["crash_loop"].startswith("crash loop: rank 1 failed with ValueError at /w/train.py:12")
    assert [i["attempt"] for i in record["incidents"]] == [0, 1]
    assert run.over, "a crash loop ends the job for every node"


def test_a_joining_node_ends_the_round_without_a_restart_or_a_crash_loop_check(
    tmp_path: Path, script: list[RunResult]
) -> None:
    """torchrun: a membership change is no restart; the failures either side of it are still in a row."""
    script += [failed(raised()), JOINED, failed(raised())]
    members = Scripted(_config(5))
    code, _, record = run_loop(tmp_path, members)
    assert code == EXIT_CRASH_LOOP
    assert members.meetings == [0, 1, 1], "the round after the join keeps its restart count"
    assert members.restarts == [1]
    assert [i["kind"] for i in record["incidents"]] == ["failed", "membership change", "failed"]


def test_a_changing_failure_uses_every_restart(tmp_path: Path, script: list[RunResult]) -> None:
    script += [failed(raised()), failed(raised(error="KeyError")), failed(raised())]
    members = Scripted(_config(2))
    code, run, record = run_loop(tmp_path, members)
    assert code == 1 and members.restarts == [1, 2] and "crash_loop" not in record
    assert run.over and record["status"] == "failed"


def test_a_lost_node_restarts_an_elastic_job_and_ends_a_static_one(
    tmp_path: Path, script: list[RunResult]
) -> None:
    script += [LOST, OK, LOST]
    elastic = Scripted(_config(3))
    assert run_loop(tmp_path / "e", elastic)[0] == 0 and elastic.restarts == [1]
    static = Scripted(_config(3), elastic=False)
    code, run, _ = run_loop(tmp_path / "s", static)
    assert code != 0 and static.restarts == [] and run.over


def test_a_lost_store_ends_every_mode(tmp_path: Path, script: list[RunResult]) -> None:
    script += [STORE_GONE]
    members = Scripted(_config(3))
    code, run, _ = run_loop(tmp_path, members)
    assert code != 0 and members.restarts == [] and run.over


def test_an_interrupted_node_leaves_an_elastic_job_open_for_the_others(
    tmp_path: Path, script: list[RunResult]
) -> None:
    import signal

    script += [RunResult(RunStatus.INTERRUPTED, [], signal.SIGTERM)]
    code, run, record = run_loop(tmp_path, Scripted(_config(3)))
    assert code == 128 + signal.SIGTERM and not run.over and record["status"] == "interrupted"


def test_a_loop_that_raises_closes_the_record_and_a_rendezvous_error_ends_the_job(
    tmp_path: Path, script: list[RunResult]
) -> None:
    from multigpu.contract.errors import RendezvousError

    class Refused(Scripted):
        def meet(self) -> Meeting:
            if self.count:
                raise RendezvousError("the job at 127.0.0.1:1 has already ended")
            return super().meet()

    script += [failed(raised())]
    members = Refused(_config(3))
    record = RunRecord.create(tmp_path / "run.json", members.config, RUN_ID, ["cpu"])
    run = attempts.Run(members.config, members, record, tmp_path, {}, None)
    with pytest.raises(RendezvousError):
        attempts.run_attempts(run)
    assert run.over and json.loads(record.path.read_text())["status"] == "failed"


def test_a_store_memory_lets_a_node_that_joined_later_see_the_loop() -> None:
    """An elastic job's nodes change between rounds: the signature of each failed round is the job's,
    so a node that was not in the round before decides as the nodes that were."""
    from torch.distributed import HashStore

    store = HashStore()
    first = CrashLoopPolicy(StoreFailures(store, f"multigpu/{RUN_ID}/failures"))
    assert first.check(raised(), 0) is None
    joined = CrashLoopPolicy(StoreFailures(store, f"multigpu/{RUN_ID}/failures"))  # its first round: 1
    line = joined.check(raised(), 1)
    assert line is not None and "ValueError at /w/train.py:12 on two attempts in a row" in line
    assert first.check(raised(), 1) == line, "every node of the round comes to the same answer"


def test_the_first_node_to_write_a_rounds_signature_is_every_nodes_word() -> None:
    from torch.distributed import HashStore

    memory = StoreFailures(HashStore(), "multigpu/x/failures")
    assert memory.recall(0) is None
    assert memory.agree(0, "ValueError at a.py:1") == "ValueError at a.py:1"
    assert memory.agree(0, "KeyError at a.py:2") == "ValueError at a.py:1"
    assert memory.agree(1, "") == "" and memory.recall(1) == "", "no place: kept as such, never a loop"
    policy = CrashLoopPolicy(memory)
    nameless = WorkerFailure(rank=0, local_rank=0, pid=1, signal="SIGKILL")
    assert policy.check(nameless, 2) is None and policy.check(nameless, 3) is None


def test_a_static_membership_on_one_node_counts_every_attempt(tmp_path: Path) -> None:
    """The static membership's own rules, without a spawner or a store: attempts count one by one, a
    lost node or store ends the run, and the restart line names the attempt."""
    members = StaticMembership.__new__(StaticMembership)
    members.config = replace(_config(3))
    members.job, members._next, members._worker_store = None, 0, None
    members.rdzv = type("R", (), {"job": None, "master_addr": "127.0.0.1", "master_port": 29400})()  # type: ignore[assignment]
    first = members.meet()
    assert (first.attempt, first.master_port, first.job) == (0, 29400, None)
    assert members.restart(first) == "restarting: attempt 1 of 3 restart(s)"
    assert members.meet().attempt == 1
    assert not members.can_meet_again(LOST) and not members.can_meet_again(STORE_GONE)
    assert members.can_meet_again(failed(raised()))
