"""Several launchers forming one job on 127.0.0.1: layout, run ids, fate sharing, time-outs."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from helpers import (
    assert_gone,
    free_port,
    node_args,
    pids_in,
    run_cli,
    start_cli,
    tier_cannot_run,
    wait_for_lines,
    write_script,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ALLREDUCE = """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print(f"pid={os.getpid()} rank={dist.get_rank()} world={dist.get_world_size()} "
          f"group={os.environ['GROUP_RANK']} sum={int(t.item())} run={os.environ['TORCHELASTIC_RUN_ID']}")
    dist.destroy_process_group()
"""

SLEEP = """
    import os, time
    print(f"pid={os.getpid()}", flush=True)
    time.sleep(120)
"""


def node(
    tmp_path: Path, script: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return start_cli(
        ["run", "--cpu", "2", "--grace-period", "1", "--output", str(tmp_path / "out"), *args, str(script)],
        cwd=tmp_path,
        env=env,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise
    return proc.returncode, out, err


def test_two_launchers_form_one_2x2_job(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", ALLREDUCE)
    endpoint = f"127.0.0.1:{free_port()}"
    second = node(tmp_path, script, *node_args(1, endpoint=endpoint))
    first = node(tmp_path, script, *node_args(0, endpoint=endpoint))
    rc0, out0, err0 = finish(first)
    rc1, out1, err1 = finish(second)
    assert (rc0, rc1) == (0, 0), err0 + err1
    lines = re.findall(r"rank=(\d) world=4 group=(\d) sum=10 run=(\S+)", out0 + out1)
    assert sorted((int(r), int(g)) for r, g, _ in lines) == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert len({run for _, _, run in lines}) == 1, "every node shares one run id"
    assert "[node 1 rank 2]" in out1 and "[node 0 rank 0]" in out0
    assert (tmp_path / "out" / "run_node0.json").exists() and (tmp_path / "out" / "run_node1.json").exists()
    assert_gone(pids_in(out0 + out1))


RANK_3_FAILS_FIRST_TIME = """
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"pid={os.getpid()} rank={dist.get_rank()} restart={restart}", flush=True)
    dist.barrier()
    if dist.get_rank() == 3 and restart == "0":
        time.sleep(0.3)
        raise RuntimeError("rank 3 broke")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank={dist.get_rank()} restart={restart} sum={int(t.item())}", flush=True)
    dist.destroy_process_group()
