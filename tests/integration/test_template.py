"""The warm worker template with real launches: forked ranks look fresh, restarts fork again from the
same template, the store outlives rank 0 (with and without the template), and a launcher SIGKILL
leaves nothing behind, the template and its store included. Every test proves by PID that what it
started is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import assert_gone, numpy_site, pids_in, run_cli, start_cli, wait_gone, write_script

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(120)]

# What a rank can see of itself at the first line of its script, before it imports anything.
REPORT = """
import json, os, random, sys, threading
forked = "torch" in sys.modules  # a rank forked from the template has torch already
import torch
launcher = os.getppid()
import psutil
def of_template(p):
    try:
        return "multigpu.template" in " ".join(p.cmdline())
    except psutil.Error:  # a sentinel's short-lived middle process
        return False
forks = [p for p in psutil.Process(launcher).children() if of_template(p)]
template = [min(forks, key=lambda p: p.create_time()).pid] if forks else []  # forks keep its cmdline
fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
print("REPORT " + json.dumps({
    "rank": int(os.environ["RANK"]), "pid": os.getpid(), "pgid": os.getpgrp(), "sid": os.getsid(0),
    "ppid": launcher, "forked": forked, "template": template, "random": random.random(),
    "torch_seed": torch.initial_seed(), "threads": len(os.listdir("/proc/self/task")),
    "fds": fds,
    "fd_targets": sorted(os.readlink(f"/proc/self/fd/{f}").split(":")[0] for f in fds
                         if os.path.exists(f"/proc/self/fd/{f}")),
    "argv": sys.argv, "path0": sys.path[0], "name": __name__, "cwd": os.getcwd(),
    "restart": os.environ["TORCHELASTIC_RESTART_COUNT"],
}), flush=True)
"""


def reports(text: str) -> list[dict[str, Any]]:
    return [json.loads(line.split("REPORT ", 1)[1]) for line in text.splitlines() if "REPORT " in line]


def gone_after(out_text: str, extra: list[int]) -> None:
    pids = [r["pid"] for r in reports(out_text)] + extra
    assert_gone(pids)


def test_forked_ranks_look_fresh(tmp_path: Path) -> None:
    """Per-rank independence, and a forked rank's view matches a plain-spawned rank's."""
    job = write_script(tmp_path, "job.py", REPORT)
    warm = run_cli(["run", "--cpu", "2", "--status", "off", str(job), "a1"], cwd=tmp_path)
    cold = run_cli(["run", "--cpu", "2", "--status", "off", "--no-template", str(job), "a1"], cwd=tmp_path)
    assert warm.returncode == 0 and cold.returncode == 0, warm.stderr + cold.stderr
    forked, plain = reports(warm.stdout), reports(cold.stdout)
    assert len(forked) == 2 and len(plain) == 2
    assert all(r["forked"] for r in forked) and not any(r["forked"] for r in plain)
    assert "plain processes (--no-template)" in cold.stderr and "plain processes" not in warm.stderr
    template = forked[0]["template"]
    assert len(template) == 1 and forked[1]["template"] == template
    for r in forked:
        assert r["pgid"] == r["pid"] and r["sid"] == r["pid"]  # own session and group
        assert r["pid"] not in template  # threads: as many as a plain rank has (its watchdog), below
    assert len({r["pid"] for r in forked}) == 2
    assert len({r["random"] for r in forked}) == 2 and len({r["torch_seed"] for r in forked}) == 2
    same = ("fds", "fd_targets", "argv", "path0", "name", "cwd", "threads")
    by_rank = {r["rank"]: r for r in plain}
    for r in forked:
        assert {k: r[k] for k in same} == {k: by_rank[r["rank"]][k] for k in same}
        assert r["ppid"] != template[0]  # re-parented to the launcher
    assert forked[0]["argv"] == [str(job), "a1"]
    gone_after(warm.stdout + cold.stdout, template)


POOLS = """
import json, os, sys
forked = "torch" in sys.modules
import torch, threadpoolctl
blas = {i["internal_api"]: i["num_threads"] for i in threadpoolctl.threadpool_info()
        if i["user_api"] == "blas"}
