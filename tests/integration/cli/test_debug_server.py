"""``--debug-server``: torch's own debug server, run for real in a 2-rank CPU job, bound to loopback.

The page on rank 0's node answers with every rank's stacks, to whoever brings the run's token (printed
by the launcher) and to no one else: neither the page nor any rank's server answers without it, and
torch's worker servers listen on Unix sockets only their user can reach; every socket the job listens
on (the ranks' token proxies, the page, the store) is on 127.0.0.1; the page's helper process goes with
the job. Without torch's extra packages the option is one line naming the fix."""

from __future__ import annotations

import html
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from helpers import assert_gone, free_port, node_args, pids_in, run_cli, start_cli, write_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

JOB = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"pid={os.getpid()}", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)  # line 8: where the page must show both ranks
dist.barrier()
"""


def start_job(tmp_path: Path, job: Path, port: int, marker: Path) -> subprocess.Popen[str]:
    """The 2-rank job with its debug server on ``port``; its ranks wait for ``marker``."""
    argv = ["run", "--cpu", "2", "--grace-period", "1", "--output", str(tmp_path / "out")]
    return start_cli([*argv, "--debug-server", str(port), str(job), str(marker)], cwd=tmp_path)


def fetch(url: str, deadline: float) -> str:
    """The page at ``url``, once its server answers (bounded: the page process starts with torch)."""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=20) as reply:
                return str(reply.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def status_without_token(url: str) -> int | str:
    """What ``url`` answers a request without the token: an HTTP status, or why there was none."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError as exc:  # not HTTP (the store): nothing served either
        return type(exc).__name__


def test_the_page_shows_every_ranks_stack_and_everything_listens_on_loopback(tmp_path: Path) -> None:
    job = write_script(tmp_path, "job.py", JOB)
    marker = tmp_path / "go"
    port = free_port()
    launcher = start_job(tmp_path, job, port, marker)
    first = []
    try:
        assert launcher.stderr is not None
        while not any("debug server (torch's" in line for line in first):
            first.append(launcher.stderr.readline())
            assert first[-1], "".join(first)
        address = re.search(rf"http://127\.0\.0\.1:{port}/\?token=([\w-]+)", first[-1])
        assert address, first[-1]
        token = address.group(1)
        page = html.unescape(fetch(f"http://127.0.0.1:{port}/stacks?token={token}", time.monotonic() + 60))
        tree = [launcher.pid, *(c.pid for c in psutil.Process(launcher.pid).children(recursive=True))]
        sockets = [(pid, c) for pid in tree for c in psutil.Process(pid).net_connections("inet")]
        listening = [(pid, c.laddr.ip) for pid, c in sockets if c.status == psutil.CONN_LISTEN]
        ports = sorted({c.laddr.port for _, c in sockets if c.status == psutil.CONN_LISTEN})
        helpers = [
            c.pid
            for c in psutil.Process(launcher.pid).children(recursive=True)
            if "multigpu.rank.debug_frontend" in " ".join(c.cmdline())
        ]
        unix = [
            c.laddr
            for pid in tree
            for c in psutil.Process(pid).net_connections("unix")
            if c.laddr.startswith("/tmp/multigpu-debug-")
        ]
        modes = {Path(path).parent.stat().st_mode & 0o777 for path in unix}
        anonymous = {
            p: status_without_token(
                f"http://127.0.0.1:{p}/{'stacks' if p == port else 'handler/dump_traceback'}"
            )
            for p in ports
        }
        wrong = status_without_token(f"http://127.0.0.1:{port}/stacks?token=not-{token}")
    finally:
        marker.touch()
        out_text, err = launcher.communicate(timeout=60)
    err = "".join(first) + err
    assert launcher.returncode == 0, err[-3000:]
    assert len(unix) == 2 and modes == {0o700}, (unix, modes)  # each rank's worker server, private
    assert anonymous[port] == 403 and wrong == 403, anonymous
    assert list(anonymous.values()).count(403) >= 3, anonymous  # the page and both ranks' proxies
    assert 200 not in anonymous.values(), anonymous
    assert "Rank 0" in page and "Rank 1" in page, page[-2000:]
    assert len(re.findall(rf'{re.escape(str(job))}", line 8', page)) == 2, page[-2000:]
    assert {ip for _, ip in listening} == {"127.0.0.1"} and len(listening) >= 3, listening
    assert len(helpers) == 1
    assert f"multigpu: debug server (torch's, rank 0's node): http://127.0.0.1:{port}/?token={token}" in err
    assert "Traceback" not in err
    assert_gone([*pids_in(out_text), *helpers, *tree])
    assert not [u for u in unix if Path(u).parent.parent.exists()], unix  # the launcher's folder too


