"""The launcher's side of ``--preflight`` (``runner/preflight.py``): the verdict every node reaches from
the same figures, its lines and record, and the check's process read, bounded and reaped (a plain
Python child stands in for the check; the real one is in unit/preflight and integration/multinode)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from helpers import assert_gone, record_problems
from multigpu.config.run import RendezvousConfig, RunConfig
from multigpu.contract.errors import PreflightRefused, PreflightWithdrew, RendezvousError
from multigpu.contract.exitcodes import EXIT_PREFLIGHT
from multigpu.record.run_json import RunRecord
from multigpu.runner import preflight
from multigpu.runner.membership import Meeting
from multigpu.runner.preflight import (
    Figures,
    NodeLost,
    PeerBeats,
    Preflight,
    check_env,
    collect,
    end,
    parse_result,
    record_entry,
    slow_nodes,
    verdict_lines,
)
from multigpu.supervisor.spawning import PopenSpawner
from multigpu.supervisor.states import ProcessHandle, WorkerSpec

pytestmark = pytest.mark.timeout(60)

HEALTHY = [Figures(14.2, 2.1), Figures(13.0, 2.0), Figures(15.1, 2.2)]


def test_a_node_whose_matmul_is_under_half_the_others_median_is_slow() -> None:
    assert slow_nodes(HEALTHY) == []
    assert slow_nodes([*HEALTHY, Figures(0.9, 2.1)]) == [3]
    # all_reduce names no node: the healthy node waits longest for a throttled one, so it sees the
    # lowest figure (as measured here: 0.139 GB/s on the healthy node, 1.16 on the throttled one)
    assert slow_nodes([Figures(145.0, 0.139), Figures(14.4, 1.16)]) == [1]
    assert slow_nodes([Figures(14.0, 0.3), *HEALTHY]) == []
    assert slow_nodes([Figures(14.0, 2.0), Figures(7.1, 2.0)]) == []  # just above half: noise, not slow
    assert slow_nodes([Figures(14.0, 2.0)]) == []  # one node: nobody to compare with


def test_the_slow_node_is_named_with_its_figures_beside_the_others() -> None:
    figures = [Figures(14.2, 2.1), Figures(0.9, 0.3), Figures(14.2, 2.1)]
    lines, refusal = verdict_lines(figures, 1.2, "on")
    assert lines == [
        "preflight: node 1 is slow: matmul 0.9 GFLOP/s (others 14.2); all_reduce 0.3 GB/s between the nodes; "
        "running anyway (--preflight=strict refuses)"
    ]
    assert refusal is None
    lines, refusal = verdict_lines(figures, 1.2, "strict")
    assert lines == [] and refusal is not None
    assert refusal.startswith("node 1 is slow: matmul 0.9") and refusal.endswith("(--preflight=strict)")


def test_a_healthy_check_is_one_line_with_its_figures_and_time() -> None:
    lines, refusal = verdict_lines(HEALTHY, 1.23, "strict")
    assert refusal is None
    assert lines == [
        "preflight: every node healthy (3 nodes, 1.2s): matmul 14.2 GFLOP/s, all_reduce 2.1 GB/s (medians)"
    ]


def test_the_record_holds_every_node_and_the_verdict() -> None:
    entry = record_entry([Figures(14.0, 2.0), Figures(1.0, 2.0)], 0.8, "strict")
    assert entry["verdict"] == "refused" and entry["slow_nodes"] == [1]
    assert entry["nodes"]["1"] == {"matmul_gflops": 1.0, "all_reduce_gbps": 2.0}
    assert record_entry(HEALTHY, 0.8, "on")["verdict"] == "healthy"
    assert record_entry([Figures(14.0, 2.0), Figures(1.0, 2.0)], 0.8, "on")["verdict"] == "slow"


def test_the_checks_result_is_its_last_stdout_line() -> None:
    out = b"noise\n" + json.dumps({"figures": [[1.0, 2.0], [3.0, 4.0]], "seconds": 0.5}).encode() + b"\n"
    assert parse_result(out) == ([Figures(1.0, 2.0), Figures(3.0, 4.0)], 0.5)


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


def child(code: str) -> ProcessHandle:
    argv = [sys.executable, "-c", code]
    return PopenSpawner().spawn(WorkerSpec(rank=-1, local_rank=-1, argv=argv, env={}), dict(os.environ), ())


def test_both_pipes_are_read_to_their_end_and_the_process_reaped() -> None:
    handle = child("import sys; sys.stderr.write('e' * 200000); print('done')")
    out, err = collect(handle, time.monotonic() + 30)
    end(handle)
    assert out == b"done\n" and len(err) == 200000 and handle.returncode == 0


def test_a_check_past_its_deadline_is_killed_with_its_group() -> None:
    handle = child(
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)"
    )
    with pytest.raises(TimeoutError):
        collect(handle, time.monotonic() + 1.0)
    pids = [p.pid for p in __import__("psutil").Process(handle.pid).children(recursive=True)]
    end(handle)
    assert handle.returncode is not None
    assert_gone([handle.pid, *pids])


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
        result = json.dumps({"figures": [[14.0, 2.0], [1.0, 2.0]], "seconds": 0.5})
        argv = [sys.executable, "-c", f"print({result!r})"]
        return super().spawn(WorkerSpec(rank=-1, local_rank=-1, argv=argv, env={}), env, ())


class MemoryStore:
    """The three store calls the launcher's beats make, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [str(self.values[key]).encode() for key in keys]


