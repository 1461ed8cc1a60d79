"""Elastic jobs (``--nnodes 1:2 --rdzv-backend c10d --max-restarts 1``): launchers on 127.0.0.1 that join,
arrive late, get lost and fail, with torchrun's round semantics. Every test proves by PID that nothing
it started is left running."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import assert_gone, free_port, node_args, pids_in, start_cli, wait_for_lines, write_script

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(180)]

REPORT = """
    import sys
    forked = "torch" in sys.modules  # a rank the node's warm template forked has torch already
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    print(f"pid={os.getpid()} rank={rank} world={world} group={os.environ['GROUP_RANK']} "
          f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']} run={os.environ['TORCHELASTIC_RUN_ID']} "
          f"forked={forked}", flush=True)
"""

# Finishes once the world has ranks FINISH_AT [and at least MIN_RESTARTS restarts were counted]; until
# then it trains (collectives) and waits to be stopped for the next round.
UNTIL_WORLD = (
    REPORT
    + """
    finish_at, min_restarts = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0
    finish = world == finish_at and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) >= min_restarts
    t = torch.ones(1)
    deadline = time.monotonic() + 90
    while not finish and time.monotonic() < deadline:
        dist.all_reduce(t)
        time.sleep(0.05)
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"done rank={rank} world={world} sum={int(t.item())}", flush=True)
    dist.destroy_process_group()
"""
)

RANK_3_FAILS_FIRST_TIME = (
    REPORT
    + """
    dist.barrier()
    if rank == 3 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        time.sleep(0.3)
        raise RuntimeError("rank 3 broke")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"done rank={rank} world={world} sum={int(t.item())}", flush=True)
    dist.destroy_process_group()
