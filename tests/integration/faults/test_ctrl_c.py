"""Issue 31: a Ctrl-C says what it stopped, in one line per thing, at every phase: a node waiting for
a peer that never comes (or for the store's host), and ranks building DDP (one line per rank, where
it was; the ``KeyboardInterrupt`` tracebacks in the ranks' logs only). Real launchers, SIGINT to the
launcher's process group as a terminal sends it; every process they started is gone afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from helpers import MULTIGPU, assert_gone, clean_env, free_port, node_args, pids_in, write_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DDP_LOOP = """
    import os, pathlib, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    print(f"pid={os.getpid()}", flush=True)
    dist.init_process_group("gloo")
    pathlib.Path(f"ready_{os.environ['RANK']}").touch()
    while True:
        model = torch.nn.Linear(10, 10)
        model = DDP(model)
"""


@pytest.fixture
def launched() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def start(args: list[str], cwd: Path, launched: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    """A launcher in its own process group, as a shell's foreground job is."""
    proc = subprocess.Popen(
        [*MULTIGPU, *args],
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    launched.append(proc)
    return proc


def read_until(proc: subprocess.Popen[str], pattern: str) -> str:
    """The launcher's stderr up to a line matching ``pattern`` (the test's timeout bounds the wait)."""
    assert proc.stderr is not None
    seen = ""
    while not re.search(pattern, seen):
        line = proc.stderr.readline()
        assert line, f"stderr ended before {pattern!r}:\n{seen}"
        seen += line
    return seen


def ctrl_c(proc: subprocess.Popen[str]) -> tuple[list[int], int, str]:
    """SIGINT to the launcher's group; (every process it had started, its exit status, its stderr)."""
    started = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return started, proc.returncode, err


def test_ctrl_c_while_ranks_build_ddp_is_one_line_per_rank(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    job = write_script(tmp_path, "job.py", DDP_LOOP)
    out = tmp_path / "out"
    proc = start(["run", "--cpu", "3", "--status", "off", "--output", str(out), str(job)], tmp_path, launched)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready_{r}").exists() for r in range(3)):
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks never got going"
        time.sleep(0.05)
    started, rc, err = ctrl_c(proc)
    assert rc == -signal.SIGINT, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    for rank in range(3):
        assert re.search(rf"^rank {rank} interrupted in job\.py:\d+ \(model = ", err, re.MULTILINE), err
        text = (out / "logs" / "attempt_0" / f"rank_{rank}.log").read_text()
        assert "Traceback (most recent call last)" in text and "KeyboardInterrupt" in text, text
    assert len(err.splitlines()) < 20, err  # was 146-189 lines: three tracebacks through torch's imports
    data = json.loads((out / "run.json").read_text())
    assert data["status"] == "interrupted" and data["signal"] == "SIGINT"
    ranks = [r["pid"] for r in data["attempts"][0]["ranks"].values()]
    assert sorted(ranks) == sorted(
        pids_in("".join((out / "logs" / "attempt_0" / f"rank_{r}.log").read_text() for r in range(3)))
    )
    assert_gone([*started, *ranks], timeout=10)


def two_node_args(node: int, port: int, out: Path, job: Path) -> list[str]:
    return [
        "run",
        "--cpu",
        "1",
        *node_args(node, master_port=port),
        "--rdzv-timeout",
        "300",
        "--output",
        str(out),
        str(job),
    ]


@pytest.mark.slow
def test_a_node_waiting_for_a_peer_says_who_and_how_long_then_ctrl_c(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    job = write_script(tmp_path, "job.py", "print('never runs')\n")
    proc = start(two_node_args(0, free_port(), tmp_path / "out", job), tmp_path, launched)
    seen = read_until(proc, r"node 0: waiting for node\(s\) 1 \(joined: 0\); 4m5\ds left \(--rdzv-timeout\)")
    started, rc, err = ctrl_c(proc)
    assert rc == -signal.SIGINT, seen + err
    assert err.strip().splitlines() == [
        "multigpu: node 0: interrupted (SIGINT) while waiting for node(s) 1 "
        "to join (joined: 0); no rank was started"
    ], err
    assert "never runs" not in seen + err
    assert_gone([proc.pid, *started], timeout=10)


@pytest.mark.slow
def test_a_node_waiting_for_the_stores_host_says_so_then_ctrl_c(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    job = write_script(tmp_path, "job.py", "print('never runs')\n")
    port = free_port()
    proc = start(two_node_args(1, port, tmp_path / "out", job), tmp_path, launched)
    where = rf"node 0 \(the store's host, 127\.0\.0\.1:{port}\)"
    seen = read_until(proc, rf"node 1: waiting for {where}; 4m5\ds left \(--rdzv-timeout\)")
    started, rc, err = ctrl_c(proc)
    assert rc == -signal.SIGINT, seen + err  # at once: torch's C++ connect retries would hold it 300 s
    assert re.fullmatch(
        rf"multigpu: node 1: interrupted \(SIGINT\) while waiting for {where}; no rank was "
        r"started\n",
        err,
    ), err
    assert_gone([proc.pid, *started], timeout=10)


@pytest.mark.slow
def test_an_elastic_node_waiting_for_its_round_says_who_then_ctrl_c(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    job = write_script(tmp_path, "job.py", "print('never runs')\n")
    endpoint = f"127.0.0.1:{free_port()}"
    args = [
        "run",
        "--cpu",
        "1",
        *node_args(None, "2:2", endpoint=endpoint),
        "--rdzv-conf",
        "join_timeout=300",
        "--output",
        str(tmp_path / "out"),
        str(job),
    ]
    proc = start(args, tmp_path, launched)
    joined = rf"127\.0\.0\.1 pid {proc.pid}"
    seen = read_until(
        proc,
        rf"waiting for 1 more node\(s\) for the round \(2:2 nodes; joined: {joined}\); "
        r"4m\d\ds left \(join_timeout\)",
    )
    started, rc, err = ctrl_c(proc)
    assert rc == -signal.SIGINT, seen + err
    line = (
        rf"multigpu: interrupted \(SIGINT\) while waiting for a rendezvous round at {endpoint} "
        rf"\(joined: {joined}\); no rank of it was started\n"
    )
    assert re.fullmatch(line, err), err
    records = list((tmp_path / "out").glob("run_*.json"))
    assert [json.loads(p.read_text())["status"] for p in records] == ["interrupted"]
    assert_gone([proc.pid, *started], timeout=10)
