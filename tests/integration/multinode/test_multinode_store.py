"""The end of a two-node job on loopback as the store sees it: the store's host (node 0) outlives every
other node's last read, and a store that is gone anyway is one line on the other node, never a Python
traceback or torch's C++ frames (issue 31, case 3)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import MULTIGPU, PYTHON, assert_gone, clean_env, free_port, node_args, pids_in, write_script

pytestmark = [pytest.mark.slow, pytest.mark.integration]

NOISE = ("Traceback", "Exception raised from", "TCPStore.cpp", ".cpp:")

ALLREDUCE = """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"pid={os.getpid()}", flush=True)
    dist.destroy_process_group()
"""

SLEEP = """
    import os, time, torch.distributed as dist
    dist.init_process_group("gloo")
    print(f"pid={os.getpid()}", flush=True)
    for _ in range(600):
        time.sleep(0.1)
"""

SLOW_POLL = """
    # A loaded node 1: its join poll wakes 3 s apart. It claims its rank first (node 0 claims late,
    # below), so node 0 completes the join, refuses and (before the fix) was gone well before node 1
    # read the store again. The launcher is otherwise unchanged.
    import sys
    import multigpu.rendezvous.job as job
    wait_for_all = job.JobStore._wait_for_all
    job.JobStore._wait_for_all = lambda self, timeout_s, poll_s=0.1, on_wait=None: wait_for_all(
        self, timeout_s, 3.0, on_wait)
    from multigpu.cli.entry import main
    sys.exit(main())
"""

LATE_CLAIM = """
    # A loaded node 0: it serves the store and publishes the run id, but claims its rank only once
    # node 1 has claimed its own, so node 1 sits in its join poll when node 0 completes the join.
    import sys, time
    import multigpu.rendezvous.job as job
    join = job.JobStore.join

    def late_join(self, *args, **kwargs):
        deadline = time.monotonic() + 30
        while not self.store.check([self.key("rank", 1)]) and time.monotonic() < deadline:
            time.sleep(0.02)
        return join(self, *args, **kwargs)

    job.JobStore.join = late_join
    from multigpu.cli.entry import main
    sys.exit(main())
