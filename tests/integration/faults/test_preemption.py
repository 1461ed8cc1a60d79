"""Preemption and crash loops with real launches of 2 CPU workers.

The requeue cycle itself runs against a real SLURM (``multinode/test_slurm.py``). What a real cluster does not
show runs here under a recorded SLURM environment with a stand-in ``scontrol`` on PATH: a node whose
launcher missed the warning, ranks that ignore it, crash loops. Every test proves by PID that nothing
is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import time
from pathlib import Path

import pytest

from helpers import assert_gone, free_port, node_args, pids_in, run_cli, start_cli, write_script
from multigpu.contract.exitcodes import EXIT_CRASH_LOOP, EXIT_PREEMPTED

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(150)]

SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "1",
    "SLURM_JOB_NODELIST": "gpu07",
    "SLURM_STEP_ID": "0",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_NODELIST": "gpu07",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "1",
}

TRAIN = """
import os, time
import torch, torch.distributed as dist
import multigpu

dist.init_process_group("gloo")
rank = dist.get_rank()
previous = os.environ.get("MULTIGPU_PREVIOUS_OUTPUT")
resumed = int(os.environ["MULTIGPU_RESUMED"])
start = int(open(os.path.join(previous, f"ckpt_{rank}.txt")).read()) if previous else 0
print(f"pid={os.getpid()} resumed={resumed} start={start} previous={previous}", flush=True)
t = torch.ones(1)
step = start
while step < (start + 3 if resumed else 10**9):
    if multigpu.should_stop(step):
        print(f"stop step={step} preempted={multigpu.preempted()}", flush=True)
        break
    dist.all_reduce(t)
    if step == start + 3 and rank == 0:
        print("ready", flush=True)
    step += 1
    time.sleep(0.01 * (rank + 1))  # ranks drift apart: they hear the warning at different steps
with open(os.path.join(os.environ["MULTIGPU_OUTPUT_DIR"], f"ckpt_{rank}.txt"), "w") as f:
    f.write(str(step))
dist.destroy_process_group()
"""


def _slurm(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    tool.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/scontrol.log"\n')
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return {**SLURM_ENV, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}


CRASH = """
import os
attempt = int(os.environ["MULTIGPU_ATTEMPT"])
print(f"pid={os.getpid()}", flush=True)
if os.environ["RANK"] == "1":
    if os.environ.get("CHANGE") and attempt % 2:
        raise KeyError("another failure")
    raise ValueError(f"the same failure (attempt {attempt})")
"""


@pytest.mark.parametrize(
    ("change", "restarts", "attempts", "code"), [("", 3, 2, EXIT_CRASH_LOOP), ("1", 2, 3, 1)]
)
def test_crash_loop(tmp_path: Path, change: str, restarts: int, attempts: int, code: int) -> None:
    """The same failure twice stops with restarts left; a changing one uses them all."""
    script = write_script(tmp_path, "crash.py", CRASH)
    out_dir = tmp_path / "out"
    done = run_cli(
        [
            "run",
            "--cpu",
            "2",
            "--max-restarts",
            str(restarts),
            "--grace-period",
            "0.5",
            "--output",
            str(out_dir),
            str(script),
        ],
        tmp_path,
        env={"CHANGE": change},
    )
    assert done.returncode == code, done.stderr
    record = json.loads((out_dir / "run.json").read_text())
    assert len(record["attempts"]) == attempts
    loop = [line for line in done.stderr.splitlines() if "crash loop" in line]
    if change:
        assert not loop and "crash_loop" not in record
    else:
        assert loop == [
            f"multigpu: crash loop: rank 1 failed with ValueError at {script}:8 on two "
            f"attempts in a row; not restarting (exit {EXIT_CRASH_LOOP}: do not requeue "
            "until the cause is fixed)"
        ]
    assert_gone(pids_in(done.stdout))


def test_a_node_that_missed_the_warning_learns_it_from_the_store(tmp_path: Path) -> None:
    """Two launchers of one job on 127.0.0.1; only node 1's gets SIGUSR1. Node 0 learns it from the
    job's store, both ranks stop at the same step, and node 0 requeues the job once both are done."""
    script = write_script(tmp_path, "train.py", TRAIN)
    env = _slurm(tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        start_cli(
            [
                "run",
                "--cpu",
                "1",
                *node_args(i, endpoint=endpoint),
                "--grace-period",
                "2",
                str(script),
            ],
            tmp_path,
            env,
        )
        for i in (0, 1)
    ]
    first = nodes[0].stdout
    assert first is not None
    lines = []
    for line in first:
        lines.append(line)
        if "] ready" in line:
            break
    nodes[1].send_signal(signal.SIGUSR1)
    (out0, err0), (out1, err1) = (node.communicate(timeout=90) for node in nodes)
    out = "".join(lines) + out0 + out1
    assert [node.returncode for node in nodes] == [EXIT_PREEMPTED, EXIT_PREEMPTED], err0 + err1
    assert "preemption warning (from another node, through the store)" in err0
    assert "node 0 requeues the job" in err1 and "requeued job 4242" in err0
    stops = re.findall(r"stop step=(\d+) preempted=True", out)
    assert len(stops) == 2 and stops[0] == stops[1], out
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert_gone(pids_in(out))


