"""Slow nodes named across nodes while the job runs (``rendezvous/node_lateness.py``): two launchers on
127.0.0.1, one rank each, 50 ms steps with an all_reduce each. With node 1's rank taking 30 ms more a
step (every rank of that node slow; no rank of a node is late against the node's own), one line names
node 1 on both nodes while the job runs; a healthy job, quiet or beside two CPU hogs, names nothing."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import free_port, node_args, start_cli, write_script

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(150)]

JOB = """
    import os, random, sys, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    extra = float(sys.argv[1]) if os.environ["GROUP_RANK"] == "1" else 0.0
    t = torch.ones(4)
    for step in range(int(sys.argv[2])):
        time.sleep(random.uniform(0.04, 0.06) + extra)
        dist.all_reduce(t)
        if step % 20 == 0:
            print(f"step {step} at {time.time():.3f}", flush=True)
    dist.destroy_process_group()
"""

SLOW_LINE = re.compile(
    r"multigpu: node 1 \(127\.0\.0\.1\) is slow: its ranks enter the collectives (0\.\d\d) s after the "
    r"others' median over the last (\d+) steps \((\d+)% of the others' step\)"
)


def two_nodes(tmp_path: Path, extra: float, steps: int) -> list[tuple[int, str, str, float]]:
    """Both launchers to their end: (exit code, stdout, stderr, when each ended) per node."""
    script = write_script(tmp_path, "job.py", JOB)
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [
        start_cli(
            ["run", "--cpu", "1", "--status", "off", "--output", str(tmp_path / "out"),
             *node_args(n, endpoint=endpoint), str(script), str(extra), str(steps)],
            cwd=tmp_path,
        )
        for n in (1, 0)
    ]  # fmt: skip
    ended = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            ended.append((p.returncode, out, err, time.time()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return ended


def test_a_node_whose_ranks_are_all_slow_is_named_on_every_node_while_it_runs(tmp_path: Path) -> None:
    started = time.time()
    ended = two_nodes(tmp_path, 0.03, 400)
    assert [rc for rc, *_ in ended] == [0, 0], [err for *_, err, _ in ended]
    lines = [[line for line in err.splitlines() if "slow" in line] for _, _, err, _ in ended]
    assert len(lines[0]) == 1 and lines[0] == lines[1], lines  # the same one line on every node
    found = SLOW_LINE.fullmatch(lines[0][0])
    assert found, lines[0][0]
    late, share = float(found.group(1)), int(found.group(3))
    assert 0.02 <= late <= 0.05 and 30 <= share <= 100, lines[0][0]
    assert "straggler" not in ended[0][2] + ended[1][2]  # no rank is late against its own node's
    # While it ran: the line came before the last steps (node 0's stdout has step times).
    steps = [float(t) for t in re.findall(r"step \d+ at (\S+)", ended[1][1])]
    assert steps and steps[-1] - started > 10


@pytest.mark.parametrize("hogs", [0, 2])
def test_a_healthy_two_node_job_names_no_node(tmp_path: Path, hogs: int) -> None:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        ended = two_nodes(tmp_path, 0.0, 300)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert [rc for rc, *_ in ended] == [0, 0], [err for *_, err, _ in ended]
    for _, _, err, _ in ended:
        assert " is slow" not in err and "slow link" not in err, err