"""


def launcher(
    tmp_path: Path, script: Path, rank: int, port: int, entry: list[str] | None = None, nnodes: int = 2
) -> subprocess.Popen[str]:
    args = [
        "run",
        *node_args(rank, nnodes, master_port=port),
        "--nproc-per-node",
        "1",
        "--grace-period",
        "1",
        "--rdzv-timeout",
        "30",
        "--output",
        str(tmp_path / f"out{rank}"),
        str(script),
    ]
    with open(tmp_path / f"node{rank}.out", "w") as out, open(tmp_path / f"node{rank}.err", "w") as err:
        return subprocess.Popen(
            [*(entry or MULTIGPU), *args], cwd=tmp_path, env=clean_env(), stdout=out, stderr=err, text=True
        )


def console(tmp_path: Path, rank: int) -> tuple[str, str]:
    """What node ``rank``'s launcher wrote to its stdout and stderr (files: read while it runs)."""
    return (tmp_path / f"node{rank}.out").read_text(), (tmp_path / f"node{rank}.err").read_text()


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (the launcher's template, its sentinel)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid:
                found.append(int(entry))
    return found


def watch_children(procs: list[subprocess.Popen[str]], want: int = 1, timeout: float = 20) -> list[int]:
    """Every launcher's children once each has ``want`` of them (its template starts first thing)."""
    deadline = time.monotonic() + timeout
    while True:
        kids = [children_of(p.pid) for p in procs]
        if all(len(k) >= want for k in kids) or time.monotonic() > deadline:
            return [pid for k in kids for pid in k]
        time.sleep(0.02)


def finish(
    tmp_path: Path,
    proc: subprocess.Popen[str],
    rank: int,
    timeout: float = 60,
) -> tuple[int, str, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return (proc.returncode, *console(tmp_path, rank))


def stop(procs: list[subprocess.Popen[str]]) -> None:
    """Whatever a failed test left running, ended by PID."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def assert_clean(console: str) -> None:
    noise = [line for line in console.splitlines() if any(word in line for word in NOISE)]
    assert not noise, console[-3000:]


@pytest.mark.matrix  # too heavy for the README's 8 minutes: the matrix tier runs it (scripts/fault_matrix.sh)
def test_a_refused_script_ends_both_nodes_in_one_line_even_when_node_1_reads_late(tmp_path: Path) -> None:
    """Node 1's script differs, node 1 claims first and polls slowly: node 0 refuses, but keeps serving
    until node 1 has read the verdict too (before: node 1 died in ``read_abort`` with torch's C++
    frames, the issue's stack)."""
    scripts = []
    for name, extra in (("a", ""), ("b", "    # edited on node 1 only\n")):
        (tmp_path / name).mkdir()
        scripts.append(write_script(tmp_path / name, "train.py", ALLREDUCE + extra))
    slow = write_script(tmp_path, "slow_poll.py", SLOW_POLL)
    late = write_script(tmp_path, "late_claim.py", LATE_CLAIM)
    port = free_port()
    procs = [
        launcher(tmp_path, scripts[0], 0, port, entry=[PYTHON, str(late)]),
        launcher(tmp_path, scripts[1], 1, port, entry=[PYTHON, str(slow)]),
    ]
    try:
        kids = watch_children(procs)
        results = [finish(tmp_path, proc, rank) for rank, proc in enumerate(procs)]
    finally:
        stop(procs)
    for rc, out, err in results:
        assert rc == 1, err[-3000:]  # the refusal's documented code, on the refusing and the refused node
        assert_clean(out + err)
        refusal = [line for line in err.splitlines() if "would run different things" in line]
        shown = "train.py differs between nodes: node 0 SHA-256 "
        assert len(refusal) == 1 and shown in refusal[0], err[-3000:]
        assert "pid=" not in out  # no rank started
    assert_gone([proc.pid for proc in procs] + kids, timeout=10)


def test_node_0_launcher_killed_is_one_line_on_node_1_and_nothing_is_left(tmp_path: Path) -> None:
    script = write_script(tmp_path, "sleep.py", SLEEP)
    port = free_port()
    nodes = [launcher(tmp_path, script, rank, port) for rank in (0, 1)]
    try:
        kids = watch_children(nodes)
        logs = [tmp_path / f"out{r}" / "logs" / "attempt_0" / f"rank_{r}.log" for r in (0, 1)]
        deadline = time.monotonic() + 60  # a generous bound: a loaded machine starts ranks slowly
        while time.monotonic() < deadline and not all(
            log.exists() and "pid=" in log.read_text() for log in logs
        ):
            time.sleep(0.05)
        ranks = pids_in("".join(log.read_text() for log in logs if log.exists()))
        assert len(ranks) == 2, [log.read_text() for log in logs if log.exists()]
        os.kill(nodes[0].pid, signal.SIGKILL)
        rc, out, err = finish(tmp_path, nodes[1], 1, timeout=30)
    finally:
        stop(nodes)
    assert rc != 0, err[-3000:]
    assert_clean(out + err)
    lost = [line for line in err.splitlines() if "the store's host" in line]
    assert lost[0] == "multigpu: node 0, the store's host, ended (its launcher was killed?); stopping", err
    assert len([line for line in lost if "stopping" in line]) == 1, err
    assert "root cause: node 0, the store's host, ended (its launcher was killed?)" in err, err
    notes = (tmp_path / "out1" / "store_node1.log").read_text()
    assert "DistNetworkError" in notes  # torch's own words: in the node's log, not on its console
    assert_gone([*ranks, nodes[1].pid, *kids], timeout=10)


def test_node_0_launcher_killed_while_the_nodes_meet_is_one_line_on_node_1(tmp_path: Path) -> None:
    """A 3-node job whose third node never comes: both launchers wait in the join when node 0's launcher
    is killed; node 1 says so in one line and exits 1, before any rank started."""
    script = write_script(tmp_path, "sleep.py", SLEEP)
    port = free_port()
    nodes = [launcher(tmp_path, script, rank, port, nnodes=3) for rank in (0, 1)]
    try:
        kids = watch_children(nodes)
        deadline = time.monotonic() + 60

        def both_joined() -> bool:
            return all("joined run" in console(tmp_path, r)[1] for r in (0, 1))

        while time.monotonic() < deadline and not both_joined():
            time.sleep(0.05)
        assert both_joined(), console(tmp_path, 1)
        time.sleep(0.5)  # node 1 polls the join again meanwhile
        os.kill(nodes[0].pid, signal.SIGKILL)
        rc, out, err = finish(tmp_path, nodes[1], 1, timeout=30)
    finally:
        stop(nodes)
    assert rc == 1, err[-3000:]
    assert_clean(out + err)
    assert err.splitlines()[-1] == (
        "multigpu: error: node 0, the store's host, ended (its launcher was killed?); stopping"
    ), err
    assert_gone([nodes[1].pid, *kids], timeout=10)
