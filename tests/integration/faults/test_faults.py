"""The fault matrix with real ``python -m multigpu run --cpu 2`` launches.

Workers print ``pid=<n>`` (and ``gc=<n>`` for every grandchild they start); the launcher's run.json
holds every rank's PID too. Each test bounds its time and proves by PID that nothing it started is
still alive. The ranks are forked from the node's template (which imported torch once); a few tests
run again with ``--no-template`` (fresh processes, a store process serving the store).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import (
    MULTIGPU,
    PYTHON,
    alive,
    assert_gone,
    clean_env,
    pids_in,
    run_cli,
    start_cli,
    wait_gone,
    write_script,
)
from multigpu.supervisor.stop_requests import SAME_INTERRUPT_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

GRACE = "0.5"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
RUN_TIMEOUT = 60.0

# Common prologue: the rank, its pid on stdout, and a ready marker the test (or a peer) can wait for.
PROLOGUE = """
import os, pathlib, signal, subprocess, sys, time
RANK = int(os.environ["RANK"])
print(f"rank={RANK} pid={os.getpid()}", flush=True)

def ready(name=None):
    pathlib.Path(f"ready_{RANK if name is None else name}").touch()

def wait_ready(name, timeout=30):
    deadline = time.monotonic() + timeout
    while not os.path.exists(f"ready_{name}"):
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.01)

def grandchild():
    child = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL)
    print(f"gc={child.pid}", flush=True)
    return child
"""


def script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    return write_script(tmp_path, name, PROLOGUE + body)


def record(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "run.json").read_text())
    return data


def log(out: Path, rank: int, attempt: int = 0) -> str:
    return (out / "logs" / f"attempt_{attempt}" / f"rank_{rank}.log").read_text()


def rank_pids(out: Path) -> list[int]:
    """Every rank's PID over every attempt, from the run record."""
    return [r["pid"] for a in record(out)["attempts"] for r in a["ranks"].values() if r["pid"]]


def grandchild_pids(out: Path) -> list[int]:
    logs = out / "logs"
    return [pid for p in sorted(logs.glob("attempt_*/rank_*.log")) for pid in pids_in(p.read_text(), "gc")]


