"""The kernel refuses the launcher a process while it starts its ranks (issue 43: the fork limit hit
while starting 3,000 ranks ended the launcher with a ``BlockingIOError`` traceback). Cheaply here: the
launcher runs in a child cgroup v1 ``pids`` controller whose ``pids.max`` lets it start a few ranks
of many, forked by the template or (``--no-template``) started fresh. One line names the rank and the
limit, the launcher exits 1, and nothing it started is left: the cgroup holds no process afterwards.
Skips where this process cannot make a pids cgroup (fails under ``CI=true``)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path

import pytest

from helpers import MULTIGPU, clean_env, v1_group, write_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LIMIT = 40
"""Tasks (threads count) the launcher's cgroup may hold: its own, the template's and a few ranks'."""
RANKS = 200
"""Far more than fit: fresh ranks that die of the limit free their slots, never fast enough."""
SLEEP = """
    import time
    time.sleep(60)
"""


def pids_cgroup(limit: int) -> contextlib.AbstractContextManager[Path]:
    """A child cgroup of the v1 pids hierarchy with ``pids.max`` = ``limit``."""
    return v1_group("pids", max=limit)


def emptied(group: Path, timeout: float = 10.0) -> list[str]:
    """The processes left in ``group`` once it empties or ``timeout`` passes (the template and its store
    end with the launcher, by their parent-death signal, a moment after it)."""
    deadline = time.monotonic() + timeout
    while (left := (group / "cgroup.procs").read_text().split()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.parametrize("template", [True, False], ids=["template", "no-template"])
def test_the_process_limit_is_one_line_naming_the_rank_and_nothing_is_left(
    tmp_path: Path, template: bool
) -> None:
    script = write_script(tmp_path, "sleep.py", SLEEP)
    out = tmp_path / "out"
    flags = [] if template else ["--no-template"]
    launch = [
        *MULTIGPU,
        "run",
        "--cpu",
        str(RANKS),
        *flags,
        "--status",
        "off",
        "--output",
        str(out),
        str(script),
    ]
    with pids_cgroup(LIMIT) as group:
        res = subprocess.run(
            ["bash", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "bash", *launch],
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=100,
        )
        left = emptied(group)
    assert res.returncode == 1, res.stderr[-3000:]
    # the launcher's own traceback, that is (a fresh rank may fail to start a thread of its own first:
    # its traceback is its output, prefixed with its rank)
    assert not any(line.startswith("Traceback") for line in res.stderr.splitlines()), res.stderr[-3000:]
    assert "BlockingIOError" not in res.stderr, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if "the process limit was reached" in line]
    assert len(said) == 1, res.stderr[-3000:]
    assert said[0].startswith("multigpu: error: cannot start rank "), said[0]
    assert f"the cgroup's pids.max is {LIMIT}" in said[0] and "start fewer ranks" in said[0], said[0]
    if template:  # a template that cannot fork is no reason to try plain processes: they cannot start either
        assert "could not fork" not in res.stderr and "plain processes" not in res.stderr, res.stderr[-3000:]
    assert left == []  # nothing it started outlived it (the wait for the cgroup to empty was bounded)
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "failed", record
