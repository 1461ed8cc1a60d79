"""The SLURM tier: every SLURM path run for real against one slurmctld and two slurmd on loopback.

Why: the layout from ``SLURM_*``, preemption signals, ``scontrol requeue`` and lost nodes were tested
only against recorded environments and a stand-in ``scontrol``. Here ``srun``, ``sbatch``,
``scancel`` and ``scontrol`` are SLURM's own. The cluster (``slurm_cluster.py``) is started once per
test run: every test here is in the xdist group "slurm" (``--dist loadgroup``), so one worker runs
them in turn against the one cluster. Each test waits for SLURM's job states (bounded), never sleeps
for order, and proves that nothing it started is left under either slurmd. Runs in the pytest
process; the jobs run under the slurmd children it started.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from helpers import alive, clean_env, free_port, tier_cannot_run, write_script
from multigpu.contract.exitcodes import EXIT_PREEMPTED
from slurm_cluster import SlurmCluster, ensure_hosts, missing

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.xdist_group("slurm"),
]

REPO = Path(__file__).resolve().parents[3]
SBATCH = REPO / "docs" / "examples" / "multigpu.sbatch"
BIN = Path(sys.executable).parent
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")
TORCH_NOISE = ("Failed to initialize NumPy", "Traceback", "Exception raised from", "Utils.hpp")


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """The test run's one cluster: started at the first SLURM test, stopped (by PID) at the end."""
    why = missing()
    if why:
        tier_cannot_run(why)
    note = ensure_hosts()
    if note:
        warnings.warn(note, stacklevel=1)  # one line in the run's summary
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        killed = cluster.end_jobs() if cluster.procs else []
        pids = [p.pid for p in cluster.procs.values()]
        left = cluster.stop()
        cluster.cleanup()
        assert not killed, f"job processes outlived their tests and were killed: {killed}"
        assert not left and not [p for p in pids if alive(p)], f"SLURM daemons still alive: {left}"


def job_env(cluster: SlurmCluster, **extra: str) -> dict[str, str]:
    """What a job is submitted with (``--export=ALL``): the venv first on PATH, a port of its own."""
    return {
        **clean_env(),
        "SLURM_CONF": cluster.env["SLURM_CONF"],
        "MASTER_PORT": str(free_port()),
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
        **extra,
    }


def job_field(cluster: SlurmCluster, job: str, field: str) -> str:
    out = cluster.run(["scontrol", "show", "job", job], check=False).stdout
    found = re.search(rf"\b{field}=(\S*)", out)
    return found.group(1) if found else ""


def wait_job(cluster: SlurmCluster, job: str, states: tuple[str, ...] = DONE, timeout: float = 60) -> str:
    """Wait (bounded) until the job's state is one of ``states``; the state."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = job_field(cluster, job, "JobState")
        if state in states:
            return state
        time.sleep(0.1)
    raise AssertionError(f"job {job} still {state!r} after {timeout}s\n{cluster.logs()}")


def wait_file(path: Path, pattern: str, timeout: float = 60, count: int = 1) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if len(re.findall(pattern, text, re.M)) >= count:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{path} never showed {pattern!r} {count} time(s)")


def assert_nothing_left(cluster: SlurmCluster, timeout: float = 15) -> None:
    """Nothing runs under either slurmd any more: no step, no launcher, no rank (bounded wait)."""
    deadline = time.monotonic() + timeout
    left = cluster.job_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = cluster.job_processes()
    assert not left, f"left under slurmd: {[(p.pid, p.name()) for p in left]}"


TRAIN = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank={dist.get_rank()} world={dist.get_world_size()} group={os.environ['GROUP_RANK']} "
      f"node={os.environ['SLURM_NODEID']} out={os.environ['MULTIGPU_OUTPUT_DIR']} sum={t.item():.0f}",
      flush=True)
dist.destroy_process_group()
"""


