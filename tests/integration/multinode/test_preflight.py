"""``--preflight`` with two launchers on 127.0.0.1: a healthy check is one line on both nodes and the
job runs; a node whose launcher and ranks share 15% of a core (a real cgroup v1 CPU quota) is named on
both nodes before its ranks start; ``--preflight strict`` refuses the job on both, with exit 77; in
an elastic job the throttled node withdraws from the round and the job goes on without it; a node
killed during the check is named on the other, with nothing left running."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from helpers import MULTIGPU, assert_gone, clean_env, cpu_group, finish_all, free_port, write_script

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(300)]

TRAIN = """
    import os, sys, torch, torch.distributed as dist
    print("training starts", file=sys.stderr, flush=True)
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"sum={int(t.item())} world={dist.get_world_size()} group={os.environ['GROUP_RANK']}", flush=True)
    dist.destroy_process_group()
"""

THROTTLED = {"cfs_period_us": 100000, "cfs_quota_us": 15000}
"""The slow node: its launcher and ranks share 15% of one core."""
HEALTHY = {"shares": 16384}
"""A healthy node owns its core: weighted far above a shared test machine's other work (other suites,
benchmarks), which would otherwise slow it as much as the quota slows the throttled one."""


def start_node(
    tmp_path: Path, name: str, script: Path, layout: list[str], cgroup: Path
) -> subprocess.Popen[str]:
    """One launcher (1 CPU rank) with ``layout``'s options, in ``cgroup`` from its first instruction on
    (a shell writes its own pid into the group, then becomes the launcher)."""
    argv = [*MULTIGPU, "run", "--cpu", "1", "--grace-period", "1", *layout]
    argv += ["--output", str(tmp_path / name), str(script)]
    wrapped = ["sh", "-c", f'echo $$ > {cgroup / "cgroup.procs"} && exec "$@"', "sh", *argv]
    return subprocess.Popen(
        wrapped, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def static(rank: int, endpoint: str, *options: str) -> list[str]:
    """Node ``rank`` of two; ``--preflight on`` unless the options say: both nodes are on this machine,
    where the default leaves them unchecked (``test_nodes_on_one_machine_are_not_checked_by_default``)."""
    if DEFAULT in options:
        asked = tuple(o for o in options if o != DEFAULT)
    elif "--preflight" in options or "--no-preflight" in options:
        asked = options
    else:
        asked = ("--preflight", "on", *options)
    return ["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint, *asked]


DEFAULT = "(no --preflight)"
"""Among ``static``'s options: leave ``--preflight`` out, as a user who does not name it."""


def both(
    tmp_path: Path, *options: str, throttle: bool = False, timeout: float = 240
) -> list[tuple[int, str, str]]:
    """Run both nodes to their end, (exit code, stdout, stderr) each: healthy ones, or node 1
    throttled (``throttle``)."""
    script = write_script(tmp_path, "train.py", TRAIN)
    endpoint = f"127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as stack:
        healthy = stack.enter_context(cpu_group(**HEALTHY))
        slow = stack.enter_context(cpu_group(**THROTTLED)) if throttle else healthy
        procs = [
            start_node(tmp_path, "out", script, static(0, endpoint, *options), healthy),
            start_node(tmp_path, "out", script, static(1, endpoint, *options), slow),
        ]
        return finish_all(procs, timeout)


def record(tmp_path: Path, node: int) -> dict[str, object]:
    data = json.loads((tmp_path / "out" / f"run_node{node}.json").read_text())
    return dict(data["preflight"])


def test_nodes_on_one_machine_are_not_checked_by_default(tmp_path: Path) -> None:
    """Both nodes here share this machine's processors: by default no check, no line, no record."""
    for code, _, err in both(tmp_path, DEFAULT):
        assert code == 0 and "preflight" not in err, err
    assert "preflight" not in json.loads((tmp_path / "out" / "run_node0.json").read_text())


def test_a_healthy_preflight_is_one_line_on_both_nodes_and_the_job_runs(tmp_path: Path) -> None:
    for code, out, err in both(tmp_path):
        assert code == 0, err
        [line] = [x for x in err.splitlines() if x.startswith("multigpu: preflight:")]
        assert line.startswith("multigpu: preflight: every node healthy (2 nodes, ")
        assert "GFLOP/s" in line and "GB/s" in line
        assert err.index("preflight:") < err.index("training starts")
        assert "sum=2" in out
    assert record(tmp_path, 0)["verdict"] == record(tmp_path, 1)["verdict"] == "healthy"