print("POOLS " + json.dumps({
    "rank": int(os.environ["RANK"]), "pid": os.getpid(), "forked": forked, "numpy": "numpy" in sys.modules,
    "torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads(), "blas": blas}), flush=True)
"""


@pytest.mark.parametrize("numpy", ["numpy", "no-numpy"])
@pytest.mark.parametrize(
    ("nproc", "extra"),
    [
        ("1", {}),
        pytest.param("2", {"OPENBLAS_NUM_THREADS": "2"}, marks=pytest.mark.matrix),
        pytest.param("2", {}, marks=pytest.mark.matrix),
        pytest.param("1", {"MKL_NUM_THREADS": "1"}, marks=pytest.mark.matrix),
    ],
)
def test_a_forked_rank_sizes_its_thread_pools_as_a_fresh_one(
    tmp_path: Path, numpy: str, nproc: str, extra: dict[str, str]
) -> None:
    """Issue 31, case 4: NumPy's OpenBLAS started its pool at the template's ``import torch`` (one rank
    per node: OMP_NUM_THREADS=2 here) and the template refused to fork. Held to one thread there, each
    rank sizes torch's and the BLAS pools from its own environment, as a fresh rank does."""
    env = dict(extra)
    if numpy == "numpy":
        site = numpy_site()
        if site is None:
            pytest.skip("pip could not install numpy here")
        env["PYTHONPATH"] = str(site)
    job = write_script(tmp_path, "job.py", POOLS)
    runs = {
        flag: run_cli(["run", "--cpu", nproc, "--status", "off", *flags, str(job)], cwd=tmp_path, env=env)
        for flag, flags in (("warm", []), ("cold", ["--no-template"]))
    }
    for done in runs.values():
        assert done.returncode == 0, done.stderr
    assert "plain processes" not in runs["warm"].stderr, runs["warm"].stderr
    seen = {
        flag: sorted(
            (json.loads(line.split("POOLS ", 1)[1]) for line in done.stdout.splitlines() if "POOLS " in line),
            key=lambda r: r["rank"],
        )
        for flag, done in runs.items()
    }
    assert_gone([r.pop("pid") for rs in seen.values() for r in rs])
    assert len(seen["warm"]) == int(nproc) and all(r.pop("forked") for r in seen["warm"])
    assert not any(r.pop("forked") for r in seen["cold"])
    assert seen["warm"] == seen["cold"]
    assert all(r["numpy"] == (numpy == "numpy") and bool(r["blas"]) == r["numpy"] for r in seen["warm"])


STORE_AFTER_RANK0 = """
import os, sys, time, pathlib, datetime
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
dist.barrier()  # both ranks' gloo meshes are complete (rank 0 leaving mid-connect fails rank 1's init)
rank = dist.get_rank()
if rank == 0:
    pathlib.Path("rank0.pid.tmp").write_text(str(os.getpid()))
    os.replace("rank0.pid.tmp", "rank0.pid")  # whole or not at all: rank 1 polls for it
    sys.exit(0)  # finishes first; its peer still needs the store
deadline = time.monotonic() + 20
while not pathlib.Path("rank0.pid").exists() and time.monotonic() < deadline:
    time.sleep(0.01)
pid = int(pathlib.Path("rank0.pid").read_text())
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
    except (ProcessLookupError, FileNotFoundError):
        break
    time.sleep(0.01)
group = dist.new_group([1], use_local_synchronization=True)  # a store-based barrier of its own
dist.barrier(group=group)
print(f"pid={os.getpid()} subgroup made after rank 0 had gone", flush=True)
"""


@pytest.mark.parametrize("mode", ["template", "no-template"])
def test_the_store_outlives_rank_0(tmp_path: Path, mode: str) -> None:
    """Rank 0 exits first; rank 1 still makes a subgroup through the store (torchrun's agent holds
    the store, so this works there; when rank 0's bootstrap served it, it failed with Broken pipe)."""
    job = write_script(tmp_path, "job.py", STORE_AFTER_RANK0)
    flags = ["--no-template"] if mode == "no-template" else []
    res = run_cli(["run", "--cpu", "2", "--status", "off", *flags, str(job)], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "subgroup made after rank 0 had gone" in res.stdout
    assert_gone([*pids_in(res.stdout), int((tmp_path / "rank0.pid").read_text())])


RESTART = (
    REPORT
    + """
import torch.distributed as dist
dist.init_process_group("gloo")
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
    os._exit(3)
dist.barrier()
dist.destroy_process_group()
"""
)


def test_module_mode_restart_forks_from_the_same_template(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    write_script(tmp_path / "pkg", "job.py", RESTART)
    res = run_cli(
        [
            "run",
            "--cpu",
            "2",
            "--status",
            "off",
            "--max-restarts",
            "1",
            "--grace-period",
            "1",
            "-m",
            "pkg.job",
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    seen = reports(res.stdout)
    assert sorted((r["restart"], r["rank"]) for r in seen) == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    assert all(r["forked"] and r["name"] == "__main__" for r in seen)
    assert all(r["argv"] == [str(tmp_path / "pkg" / "job.py")] for r in seen)
    assert len({tuple(r["template"]) for r in seen}) == 1  # one template for both attempts
    gone_after(res.stdout, seen[0]["template"])


def test_launcher_sigkill_leaves_nothing(tmp_path: Path) -> None:
    """The ranks, their children, the template and its store process all go with the launcher."""
    job = write_script(
        tmp_path,
        "job.py",
        """
import os, pathlib, subprocess, time
child = subprocess.Popen(["sleep", "60"])
pathlib.Path(f"ready_{os.environ['RANK']}").write_text(f"{os.getpid()} {child.pid}")
time.sleep(60)
""",
    )
    proc = start_cli(["run", "--cpu", "2", "--status", "off", str(job)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready_{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
            time.sleep(0.05)
        pids = [int(p) for r in (0, 1) for p in (tmp_path / f"ready_{r}").read_text().split()]
        hosts = [
            p.pid
            for p in psutil.Process(proc.pid).children(recursive=True)
            if p.pid not in pids and "multigpu.template" in " ".join(p.cmdline())
        ]
        assert len(hosts) >= 2, hosts  # the template and its store process
        sentinels = [
            p.pid
            for p in psutil.Process(proc.pid).children()
            if "multigpu.rank.sentinel" in " ".join(p.cmdline())
        ]
        assert len(sentinels) == 1, sentinels  # the node's one sentinel; no rank forked its own
        os.kill(proc.pid, signal.SIGKILL)
        left = wait_gone(pids + hosts + sentinels, timeout=5.0)
        assert not left, f"alive after the launcher's SIGKILL: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL


def test_a_template_that_cannot_start_falls_back(tmp_path: Path) -> None:
    """A --preload that fails to import: the run goes on with plain processes, said in one line."""
    job = write_script(tmp_path, "job.py", "import os\nprint(f'pid={os.getpid()}', flush=True)\n")
    res = run_cli(
        ["run", "--cpu", "2", "--status", "off", "--preload", "no_such_module_here", str(job)], cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    notes = [line for line in res.stderr.splitlines() if "template failed to start" in line]
    assert len(notes) == 1 and "no_such_module_here" in notes[0], res.stderr
    assert "plain processes" in res.stderr
    assert_gone(pids_in(res.stdout))


def test_plain_launch_env_reaches_forked_rank(tmp_path: Path) -> None:
    """A variable set for the ranks only in one rank's environment (here: RANK) is the rank's own,
    and OMP_NUM_THREADS is applied as a fresh rank reads it."""
    job = write_script(
        tmp_path,
        "job.py",
        """
import os, torch
print(f"pid={os.getpid()} omp={os.environ['OMP_NUM_THREADS']} threads={torch.get_num_threads()}", flush=True)
""",
    )
    res = run_cli(
        ["run", "--cpu", "2", "--status", "off", str(job)], cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("omp=1 threads=1") == 2
    assert_gone(pids_in(res.stdout))


CLOSE = """
import json, os, sys
from multigpu.contract.prctl import set_child_subreaper
from multigpu.config.endpoint import Endpoint
from multigpu.rendezvous.store import bind_store_socket
from multigpu.template.process import StoreSocket, TemplateProcess
set_child_subreaper()  # as a launcher is
sock = bind_store_socket(Endpoint("127.0.0.1", 0))
host, port = sock.getsockname()[:2]
template = TemplateProcess(dict(os.environ))
template.configure(StoreSocket(sock.fileno(), host, port), ())
assert template.wait_ready() is None
pids = [template.process.pid, template.store_pid]
template.close()
print(json.dumps({"pids": pids, "left": [p for p in pids if os.path.exists(f"/proc/{p}")]}))
"""


def test_closing_the_template_ends_and_reaps_it_and_its_store(tmp_path: Path) -> None:
    """The template and its store hold nothing a user needs once the ranks are gone: close() ends
    both at once and reaps both (no zombie left for the launcher's own exit to leave behind)."""
    res = subprocess.run(
        [sys.executable, "-c", CLOSE], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    assert len(seen["pids"]) == 2 and all(seen["pids"])
    assert seen["left"] == []
    assert_gone(seen["pids"])


def test_a_rank_leaving_does_not_run_the_templates_finalizers(tmp_path: Path) -> None:
    """A --preload module's temporary folder belongs to the template: rank 0 exiting must not delete it
    while rank 1 still runs (the template's weakref finalizers stay the template's)."""
    (tmp_path / "holder.py").write_text("import tempfile\nFOLDER = tempfile.TemporaryDirectory()\n")
    job = write_script(
        tmp_path,
        "job.py",
        """
import os, pathlib, time, holder
folder = pathlib.Path(holder.FOLDER.name)
if os.environ["RANK"] == "0":
    pathlib.Path("rank0_pid").write_text(str(os.getpid()))
    raise SystemExit(0)
while not pathlib.Path("rank0_pid").exists():
    time.sleep(0.02)
pid = int(pathlib.Path("rank0_pid").read_text())
deadline = time.monotonic() + 30
while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
    time.sleep(0.02)
print(f"pid={os.getpid()} folder={folder} exists={folder.is_dir()}", flush=True)
""",
    )
    res = run_cli(
        ["run", "--cpu", "2", "--status", "off", "--preload", "holder", str(job)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "exists=True" in res.stdout, res.stdout[-2000:]
    assert_gone(pids_in(res.stdout))


KEEP = """
import json, os, socket, sys
from datetime import timedelta
from torch.distributed import TCPStore
from multigpu.contract.prctl import set_child_subreaper
from multigpu.config.endpoint import Endpoint
from multigpu.rendezvous.store import bind_store_socket
from multigpu.template.process import StoreSocket, TemplateProcess
set_child_subreaper()  # as a launcher is

def launch_store():
    sock = bind_store_socket(Endpoint("127.0.0.1", 0))
    host, port = sock.getsockname()[:2]
    return sock, StoreSocket(sock.fileno(), host, port)

def serves(port):
    try:
        TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5)).set("k", "v")
        return True
    except Exception:
        return False

template = TemplateProcess(dict(os.environ))
first_sock, first = launch_store()
template.configure(first, ())
assert template.wait_ready() is None
out = {"first_store": template.store_pid, "first_serves": serves(first.port)}
out["released"] = template.release()  # the launch is over: its store ends, its socket closes
first_sock.close()
out["first_store_left"] = os.path.exists(f"/proc/{out['first_store']}")
with socket.socket() as probe:
    out["first_port_open"] = probe.connect_ex(("127.0.0.1", first.port)) == 0
second_sock, second = launch_store()
template.configure(second, ())  # the next launch: the same template, a store on its socket
out["ready_again"] = template.wait_ready()
out["second_store"] = template.store_pid
out["second_serves"] = serves(second.port)
out["pids"] = [template.process.pid, template.store_pid]
template.close()
print(json.dumps(out))
"""


def test_a_kept_template_serves_the_next_launchs_store(tmp_path: Path) -> None:
    """``multigpu.launch``'s launcher keeps its template between launches: the first launch's store ends
    and its port is closed when the launch is over, and the next launch's store is served on its own
    socket by the same template."""
    res = subprocess.run(
        [sys.executable, "-c", KEEP], capture_output=True, text=True, timeout=90, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["first_serves"] and out["released"] and out["ready_again"] is None, out
    assert not out["first_store_left"] and not out["first_port_open"], out
    assert out["second_store"] not in (None, out["first_store"]) and out["second_serves"], out
    assert_gone([*out["pids"], out["first_store"]])
