"""A slow rank named from when the ranks enter their collectives, with no change to the script: two
CPU ranks on gloo, 50 ms steps with an all_reduce each, rank 1 taking 20 ms more per step (the job runs
40% slower). The launcher says so while the job runs, and run.json keeps the span. A healthy job of the
same shape, with noisy steps, a pause on every rank and rank-0-only logging in a few steps, is not named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import run_cli, write_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.matrix,
]  # the heavy tier

JOB = """
import random, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
slow = float(sys.argv[1])
t = torch.ones(4)
for step in range(int(sys.argv[2])):
    time.sleep(random.uniform(0.035, 0.065) if slow == 0 else 0.05)
    if rank == 1:
        time.sleep(slow)
    if slow == 0 and step % 100 == 99:
        time.sleep(1.0)  # a checkpoint, every rank
    if slow == 0 and rank == 0 and step % 20 == 0:
        time.sleep(0.03)  # logging, on rank 0 only
    dist.all_reduce(t)
print("done", rank, flush=True)
"""


def run(tmp_path: Path, slow: float, steps: int) -> tuple[str, dict[str, dict[str, object]]]:
    job = write_script(tmp_path, "job.py", JOB)
    out = tmp_path / "out"
    res = run_cli(
        ["run", "--cpu", "2", "--status", "off", "--output", str(out), str(job), str(slow), str(steps)],
        cwd=tmp_path,
        timeout=100,
    )
    assert res.returncode == 0, res.stderr
    data = json.loads((out / "run.json").read_text())
    return res.stderr, data["attempts"][-1]["progress"]


def test_a_rank_40_percent_slower_is_named_while_the_job_runs(tmp_path: Path) -> None:
    stderr, progress = run(tmp_path, 0.02, 450)
    lines = [line for line in stderr.splitlines() if "straggler" in line]
    assert len(lines) == 1, stderr
    assert re.fullmatch(
        r"multigpu: rank 1 \(node 0, pid \d+\) is a straggler: it enters collectives "
        r"(\d+) ms \((\d+)%\) after the others, over the last \d+; the job runs at the pace "
        r"of its slowest rank",
        lines[0],
    ), lines[0]
    late, share = map(int, re.findall(r"collectives (\d+) ms \((\d+)%\)", lines[0])[0])
    assert 12 <= late <= 35 and 20 <= share <= 80, lines[0]
    span = progress["1"]["straggling"][0]  # type: ignore[index]
    first = min(p["last_progress_time"] for p in progress.values())  # type: ignore[index]
    assert span["start_time"] < first - 5  # named well before the end (the job takes ~32 s)
    assert "straggling" not in progress["0"]


def test_a_healthy_job_is_not_named(tmp_path: Path) -> None:
    stderr, progress = run(tmp_path, 0.0, 400)
    assert "straggler" not in stderr, stderr
    assert all("straggling" not in p for p in progress.values())
    assert all(abs(p["collective_late_s"]) < 0.01 for p in progress.values()), progress  # type: ignore[arg-type]


THROTTLED_JOB = """
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
group = os.environ["TEST_CPU_GROUP_" + str(rank)]
with open(os.path.join(group, "cgroup.procs"), "w") as procs:
    procs.write(str(os.getpid()))  # this rank alone joins its group, before its first step
t = torch.ones(4)
for step in range(int(sys.argv[1])):
    end = time.process_time() + 0.02  # 20 ms of CPU a step: a throttled rank takes longer for it
    while time.process_time() < end:
        pass
    dist.all_reduce(t)
print("done", rank, flush=True)
"""


def test_a_rank_held_by_a_cgroup_cpu_quota_is_named(tmp_path: Path) -> None:
    """Real slowness, not a sleep: rank 1 runs in a cgroup v1 CPU group held to 40% of a core (4 ms
    of every 10 ms), rank 0 in one weighted to own its core; both do 20 ms of CPU work a step and an
    all_reduce. Nothing in the script says which rank is slow: the launcher names rank 1."""
    from helpers import cpu_group

    job = write_script(tmp_path, "job.py", THROTTLED_JOB)
    out = tmp_path / "out"
    with cpu_group(shares=16384) as fast, cpu_group(cfs_period_us=10000, cfs_quota_us=4000) as slow:
        res = run_cli(
            ["run", "--cpu", "2", "--status", "off", "--output", str(out), str(job), "400"],
            cwd=tmp_path,
            timeout=100,
            env={"TEST_CPU_GROUP_0": str(fast), "TEST_CPU_GROUP_1": str(slow)},
        )
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stderr.splitlines() if "is a straggler" in line]
    assert lines and lines[0].startswith("multigpu: rank 1 (node 0, pid "), res.stderr
    progress = json.loads((out / "run.json").read_text())["attempts"][-1]["progress"]
    assert progress["1"]["straggling"] and "straggling" not in progress["0"], progress


def test_a_rank_slowed_in_bursts_by_a_default_period_quota_is_named(tmp_path: Path) -> None:
    """Issue 41, found by a user: rank 1 held to 80% of a core with the default 100 ms period (it runs
    80 ms, then waits 20 ms), so one step in several waits for it and the job runs ~25% slower; its
    median lateness is ~0. The launcher names it by the time the job loses to it."""
    from helpers import cpu_group

    job = write_script(tmp_path, "job.py", THROTTLED_JOB)
    out = tmp_path / "out"
    with cpu_group(shares=16384) as fast, cpu_group(cfs_period_us=100000, cfs_quota_us=80000) as slow:
        res = run_cli(
            ["run", "--cpu", "2", "--status", "off", "--output", str(out), str(job), "300"],
            cwd=tmp_path,
            timeout=100,
            env={"TEST_CPU_GROUP_0": str(fast), "TEST_CPU_GROUP_1": str(slow)},
        )
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stderr.splitlines() if "is a straggler" in line]
    assert lines and lines[0].startswith("multigpu: rank 1 (node 0, pid "), res.stderr
    assert "rank 0" not in "".join(lines), lines
    progress = json.loads((out / "run.json").read_text())["attempts"][-1]["progress"]
    assert progress["1"]["straggling"] and "straggling" not in progress["0"], progress
