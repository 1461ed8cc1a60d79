"""The launcher's side of ``--preflight`` (``runner/preflight.py``): which meetings are checked, the
task handed to the check, and what follows from its result: the lines (to the module's logger), the
record, a refusal, a withdrawal, a failed check (a plain Python child stands in for the check; the
real one is in unit/preflight and integration/multinode)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

from helpers import record_problems
from multigpu.config.run import RendezvousConfig, RunConfig
from multigpu.contract.errors import PreflightRefused, PreflightWithdrew, RendezvousError
from multigpu.contract.exitcodes import EXIT_PREFLIGHT
from multigpu.contract.preflight_wire import Figures, PreflightResult, PreflightTask
from multigpu.record.run_json import RunRecord
from multigpu.runner.membership import Meeting
from multigpu.runner.preflight import Preflight, check_env, parse_result
from multigpu.runner.preflight_peers import NodeLost, PeerBeats
from multigpu.supervisor.spawning import PopenSpawner
from multigpu.supervisor.states import ProcessHandle, WorkerSpec
from unit.runner.test_preflight_peers import Job

pytestmark = pytest.mark.timeout(60)


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the preflight said, in order (its module's logger: the run's console in ``multigpu run``)."""
    return [r.getMessage() for r in caplog.records if r.name == "multigpu.runner.preflight"]


@pytest.fixture(autouse=True)
def heard(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="multigpu")


def test_the_checks_result_is_its_last_stdout_line() -> None:
    line = PreflightResult((Figures(1.0, 2.0), Figures(3.0, 4.0)), 0.5).encode()
    out = b"noise\n" + line.encode() + b"\n"
    assert parse_result(out) == PreflightResult((Figures(1.0, 2.0), Figures(3.0, 4.0)), 0.5)


def test_the_check_runs_on_one_thread_and_sees_the_ranks_gpus() -> None:
    env = check_env({"PATH": "/bin", "OMP_NUM_THREADS": "8"}, {"X": "1"}, "2,3")
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "X": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert "CUDA_VISIBLE_DEVICES" not in check_env({}, {}, None)


def test_preflight_is_on_for_several_nodes_off_for_one() -> None:
    assert RunConfig(target="t", nproc=2).preflight_mode == "off"
    assert RunConfig(target="t", nproc=2, world_size=4).preflight_mode == "on"
    elastic = RendezvousConfig(min_nodes=1, max_nodes=2)
    assert RunConfig(target="t", nproc=2, rdzv=elastic).preflight_mode == "on"
    strict = RendezvousConfig(preflight="strict")
    assert RunConfig(target="t", nproc=2, rdzv=strict).preflight_mode == "strict"


class FailingSpawner(PopenSpawner):
    """The check as a process that fails as a check does: one line, exit 1."""

    def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
        code = "import sys; print('RuntimeError: [gloo] timed out', file=sys.stderr); sys.exit(1)"
        return super().spawn(
            WorkerSpec(rank=-1, local_rank=-1, argv=[sys.executable, "-c", code], env={}), env, ()
        )


class FixedSpawner(PopenSpawner):
    """The check as a process that prints fixed figures (node 1 slow)."""

    def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
        result = PreflightResult((Figures(14.0, 2.0), Figures(1.0, 2.0)), 0.5).encode()
        argv = [sys.executable, "-c", f"print({result!r})"]
        return super().spawn(WorkerSpec(rank=-1, local_rank=-1, argv=argv, env={}), env, ())


def meeting() -> Meeting:
    config = RunConfig(target="t", nproc=1, world_size=2, base_rank=1)
    return Meeting(0, config, "127.0.0.1", 1, Job())  # type: ignore[arg-type]


def record(tmp_path: Path) -> RunRecord:
    return RunRecord(tmp_path / "run.json", RunConfig(target="t"), "r", ["cpu"], command=["multigpu"])


def test_a_failed_check_is_one_line_naming_the_node_and_is_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    check = Preflight("on", dict(os.environ), record(tmp_path))
    assert check.due(meeting())
    with pytest.raises(RendezvousError) as info:
        check.check(meeting(), FailingSpawner())
    assert str(info.value).startswith(
        "preflight: the check failed on node 1: RuntimeError: [gloo] timed out; no rank was started"
    )
    assert not check.due(meeting())  # once per job
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["preflight"]["verdict"] == "failed" and said(caplog) == []
    assert record_problems(tmp_path) == []


def test_strict_refuses_with_its_own_exit_code_and_on_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(PreflightRefused) as info:
        Preflight("strict", dict(os.environ), record(tmp_path)).check(meeting(), FixedSpawner())
    assert info.value.launcher_exit == EXIT_PREFLIGHT and said(caplog) == []
    Preflight("on", dict(os.environ), record(tmp_path)).check(meeting(), FixedSpawner())
    [line] = said(caplog)
    assert line.startswith("preflight: node 1 is slow: matmul 1 GFLOP/s (others 14)")
    assert caplog.records[-1].levelno == logging.WARNING
    assert json.loads((tmp_path / "run.json").read_text())["preflight"]["slow_nodes"] == [1]
    assert record_problems(tmp_path) == []


def test_off_or_one_node_is_never_checked(tmp_path: Path) -> None:
    assert not Preflight("off", {}, record(tmp_path)).due(meeting())
    alone = Meeting(0, RunConfig(target="t"), "127.0.0.1", 1, None)
    assert not Preflight("on", {}, record(tmp_path)).due(alone)