"""
)

LINE = re.compile(r"pid=\d+ rank=(\d+) world=(\d+) group=(\d+) restart=(\d+) run=(\S+)")


def node(
    tmp_path: Path,
    name: str,
    endpoint: str,
    script: Path,
    *args: str,
    restarts: int = 1,
    conf: str = "join_timeout=60,last_call_timeout=30",
) -> subprocess.Popen[str]:
    """One launcher of the elastic job; a short last call makes a node alone start without waiting."""
    return start_cli(
        [
            "run",
            "--cpu",
            "2",
            "--grace-period",
            "1",
            *node_args(None, "1:2", endpoint=endpoint),
            "--rdzv-conf",
            conf,
            "--max-restarts",
            str(restarts),
            "--output",
            str(tmp_path / name),
            str(script),
            *args,
        ],
        cwd=tmp_path,
    )


def incidents_of(output: Path) -> list[dict[str, Any]]:
    """The incidents in the one run record an elastic launcher wrote under ``output``."""
    [record] = output.glob("run_*.json")
    return list(json.loads(record.read_text())["incidents"])


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise
    return proc.returncode, out, err


def serving(endpoint: str, timeout: float = 60) -> None:
    """Wait until the first launcher serves the store, so it is the host and the second a client."""
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing served {endpoint} within {timeout}s")


def rounds(out: str) -> list[tuple[int, int, int, int, str]]:
    """(rank, world, group, restart count, run id) of every rank start, in order."""
    return [(int(r), int(w), int(g), int(c), run) for r, w, g, c, run in LINE.findall(out)]


def test_two_launchers_started_together_form_one_job_of_both_nodes(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", UNTIL_WORLD)
    endpoint = f"127.0.0.1:{free_port()}"
    first = node(tmp_path, "a", endpoint, script, "4")
    second = node(tmp_path, "b", endpoint, script, "4")
    (rc0, out0, err0), (rc1, out1, err1) = finish(first), finish(second)
    assert (rc0, rc1) == (0, 0), err0[-3000:] + err1[-3000:]
    started = rounds(out0) + rounds(out1)
    assert sorted((rank, world) for rank, world, *_ in started) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert {group for _, _, group, _, _ in started} == {0, 1}
    assert len({run for *_, run in started}) == 1, "every node shares one run id"
    assert {restart for _, _, _, restart, _ in started} == {0}
    assert (out0 + out1).count("sum=4") == 4
    assert (out0 + out1).count("forked=True") == 4, "every rank forked from its node's warm template"
    assert "plain processes" not in err0 + err1
    assert_gone(pids_in(out0 + out1))


def test_a_node_alone_runs_then_a_late_joiner_leads_to_a_round_with_both(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", UNTIL_WORLD)
    endpoint = f"127.0.0.1:{free_port()}"
    short = "join_timeout=60,last_call_timeout=1"
    first = node(tmp_path, "a", endpoint, script, "4", conf=short)
    second = None
    try:
        wait_for_lines(tmp_path / "a" / "logs" / "attempt_0" / "rank_1.log", r"world=2 group=0", 1, 90)
        second = node(tmp_path, "b", endpoint, script, "4", conf=short)
        rc1, out1, err1 = finish(second)
        rc0, out0, err0 = finish(first)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert (rc0, rc1) == (0, 0), err0[-3000:] + err1[-3000:]
    alone = [r for r in rounds(out0) if r[1] == 2]
    assert sorted((rank, group) for rank, _, group, _, _ in alone) == [(0, 0), (1, 0)], "its own ranks"
    both = [r for r in rounds(out0) + rounds(out1) if r[1] == 4]
    assert sorted(rank for rank, *_ in both) == [0, 1, 2, 3]
    assert {group for _, _, group, _, _ in both} == {0, 1}
    assert {restart for _, _, _, restart, _ in alone + both} == {0}, "a membership change is no restart"
    assert "asked to join: a new rendezvous round" in err0
    assert (out0 + out1).count("sum=4") == 4
    [joined] = incidents_of(tmp_path / "a")  # the join is on the timeline, as what it is
    assert joined["kind"] == "membership change" and "asked to join" in joined["what"], joined
    assert joined["detected_time"] <= joined["stopped_time"] <= joined["next_attempt_time"], joined
    assert_gone(pids_in(out0 + out1))


def test_when_one_of_two_nodes_is_lost_the_survivor_starts_a_round_alone_and_finishes(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", UNTIL_WORLD)
    endpoint = f"127.0.0.1:{free_port()}"
    short = "join_timeout=60,last_call_timeout=1"  # the survivor's round alone starts 1 s after the loss
    first = node(tmp_path, "a", endpoint, script, "2", "1", conf=short)
    serving(endpoint)
    second = node(tmp_path, "b", endpoint, script, "2", "1", conf=short)
    try:
        logs = [tmp_path / name / "logs" / "attempt_0" / f"rank_{r}.log" for name in "ab" for r in range(4)]
        deadline = time.monotonic() + 90
        while sum("world=4" in log.read_text() for log in logs if log.exists()) < 4:
            assert time.monotonic() < deadline, "the two-node round never started"
            time.sleep(0.1)
        os.kill(second.pid, signal.SIGKILL)
        rc0, out0, err0 = finish(first)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    assert rc0 == 0, err0[-3000:]
    assert "plain processes" not in err0, "the survivor's rounds run on its warm template too"
    assert out0.count("forked=False") == 0 and out0.count("forked=True") >= 2
    alone = [r for r in rounds(out0) if r[1] == 2 and r[3] == 1]  # (it may have run alone before B came)
    assert sorted((rank, group) for rank, _, group, _, _ in alone) == [(0, 0), (1, 0)]
    assert out0.count("done rank=") == 2
    lost = [i for i in incidents_of(tmp_path / "a") if i["kind"] == "failed"]
    assert len(lost) == 1 and lost[0]["what"].startswith("node 1 was lost: its launcher "), lost
    assert lost[0]["next_attempt_time"] is not None, lost  # the survivor's round alone
    all_pids = [
        int(p) for p in re.findall(r"pid=(\d+)", "".join(log.read_text() for log in logs if log.exists()))
    ]
    all_pids += pids_in(out0)
    assert len(set(all_pids)) >= 6, "4 ranks of the two-node round, 2 of the survivor's round"
    assert_gone(set(all_pids))


def test_a_failure_with_a_restart_left_restarts_every_node(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", RANK_3_FAILS_FIRST_TIME)
    endpoint = f"127.0.0.1:{free_port()}"
    first = node(tmp_path, "a", endpoint, script)
    second = node(tmp_path, "b", endpoint, script)
    (rc0, out0, err0), (rc1, out1, err1) = finish(first), finish(second)
    assert (rc0, rc1) == (0, 0), err0[-3000:] + err1[-3000:]
    for out, err in ((out0, err0), (out1, err1)):
        restarts = sorted({restart for _, _, _, restart, _ in rounds(out)})
        assert restarts == [0, 1], "every node ran a round before and after the restart"
        assert "restarting every node: restart 1 of 1" in err
    again = [r for r in rounds(out0) + rounds(out1) if r[3] == 1]
    assert sorted(rank for rank, world, *_ in again if world == 4) == [0, 1, 2, 3]
    assert (out0 + out1).count("sum=4") == 4
    assert_gone(pids_in(out0 + out1))


def test_a_failure_with_no_restart_left_ends_every_node_with_the_same_root_cause(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", RANK_3_FAILS_FIRST_TIME)
    endpoint = f"127.0.0.1:{free_port()}"
    first = node(tmp_path, "a", endpoint, script, restarts=0)
    second = node(tmp_path, "b", endpoint, script, restarts=0)
    (rc0, out0, err0), (rc1, out1, err1) = finish(first), finish(second)
    assert (rc0, rc1) == (1, 1), err0[-3000:] + err1[-3000:]
    for err in (err0, err1):
        root = [line for line in err.splitlines() if line.startswith("root cause:")]
        assert root and root[0].startswith("root cause: rank 3 ") and "RuntimeError: rank 3 broke" in root[0]
        assert "restarting" not in err
    assert_gone(pids_in(out0 + out1))


RANK_3_ALWAYS_FAILS = (
    REPORT
    + """
    dist.barrier()
    if rank == 3:
        raise RuntimeError("rank 3 broke again")
    t = torch.ones(1)
    dist.all_reduce(t)