"""


def test_max_restarts_restarts_every_node_together(tmp_path: Path) -> None:
    script = write_script(tmp_path, "fail_once.py", RANK_3_FAILS_FIRST_TIME)
    endpoint = f"127.0.0.1:{free_port()}"
    first = node(tmp_path, script, *node_args(0, endpoint=endpoint), "--max-restarts", "1")
    second = node(tmp_path, script, *node_args(1, endpoint=endpoint), "--max-restarts", "1")
    rc1, out1, err1 = finish(second)
    rc0, out0, err0 = finish(first)
    assert (rc0, rc1) == (0, 0), err0[-3000:] + err1[-3000:]
    for err in (err0, err1):
        assert "root cause: rank 3 (node 1" in err and "restarting on every node: attempt 1" in err
    finished = sorted(re.findall(r"rank=(\d) restart=1 sum=4", out0 + out1))
    assert finished == ["0", "1", "2", "3"], "every rank of both nodes ran the restarted attempt"
    assert_gone(pids_in(out0 + out1))


def test_peers_that_never_come_time_out_with_one_clear_line(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", ALLREDUCE)
    endpoint = f"127.0.0.1:{free_port()}"
    alone = run_cli(
        [
            "run",
            "--cpu",
            "1",
            *node_args(0, endpoint=endpoint),
            "--rdzv-timeout",
            "1.5",
            "--output",
            str(tmp_path / "a"),
            str(script),
        ],
        tmp_path,
    )
    assert alone.returncode == 1
    assert "node(s) 1 never joined within 1.5s (--rdzv-timeout)" in alone.stderr
    orphan = run_cli(
        [
            "run",
            "--cpu",
            "1",
            *node_args(1, endpoint=endpoint),
            "--rdzv-timeout",
            "1.5",
            "--output",
            str(tmp_path / "b"),
            str(script),
        ],
        tmp_path,
    )
    assert orphan.returncode == 1
    error_lines = [line for line in orphan.stderr.splitlines() if "error" in line]
    assert len(error_lines) == 1 and endpoint in error_lines[0], orphan.stderr
    assert "Traceback" not in orphan.stderr


def test_nodes_that_disagree_on_the_layout_are_refused_on_both(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", ALLREDUCE)
    endpoint = f"127.0.0.1:{free_port()}"
    first = node(
        tmp_path,
        script,
        "--base-rank",
        "0",
        "--world-size",
        "4",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-timeout",
        "20",
    )
    time.sleep(0.5)
    second = node(
        tmp_path,
        script,
        "--base-rank",
        "1",
        "--world-size",
        "4",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-timeout",
        "20",
    )
    rc1, _, err1 = finish(second)
    rc0, _, err0 = finish(first)
    assert rc0 == 1 and rc1 == 1
    for err in (err0, err1):
        assert "inconsistent layout: rank 1 is claimed by both" in err


@pytest.mark.matrix  # three launchers, two runs: the heavy tier (scripts/fault_matrix.sh)
def test_a_launcher_with_another_run_id_is_refused_and_cannot_disturb_the_job(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", ALLREDUCE)
    endpoint = f"127.0.0.1:{free_port()}"
    first = node(tmp_path, script, *node_args(0, endpoint=endpoint), "--run-id", "job-a")
    intruder = run_cli(
        [
            "run",
            "--cpu",
            "2",
            *node_args(1, endpoint=endpoint),
            "--run-id",
            "job-b",
            "--output",
            str(tmp_path / "x"),
            str(script),
        ],
        tmp_path,
    )
    assert intruder.returncode == 1
    assert "run id 'job-b' does not match the live job's run id 'job-a'" in intruder.stderr
    second = node(tmp_path, script, *node_args(1, endpoint=endpoint), "--run-id", "job-a")
    rc1, out1, err1 = finish(second)
    rc0, out0, err0 = finish(first)
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert out0.count("sum=10 run=job-a") + out1.count("sum=10 run=job-a") == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--base-rank", "3", "--world-size", "4"], "do not fit in --world-size 4"),
        (["--nnodes", "2", "--master-port", "0"], "needs a fixed port"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"],
            "must be below --nnodes",
        ),
        (["--nnodes", "3:1"], "0 < MIN <= MAX"),
        (["--world-size", "1"], "smaller than this node's 2 worker(s)"),
        (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:0"], "needs a fixed port"),
    ],
)
def test_wrong_layouts_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    script = write_script(tmp_path, "job.py", ALLREDUCE)
    result = run_cli(["run", "--cpu", "2", *args, str(script)], tmp_path, timeout=10)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.splitlines()) <= 4 and "Traceback" not in result.stderr


def _netns_available() -> bool:
    if os.geteuid() != 0 or (not Path("/usr/sbin/ip").exists() and not Path("/sbin/ip").exists()):
        return False
    name = f"mgprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


def _sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts() -> object:
    """Two network namespaces joined by a veth pair: hosts 10.231.<n>.1 and .2, nothing else."""
    if not _netns_available():
        tier_cannot_run("network namespaces need root and iproute2 (ip netns)")
    tag = os.getpid() % 200 + 20
    a, b = f"mga{os.getpid()}", f"mgb{os.getpid()}"
    va, vb = f"va{os.getpid()}"[:15], f"vb{os.getpid()}"[:15]
    ip_a, ip_b = f"10.231.{tag}.1", f"10.231.{tag}.2"
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        _sh("ip", "link", "set", va, "netns", a)
        _sh("ip", "link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, ip_a), (b, vb, ip_b)):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield {"a": (a, va, ip_a), "b": (b, vb, ip_b)}
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _in_ns(ns: str, dev: str, args: list[str], cwd: Path) -> subprocess.Popen[str]:
    from helpers import MULTIGPU, clean_env

    env = clean_env({"GLOO_SOCKET_IFNAME": dev})
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *MULTIGPU, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.matrix  # two network namespaces and a cut link: the heavy tier (scripts/fault_matrix.sh)
def test_two_hosts_in_namespaces_then_a_cut_link_ends_the_other(tmp_path: Path, two_hosts: dict) -> None:
    (ns_a, dev_a, ip_a), (ns_b, dev_b, _) = two_hosts["a"], two_hosts["b"]
    job = write_script(tmp_path, "job.py", ALLREDUCE)
    endpoint = f"{ip_a}:29555"

    def args(node: int, out: str, script: Path) -> list[str]:
        layout = node_args(node, endpoint=endpoint)
        return [
            "run",
            "--cpu",
            "1",
            *layout,
            "--rdzv-timeout",
            "30",
            "--grace-period",
            "1",
            "--output",
            str(tmp_path / out),
            str(script),
        ]

    first = _in_ns(ns_a, dev_a, args(0, "a1", job), tmp_path)
    second = _in_ns(ns_b, dev_b, args(1, "b1", job), tmp_path)
    rc0, out0, err0 = finish(first)
    rc1, out1, err1 = finish(second)
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert "sum=3" in out0 and "sum=3" in out1
    assert_gone(pids_in(out0 + out1))

    sleeper = write_script(tmp_path, "sleep.py", SLEEP)
    first = _in_ns(ns_a, dev_a, args(0, "a2", sleeper), tmp_path)
    second = _in_ns(ns_b, dev_b, args(1, "b2", sleeper), tmp_path)
    logs = [
        tmp_path / "a2" / "logs" / "attempt_0" / "rank_0.log",
        tmp_path / "b2" / "logs" / "attempt_0" / "rank_1.log",
    ]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(log.exists() and "pid=" in log.read_text() for log in logs):
        time.sleep(0.1)
    _sh("ip", "-n", ns_b, "link", "set", dev_b, "down")
    cut = time.monotonic()
    rc0, _, err0 = finish(first, timeout=30)
    took_a = time.monotonic() - cut
    rc1, _, err1 = finish(second, timeout=30)
    took_b = time.monotonic() - cut
    print(f"after the cut: node 0 ended in {took_a:.2f}s, node 1 in {took_b:.2f}s")
    assert rc0 != 0 and rc1 != 0
    assert "node 1 was lost: its launcher (host " in err0 and ") stopped beating" in err0
    assert took_a < 20 and took_b < 20  # fate sharing, not a 30 s time-out (latency: benchmarks)
    pids = [int(p) for p in re.findall(r"pid=(\d+)", "".join(log.read_text() for log in logs))]
    assert_gone(pids)


MANAGER_NODE = """
    import os, sys
    from multigpu import MultiGPUManager

    def train():
        import torch, torch.distributed as dist
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        print(f"pid={os.getpid()} rank={dist.get_rank()} world={dist.get_world_size()} "
              f"group={os.environ['GROUP_RANK']} sum={int(t.item())}", flush=True)

    if __name__ == "__main__":
        base, endpoint, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
        manager = MultiGPUManager(train, "0,1", rdzv_endpoint=endpoint, base_rank=base, world_size=4,
                                  device="cpu")
        if manager.is_available():
            manager.setup_multi_gpu_train(out)
        train()
        manager.finalize()