def elastic_meeting(node: int, min_nodes: int, store_host: int | None = 0) -> Meeting:
    rdzv = RendezvousConfig(min_nodes=min_nodes, max_nodes=3)
    config = RunConfig(target="t", nproc=1, world_size=3, base_rank=node, node_rank=node, nnodes=3, rdzv=rdzv)
    job = Job()
    job.store_host = store_host  # type: ignore[attr-defined]
    return Meeting(0, config, "127.0.0.1", 1, job)  # type: ignore[arg-type]


def test_a_slow_node_withdraws_from_an_elastic_round_only_where_enough_nodes_are_left(
    tmp_path: Path,
) -> None:
    elastic = Preflight("on", {}, record(tmp_path), every_round=True)
    assert elastic.withdrawing(elastic_meeting(0, min_nodes=2), [2]) == [2]
    assert elastic.withdrawing(elastic_meeting(0, min_nodes=3), [2]) == []  # too few without it
    assert elastic.withdrawing(elastic_meeting(0, min_nodes=1, store_host=2), [2]) == []  # its store
    assert elastic.withdrawing(elastic_meeting(0, min_nodes=1, store_host=None), [1, 2]) == [1, 2]
    static = Preflight("on", {}, record(tmp_path))
    assert static.withdrawing(elastic_meeting(0, min_nodes=2), [2]) == []


class ThreeNodesSpawner(PopenSpawner):
    """The check as a process that prints fixed figures: node 2 slow of 3."""

    def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
        result = PreflightResult((Figures(14.0, 2.0), Figures(13.0, 2.0), Figures(1.0, 2.0)), 0.5).encode()
        argv = [sys.executable, "-c", f"print({result!r})"]
        return super().spawn(WorkerSpec(rank=-1, local_rank=-1, argv=argv, env={}), env, ())


def test_the_slow_node_leaves_and_the_others_meet_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    check = Preflight("strict", dict(os.environ), record(tmp_path), every_round=True)
    assert check.check(elastic_meeting(0, min_nodes=2), ThreeNodesSpawner()) is False
    assert said(caplog) == [
        "preflight: node 2 is slow: matmul 1 GFLOP/s (others 13.5); all_reduce 2 GB/s between the nodes; "
        "it leaves the job: a new round with 2 node(s)"
    ]
    assert check.due(elastic_meeting(0, min_nodes=2))  # the next round is checked again
    with pytest.raises(PreflightWithdrew) as info:
        check.check(elastic_meeting(2, min_nodes=2), ThreeNodesSpawner())
    assert str(info.value).endswith("node 2 (this one) leaves the job, which goes on with 2 node(s)")
    assert info.value.launcher_exit == EXIT_PREFLIGHT
    assert json.loads((tmp_path / "run.json").read_text())["preflight"]["verdict"] == "withdrawn"
    assert record_problems(tmp_path) == []


class TaskSpawner(FixedSpawner):
    """Keeps the task the launcher hands its check."""

    argv: list[str] = []

    def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
        TaskSpawner.argv = spec.argv
        return super().spawn(spec, env, pass_fds)


def test_the_launcher_hands_its_check_a_task_the_check_reads(tmp_path: Path) -> None:
    Preflight("on", dict(os.environ), record(tmp_path)).check(meeting(), TaskSpawner())
    assert TaskSpawner.argv[:3] == [sys.executable, "-m", "multigpu.preflight"]
    task = PreflightTask.decode(TaskSpawner.argv[3])
    assert (task.node, task.nodes, task.device, task.launcher) == (1, 2, "cpu", os.getpid())
    assert task.prefix == "multigpu/r/preflight/0"  # under the run's keys, apart from the launchers' beats


class SleepingSpawner(PopenSpawner):
    """The check as a process that waits for peers that never come."""

    def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
        argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        return super().spawn(WorkerSpec(rank=-1, local_rank=-1, argv=argv, env={}), env, ())


def test_a_node_lost_during_an_elastic_rounds_check_ends_the_round_not_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    polls: list[int] = []

    def lost(self: PeerBeats) -> None:  # the first beat (before the fork) passes, as it does
        polls.append(1)
        if len(polls) > 1:
            raise NodeLost("node 2 was lost during the check: its launcher stopped beating for 10.0s")

    monkeypatch.setattr(PeerBeats, "poll", lost)
    elastic = Preflight("on", dict(os.environ), record(tmp_path), every_round=True)
    assert elastic.check(elastic_meeting(0, min_nodes=1), SleepingSpawner()) is False  # meet again
    assert said(caplog) == [
        "preflight: node 2 was lost during the check: its launcher stopped beating for 10.0s; "
        "meeting again without it"
    ]
    static, polls[:] = Preflight("on", dict(os.environ), record(tmp_path)), []
    with pytest.raises(RendezvousError, match=r"^preflight: node 2 was lost during the check: "):
        static.check(meeting(), SleepingSpawner())


def test_by_default_nodes_on_one_machine_are_not_checked(tmp_path: Path) -> None:
    """They share the machine's processors: nothing to compare. ``--preflight on`` checks them anyway."""
    config = RunConfig(target="t", nproc=1, world_size=2, base_rank=1)
    shared = Meeting(0, config, "127.0.0.1", 1, Job(("same", "same")))  # type: ignore[arg-type]
    assert not Preflight("on", {}, record(tmp_path), auto=True).due(shared)
    assert Preflight("on", {}, record(tmp_path), auto=True).due(meeting())  # two machines
    assert Preflight("on", {}, record(tmp_path)).due(shared)  # asked for


def test_the_fingerprint_names_the_machine_and_no_difference_is_made_of_it() -> None:
    from multigpu.rendezvous.fingerprint import differences, fingerprint

    mine = fingerprint("t.py", (), "cpu")
    assert mine["machine"]
    other = {**mine, "machine": "another boot"}
    assert differences({0: mine, 1: other}) == ([], [])