"""
)


def test_the_same_failure_in_two_rounds_in_a_row_stops_every_node_as_a_crash_loop(tmp_path: Path) -> None:
    """Issue 31, case 5: the elastic job runs the static job's loop, so the second identical failure
    stops every node with exit 76 and restarts left, and each node's run record has the incidents."""
    from multigpu.contract.exitcodes import EXIT_CRASH_LOOP

    script = write_script(tmp_path, "job.py", RANK_3_ALWAYS_FAILS)
    at = script.read_text().splitlines().index('    raise RuntimeError("rank 3 broke again")') + 1
    endpoint = f"127.0.0.1:{free_port()}"
    first = node(tmp_path, "a", endpoint, script, restarts=5)
    second = node(tmp_path, "b", endpoint, script, restarts=5)
    (rc0, out0, err0), (rc1, out1, err1) = finish(first), finish(second)
    assert (rc0, rc1) == (EXIT_CRASH_LOOP, EXIT_CRASH_LOOP), err0[-3000:] + err1[-3000:]
    for name, out, err in (("a", out0, err0), ("b", out1, err1)):
        assert sorted({restart for _, _, _, restart, _ in rounds(out)}) == [0, 1], "two rounds, not six"
        assert err.count("restarting every node: restart 1 of 5") == 1 and "restart 2 of 5" not in err
        [loop] = [text for text in err.splitlines() if "crash loop" in text]
        assert loop == (
            f"multigpu: crash loop: rank 3 failed with RuntimeError at {script}:{at} on two "
            f"attempts in a row; not restarting (exit {EXIT_CRASH_LOOP}: do not requeue until "
            "the cause is fixed)"
        )
        [path] = (tmp_path / name).glob("run_*.json")
        record = json.loads(path.read_text())
        assert (record["status"], record["exit_code"]) == ("failed", EXIT_CRASH_LOOP)
        assert record["crash_loop"] == loop.removeprefix("multigpu: ")
        incidents = [(i["attempt"], i["kind"], i["rank"]) for i in record["incidents"]]
        assert incidents == [(0, "failed", 3), (1, "failed", 3)], record["incidents"]
        assert all("RuntimeError: rank 3 broke again" in i["what"] for i in record["incidents"]), record
        assert not list((tmp_path / name).glob(".multigpu*.lock")), "the output claim is released"
    assert len(pids_in(out0 + out1)) == 8, "4 ranks in each of the two rounds"
    assert_gone([*pids_in(out0 + out1), first.pid, second.pid])


