"""``multigpu store``: elastic jobs' rendezvous store off the training nodes. A 3-node elastic job
loses the node that started first (its launcher kill -9ed) and finishes on the other two; a second
job with another --rdzv-id then runs on the same store; the store ends on SIGTERM in one line."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import (
    MULTIGPU,
    assert_gone,
    clean_env,
    free_port,
    node_args,
    pids_in,
    run_cli,
    start_cli,
    write_script,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(150)]

LOOP = """
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    world, restart = dist.get_world_size(), os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"pid={os.getpid()} world={world} restart={restart}", flush=True)
    t = torch.ones(1)
    for _ in range(int(os.environ.get("STEPS", "30"))):
        dist.all_reduce(t)
        time.sleep(0.1)
    print(f"done world={world} restart={restart}", flush=True)
"""


def store_process(port: int, tmp_path: Path) -> subprocess.Popen[str]:
    store = subprocess.Popen(
        [*MULTIGPU, "store", f"127.0.0.1:{port}"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert store.stderr is not None
    line = store.stderr.readline()  # the one status line, once it serves
    assert "serving the rendezvous store at 127.0.0.1:" in line and "trusted network" in line, line
    return store


def elastic_node(
    tmp_path: Path, port: int, rdzv_id: str, i: int, steps: str = "30", last_call: str = "1"
) -> subprocess.Popen[str]:
    layout = [
        *node_args(None, "2:3", endpoint=f"127.0.0.1:{port}"),
        "--rdzv-conf",
        f"is_host=false,last_call_timeout={last_call}",
        "--rdzv-id",
        rdzv_id,
    ]
    return start_cli(
        [
            "run",
            *layout,
            "--max-restarts",
            "2",
            "--nproc-per-node",
            "1",
            "--grace-period",
            "1",
            "--output",
            str(tmp_path / f"{rdzv_id}{i}"),
            "loop.py",
        ],
        cwd=tmp_path,
        env={"STEPS": steps},
    )


@pytest.mark.matrix  # too heavy for the README's 8 minutes: the matrix tier runs it (scripts/fault_matrix.sh)
def test_a_job_outlives_the_loss_of_any_node_and_the_store_serves_the_next_job(tmp_path: Path) -> None:
    write_script(tmp_path, "loop.py", LOOP)
    port = free_port()
    store = store_process(port, tmp_path)
    nodes: list[subprocess.Popen[str]] = []
    try:
        nodes += [elastic_node(tmp_path, port, "first", i) for i in range(3)]
        out0 = tmp_path / "first0"
        deadline = time.monotonic() + 60
        seen = ""
        assert nodes[0].stdout is not None
        while "world=3" not in seen and time.monotonic() < deadline:  # node 0's rank runs in a round of 3
            seen += nodes[0].stdout.readline()
        assert "world=3" in seen, seen
        nodes[0].kill()  # the node that came first: with torchrun's default its launcher held the store
        first_pids = pids_in(seen)
        results = [n.communicate(timeout=90) for n in nodes[1:]]
        for node, (out, err) in zip(nodes[1:], results, strict=True):
            assert node.returncode == 0, err
            assert "plain processes" not in err, err  # every round's rank forked from the template
            assert re.search(r"done world=2 restart=1", out), out + err
            assert "Traceback" not in err and "Exception raised from" not in err, err
        nodes[0].wait()
        assert_gone(first_pids + [p for out, _ in results for p in pids_in(out)])
        assert out0.exists()

        second = [elastic_node(tmp_path, port, "second", i, steps="3") for i in range(2)]
        nodes += second
        done = [n.communicate(timeout=60) for n in second]
        assert [n.returncode for n in second] == [0, 0], [err for _, err in done]
        assert all("done world=2 restart=0" in out for out, _ in done), done
        assert_gone([p for out, _ in done for p in pids_in(out)])
    finally:
        for node in nodes:  # a failed assertion leaves launchers running: end them, close their pipes
            if node.poll() is None:
                node.kill()
            node.communicate(timeout=30)
        store.send_signal(signal.SIGTERM)
        _, err = store.communicate(timeout=10)
    assert store.returncode == 0 and "SIGTERM received; stopped" in err, err
    assert_gone([store.pid])


@pytest.mark.matrix  # two launchers and a store restarted under them: the matrix tier runs it
def test_a_store_restarted_mid_job_is_named_as_the_store_not_a_killed_launcher(tmp_path: Path) -> None:
    """Issue 43: ``multigpu store`` restarted under a running job read "its launcher was killed?" on
    every node, though no launcher serves it. Each node says, once, that the store went away."""
    write_script(tmp_path, "loop.py", LOOP)
    port = free_port()
    store = store_process(port, tmp_path)
    nodes: list[subprocess.Popen[str]] = []
    try:
        nodes += [elastic_node(tmp_path, port, "restarted", i, steps="600") for i in range(2)]
        deadline = time.monotonic() + 60
        seen = ""
        assert nodes[0].stdout is not None
        while "world=2" not in seen and time.monotonic() < deadline:
            seen += nodes[0].stdout.readline()
        assert "world=2" in seen, seen
        store.send_signal(signal.SIGTERM)
        store.communicate(timeout=10)
        store = store_process(port, tmp_path)  # back at the same address, empty
        results = [n.communicate(timeout=60) for n in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
            node.communicate(timeout=30)
        store.send_signal(signal.SIGTERM)
        store.communicate(timeout=10)
    for node, (_, err) in zip(nodes, results, strict=True):
        assert node.returncode != 0, err
        lost = [line for line in err.splitlines() if line.endswith("; stopping")]
        assert lost == [
            "multigpu: the rendezvous store went away (stopped or restarted? a restarted store has lost "
            "the job's state); stopping"
        ], err
        assert "launcher was killed" not in err and "Traceback" not in err, err
    assert_gone([*pids_in(seen), *(p for out, _ in results for p in pids_in(out)), store.pid])


@pytest.mark.matrix  # three launchers and a store: the matrix tier runs it (scripts/fault_matrix.sh)
def test_the_round_wait_after_a_lost_node_lists_only_live_launchers(tmp_path: Path) -> None:
    """Node 0's launcher kill -9ed: the survivors' next round waits out last_call_timeout (8 s here),
    and its line names the two live launchers only, not the dead one torch's state still holds."""
    write_script(tmp_path, "loop.py", LOOP)
    port = free_port()
    store = store_process(port, tmp_path)
    nodes = [elastic_node(tmp_path, port, "wait", i, last_call="8") for i in range(3)]
    try:
        seen = ""
        assert nodes[0].stdout is not None
        deadline = time.monotonic() + 60
        while "world=3" not in seen and time.monotonic() < deadline:
            seen += nodes[0].stdout.readline()
        assert "world=3" in seen, seen
        nodes[0].kill()
        results = [n.communicate(timeout=90) for n in nodes[1:]]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
            node.communicate(timeout=30)
        store.send_signal(signal.SIGTERM)
        store.communicate(timeout=10)
    dead = f"127.0.0.1 pid {nodes[0].pid}"
    lines = [line for _, err in results for line in err.splitlines() if "waiting for more" in line]
    assert lines and all(dead not in line for line in lines), lines
    assert all(f"pid {node.pid}" in "".join(lines) for node in nodes[1:]), lines
    assert all(node.returncode == 0 for node in nodes[1:]), [err for _, err in results]


def test_store_usage_mistakes_are_one_line(tmp_path: Path) -> None:
    for args, message in (
        (["store"], "HOST:PORT"),
        (["store", "127.0.0.1:0"], "fixed port"),
        (["store", "localhost"], "has no port"),
        (["store", "127.0.0.1"], "with the fixed port the jobs name in --rdzv-endpoint"),
    ):
        done = run_cli(args, cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and "port 0" not in done.stderr, done.stderr