class Job:
    def __init__(self, machines: tuple[str, ...] = ("a", "b")) -> None:
        self.store = MemoryStore()
        self.machines = machines

    def fingerprints(self) -> dict[int, dict[str, str]]:
        return {node: {"machine": m} for node, m in enumerate(self.machines)}

    def key(self, *parts: object) -> str:
        return "/".join(["multigpu", "r", *map(str, parts)])


def test_a_node_whose_launcher_stops_beating_is_named_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(preflight.time, "monotonic", lambda: now[0])
    job = Job()
    beats = PeerBeats(job, 0, 2, me=0)  # type: ignore[arg-type]
    other = PeerBeats(job, 0, 2, me=1)  # type: ignore[arg-type]
    beats.poll()  # node 1 has not begun: nothing judged
    for _ in range(4):
        now[0] += preflight.BEAT_S
        other.poll()
        beats.poll()
    now[0] += preflight.LOST_AFTER_S - preflight.BEAT_S  # node 1 stops beating: still within bounds
    beats.poll()
    with pytest.raises(NodeLost) as info:
        now[0] += 2 * preflight.BEAT_S
        beats.poll()
    assert str(info.value).startswith("node 1 was lost during the check: its launcher stopped beating for")


def test_a_node_that_never_begins_the_check_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(preflight.time, "monotonic", lambda: now[0])
    beats = PeerBeats(Job(), 0, 3, me=1)  # type: ignore[arg-type]
    beats.poll()
    now[0] += preflight.START_S + 1
    with pytest.raises(NodeLost, match=r"^node 0 never began the check within 30s$"):
        beats.poll()


def meeting() -> Meeting:
    config = RunConfig(target="t", nproc=1, world_size=2, base_rank=1)
    return Meeting(0, config, "127.0.0.1", 1, Job())  # type: ignore[arg-type]


def record(tmp_path: Path) -> RunRecord:
    return RunRecord(tmp_path / "run.json", RunConfig(target="t"), "r", ["cpu"], command=["multigpu"])


def test_a_failed_check_is_one_line_naming_the_node_and_is_recorded(tmp_path: Path) -> None:
    said: list[str] = []
    check = Preflight("on", dict(os.environ), record(tmp_path), said.append)
    assert check.due(meeting())
    with pytest.raises(RendezvousError) as info:
        check.check(meeting(), FailingSpawner())
    assert str(info.value).startswith(
        "preflight: the check failed on node 1: RuntimeError: [gloo] timed out; no rank was started"
    )
    assert not check.due(meeting())  # once per job
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["preflight"]["verdict"] == "failed" and said == []
    assert record_problems(tmp_path) == []


def test_strict_refuses_with_its_own_exit_code_and_on_warns(tmp_path: Path) -> None:
    said: list[str] = []
    with pytest.raises(PreflightRefused) as info:
        Preflight("strict", dict(os.environ), record(tmp_path), said.append).check(meeting(), FixedSpawner())
    assert info.value.launcher_exit == EXIT_PREFLIGHT and said == []
    Preflight("on", dict(os.environ), record(tmp_path), said.append).check(meeting(), FixedSpawner())
    assert len(said) == 1 and said[0].startswith("preflight: node 1 is slow: matmul 1 GFLOP/s (others 14)")
    assert json.loads((tmp_path / "run.json").read_text())["preflight"]["slow_nodes"] == [1]
    assert record_problems(tmp_path) == []


def test_off_or_one_node_is_never_checked(tmp_path: Path) -> None:
    assert not Preflight("off", {}, record(tmp_path), print).due(meeting())
    alone = Meeting(0, RunConfig(target="t"), "127.0.0.1", 1, None)
    assert not Preflight("on", {}, record(tmp_path), print).due(alone)
    assert preflight.SLOW_BELOW == 0.5