EP = ["--rdzv-endpoint", "127.0.0.1:29400"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "3:1", "--rdzv-backend", "c10d"], "need 0 < MIN <= MAX"),
        (["--nnodes", "1:2"], "needs --rdzv-backend c10d"),
        (["--nnodes", "1:2", "--rdzv-backend", "c10d"], "needs --rdzv-endpoint HOST:PORT"),
        (
            ["--nnodes", "1:2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h1:2379,,h2"],
            "HOST:PORT,HOST:PORT",
        ),
        (["--nnodes", "1:2", "--rdzv-backend", "c10d", *EP, "--rdzv-conf", "junk"], "--rdzv-conf"),
        (
            ["--nnodes", "1:2", "--rdzv-backend", "c10d", *EP, "--rdzv-conf", "join_timeout=soon"],
            "join_timeout",
        ),
        (["--rdzv-id", "a", "--run-id", "b"], "disagree"),
    ],
)
def test_wrong_elastic_options_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    from multigpu.cli.run_args import parse_run_args
    from multigpu.contract.errors import UsageError

    script = write_script(tmp_path, "job.py", REPORT)
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_run_args(["--cpu", "1", *args, str(script)], env={})


def test_an_elastic_usage_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from helpers import run_cli

    script = write_script(tmp_path, "job.py", REPORT)
    result = run_cli(
        ["run", "--cpu", "1", "--nnodes", "2:1", "--rdzv-backend", "c10d", *EP, str(script)],
        tmp_path,
        timeout=30,
    )
    assert result.returncode == 2
    assert "--nnodes 2:1: need 0 < MIN <= MAX" in result.stderr.splitlines()[0]
    assert "Traceback" not in result.stderr


def test_the_elastic_fields_come_from_torchruns_options(tmp_path: Path) -> None:
    from multigpu.cli.run_args import parse_run_args

    script = write_script(tmp_path, "job.py", REPORT)
    config, _ = parse_run_args(
        [
            "--cpu",
            "2",
            "--nnodes",
            "1:3",
            "--rdzv-backend",
            "c10d",
            *EP,
            "--rdzv-id",
            "j7",
            "--rdzv-conf",
            "last_call_timeout=2,is_host=false",
            "--max-restarts",
            "2",
            str(script),
        ],
        env={},
    )
    assert (config.rdzv.backend, config.rdzv.min_nodes, config.rdzv.max_nodes) == ("c10d", 1, 3)
    assert config.rdzv.conf == {"last_call_timeout": "2", "is_host": "false"}
    assert (config.output.run_id, config.supervision.max_restarts, config.nproc) == ("j7", 2, 2)
    single, _ = parse_run_args(["--cpu", "2", "--nnodes", "1", "--rdzv-backend", "c10d", str(script)], env={})
    assert single.rdzv.max_nodes == 1 and not single.multi_node, "one node at most: an ordinary local job"