def test_an_elastic_job_hears_the_warning_on_every_node_and_its_store_host_requeues(tmp_path: Path) -> None:
    """The elastic job runs the static job's attempts loop: the warning reaches the launcher that did
    not get it through the store, both stop at the same step, and the store's host requeues."""
    script = write_script(tmp_path, "train.py", TRAIN)
    env = _slurm(tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for name in "ab":  # a serves the store (it binds the endpoint first), b joins
        nodes.append(
            start_cli(
                [
                    "run",
                    "--cpu",
                    "1",
                    *node_args(None, "1:2", endpoint=endpoint),
                    "--rdzv-conf",
                    "last_call_timeout=30",
                    "--grace-period",
                    "2",
                    "--output",
                    str(tmp_path / name),
                    str(script),
                ],
                tmp_path,
                env,
            )
        )
        if name == "a":
            _wait_served(endpoint)
    try:
        logs = [tmp_path / name / "logs" / "attempt_0" / "rank_0.log" for name in "ab"]
        deadline = time.monotonic() + 90
        while not any(log.exists() and "ready" in log.read_text() for log in logs):
            assert time.monotonic() < deadline, "the two-node round never trained"
            time.sleep(0.1)
        nodes[1].send_signal(signal.SIGUSR1)
        (out0, err0), (out1, err1) = (node.communicate(timeout=90) for node in nodes)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    assert [node.returncode for node in nodes] == [EXIT_PREEMPTED, EXIT_PREEMPTED], err0 + err1
    assert "preemption warning (from another node, through the store)" in err0
    assert "the store's host requeues the job" in err1 and "requeued job 4242" in err0
    stops = re.findall(r"stop step=(\d+) preempted=True", out0 + out1)
    assert len(stops) == 2 and stops[0] == stops[1], out0 + out1
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    for name in "ab":
        [path] = (tmp_path / name).glob("run_*.json")
        assert json.loads(path.read_text())["status"] == "preempted"
    assert_gone([*pids_in(out0 + out1), *(node.pid for node in nodes)])


def _wait_served(endpoint: str, timeout: float = 60) -> None:
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing served {endpoint} within {timeout}s")


UNAWARE = """
import os, time
print(f"pid={os.getpid()}", flush=True)
print("ready", flush=True)
while True:  # knows nothing of preemption: SIGUSR1 must not kill it, the grace must end it
    time.sleep(0.05)
"""


def test_ranks_that_ignore_the_warning_are_stopped_after_the_grace(tmp_path: Path) -> None:
    script = write_script(tmp_path, "unaware.py", UNAWARE)
    launcher = start_cli(
        ["run", "--cpu", "2", "--preempt-grace", "1", "--grace-period", "1", str(script)],
        tmp_path,
        _slurm(tmp_path),
    )
    assert launcher.stdout is not None
    lines = []
    for line in launcher.stdout:
        lines.append(line)
        if sum("ready" in seen for seen in lines) == 2:
            break
    launcher.send_signal(signal.SIGUSR1)
    rest, err = launcher.communicate(timeout=60)
    assert launcher.returncode == EXIT_PREEMPTED, err
    assert "still running 1s after the warning (--preempt-grace): stopping them" in err
    assert "requeued job 4242" in err and (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    record = json.loads((tmp_path / "multigpu_runs" / "slurm-4242" / "run.json").read_text())
    assert record["status"] == "preempted"
    ranks = record["attempts"][0]["ranks"].values()
    assert {r["state"] for r in ranks} == {"stopped"}  # by the launcher, not killed by SIGUSR1
    assert {r["signal"] for r in ranks} == {"SIGTERM"}
    assert_gone(pids_in("".join(lines) + rest))