@pytest.mark.matrix  # a throttled node (cgroup quota) takes long: the heavy tier (scripts/fault_matrix.sh)
def test_a_throttled_node_is_named_on_both_nodes_before_training(tmp_path: Path) -> None:
    results = both(tmp_path, throttle=True)
    for code, _, err in results:
        assert code == 0, err
        [line] = [x for x in err.splitlines() if x.startswith("multigpu: preflight:")]
        assert line.startswith("multigpu: preflight: node 1 is slow: matmul "), line
        assert "(others " in line and line.endswith("; running anyway (--preflight=strict refuses)")
        assert err.index("preflight:") < err.index("training starts")
    entry = record(tmp_path, 0)
    assert entry["verdict"] == "slow" and entry["slow_nodes"] == [1]


@pytest.mark.matrix  # a throttled node (cgroup quota) takes long: the heavy tier (scripts/fault_matrix.sh)
def test_strict_refuses_a_throttled_node_on_both_nodes_with_exit_77(tmp_path: Path) -> None:
    results = both(tmp_path, "--preflight", "strict", throttle=True)
    for code, _, err in results:
        assert code == 77, err
        assert "multigpu: error: preflight: node 1 is slow: matmul " in err
        assert "every node refuses the job (--preflight=strict)" in err
        assert "training starts" not in err and "Traceback" not in err
    assert record(tmp_path, 1)["verdict"] == "refused"


ELASTIC = [
    "--nnodes",
    "1:2",
    "--rdzv-backend",
    "c10d",
    "--rdzv-conf",
    "join_timeout=150,last_call_timeout=40",
    "--preflight",
    "on",
]
"""An elastic job of 1 to 2 nodes; a last call long enough for the throttled node to join the first round."""


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


@pytest.mark.matrix  # a throttled node (cgroup quota) takes long: the heavy tier (scripts/fault_matrix.sh)
def test_a_throttled_node_withdraws_from_an_elastic_round_and_the_job_goes_on(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", TRAIN)
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    with cpu_group(**HEALTHY) as healthy, cpu_group(**THROTTLED) as slow:
        first = start_node(tmp_path, "a", script, [*ELASTIC, "--rdzv-endpoint", endpoint], healthy)
        deadline = time.monotonic() + 60
        while not listening(port) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the healthy node serves the store: a slow node never withdraws with it
        second = start_node(tmp_path, "b", script, [*ELASTIC, "--rdzv-endpoint", endpoint], slow)
        (code_a, out_a, err_a), (code_b, _, err_b) = finish_all([first, second], 240)
    named = re.search(r"preflight: node (\d) is slow: matmul ", err_b)
    assert code_b == 77 and named, err_b
    assert f"node {named.group(1)} (this one) leaves the job, which goes on with 1 node(s)" in err_b
    assert "Traceback" not in err_b and "training starts" not in err_b
    assert f"preflight: node {named.group(1)} is slow: matmul " in err_a
    assert "it leaves the job: a new round with 1 node(s)" in err_a
    assert code_a == 0, err_a
    assert "world=1 group=0" in out_a and "world=2" not in out_a  # no rank ran with the slow node


def check_of(launcher: int, timeout: float) -> tuple[int, int]:
    """(the template, the check) of ``launcher``'s node, once the check is forked: the first process
    the template forks (it runs before any rank); both are the launcher's children."""
    me, template = psutil.Process(launcher), None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in me.children():
            with contextlib.suppress(psutil.Error):
                if any("multigpu.template" in part for part in child.cmdline()):
                    if template is None:
                        template = child.pid
                    elif child.pid != template:
                        return template, child.pid
        time.sleep(0.002)
    raise AssertionError(f"launcher {launcher} forked no check within {timeout:g}s")


@pytest.mark.matrix  # a throttled node (cgroup quota) takes long: the heavy tier (scripts/fault_matrix.sh)
def test_a_node_killed_during_the_check_is_named_lost_with_nothing_left(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", TRAIN)
    endpoint = f"127.0.0.1:{free_port()}"
    with cpu_group(**HEALTHY) as healthy:
        first = start_node(tmp_path, "out", script, static(0, endpoint), healthy)
        second = start_node(tmp_path, "out", script, static(1, endpoint), healthy)
        try:
            template, check = check_of(second.pid, 120)
        finally:
            second.kill()  # its launcher, SIGKILL, while its check runs
        [(code, out, err), _] = finish_all([first, second], 120)
    assert code == 1, err
    [line] = [x for x in err.splitlines() if x.startswith("multigpu: error:")]
    assert line.startswith("multigpu: error: preflight: node 1 was lost during the check: its launcher ")
    assert line.endswith("; no rank was started (--no-preflight skips the check)")
    assert "Traceback" not in err and "training starts" not in err and out == ""
    assert_gone([template, check], timeout=15)