def elastic_meeting(node: int, min_nodes: int, store_host: int | None = 0) -> Meeting:
    rdzv = RendezvousConfig(min_nodes=min_nodes, max_nodes=3)
    config = RunConfig(target="t", nproc=1, world_size=3, base_rank=node, node_rank=node, nnodes=3, rdzv=rdzv)
    job = Job()
    job.store_host = store_host  # type: ignore[attr-defined]
    return Meeting(0, config, "127.0.0.1", 1, job)  # type: ignore[arg-type]


def test_a_slow_node_withdraws_from_an_elastic_round_only_where_enough_nodes_are_left(
    tmp_path: Path,
) -> None:
    elastic = Preflight("on", {}, record(tmp_path), print, every_round=True)
    assert elastic.withdrawing(elastic_meeting(0, min_nodes=2), [2]) == [2]
    assert elastic.withdrawing(elastic_meeting(0, min_nodes=3), [2]) == []  # too few without it
    assert elastic.withdrawing(elastic_meeting(0, min_nodes=1, store_host=2), [2]) == []  # its store
    assert elastic.withdrawing(elastic_meeting(0, min_nodes=1, store_host=None), [1, 2]) == [1, 2]
    static = Preflight("on", {}, record(tmp_path), print)
    assert static.withdrawing(elastic_meeting(0, min_nodes=2), [2]) == []


class ThreeNodesSpawner(PopenSpawner):
    """The check as a process that prints fixed figures: node 2 slow of 3."""

    def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
        result = json.dumps({"figures": [[14.0, 2.0], [13.0, 2.0], [1.0, 2.0]], "seconds": 0.5})
        argv = [sys.executable, "-c", f"print({result!r})"]
        return super().spawn(WorkerSpec(rank=-1, local_rank=-1, argv=argv, env={}), env, ())


def test_the_slow_node_leaves_and_the_others_meet_again(tmp_path: Path) -> None:
    said: list[str] = []
    check = Preflight("strict", dict(os.environ), record(tmp_path), said.append, every_round=True)
    assert check.check(elastic_meeting(0, min_nodes=2), ThreeNodesSpawner()) is False
    assert said == [
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
    from multigpu.preflight.check import Task

    Preflight("on", dict(os.environ), record(tmp_path), print).check(meeting(), TaskSpawner())
    assert TaskSpawner.argv[:3] == [sys.executable, "-m", "multigpu.preflight"]
    task = Task.from_argv(TaskSpawner.argv[3])
    assert (task.node, task.nodes, task.device, task.launcher) == (1, 2, "cpu", os.getpid())
    assert task.prefix == "multigpu/r/preflight/0"  # under the run's keys, apart from the launchers' beats


class SleepingSpawner(PopenSpawner):
    """The check as a process that waits for peers that never come."""

    def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
        argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        return super().spawn(WorkerSpec(rank=-1, local_rank=-1, argv=argv, env={}), env, ())


def test_a_node_lost_during_an_elastic_rounds_check_ends_the_round_not_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    polls: list[int] = []

    def lost(self: PeerBeats) -> None:  # the first beat (before the fork) passes, as it does
        polls.append(1)
        if len(polls) > 1:
            raise NodeLost("node 2 was lost during the check: its launcher stopped beating for 10.0s")

    monkeypatch.setattr(PeerBeats, "poll", lost)
    said: list[str] = []
    elastic = Preflight("on", dict(os.environ), record(tmp_path), said.append, every_round=True)
    assert elastic.check(elastic_meeting(0, min_nodes=1), SleepingSpawner()) is False  # meet again
    assert said == [
        "preflight: node 2 was lost during the check: its launcher stopped beating for 10.0s; "
        "meeting again without it"
    ]
    static, polls[:] = Preflight("on", dict(os.environ), record(tmp_path), said.append), []
    with pytest.raises(RendezvousError, match=r"^preflight: node 2 was lost during the check: "):
        static.check(meeting(), SleepingSpawner())


def test_by_default_nodes_on_one_machine_are_not_checked(tmp_path: Path) -> None:
    """They share the machine's processors: nothing to compare. ``--preflight on`` checks them anyway."""
    config = RunConfig(target="t", nproc=1, world_size=2, base_rank=1)
    shared = Meeting(0, config, "127.0.0.1", 1, Job(("same", "same")))  # type: ignore[arg-type]
    assert not Preflight("on", {}, record(tmp_path), print, auto=True).due(shared)
    assert Preflight("on", {}, record(tmp_path), print, auto=True).due(meeting())  # two machines
    assert Preflight("on", {}, record(tmp_path), print).due(shared)  # asked for


def test_the_fingerprint_names_the_machine_and_no_difference_is_made_of_it() -> None:
    from multigpu.rendezvous.fingerprint import differences, fingerprint

    mine = fingerprint("t.py", (), "cpu")
    assert mine["machine"]
    other = {**mine, "machine": "another boot"}
    assert differences({0: mine, 1: other}) == ([], [])