def test_a_killed_rank_leaves_no_socket_folder(tmp_path: Path) -> None:
    """A rank SIGKILLed cannot remove its worker server's folder; the launcher, which made the folder
    they are in, removes it as the run ends."""
    job = write_script(tmp_path, "job.py", JOB)
    launcher = start_job(tmp_path, job, free_port(), tmp_path / "never")
    try:
        deadline, unix = time.monotonic() + 60, []
        while len(unix) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "no worker server came up"
            tree = [c.pid for c in psutil.Process(launcher.pid).children(recursive=True)]
            unix = [
                (pid, c.laddr)
                for pid in tree
                for c in _unix(pid)
                if c.laddr.startswith("/tmp/multigpu-debug-")
            ]
            time.sleep(0.1)
        victim = unix[0][0]
        psutil.Process(victim).kill()
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 137 and f"pid {victim}" in err, err[-2000:]
    folders = {Path(path).parent.parent for _, path in unix}
    assert len(folders) == 1 and not any(f.exists() for f in folders), folders
    assert_gone([pid for pid, _ in unix])


def _unix(pid: int) -> list[object]:
    try:
        return list(psutil.Process(pid).net_connections("unix"))
    except psutil.Error:  # a process that ended meanwhile (the page's helper starting, say)
        return []


def test_without_the_extra_packages_the_option_is_one_line(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "aiohttp.py").write_text("raise ImportError('hidden by the test')\n")
    job = write_script(tmp_path, "job.py", "print('never runs')\n")
    res = run_cli(
        ["run", "--cpu", "1", "--debug-server", "8000", str(job)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(hidden)},
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[0] == (
        "multigpu run: error: --debug-server needs aiohttp (torch's debug server imports it): "
        "pip install 'multigpu[debug]'"
    ), res.stderr
    assert "Traceback" not in res.stderr
    assert "never runs" not in res.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "shared", [True, pytest.param(False, marks=pytest.mark.matrix)], ids=["one-token", "each-its-own"]
)
def test_on_two_nodes_the_page_reaches_the_ranks_that_share_its_token(tmp_path: Path, shared: bool) -> None:
    """The store holds addresses only, and the page signs its requests with its own node's token: with
    MULTIGPU_DEBUG_TOKEN the same on both nodes it shows all four ranks; without, node 1's ranks (their
    own launcher's token) answer 403 and nothing of theirs is shown."""
    job = write_script(tmp_path, "job.py", JOB)
    marker, port, endpoint = tmp_path / "go", free_port(), f"127.0.0.1:{free_port()}"
    env = {"MULTIGPU_DEBUG_TOKEN": "Shared_token-0123456789"} if shared else None
    argv = ["run", "--cpu", "2", "--grace-period", "1", "--output", str(tmp_path / "out")]
    nodes = [
        start_cli(
            [*argv, *node_args(rank, endpoint=endpoint), "--debug-server", str(port), str(job), str(marker)],
            cwd=tmp_path,
            env=env,
        )
        for rank in (1, 0)
    ]
    first = []
    try:
        assert nodes[1].stderr is not None
        while not any("debug server (torch's" in line for line in first):
            first.append(nodes[1].stderr.readline())
            assert first[-1], "".join(first)
        address = re.search(rf"http://127\.0\.0\.1:{port}/\?token=([\w-]+)", first[-1])
        assert address and (address.group(1) == "Shared_token-0123456789") == shared, first[-1]
        page = html.unescape(fetch(address.group(0).replace("/?", "/stacks?"), time.monotonic() + 60))
    finally:
        marker.touch()
        ends = [(node.communicate(timeout=60), node.returncode) for node in nodes]
    assert [code for _, code in ends] == [0, 0], "".join(first) + "".join(err for (_, err), _ in ends)[-3000:]
    assert all(f"Rank {r}" in page for r in range(4)), page[-3000:]
    stacks = len(re.findall(rf'{re.escape(str(job))}", line 8', page))
    assert (stacks, page.count("status=403")) == ((4, 0) if shared else (2, 2)), page[-3000:]
    assert_gone(pids_in("".join(out for (out, _), _ in ends)))