def wait_files(directory: Path, names: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all((directory / n).exists() for n in names):
        assert time.monotonic() < deadline, f"never appeared: {names}"
        time.sleep(0.02)


def run_args(out: Path, *extra: str, nproc: int = 2) -> list[str]:
    return ["run", "--cpu", str(nproc), "--grace-period", GRACE, "--output", str(out), *extra]


@pytest.fixture
def launched() -> Iterator[list[subprocess.Popen[str]]]:
    """Launchers a test started; any still running at the end are SIGKILLed by PID (their workers follow)."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def finish(proc: subprocess.Popen[str], timeout: float = RUN_TIMEOUT) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


# ---- a rank fails by itself ----------------------------------------------------------------------------


def test_rank_raises_report_and_record(tmp_path: Path, launched: list[subprocess.Popen[str]]) -> None:
    job = script(
        tmp_path,
        """
if RANK == 1:
    def load_batch():
        raise ValueError("boom from rank 1")
    load_batch()
time.sleep(60)
""",
    )
    out = tmp_path / "out"
    proc = start_cli(run_args(out, str(job)), cwd=tmp_path)
    launched.append(proc)
    rc, _, err = finish(proc)
    exited = time.time()
    assert rc == 1, err
    assert "root cause: rank 1" in err
    assert "ValueError: boom from rank 1" in err
    assert "Traceback (most recent call last)" in err and 'raise ValueError("boom from rank 1")' in err
    assert "in load_batch" in err
    error_file = out / "logs" / "attempt_0" / "error_rank_1.json"
    error = json.loads(error_file.read_text())
    assert (error["error_type"], error["message"], error["rank"]) == ("ValueError", "boom from rank 1", 1)
    assert "load_batch" in error["traceback"]
    print(f"launcher exited {exited - error['time']:.3f}s after rank 1 raised (incl. interpreter exit)")
    attempt = record(out)["attempts"][0]
    root = attempt["root_cause"]
    assert (root["rank"], root["error_type"], root["message"], root["exit_code"]) == (
        1,
        "ValueError",
        "boom from rank 1",
        1,
    )
    assert "load_batch" in root["traceback"]
    assert attempt["ranks"]["0"]["state"] == "stopped" and attempt["ranks"]["1"]["state"] == "failed"
    assert f"rank 0 (pid {attempt['ranks']['0']['pid']}): stopped by the launcher" in err
    assert record(out)["exit_code"] == 1
    assert_gone(rank_pids(out))


OWN_PATH = "/multigpu/"  # a path under our package: a frame of ours shown unfolded


def test_one_rank_valueerror_console(tmp_path: Path) -> None:
    """Issue 22, the newcomer's case: ``multigpu run --cpu 2 fail.py``, rank 1 raises ValueError. The
    console ends with the summary, the root cause, and one line for rank 0; no stack dump of the
    surviving rank and none of our frames reach it (the dump, if it came, is in rank 0's log)."""
    shutil.copy(EXAMPLES / "fail.py", tmp_path / "fail.py")
    res = subprocess.run(
        [*MULTIGPU, "run", "--cpu", "2", "fail.py"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    console = res.stdout
    print(console)
    assert res.returncode == 1, console
    (out,) = (tmp_path / "multigpu_runs").iterdir()
    ranks = record(out)["attempts"][0]["ranks"]
    assert ranks["0"]["state"] == "stopped" and ranks["1"]["state"] == "failed", ranks
    summary = console.index("multigpu: summary")
    root = console.index("root cause: rank 1 (node 0, pid")
    other = [line for line in console.splitlines() if line.startswith("rank 0 (pid ")]
    assert len(other) == 1 and other[0].startswith(f"rank 0 (pid {ranks['0']['pid']}): stopped "), console
    assert summary < root < console.index(other[0])
    assert re.search(r"rank 0 +pid \d+ +cpu +stopped ", console[summary:root]), console
    assert "most recent call first" not in console and OWN_PATH not in console, console
    assert "GLHF" not in console[console.index("loss is NaN") :], console  # rank 0's consequence: log only
    assert_gone([r["pid"] for r in ranks.values()])


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        ("sys.exit(7)", 7, "exited with code 7"),
        ("import ctypes; ctypes.string_at(0)", 128 + signal.SIGSEGV, "killed by SIGSEGV"),
        ("os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL, "killed by SIGKILL"),
    ],
    ids=["exit7", "segfault", "sigkill"],
)
def test_rank_dies(tmp_path: Path, body: str, code: int, words: str) -> None:
    job = script(
        tmp_path,
        f"""
if RANK == 1:
    {body}
time.sleep(60)
""",
    )
    out = tmp_path / "out"
    t0 = time.monotonic()
    res = run_cli(run_args(out, str(job)), cwd=tmp_path, timeout=RUN_TIMEOUT)
    print(f"run took {time.monotonic() - t0:.2f}s")
    assert res.returncode == code, res.stderr
    assert "root cause: rank 1 (node 0, pid" in res.stderr and words in res.stderr
    root = record(out)["attempts"][0]["root_cause"]
    assert root["rank"] == 1
    if "SIG" in words:
        assert root["signal"] == words.split()[-1] and root["exit_code"] is None
    else:
        assert root["exit_code"] == 7
    if "SIGSEGV" in words:  # faulthandler, registered by the bootstrap, left the crash's stack
        assert "Segmentation fault" in log(out, 1)
    assert record(out)["exit_code"] == code
    assert_gone(rank_pids(out))


def test_rank_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    job = script(
        tmp_path,
        """
if RANK == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready()
    time.sleep(60)
wait_ready(0)
sys.exit(1)
""",
    )
    out = tmp_path / "out"
    res = run_cli(run_args(out, str(job)), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert res.returncode == 1, res.stderr
    ranks = record(out)["attempts"][0]["ranks"]
    assert ranks["0"]["state"] == "stopped" and ranks["0"]["signal"] == "SIGKILL"
    assert (
        f"rank 0 (pid {ranks['0']['pid']}): still running {GRACE}s after SIGTERM; sending SIGKILL"
        in res.stderr
    )
    assert_gone(rank_pids(out))


def test_rank_stuck_in_collective_while_peer_dies(
    tmp_path: Path,
    launched: list[subprocess.Popen[str]],
) -> None:
    """Rank 1 dies; a forked child keeps its gloo sockets open, so rank 0's barrier never returns.

    The run must still end at once, with rank 0's stack (inside barrier) dumped into its log.
    """
    job = script(
        tmp_path,
        """
import torch.distributed as dist
dist.init_process_group("gloo")
if RANK == 1:
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(f"gc={child}", flush=True)
    time.sleep(0.5)
    os._exit(1)
dist.barrier()
print("barrier returned", flush=True)
""",
    )
    out = tmp_path / "out"
    proc = start_cli(run_args(out, str(job)), cwd=tmp_path)
    launched.append(proc)
    rc, _, err = finish(proc)
    exited = time.time()
    assert rc == 1, err
    attempt = record(out)["attempts"][0]
    took = exited - attempt["ranks"]["1"]["end_time"]
    print(f"launcher exited {took:.3f}s after rank 1 died, rank 0 stuck in barrier")
    assert took < 15  # far below gloo's 30-minute timeout: the launcher did not wait for it
    rank0 = log(out, 0)
    assert "barrier returned" not in rank0
    assert "most recent call first" in rank0 and " in barrier" in rank0
    assert attempt["ranks"]["0"]["state"] == "stopped"
    gcs = grandchild_pids(out)
    assert len(gcs) == 1
    assert_gone(rank_pids(out) + gcs)


@pytest.mark.parametrize("mode", [(), ("--no-template",)], ids=["template", "no-template"])
def test_grandchildren_are_gone_afterwards(tmp_path: Path, mode: tuple[str, ...]) -> None:
    """DataLoader-like children: a subprocess and a forked multiprocessing worker on rank 0, a
    subprocess on rank 1, which exits first; its group is signalled even though it has already exited."""
    job = script(
        tmp_path,
        """
import multiprocessing as mp
keep = grandchild()
if RANK == 0:
    loader = mp.get_context("fork").Process(target=time.sleep, args=(60,))
    loader.start()
    print(f"gc={loader.pid}", flush=True)
    ready()
    time.sleep(60)
wait_ready(0)
sys.exit(3)
""",
    )
    out = tmp_path / "out"
    res = run_cli(run_args(out, *mode, str(job)), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert res.returncode == 3, res.stderr
    gcs = grandchild_pids(out)
    assert len(gcs) == 3, res.stdout
    assert_gone(rank_pids(out) + gcs)


# ---- the launcher is signalled ---------------------------------------------------------------------------

SLEEPERS = """
keep = grandchild()
ready()
time.sleep(60)
"""


def start_sleepers(
    tmp_path: Path, launched: list[subprocess.Popen[str]], *extra: str, body: str = SLEEPERS
) -> tuple[subprocess.Popen[str], Path, list[int]]:
    """A launcher whose two ranks each started a grandchild and sleep; returns every PID involved."""
    job = script(tmp_path, body)
    out = tmp_path / "out"
    proc = start_cli(run_args(out, *extra, str(job)), cwd=tmp_path)
    launched.append(proc)
    wait_files(tmp_path, ["ready_0", "ready_1"])
    deadline = time.monotonic() + 10  # a rank's printed pid reaches its log just after its ready file
    while len(pids := rank_pids(out) + grandchild_pids(out)) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(pids) == 4, pids
    return proc, out, pids


@pytest.mark.parametrize("mode", [(), ("--no-template",)], ids=["template", "no-template"])
def test_launcher_sigkill_takes_everything_down(
    tmp_path: Path, launched: list[subprocess.Popen[str]], mode: tuple[str, ...]
) -> None:
    proc, _, pids = start_sleepers(tmp_path, launched, *mode)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    left = wait_gone(pids, timeout=3.0)
    took = time.monotonic() - t0
    print(f"after SIGKILL of the launcher, all {len(pids)} workers and grandchildren gone in {took:.3f}s")
    assert not left, f"still alive {took:.1f}s after the launcher's SIGKILL: {left}"
    proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL


# ---- descendants that left the rank's process group ------------------------------------------------------

ESCAPEES = """
def escape(kind):
    \"\"\"A descendant that is not in the rank's process group, its pid in esc_<kind> before it sleeps.\"\"\"
    if kind == "setsid":  # a child in a session of its own (start_new_session)
        child = subprocess.Popen(["sleep", "60"], start_new_session=True)
        pathlib.Path("esc_setsid").write_text(str(child.pid))
        return
    middle = os.fork()
    if middle:
        os.waitpid(middle, 0)
        return
    if kind == "daemon":  # fork, setsid, fork: the classic daemon
        os.setsid()
    if os.fork():
        os._exit(0)  # the grandchild is orphaned
    pathlib.Path(f"esc_{kind}.tmp").write_text(str(os.getpid()))
    os.rename(f"esc_{kind}.tmp", f"esc_{kind}")
    os.execvp("sleep", ["sleep", "60"])

if RANK == 1:
    pathlib.Path("rank_pgid").write_text(str(os.getpgrp()))
    for kind in KINDS:
        escape(kind)
"""
KINDS = ("setsid", "double_fork", "daemon")


def escapee_pids(tmp_path: Path) -> list[int]:
    """The three escapees' PIDs, once each is running; the setsid child and the daemon are checked to
    have left the rank's process group (a signal to the group cannot reach them)."""
    wait_files(tmp_path, [f"esc_{kind}" for kind in KINDS])
    pids = dict(zip(KINDS, (int((tmp_path / f"esc_{kind}").read_text()) for kind in KINDS), strict=True))
    rank_group = int((tmp_path / "rank_pgid").read_text())
    assert {kind: os.getpgid(pid) != rank_group for kind, pid in pids.items()} == {
        "setsid": True,
        "double_fork": False,
        "daemon": True,
    }
    return list(pids.values())


@pytest.mark.parametrize("end", ["launcher-sigkill", "normal-end", "failure"])
def test_descendants_that_left_the_group_go_with_the_run(
    tmp_path: Path, launched: list[subprocess.Popen[str]], end: str
) -> None:
    """setsid, a double fork and a daemon started by rank 1 are gone after any end of the run: the rank
    is a child subreaper, so they stay in its tree for the guard (launcher SIGKILL) and the launcher."""
    tail = {
        "launcher-sigkill": "ready()\ntime.sleep(60)\n",
        "normal-end": "",
        "failure": "if RANK == 1:\n    raise ValueError('after the escape')\n",
    }[end]
    job = script(tmp_path, f"KINDS = {KINDS!r}\n" + ESCAPEES + tail)
    out = tmp_path / "out"
    proc = start_cli(run_args(out, str(job)), cwd=tmp_path)
    launched.append(proc)
    pids = escapee_pids(tmp_path)
    if end == "launcher-sigkill":
        wait_files(tmp_path, ["ready_0", "ready_1"])
        os.kill(proc.pid, signal.SIGKILL)
    code, _, err = finish(proc)
    assert code == {"launcher-sigkill": -signal.SIGKILL, "normal-end": 0, "failure": 1}[end], err
    assert_gone(pids + rank_pids(out), timeout=5.0)


# After a Ctrl-C the launcher dies of SIGINT itself (so a shell loop stops); other stop signals exit
# 128 + N, SIGQUIT included (handled like SIGTERM, as torchrun does). SIGHUP is forwarded (below).
@pytest.mark.parametrize(
    ("sig", "code"),
    [(signal.SIGINT, -signal.SIGINT), (signal.SIGTERM, 143), (signal.SIGQUIT, 131)],
    ids=["SIGINT", "SIGTERM", "SIGQUIT"],
)
def test_launcher_signal_stops_everything(
    tmp_path: Path, launched: list[subprocess.Popen[str]], sig: signal.Signals, code: int
) -> None:
    proc, out, pids = start_sleepers(tmp_path, launched, "--max-restarts", "2")
    t0 = time.monotonic()
    os.kill(proc.pid, sig)
    rc, _, err = finish(proc, timeout=30)
    print(f"launcher exited {time.monotonic() - t0:.3f}s after {sig.name}")
    assert rc == code, err
    assert f"{sig.name} received" in err
    attempts = record(out)["attempts"]
    assert [a["status"] for a in attempts] == ["interrupted"]  # an interrupt is never retried
    assert record(out)["status"] == "interrupted" and record(out)["exit_code"] == abs(code) % 128 + 128
    assert record(out)["signal"] == sig.name
    assert_gone(pids)


def test_second_sigint_kills_at_once(tmp_path: Path, launched: list[subprocess.Popen[str]]) -> None:
    stubborn = """
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
keep = grandchild()
ready()
time.sleep(60)
"""
    out, proc = start_ready(tmp_path, stubborn, launched)
    pids = rank_pids(out) + grandchild_pids(out)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    told = read_until(proc, "SIGINT received: stopping every rank")
    # A press is "again" once the ranks were told and the first signal's echo window is over.
    time.sleep(max(0.0, t0 + SAME_INTERRUPT_S + 0.1 - time.monotonic()))
    assert proc.poll() is None  # the first Ctrl-C waits for the (30 s) grace period
    os.kill(proc.pid, signal.SIGINT)
    rc, _, err = finish(proc, timeout=15)
    err = told + err
    took = time.monotonic() - t0
    print(f"launcher exited {took:.3f}s after the first SIGINT (grace period 30s)")
    assert rc == -signal.SIGINT, err
    ranks = ", ".join(f"rank {r} (pid {p})" for r, p in enumerate(rank_pids(out)))
    assert f"{ranks}: still running after a second interrupt; sending SIGKILL" in err
    assert took < 15
    assert_gone(pids)


def start_ready(
    tmp_path: Path,
    body: str,
    launched: list[subprocess.Popen[str]],
) -> tuple[Path, subprocess.Popen[str]]:
    """A 2-rank run of ``body`` with a 30 s grace period, once both ranks are ready."""
    job = script(tmp_path, body)
    out = tmp_path / "out"
    proc = start_cli(
        ["run", "--cpu", "2", "--grace-period", "30", "--output", str(out), str(job)], cwd=tmp_path
    )
    launched.append(proc)
    wait_files(tmp_path, ["ready_0", "ready_1"])
    return out, proc


def read_until(proc: subprocess.Popen[str], text: str) -> str:
    """The launcher's stderr up to the line holding ``text`` (the test's timeout bounds the wait)."""
    assert proc.stderr is not None
    seen = ""
    while text not in seen:
        line = proc.stderr.readline()
        assert line, f"stderr ended before {text!r}:\n{seen}"
        seen += line
    return seen


TIDY_ON_SIGINT = """
def on_int(signum, frame):
    print(f"rank {RANK} tidying up", flush=True)
    time.sleep(0.3)
    print(f"rank {RANK} tidied", flush=True)
    sys.exit(0)
signal.signal(signal.SIGINT, on_int)
ready()
time.sleep(60)
"""


def assert_one_interrupt(out: Path, rc: int, err: str) -> None:
    """One SIGINT's worth: the ranks had their grace period and tidied up; nothing was SIGKILLed."""
    assert rc in (-signal.SIGINT, 124), err  # 124: timeout's own code for "it timed out"
    assert "SIGKILL" not in err and "second interrupt" not in err, err
    for rank in (0, 1):
        assert f"rank {rank} tidied" in log(out, rank), log(out, rank)
    assert_gone(rank_pids(out))


def test_two_sigints_back_to_back_are_one_interrupt(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    """Issue 22: ``timeout`` and a terminal signal the launcher and its group at once; that is one
    interrupt, so the ranks keep their grace period."""
    out, proc = start_ready(tmp_path, TIDY_ON_SIGINT, launched)
    os.kill(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGINT)
    rc, _, err = finish(proc, timeout=30)
    assert_one_interrupt(out, rc, err)


def test_timeout_s_int_is_one_interrupt(tmp_path: Path, launched: list[subprocess.Popen[str]]) -> None:
    """The newcomer's line: ``timeout -s INT N multigpu run ...`` (SIGINT to the launcher and its group).
    ``timeout`` sends a signal it receives on exactly as it sends its own at N seconds, so the test sends
    it once both ranks are ready instead of betting that they are ready by a fixed N."""
    job = script(tmp_path, TIDY_ON_SIGINT)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            "timeout",
            "-s",
            "INT",
            "120",
            *MULTIGPU,
            "run",
            "--cpu",
            "2",
            "--grace-period",
            "30",
            "--output",
            str(out),
            str(job),
        ],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    launched.append(proc)
    wait_files(tmp_path, ["ready_0", "ready_1"])
    os.kill(proc.pid, signal.SIGINT)
    rc, _, err = finish(proc, timeout=60)
    assert_one_interrupt(out, rc, err)


HUP_BODY = """
def on_hup(signum, frame):
    print(f"rank {RANK} got SIGHUP", flush=True)
    sys.exit(0)
signal.signal(signal.SIGHUP, on_hup)
ready()
time.sleep(60)
sys.exit(9)
"""


def test_sighup_is_forwarded(tmp_path: Path, launched: list[subprocess.Popen[str]]) -> None:
    proc, out, pids = start_sleepers(tmp_path, launched, body="keep = grandchild()\n" + HUP_BODY)
    os.kill(proc.pid, signal.SIGHUP)
    rc, _, err = finish(proc, timeout=30)
    assert rc == 0, err
    for rank in (0, 1):
        assert f"rank {rank} got SIGHUP" in log(out, rank)
    assert_gone(pids)


def test_sighup_not_forwarded_when_ignored_at_start(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    """Like ``nohup multigpu run ...``: a wrapper ignores SIGHUP, then execs the launcher (same PID)."""
    job = script(tmp_path, "keep = grandchild()\n" + HUP_BODY)
    out = tmp_path / "out"
    wrapper = write_script(
        tmp_path,
        "nohup_exec.py",
        """
        import os, signal, sys
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        os.execv(sys.argv[1], sys.argv[1:])
    """,
    )
    proc = subprocess.Popen(
        [PYTHON, str(wrapper), *MULTIGPU, *run_args(out, str(job))],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    launched.append(proc)
    wait_files(tmp_path, ["ready_0", "ready_1"])
    pids = rank_pids(out) + grandchild_pids(out)
    os.kill(proc.pid, signal.SIGHUP)
    time.sleep(1.0)
    assert proc.poll() is None, "the launcher acted on an ignored SIGHUP"
    assert all(alive(pid) for pid in pids)
    os.kill(proc.pid, signal.SIGTERM)
    rc, _, err = finish(proc, timeout=30)
    assert rc == 143, err
    for rank in (0, 1):
        assert "got SIGHUP" not in log(out, rank)
    assert_gone(pids)


# ---- hangs ---------------------------------------------------------------------------------------------


def test_hang_timeout_dumps_every_rank(tmp_path: Path) -> None:
    # Rank 1 beats the heartbeat until rank 0 (slow: it imports torch) is in the script; then both are
    # silent, so the silence is measured from a known point whatever the machine's speed.
    job = script(
        tmp_path,
        """
import multigpu

def stuck_here():
    time.sleep(60)

if RANK == 0:
    ready()
else:
    while not os.path.exists("ready_0"):
        multigpu.heartbeat()
        time.sleep(0.05)
stuck_here()
""",
    )
    out = tmp_path / "out"
    t0 = time.monotonic()
    res = run_cli(run_args(out, "--hang-timeout", "1.5", str(job)), cwd=tmp_path, timeout=RUN_TIMEOUT)
    print(f"hung run ended after {time.monotonic() - t0:.2f}s")
    assert res.returncode == 1, res.stderr
    assert "no rank has shown progress" in res.stderr
    assert "attempt 0 hung: rank" in res.stderr and "stopped progressing first" in res.stderr
    assert "stack dumps of every rank follow" in res.stderr
    for rank in (0, 1):
        assert f"rank {rank} (pid" in res.stderr
        assert "stuck_here" in log(out, rank) and "most recent call first" in log(out, rank)
    assert res.stderr.count("in stuck_here") >= 2
    assert "multigpu frame" in res.stderr and OWN_PATH not in res.stderr  # our frames folded
    attempt = record(out)["attempts"][0]
    assert attempt["status"] == "hung"
    assert sorted(f["rank"] for f in attempt["failures"]) == [0, 1]
    assert all("stuck_here" in (f["traceback"] or "") for f in attempt["failures"])
    assert_gone(rank_pids(out))


# ---- restarts ------------------------------------------------------------------------------------------

RESTART_BODY = """
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt={attempt}", flush=True)
if RANK == 1 and attempt < FAILING_ATTEMPTS:
    sys.exit(4)
if RANK == 0 and attempt < FAILING_ATTEMPTS:
    time.sleep(60)
"""


def test_restart_succeeds(tmp_path: Path) -> None:
    job = script(tmp_path, "FAILING_ATTEMPTS = 1\n" + RESTART_BODY)
    out = tmp_path / "out"
    res = run_cli(run_args(out, "--max-restarts", "1", str(job)), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert res.returncode == 0, res.stderr
    assert "restarting: attempt 1" in res.stderr
    assert "attempt=0" in log(out, 1, 0)  # rank 0 may have been stopped before its script started
    for rank in (0, 1):
        assert "attempt=1" in log(out, rank, 1)
    data = record(out)
    assert [a["status"] for a in data["attempts"]] == ["failed", "succeeded"]
    assert data["attempts"][0]["root_cause"]["rank"] == 1
    assert data["exit_code"] == 0 and data["status"] == "succeeded"
    pids = rank_pids(out)
    assert len(set(pids)) == 4
    assert_gone(pids)


def test_restarts_run_out(tmp_path: Path) -> None:
    job = script(tmp_path, "FAILING_ATTEMPTS = 99\n" + RESTART_BODY)
    out = tmp_path / "out"
    res = run_cli(run_args(out, "--max-restarts", "1", str(job)), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert res.returncode == 4, res.stderr
    assert "attempt 0 failed" in res.stderr and "attempt 1 failed" in res.stderr
    assert res.stderr.count("restarting:") == 1  # not the last line's "lost: restarting 0.1s"
    data = record(out)
    assert [a["status"] for a in data["attempts"]] == ["failed", "failed"]
    assert [a["root_cause"]["exit_code"] for a in data["attempts"]] == [4, 4]
    assert not (out / "logs" / "attempt_2").exists()
    assert_gone(rank_pids(out))


def test_usage_errors_are_never_retried(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = run_cli(run_args(out, "--max-restarts", "3", "missing.py"), cwd=tmp_path, timeout=30)
    assert res.returncode == 2
    assert res.stderr.count("error:") == 1 and "missing.py" in res.stderr
    assert not out.exists()
    # A rendezvous address already in use: one clear error, no attempt started, no retry.
    job = script(tmp_path, "pass\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run_cli(
            run_args(out, "--max-restarts", "3", "--rdzv-endpoint", f"127.0.0.1:{port}", str(job)),
            cwd=tmp_path,
            timeout=30,
        )
    assert res.returncode == 1, res.stderr
    assert res.stderr.count("already in use") == 1 and "restarting" not in res.stderr
    assert not (out / "logs").exists()


# ---- hygiene over several runs -------------------------------------------------------------------------


def _listening() -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


@pytest.mark.slow  # ten runs in a row; each kind of end is also checked by PID in the tests above
def test_consecutive_runs_leave_nothing_behind(tmp_path: Path) -> None:
    job = script(tmp_path, "keep = grandchild()\nkeep.kill()\nkeep.wait()\n")
    shm_before = set(os.listdir("/dev/shm"))
    listening_before = _listening()
    pids: list[int] = []
    ports: list[int] = []
    for i in range(5):
        out = tmp_path / f"out{i}"
        res = run_cli(run_args(out, str(job)), cwd=tmp_path, timeout=RUN_TIMEOUT)
        assert res.returncode == 0, res.stderr
        attempt = record(out)["attempts"][0]
        assert attempt["master_addr"] == "127.0.0.1"
        ports.append(attempt["master_port"])
        pids += rank_pids(out) + grandchild_pids(out)
    assert len(set(pids)) == 20
    assert_gone(pids)
    listening = _listening()
    assert not [p for p in ports if ("127.0.0.1", p) in listening or ("0.0.0.0", p) in listening]
    ours = {addr for addr in listening - listening_before if addr[1] in ports}
    assert not ours
    assert set(os.listdir("/dev/shm")) - shm_before == set()