"""


def start_manager_nodes(tmp_path: Path, code: str) -> list[subprocess.Popen[str]]:
    """Two processes running ``code`` as MultiGPUManager nodes with base ranks 0 and 2 of a 2x2 job."""
    from helpers import PYTHON, clean_env

    script = write_script(tmp_path, "node.py", code)
    endpoint = f"127.0.0.1:{free_port()}"
    return [
        subprocess.Popen(
            [PYTHON, str(script), str(base), endpoint, str(tmp_path / f"o{base}")],
            cwd=tmp_path,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for base in (0, 2)
    ]


def test_manager_nodes_join_through_base_rank_and_world_size(tmp_path: Path) -> None:
    procs = start_manager_nodes(tmp_path, MANAGER_NODE)
    results = [finish(p) for p in procs]
    assert [rc for rc, _, _ in results] == [0, 0], "".join(err for _, _, err in results)
    out = "".join(o for _, o, _ in results)
    found = sorted(re.findall(r"rank=(\d) world=4 group=(\d) sum=10", out))
    assert found == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")]
    assert_gone(pids_in(out))


HELD = """
    import os, pathlib, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    here = pathlib.Path(__file__).parent
    with open(here / "ready.txt", "a") as f:
        f.write(f"pid={os.getpid()} rank={dist.get_rank()}\\n")
    deadline = time.monotonic() + 60
    while not (here / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
"""


def test_the_same_node_started_twice_is_refused(tmp_path: Path) -> None:
    # The job the two real nodes formed holds until the duplicate has been answered: waiting for that
    # event, not for a fixed time, keeps the duplicate from arriving after the job is already gone (CI
    # saw that race). The latecomer is refused alone; the job it came to finishes.
    script = write_script(tmp_path, "job.py", HELD)
    endpoint = f"127.0.0.1:{free_port()}"
    first, second = (
        node(tmp_path, script, *node_args(rank, endpoint=endpoint), "--rdzv-timeout", "20") for rank in (0, 1)
    )
    try:
        ready = wait_for_lines(tmp_path / "ready.txt", r"pid=(\d+)", 4, timeout=60)
        again = node(tmp_path, script, *node_args(1, endpoint=endpoint), "--rdzv-timeout", "20")
        rc, _, err = finish(again)
    finally:
        (tmp_path / "release").touch()
    assert rc == 1 and "is claimed by both" in err, err[-700:]
    results = [finish(p) for p in (second, first)]
    assert [code for code, _, _ in results] == [0, 0], [e[-700:] for _, _, e in results]
    assert_gone([int(pid) for pid in ready])


MANAGER_NODE_FAILING = """
    import os, sys, time
    from multigpu import MultiGPUManager

    def train():
        import torch, torch.distributed as dist
        print(f"pid={os.getpid()}", flush=True)
        dist.barrier()
        if dist.get_rank() == 3:
            time.sleep(0.3)
            raise RuntimeError("rank 3 broke on node 1")
        t = torch.ones(1)
        for _ in range(100000):
            dist.all_reduce(t)
            time.sleep(0.01)

    if __name__ == "__main__":
        base, endpoint, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
        manager = MultiGPUManager(train, "0,1", rdzv_endpoint=endpoint, base_rank=base, world_size=4,
                                  device="cpu", grace_period=1)
        manager.setup_multi_gpu_train(out)
        try:
            train()
        finally:
            manager.finalize()
"""


def test_manager_nodes_share_fate(tmp_path: Path) -> None:
    procs = start_manager_nodes(tmp_path, MANAGER_NODE_FAILING)
    results = [finish(p, timeout=60) for p in procs]
    assert all(rc != 0 for rc, _, _ in results)
    node0_err = results[0][2]
    assert "rank 3 (node 1" in node0_err and "rank 3 broke on node 1" in node0_err, node0_err[-2000:]
    assert_gone(pids_in("".join(out for _, out, _ in results)))


@pytest.mark.parametrize("difference", ["torch", "nproc"])
def test_nodes_with_a_different_torch_or_layout_are_refused_on_every_node(
    tmp_path: Path, difference: str
) -> None:
    """Node 1 sees another torch (a dist-info first on its path, as a second install would be) or starts
    one worker where node 0 starts two: both nodes refuse before any rank starts, in one line that
    names the nodes and the difference."""
    script = write_script(tmp_path, "job.py", ALLREDUCE)
    other = tmp_path / "other"
    info = other / "torch-2.12.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.12.0\n")
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        node(tmp_path, script, *node_args(0, endpoint=endpoint), "--rdzv-timeout", "30"),
        node(
            tmp_path,
            script,
            *node_args(1, endpoint=endpoint),
            "--rdzv-timeout",
            "30",
            *(["--cpu", "1"] if difference == "nproc" else []),
            env={"PYTHONPATH": str(other)} if difference == "torch" else None,
        ),
    ]
    results = [finish(p) for p in nodes]
    expected = (
        r"the nodes would run different things: torch differs: node 0 2\.13\S*, node 1 2\.12\.0; "
        r"every node refuses"
        if difference == "torch"
        # the node that came second is named
        else r"inconsistent layout: node (1 \(base rank 1, 1|0 \(base rank 0, 2) worker\(s\), .*\) "
        r"says world size (2, the job says 4|4, the job says 2)$"
    )
    lines = []
    for rc, out, err in results:
        assert rc == 1, err[-2000:]
        errors = [line for line in err.splitlines() if line.startswith("multigpu: error: ")]
        assert len(errors) == 1 and re.search(expected, errors[0]), err[-2000:]
        lines.append(errors[0])
        assert "pid=" not in out and "Traceback" not in err  # no rank started, no traceback
    assert lines[0] == lines[1]  # one verdict, the same on both nodes


@pytest.mark.matrix  # two pairs of nodes: the heavy tier (the mismatch cell runs the refusal there too)
def test_nodes_that_would_run_different_scripts_are_refused_on_every_node(tmp_path: Path) -> None:
    """The same file name, different contents: refused before any rank starts, on both nodes, in one
    line naming the difference; ``--allow-mismatch`` runs the job with a warning."""
    scripts = []
    for name, extra in (("a", ""), ("b", "    # edited on one node only\n")):
        folder = tmp_path / name
        folder.mkdir()
        scripts.append(write_script(folder, "job.py", ALLREDUCE + extra))

    def both_nodes(*extra: str) -> list[tuple[int, str, str]]:
        endpoint = f"127.0.0.1:{free_port()}"
        nodes = [
            node(tmp_path, scripts[r], *node_args(r, endpoint=endpoint), "--rdzv-timeout", "30", *extra)
            for r in (0, 1)
        ]
        return [finish(p) for p in nodes]

    for rc, out, err in both_nodes():
        assert rc == 1, err[-2000:]
        refusal = [line for line in err.splitlines() if "would run different things" in line]
        shown = "job.py differs between nodes: node 0 SHA-256 "
        assert len(refusal) == 1 and shown in refusal[0], err[-2000:]
        assert "pid=" not in out  # no rank started
    results = both_nodes("--allow-mismatch")
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert all("running anyway (--allow-mismatch)" in err for _, _, err in results)
    assert_gone(pids_in("".join(out for _, out, _ in results)))
