"""A real OOM kill: the launcher runs in a child memory cgroup of this test's own, with a limit that
rank 1's allocation exceeds; the kernel's OOM killer SIGKILLs it, and the report says so (not just
"killed by SIGKILL"), with the rank's resident memory and the limit. Skips where the machine does
not let this process make a memory cgroup."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import MULTIGPU, assert_gone, clean_env, memory_cgroup, pids_in, write_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LIMIT = "600M"
JOB = """
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    print(f"pid={os.getpid()}", flush=True)
    dist.barrier()
    if dist.get_rank() == 1:
        hog = b"x" * (1200 << 20)  # twice the cgroup's limit
        time.sleep(30)
    dist.barrier()
"""


@pytest.fixture
def small_cgroup() -> Iterator[Path]:
    with memory_cgroup(LIMIT) as path:
        yield path


def test_a_rank_the_oom_killer_ends_is_reported_as_such(tmp_path: Path, small_cgroup: Path) -> None:
    job = write_script(tmp_path, "job.py", JOB)
    out = tmp_path / "out"
    launch = " ".join([*MULTIGPU, "run", "--cpu", "2", "--status", "off", "--output", str(out), str(job)])
    res = subprocess.run(
        ["bash", "-c", f"echo $$ > {small_cgroup}/cgroup.procs && exec {launch}"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert res.returncode == 137, res.stderr[-3000:]
    assert "root cause: rank 1 (node 0, pid" in res.stderr
    line = next(x for x in res.stderr.splitlines() if x.startswith("root cause:"))
    assert "was killed by the kernel's OOM killer (" in line and "of a 600.0 MiB limit)" in line, line
    assert "oom_kill 1" in (small_cgroup / "memory.oom_control").read_text()
    root = json.loads((out / "run.json").read_text())["attempts"][0]["root_cause"]
    assert root["signal"] == "SIGKILL" and root["killed_by"].startswith("the kernel's OOM killer")
    assert_gone(pids_in(res.stdout))
    assert (small_cgroup / "cgroup.procs").read_text().strip() == ""
