"""Slow nodes named across nodes while the job runs (``rendezvous/node_lateness.py``): two launchers on
127.0.0.1, one rank each, 50 ms steps with an all_reduce each. With node 1's rank taking 30 ms more a
step (every rank of that node slow; no rank of a node is late against the node's own), one line names
node 1 on both nodes while the job runs; a healthy job, quiet or beside two CPU hogs, names nothing."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import free_port, node_args, start_cli, write_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(150),
    pytest.mark.matrix,
]  # the heavy tier: two launchers for 20-40 s each

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
    dist.destroy_process_group()
"""

SLOW_LINE = re.compile(
    r"multigpu: node 1 \(127\.0\.0\.1\) is slow: its ranks enter the collectives (0\.\d\d) s after the "
    r"others' median over the last (\d+) steps \((\d+)% of the others' step\)"
)


@dataclass
class Node:
    """One launcher to its end: its exit code, and each line of its stderr with when it came."""

    proc: subprocess.Popen[str]
    lines: list[tuple[float, str]] = field(default_factory=list)
    ended: float = 0.0

    def read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def said(self, word: str) -> list[tuple[float, str]]:
        return [(t, line) for t, line in self.lines if word in line]


def two_nodes(tmp_path: Path, extra: float, steps: int) -> list[Node]:
    """Node 0 and node 1 to their end, their lines read as they come."""
    script = write_script(tmp_path, "job.py", JOB)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        Node(
            start_cli(
                ["run", "--cpu", "1", "--status", "off", "--output", str(tmp_path / "out"),
                 *node_args(n, endpoint=endpoint), str(script), str(extra), str(steps)],
                cwd=tmp_path,
            )
        )
        for n in (0, 1)
    ]  # fmt: skip
    readers = [threading.Thread(target=n.read, daemon=True) for n in nodes]
    for r in readers:
        r.start()
    try:
        for n in nodes:
            n.proc.wait(timeout=120)
            n.ended = time.monotonic()
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait()
        for r in readers:
            r.join(10)
        for n in nodes:
            for pipe in (n.proc.stdout, n.proc.stderr):
                if pipe is not None:
                    pipe.close()
    return nodes


def test_a_node_whose_ranks_are_all_slow_is_named_on_every_node_while_it_runs(tmp_path: Path) -> None:
    nodes = two_nodes(tmp_path, 0.03, 300)
    assert [n.proc.returncode for n in nodes] == [0, 0], [n.lines for n in nodes]
    said = [n.said(" is slow") for n in nodes]
    assert len(said[0]) == 1 and [line for _, line in said[0]] == [line for _, line in said[1]], said
    found = SLOW_LINE.fullmatch(said[0][0][1])
    assert found, said[0][0][1]
    late, share = float(found.group(1)), int(found.group(3))
    assert 0.02 <= late <= 0.05 and 30 <= share <= 100, said[0][0][1]
    assert all(not n.said("straggler") for n in nodes)  # no rank is late against its own node's
    for n, ((when, _),) in zip(nodes, said, strict=True):
        assert when < n.ended - 3, "named while the job runs (it takes ~30 s)"


@pytest.mark.parametrize("hogs", [0, 2])
def test_a_healthy_two_node_job_names_no_node(tmp_path: Path, hogs: int) -> None:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        nodes = two_nodes(tmp_path, 0.0, 200)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert [n.proc.returncode for n in nodes] == [0, 0], [n.lines for n in nodes]
    for n in nodes:
        assert not n.said(" is slow") and not n.said("slow link"), n.lines
