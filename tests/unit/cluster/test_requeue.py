"""The launcher's side of preemption: options, the requeue call, resume folders, the warning watch.

SLURM's environment is recorded from a batch job's ``srun`` step (variable names as in the sbatch and
srun manuals). The real ``scontrol requeue`` of a job and of an array task runs in the SLURM tier
(``tests/integration/multinode/test_slurm.py``); here a stand-in ``scontrol`` on PATH only plays a refusal.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from helpers import logged
from multigpu.cli.run_args import parse_run_args
from multigpu.cluster import requeue
from multigpu.contract.errors import UsageError
from multigpu.runner.preempt_watch import PreemptWatch

SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOBID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "1",
    "SLURM_NODELIST": "gpu07",
    "SLURM_JOB_NODELIST": "gpu07",
    "SLURM_SUBMIT_DIR": "/home/u/proj",
    "SLURM_CLUSTER_NAME": "c1",
    "SLURM_JOB_PARTITION": "gpu",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_NODELIST": "gpu07",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_TASKS_PER_NODE": "1",
}


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def test_defaults_under_slurm_and_elsewhere(script: str) -> None:
    config, _ = parse_run_args(["--cpu", "1", script], SLURM_ENV)
    assert config.preemption.signals == ("SIGUSR1", "SIGUSR2") and config.preemption.requeue
    assert config.output.run_id == "slurm-4242"  # the next allocation finds this run's folder by it
    batch_script_itself = {k: v for k, v in SLURM_ENV.items() if "STEP" not in k}  # no srun step
    assert parse_run_args([script], batch_script_itself)[0].output.run_id == "slurm-4242"
    assert parse_run_args(["--no-requeue", script], batch_script_itself)[0].output.run_id == "slurm-4242"
    config, _ = parse_run_args(["--cpu", "1", script], {})
    assert config.preemption.signals == () and not config.preemption.requeue


@pytest.mark.parametrize(
    ("argv", "signals", "requeue_on", "grace"),
    [
        (["--preempt-signal", "usr1"], ("SIGUSR1",), True, None),
        (["--preempt-signal", "none"], (), False, None),
        (["--no-requeue", "--preempt-grace", "30"], ("SIGUSR1", "SIGUSR2"), False, 30.0),
    ],
)
def test_options_under_slurm(
    script: str, argv: list[str], signals: tuple[str, ...], requeue_on: bool, grace: float | None
) -> None:
    config, _ = parse_run_args(["--cpu", "1", *argv, script], SLURM_ENV)
    chosen = config.preemption
    assert (chosen.signals, chosen.requeue, chosen.grace) == (signals, requeue_on, grace)


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [
        (["--requeue"], {}, "--requeue needs a SLURM batch job"),
        (["--requeue", "--no-requeue"], SLURM_ENV, "contradict"),
        (["--requeue", "--preempt-signal", "none"], SLURM_ENV, "needs a warning signal"),
        (["--preempt-signal", "TERM"], SLURM_ENV, "SIGTERM cannot be a warning"),
        (["--preempt-signal", "USR9"], SLURM_ENV, "'USR9' is not a signal name"),
        (["--preempt-grace", "30"], {}, "--preempt-grace needs a warning signal"),
        (["--preempt-grace", "-1"], SLURM_ENV, "more than 0"),
    ],
)
def test_usage_mistakes_are_one_line(script: str, argv: list[str], env: dict[str, str], words: str) -> None:
    with pytest.raises(UsageError, match=words) as caught:
        parse_run_args(["--cpu", "1", *argv, script], env)
    assert "\n" not in str(caught.value)


def test_environment_variables_set_the_options(script: str) -> None:
    config, _ = parse_run_args(
        ["--cpu", "1", script], {**SLURM_ENV, "MULTIGPU_NO_REQUEUE": "1", "MULTIGPU_PREEMPT_SIGNAL": "USR2"}
    )
    assert config.preemption.signals == ("SIGUSR2",) and not config.preemption.requeue
    assert not parse_run_args([script], {**SLURM_ENV, "MULTIGPU_REQUEUE": "0"})[0].preemption.requeue
    assert parse_run_args([script], {**SLURM_ENV, "MULTIGPU_REQUEUE": "1"})[0].preemption.requeue


def _stand_in_scontrol(tmp_path: Path, code: int = 0) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    tool.write_text(
        f'#!/bin/sh\necho "$@" >> "{tmp_path}/scontrol.log"\n'
        + (f'echo "scontrol: error: Job is not a batch job" >&2\nexit {code}\n' if code else "")
    )
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}


@pytest.mark.integration
def test_a_refused_requeue_says_why(tmp_path: Path) -> None:
    job, why = requeue.requeue_job({**SLURM_ENV, **_stand_in_scontrol(tmp_path, code=1)})
    assert job == "4242" and why == "scontrol exited with 1: scontrol: error: Job is not a batch job"
    assert requeue.requeue_job({**SLURM_ENV, "PATH": str(tmp_path)})[1].startswith("cannot run scontrol")
    assert requeue.requeue_job({}) == ("?", "SLURM_JOB_ID is not set")


def test_each_allocation_has_its_own_folder(tmp_path: Path) -> None:
    job_dir = tmp_path / "slurm-4242"
    assert requeue.allocation_dir(job_dir, SLURM_ENV) == job_dir
    second = requeue.allocation_dir(job_dir, {**SLURM_ENV, "SLURM_RESTART_COUNT": "1"})
    assert second == job_dir / "requeue_1"
    assert requeue.previous_output(second, 1) == job_dir
    third = job_dir / "requeue_3"
    assert requeue.previous_output(third, 3) == job_dir  # allocation 2 died before writing anything
    (job_dir / "requeue_2").mkdir(parents=True)
    assert requeue.previous_output(third, 3) == job_dir / "requeue_2"


def test_rank_env_is_always_replaced(tmp_path: Path, script: str) -> None:
    config, _ = parse_run_args(["--cpu", "1", script], SLURM_ENV)
    stale = {"MULTIGPU_PREVIOUS_OUTPUT": "/stale", "MULTIGPU_RESUMED": "9"}
    first = requeue.preemption_env(config, tmp_path, {**SLURM_ENV, **stale})
    assert first["MULTIGPU_RESUMED"] == "0" and "MULTIGPU_PREVIOUS_OUTPUT" not in first
    assert first["MULTIGPU_WARNING_SIGNALS"] == "SIGUSR1,SIGUSR2"
    later = requeue.preemption_env(config, tmp_path / "requeue_2", {**SLURM_ENV, "SLURM_RESTART_COUNT": "2"})
    assert later["MULTIGPU_RESUMED"] == "2" and later["MULTIGPU_PREVIOUS_OUTPUT"] == str(tmp_path)


class Target:
    """Stands in for the supervisor: records what the watch asks of it."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.stopped = threading.Event()
        self.forwarded = threading.Event()

    def request_signal(self, signum: int) -> None:
        self.signals.append(signum)
        self.forwarded.set()

    def request_stop(self) -> None:
        self.stopped.set()


class DictStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        if self.data.get(key, b"").decode() == expected:
            self.data[key] = value.encode()
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


class Job:
    def __init__(self, store: DictStore, node: int) -> None:
        self.store, self.node = store, node

    def key(self, *parts: object) -> str:
        return "/".join(["multigpu", "run", *map(str, parts)])


def _watch(**kwargs: Any) -> PreemptWatch:
    return PreemptWatch({signal.SIGUSR1, signal.SIGUSR2}, **kwargs)


def test_the_handler_records_and_forwards_and_the_grace_stops_the_ranks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch, target = _watch(grace=0.05), Target()
    try:
        with ExitStack() as stack:
            handler = watch.attach(stack, target)
            handler(signal.SIGHUP)  # not a warning: forwarded as ever, nothing noted
            assert not watch.warned and target.signals == [signal.SIGHUP]
            handler(signal.SIGUSR1)
            assert watch.warned and target.signals[-1] == signal.SIGUSR1
            assert target.stopped.wait(5), "the grace never stopped the ranks"
    finally:
        watch.close()
    notes = logged(caplog)
    assert notes[0].startswith("SIGUSR1: preemption warning;")
    assert "--preempt-grace" in notes[1]


def test_a_node_that_missed_the_signal_learns_it_from_the_store(caplog: pytest.LogCaptureFixture) -> None:
    store = DictStore()
    warned_node, other = _watch(job=Job(store, 0)), _watch(job=Job(store, 1), poll_s=0.01)
    target_a, target_b = Target(), Target()
    try:
        with ExitStack() as stack:
            handler = warned_node.attach(stack, target_a)
            other.attach(stack, target_b)
            handler(signal.SIGUSR2)
            assert target_b.forwarded.wait(5), "the other node never passed the warning on"
            deadline = time.monotonic() + 5
            while len(logged(caplog)) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        warned_node.close()
        other.close()
    assert target_b.signals == [signal.SIGUSR2] and other.source == "store"
    assert json.loads(store.data["multigpu/run/preempt"])["node"] == 0
    assert any("from another node, through the store" in n for n in logged(caplog))
