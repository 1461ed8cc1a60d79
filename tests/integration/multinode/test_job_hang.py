"""Hangs across nodes (issue 31, cases 1 and 7): progress is the job's, a hang is declared once for the
job, and every node prints the same verdict from every rank's stacks. Two launchers on 127.0.0.1, one
rank each."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import assert_gone, finish_all, free_port, node_args, pids_in, start_cli, write_script

pytestmark = [pytest.mark.slow, pytest.mark.integration]

RUN_TIMEOUT = 150  # a bound: reached only when the behaviour is broken (start-up under load included)

RANK_0_PRINTS = """
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        print(f"pid={os.getpid()} start", flush=True)
    for step in range(8):
        time.sleep(1.0)  # a 1 s step; rank 1 says nothing at all
        t = torch.ones(1)
        dist.all_reduce(t)
        if rank == 0:
            print(f"step {step} sum={int(t.item())}", flush=True)
    dist.destroy_process_group()
"""

RANK_1_SLEEPS = """
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"pid={os.getpid()} rank={rank}", flush=True)
    for step in range(1000):
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.1)
        if step == 5 and rank == 1:
            time.sleep(3600)  # STUCK HERE
"""


@pytest.fixture
def hogs(request: pytest.FixtureRequest) -> Iterator[list[int]]:
    """Two busy CPU processes beside the job when the test is parametrized 'loaded' (the fault
    matrix's tier: ``scripts/fault_matrix.sh`` keeps two running itself, and then none start here)."""
    loaded = getattr(request, "param", "quiet") == "loaded"
    own = loaded and os.environ.get("MULTIGPU_MATRIX_HOGS") != "outside"
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if own else 0)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def two_nodes(tmp_path: Path, script: Path, *args: str) -> list[tuple[int, str, str]]:
    """Both launchers to the end: (exit code, stdout, stderr) of node 0, then node 1."""
    port = str(free_port())
    procs = [
        start_cli(
            [
                "run",
                *node_args(n, master_port=port),
                "--nproc-per-node",
                "1",
                "--grace-period",
                "1",
                "--output",
                str(tmp_path / "out"),
                *args,
                str(script),
            ],
            cwd=tmp_path,
        )
        for n in (1, 0)
    ][::-1]
    return finish_all(procs, RUN_TIMEOUT)


def record(tmp_path: Path, node: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tmp_path / "out" / f"run_node{node}.json").read_text())
    return data


def rank_pids(tmp_path: Path) -> list[int]:
    return [
        r["pid"]
        for n in (0, 1)
        for a in record(tmp_path, n)["attempts"]
        for r in a["ranks"].values()
        if r["pid"]
    ]


@pytest.mark.matrix  # the matrix's healthy cells in the suite's place; the tier runs both
@pytest.mark.parametrize("hogs", ["quiet", "loaded"], indirect=True)
def test_a_healthy_job_printing_from_rank_0_only_is_not_hung(tmp_path: Path, hogs: list[int]) -> None:
    script = write_script(tmp_path, "train.py", RANK_0_PRINTS)
    (rc0, out0, err0), (rc1, out1, err1) = two_nodes(tmp_path, script, "--hang-timeout", "5")
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert "step 7 sum=2" in out0
    assert out1 == "", "rank 1 printed nothing: its progress was its collectives and node 0's output"
    assert "hang" not in err0 + err1
    assert_gone(rank_pids(tmp_path))


NO_COLLECTIVE_FOR_A_WHILE = """
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for i in range(8):  # 8 s without a collective: rank 1 silent, rank 0 printing every second
        time.sleep(1.0)
        if rank == 0:
            print(f"working {i}", flush=True)
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank {rank} sum={int(t.item())}", flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.matrix  # too heavy for the README's 8 minutes: the matrix tier runs it (scripts/fault_matrix.sh)
def test_a_silent_node_lives_on_another_nodes_progress(tmp_path: Path) -> None:
    """No collective to count: node 1 knows the job is alive only from node 0's output, via the store."""
    script = write_script(tmp_path, "train.py", NO_COLLECTIVE_FOR_A_WHILE)
    (rc0, out0, err0), (rc1, out1, err1) = two_nodes(tmp_path, script, "--hang-timeout", "4")
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert "working 7" in out0 and "rank 1 sum=2" in out1 and "hang" not in err0 + err1
    assert_gone(rank_pids(tmp_path))


def verdict_of(err: str) -> str:
    found = re.findall(r"^multigpu: attempt 0 hung: (.*)$", err, re.M)
    assert len(found) == 1, err
    return found[0]


@pytest.mark.parametrize("hogs", ["quiet", pytest.param("loaded", marks=pytest.mark.matrix)], indirect=True)
def test_a_hang_is_declared_once_and_judged_the_same_on_every_node(tmp_path: Path, hogs: list[int]) -> None:
    script = write_script(tmp_path, "train.py", RANK_1_SLEEPS)
    stuck = next(i for i, line in enumerate(script.read_text().splitlines(), 1) if "STUCK HERE" in line)
    (rc0, out0, err0), (rc1, out1, err1) = two_nodes(tmp_path, script, "--hang-timeout", "5")
    pids = pids_in(out0 + out1)
    assert (rc0, rc1) == (1, 1), err0 + err1
    for err in (err0, err1):
        first = re.findall(r"^multigpu: hang: (.*)$", err, re.M)
        assert len(first) == 1, err
        assert first[0].startswith("no progress for ") and not re.search(r"ranks? \d", first[0]), first[0]
        assert first[0].endswith("; collecting every rank's stacks")
        for rank in (0, 1):
            assert len(re.findall(rf"^rank {rank} \(pid \d+\) stacks:$", err, re.M)) == 1, err
        assert err.index("rank 1 (pid") < err.index("rank 0 (pid"), err
        assert f'train.py", line {stuck} in <module>' in err
        assert "in all_reduce" in err
    assert verdict_of(err0) == verdict_of(err1)
    assert verdict_of(err0).startswith(
        f"rank 1 never reached the all_reduce that rank 0 waits in: rank 1 is in {script}:{stuck} (<module>)"
    ), verdict_of(err0)
    for node in (0, 1):
        attempt = record(tmp_path, node)["attempts"][0]
        assert attempt["status"] == "hung"
        assert (attempt["root_cause"]["rank"], attempt["root_cause"]["node"]) == (1, 1)
    logs = tmp_path / "out" / "logs" / "attempt_0"
    for rank in (0, 1):
        assert "most recent call first" in (logs / f"rank_{rank}.log").read_text()
    assert len(pids) == 2
    assert_gone(pids + rank_pids(tmp_path))