def test_srun_two_nodes(slurm: SlurmCluster, tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", TRAIN)
    done = slurm.run(
        ["srun", "-N2", "--ntasks-per-node=1", "multigpu", "run", "--cpu", "1", str(script)],
        check=False,
        timeout=90,
        env=job_env(slurm),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    job = re.search(r"run slurm-(\d+)", done.stderr)
    assert job, done.stderr
    out = tmp_path / "multigpu_runs" / f"slurm-{job.group(1)}"
    lines = sorted(re.findall(r"rank=.*", done.stdout))
    assert lines == [f"rank={r} world=2 group={r} node={r} out={out} sum=2" for r in (0, 1)]
    screen = done.stdout + done.stderr
    assert not [noise for noise in TORCH_NOISE if noise in screen], screen
    assert_nothing_left(slurm)


def test_documented_sbatch_script(slurm: SlurmCluster, tmp_path: Path) -> None:
    """docs/examples/multigpu.sbatch as users read it; only what this cluster lacks is overridden on
    sbatch's command line (no GPUs, 2 CPUs a node), and the paths it names are linked into place."""
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "examples").symlink_to(REPO / "examples")
    done = slurm.run(
        ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", str(SBATCH)],
        env=job_env(slurm),
        cwd=tmp_path,
    )
    job = done.stdout.strip()
    assert wait_job(slurm, job) == "COMPLETED", (tmp_path / f"ddp-{job}.out").read_text()
    screen = (tmp_path / f"ddp-{job}.out").read_text()
    out = tmp_path / "runs" / job
    assert screen.count(f"run slurm-{job}: 1 CPU worker(s), rendezvous n1:") == 2, screen
    assert screen.count(f"output in {out}") == 2
    assert "[node 0 rank 0] done: 2 rank(s), backend gloo" in screen
    assert not [noise for noise in TORCH_NOISE if noise in screen], screen
    logs = sorted(p.name for p in (out / "logs" / "attempt_0").glob("rank_*.log"))
    assert logs == ["rank_0.log", "rank_1.log"]
    assert_nothing_left(slurm)


PREEMPTIBLE = """
import os, time
import torch, torch.distributed as dist
import multigpu

dist.init_process_group("gloo")
rank = dist.get_rank()
previous = os.environ.get("MULTIGPU_PREVIOUS_OUTPUT")
resumed = int(os.environ["MULTIGPU_RESUMED"])
start = int(open(os.path.join(previous, f"ckpt_{rank}.txt")).read()) if previous else 0
print(f"rank={rank} restarts={os.environ.get('SLURM_RESTART_COUNT', '0')} resumed={resumed} start={start} "
      f"previous={previous}", flush=True)
t = torch.ones(1)
step = start
while step < (start + 3 if resumed else 10**9):
    if multigpu.should_stop(step):
        print(f"rank={rank} stopped at step={step}", flush=True)
        break
    dist.all_reduce(t)
    if step == start + 3 and rank == 0:
        print("ready", flush=True)
    step += 1
    time.sleep(0.01 * (rank + 1))  # the ranks drift apart: they hear the warning at different steps
with open(os.path.join(os.environ["MULTIGPU_OUTPUT_DIR"], f"ckpt_{rank}.txt"), "w") as f:
    f.write(str(step))
print(f"rank={rank} saved step={step}", flush=True)
dist.destroy_process_group()
"""

REQUEUE_SBATCH = """#!/bin/bash
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --signal=USR1@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=job-%j.out
job=${{SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}}${{SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}}
srun --ntasks-per-node=1 multigpu run --cpu 1 --output runs/$job train.py
"""


def release(cluster: SlurmCluster, job: str) -> None:
    """Start a requeued job now instead of at the begin time SLURM gives it (about 2 minutes on).

    Only once the old allocation has ended on both nodes and the clock has passed the second of the
    requeue: slurmd revokes the old allocation's credential with a time in whole seconds, and an
    allocation whose credential is dated the same second is killed as "Job credential revoked"."""
    assert wait_job(cluster, job, ("PENDING",)) == "PENDING"
    assert job_field(cluster, job, "Reason") == "BeginTime"
    requeued = int(time.time())
    cluster.wait_idle()
    while int(time.time()) <= requeued:
        time.sleep(0.05)
    cluster.run(["scontrol", "update", f"jobid={job}", "StartTime=now"])


def preempt_and_resume(cluster: SlurmCluster, tmp_path: Path, job: str, out: Path) -> tuple[str, str]:
    """Warn the running job the way ``--signal=USR1@N`` does (every step), release its requeued copy,
    wait for it to finish; (``scontrol show job`` after the requeue, the job's output)."""
    wait_file(out, r"^\[(node 0 )?rank 0\] ready$")
    cluster.run(["scancel", "--signal=USR1", job])
    release(cluster, job)
    shown = cluster.run(["scontrol", "show", "job", job]).stdout
    assert wait_job(cluster, job) == "COMPLETED", out.read_text() + cluster.logs()
    return shown, out.read_text()


def test_preemption_requeue_cycle(slurm: SlurmCluster, tmp_path: Path) -> None:
    write_script(tmp_path, "train.py", PREEMPTIBLE)
    batch = write_script(tmp_path, "job.sbatch", REQUEUE_SBATCH.format(nodes=2))
    job = slurm.run(["sbatch", "--parsable", str(batch)], env=job_env(slurm), cwd=tmp_path).stdout.strip()
    shown, screen = preempt_and_resume(slurm, tmp_path, job, tmp_path / f"job-{job}.out")
    assert "Restarts=1" in shown and "Requeue=1" in shown
    assert job_field(slurm, job, "Restarts") == "1" and job_field(slurm, job, "ExitCode") == "0:0"
    stops = re.findall(r"rank=(\d) stopped at step=(\d+)", screen)
    assert sorted(r for r, _ in stops) == ["0", "1"] and len({s for _, s in stops}) == 1, screen
    step = stops[0][1]
    assert screen.count("multigpu: SIGUSR1: preemption warning;") == 2, screen
    # "requeued job J" comes after scontrol returns: SLURM may end the allocation before it is printed
    assert f"multigpu: preempted: the ranks stopped after SIGUSR1; requeueing SLURM job {job}" in screen
    first = tmp_path / "runs" / job
    for rank in (0, 1):
        assert f"rank={rank} restarts=1 resumed=1 start={step} previous={first}" in screen, screen
        assert f"rank={rank} saved step={int(step) + 3}" in screen
        assert (first / "requeue_1" / f"ckpt_{rank}.txt").read_text() == str(int(step) + 3)
        record = json.loads((first / f"run_node{rank}.json").read_text())
        assert record["status"] == "preempted" and record["exit_code"] == EXIT_PREEMPTED
        assert record["preemption"]["signal"] == "SIGUSR1"
        assert json.loads((first / "requeue_1" / f"run_node{rank}.json").read_text())["resumed"] == 1
    assert not [noise for noise in TORCH_NOISE if noise in screen], screen
    assert_nothing_left(slurm)


def test_preemption_requeue_array_task(slurm: SlurmCluster, tmp_path: Path) -> None:
    """An array task is requeued by its own id (``<array job>_<task>``), not the whole array."""
    write_script(tmp_path, "train.py", PREEMPTIBLE)
    batch = write_script(
        tmp_path,
        "job.sbatch",
        REQUEUE_SBATCH.format(nodes=1).replace("--output=job-%j.out", "--output=job-%A_%a.out"),
    )
    array = slurm.run(
        ["sbatch", "--parsable", "--array=3", str(batch)], env=job_env(slurm), cwd=tmp_path
    ).stdout.strip()
    task = f"{array}_3"
    shown, screen = preempt_and_resume(slurm, tmp_path, task, tmp_path / f"job-{task}.out")
    assert "Restarts=1" in shown and f"ArrayJobId={array} ArrayTaskId=3" in shown
    assert f"multigpu: preempted: the ranks stopped after SIGUSR1; requeueing SLURM job {task}" in screen
    assert "rank=0 restarts=1 resumed=1" in screen and (tmp_path / "runs" / task / "requeue_1").is_dir()
    assert_nothing_left(slurm)


LOOP = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
print(f"pid={os.getpid()} ppid={os.getppid()}", flush=True)
t = torch.ones(1)
step = 0
while True:
    dist.all_reduce(t)
    step += 1
    if step == 40 and dist.get_rank() == 0:  # about a second in: every launcher has beaten
        print("ready", flush=True)
    time.sleep(0.02)
"""


def start_step(
    cluster: SlurmCluster,
    tmp_path: Path,
    *options: str,
) -> tuple[subprocess.Popen[str], Path, str]:
    """``srun -N2 ... multigpu run --cpu 1 OPTIONS loop.py`` in the background, its console in a file;
    returns once rank 0 has trained a few steps: (srun, the console file, the job id)."""
    script = write_script(tmp_path, "loop.py", LOOP)
    console = tmp_path / "console.out"
    with open(console, "w") as out:
        srun = subprocess.Popen(
            [
                "srun",
                "-N2",
                "--ntasks-per-node=1",
                "multigpu",
                "run",
                "--cpu",
                "1",
                "--output",
                str(tmp_path / "run"),
                *options,
                str(script),
            ],
            env=job_env(cluster),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    text = wait_file(console, r"^\[node 0 rank 0\] ready$")
    job = re.search(r"run slurm-(\d+)", text)
    assert job, text
    return srun, console, job.group(1)


def test_scancel_stops_both_nodes_cleanly(slurm: SlurmCluster, tmp_path: Path) -> None:
    """scancel (as a time limit does): SIGTERM to every process of the step on both nodes, SIGKILL
    after KillWait. Each launcher stops its ranks within its grace (set below KillWait), both records
    say "interrupted", the console shows no traceback, and nothing is left on either node."""
    srun, console, job = start_step(slurm, tmp_path, "--grace-period", "1")
    slurm.run(["scancel", job])
    srun.wait(timeout=30)
    screen = console.read_text()
    assert screen.count("multigpu: attempt 0 interrupted by SIGTERM") == 2, screen
    assert "root cause" not in screen and "failed" not in screen, screen
    assert not [noise for noise in TORCH_NOISE if noise in screen], screen
    for node in (0, 1):
        record = json.loads((tmp_path / "run" / f"run_node{node}.json").read_text())
        assert record["status"] == "interrupted", record
    pids = [int(p) for p in re.findall(r"\b(?:pid|ppid)=(\d+)", screen)]  # the ranks and their launchers
    assert len(pids) == 4 and not [p for p in pids if alive(p)]
    assert_nothing_left(slurm)


def test_a_lost_node_is_named_by_the_survivor(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Node 1's launcher SIGKILLed mid-run: its ranks go with it (their guard), node 0's rank sees gloo's
    "Connection closed by peer", and node 0's root cause is the lost node, in plain words, found by
    fate sharing; nothing is left on either node."""
    srun, console, _ = start_step(slurm, tmp_path, "--grace-period", "1")
    launchers = {
        int(n): int(ppid)
        for n, ppid in re.findall(r"^\[node (\d) rank \d\] pid=\d+ ppid=(\d+)$", console.read_text(), re.M)
    }
    assert "multigpu" in " ".join(psutil.Process(launchers[1]).cmdline())
    os.kill(launchers[1], signal.SIGKILL)
    srun.wait(timeout=30)
    screen = console.read_text()
    root = re.search(r"^root cause: (.*)$", screen, re.M)
    assert root and root.group(1).startswith(
        f"node 1 was lost: its launcher (host {socket.gethostname()}, "
        f"pid {launchers[1]}) stopped beating for "
    ), screen
    assert "by peer" not in root.group(1) and "rank -1" not in screen, screen
    assert "Failed to initialize NumPy" not in screen and "Exception raised from" not in screen, screen
    record = json.loads((tmp_path / "run" / "run_node0.json").read_text())
    assert record["status"] == "failed", record
    pids = [int(p) for p in re.findall(r"\b(?:pid|ppid)=(\d+)", screen)]
    assert len(pids) == 4 and not [p for p in pids if alive(p)]
    assert_nothing_left(slurm)


@pytest.mark.parametrize("ci", ["", "true"])
def test_the_tier_says_in_one_line_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    """Where slurm-wlm and munge are not installed: locally the tier skips saying why; under CI=true
    the same line fails it."""
    import slurm_cluster

    monkeypatch.setattr(slurm_cluster, "SBIN", ())
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CI", ci)
    why = missing()
    assert why == "SLURM tier: munged is not installed (apt-get install slurm-wlm munge)"
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match=re.escape(why)):
        tier_cannot_run(why)
