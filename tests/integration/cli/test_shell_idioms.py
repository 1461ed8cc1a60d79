"""The shell idioms users log a run with: in each, the log ends with the launcher's summary and the
root cause of a failing rank, and no process the launcher did not start is signalled.

``cmd > >(tee run.log) 2>&1`` makes the ``tee`` a child of the launcher (bash forks the command's
process, opens the process substitution from it, then execs the launcher), and a launcher that ended
"every descendant that is not a rank" killed it before its last lines reached the log. Each idiom runs
in a shell of its own session; the ``tee`` (or filter) writes its own exit status to a file, which must
be its own 0, never a signal's. Each test bounds its time and proves by working directory that no
process it started is left: the shell, the launcher, its template and sentinel, the ranks and the
``tee`` all run in the test's folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from helpers import MULTIGPU, alive, clean_env, free_port, node_args, tier_cannot_run, write_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

RUN_TIMEOUT = 60.0

FAILING = """
import os, sys
rank = int(os.environ["RANK"])
print(f"rank {rank} working", flush=True)
if rank == 1:
    raise ValueError("idiom-root-cause")
"""
HEALTHY = """
import os
print(f"rank {os.environ['RANK']} done", flush=True)
"""


def launcher_line(tmp_path: Path, code: str = FAILING) -> str:
    """The ``multigpu run`` command line an idiom wraps, quoted for bash."""
    write_script(tmp_path, "train.py", code)
    args = [*MULTIGPU, "run", "--cpu", "2", "--output", str(tmp_path / "out"), "train.py"]
    return shlex.join(args)


def in_folder(folder: Path) -> list[psutil.Process]:
    """Every process of this user whose working directory is ``folder``: what an idiom started."""
    found = []
    for process in psutil.process_iter(["cwd"]):
        with contextlib.suppress(psutil.Error):
            if process.info["cwd"] == str(folder) and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Shells a test started (each in its own session); whatever is left in the test's folder at the
    end fails the test, and is then killed by PID."""
    shells: list[subprocess.Popen[bytes]] = []
    yield shells
    deadline = time.monotonic() + 5.0
    while (left := in_folder(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    for proc in shells:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert not left, f"left running: {[p.info for p in left]}"


def run_shell(shells: list[subprocess.Popen[bytes]], tmp_path: Path, line: str) -> int:
    """``bash -c LINE`` in ``tmp_path``, in a session of its own, to its end (bounded)."""
    proc = subprocess.Popen(
        ["bash", "-c", line],
        cwd=tmp_path,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    shells.append(proc)
    return proc.wait(timeout=RUN_TIMEOUT)


def wait_file(path: Path, timeout: float = 20.0) -> str:
    """The content of ``path`` once a process wrote it (a ``tee``'s status after its input ended)."""
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().endswith("\n"):
        assert time.monotonic() < deadline, f"{path.name} never written (was its writer killed?)"
        time.sleep(0.02)
    return path.read_text()


def assert_report_at_end(log: str, failed: bool = True, ranks: tuple[int, ...] = (0, 1)) -> None:
    """The log holds the rank's lines, then the launcher's summary (``multigpu: summary``, or the
    table titled ``multigpu summary`` on a terminal) and, for a failure, its root cause, which come
    last: nothing of the launcher's was cut off. A terminal's colours are left out."""
    log = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", log)
    assert all(f"rank {rank} " in log for rank in ranks), log
    summary = re.search(r"^multigpu:? summary", log, re.MULTILINE)
    assert summary is not None, log
    assert summary.start() > log.rindex("[rank 1] "), log  # after the rank's last line
    if failed:
        cause = [line for line in log.splitlines() if line.startswith("root cause: ")]
        assert cause and "ValueError: idiom-root-cause" in cause[0], log
        assert summary.start() < log.index(cause[0]), log


# ---- the idioms in the README's suite: the ones most logs are made with ------------------------------


def test_process_substitution_tee(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    """``> >(tee run.log) 2>&1``: the tee is the launcher's child; it ends of its own accord (0)."""
    line = f"{launcher_line(tmp_path)} > >(tee run.log >/dev/null; echo $? > tee.status) 2>&1"
    assert run_shell(shell, tmp_path, line) == 1
    assert wait_file(tmp_path / "tee.status") == "0\n"
    assert_report_at_end((tmp_path / "run.log").read_text())


def test_process_substitution_tee_healthy_run(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    """A healthy run keeps its summary in the tee's log too."""
    line = f"{launcher_line(tmp_path, HEALTHY)} > >(tee run.log >/dev/null; echo $? > tee.status) 2>&1"
    assert run_shell(shell, tmp_path, line) == 0
    assert wait_file(tmp_path / "tee.status") == "0\n"
    assert_report_at_end((tmp_path / "run.log").read_text(), failed=False)


def test_exec_tee_in_a_batch_script(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    """A batch script whose first line is ``exec > >(tee -a job.log) 2>&1`` (SLURM scripts do this),
    the launcher its last command (``bash -c`` then execs it: the tee is again its child)."""
    line = f"exec > >(tee -a job.log >/dev/null; echo $? > tee.status) 2>&1\n{launcher_line(tmp_path)}"
    assert run_shell(shell, tmp_path, line) == 1
    assert wait_file(tmp_path / "tee.status") == "0\n"
    assert_report_at_end((tmp_path / "job.log").read_text())


def test_pipe_to_tee(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    line = f"{launcher_line(tmp_path)} 2>&1 | tee run.log >/dev/null; echo ${{PIPESTATUS[*]}} > status"
    assert run_shell(shell, tmp_path, line) == 0
    assert wait_file(tmp_path / "status") == "1 0\n"
    assert_report_at_end((tmp_path / "run.log").read_text())


def test_line_filter(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    """``2>&1 | ts``-style: a filter that stamps each line as it comes (awk, flushing each line)."""
    stamp = "awk '{ print \"[ts] \" $0; fflush() }' > run.log"
    line = f"{launcher_line(tmp_path)} 2>&1 | {stamp}; echo ${{PIPESTATUS[*]}} > status"
    assert run_shell(shell, tmp_path, line) == 0
    assert wait_file(tmp_path / "status") == "1 0\n"
    log = (tmp_path / "run.log").read_text()
    assert all(row.startswith("[ts] ") for row in log.splitlines()), log
    assert_report_at_end(log.replace("[ts] ", ""))


def test_output_to_a_file(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    assert run_shell(shell, tmp_path, f"{launcher_line(tmp_path)} > run.log 2>&1") == 1
    assert_report_at_end((tmp_path / "run.log").read_text())


@pytest.mark.matrix
def test_process_substitution_tee_on_two_nodes(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    """Two nodes on this machine, each launcher logging through its own ``> >(tee node_N.log)``: a
    healthy run keeps each node's summary, and neither tee is signalled."""
    write_script(tmp_path, "train.py", HEALTHY)
    port = free_port()
    lines = []
    for node in (0, 1):
        args = [*MULTIGPU, "run", "--cpu", "1", *node_args(node, master_port=port)]
        args += ["--output", str(tmp_path / f"out{node}"), "train.py"]
        tee = f">(tee node_{node}.log >/dev/null; echo $? > tee_{node}.status)"
        lines.append(f"{shlex.join(args)} > {tee} 2>&1")
    procs = [
        subprocess.Popen(
            ["bash", "-c", line],
            cwd=tmp_path,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        for line in lines
    ]
    shell += procs
    assert [proc.wait(timeout=RUN_TIMEOUT) for proc in procs] == [0, 0]
    for node in (0, 1):
        assert wait_file(tmp_path / f"tee_{node}.status") == "0\n"
        log = (tmp_path / f"node_{node}.log").read_text()
        assert re.search(r"^multigpu: summary", log, re.MULTILINE) and f"rank {node} done" in log, log


# ---- the heavy tier: the rarer idioms -------------------------------------------------------------------


@pytest.mark.matrix
def test_nohup_in_the_background(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    """``nohup ... > run.log 2>&1 &``, the shell waiting for it: SIGHUP ignored changes nothing."""
    line = f"nohup {launcher_line(tmp_path)} > run.log 2>&1 &\nwait $!; echo $? > status"
    assert run_shell(shell, tmp_path, line) == 0
    assert wait_file(tmp_path / "status") == "1\n"
    assert_report_at_end((tmp_path / "run.log").read_text())


@pytest.mark.matrix
def test_script_typescript(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    """``script -qc``: the launcher on a terminal; the typescript is the log."""
    if shutil.which("script") is None:
        tier_cannot_run("script (util-linux) is not installed")
    line = f"script -qec {shlex.quote(launcher_line(tmp_path))} run.log > /dev/null; echo $? > status"
    assert run_shell(shell, tmp_path, line) == 0
    assert wait_file(tmp_path / "status") == "1\n"
    assert_report_at_end((tmp_path / "run.log").read_text().replace("\r\n", "\n"))


@pytest.mark.matrix
def test_tmux_pane(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    """A tmux pane running ``cmd > >(tee run.log) 2>&1``: the pane and the tee both end with the report."""
    if shutil.which("tmux") is None:
        tier_cannot_run("tmux is not installed")
    tmux = ["tmux", "-L", f"multigpu-test-{os.getpid()}", "-f", "/dev/null"]
    pane = (
        f"{launcher_line(tmp_path)} > >(tee run.log; echo $? > tee.status) 2>&1; echo $? > status; sleep 30"
    )
    server = subprocess.run(
        [*tmux, "new-session", "-d", "-x", "250", "-y", "100", "-c", str(tmp_path), pane],
        cwd=tmp_path,
        env={**clean_env(), "TMUX": ""},
        timeout=10,
        check=True,
    )
    assert server.returncode == 0
    try:
        assert wait_file(tmp_path / "status", RUN_TIMEOUT) == "1\n"
        assert wait_file(tmp_path / "tee.status") == "0\n"
        assert_report_at_end((tmp_path / "run.log").read_text())
        shown = subprocess.run(
            [*tmux, "capture-pane", "-p", "-J", "-S", "-"], capture_output=True, text=True, timeout=10
        ).stdout
        assert "root cause: " in shown, shown
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)


@pytest.mark.matrix
def test_stdout_to_a_closed_pipe(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    """Standard output into a pipe whose reader has gone (``| true``): the report still reaches the
    log on standard error, and the launcher exits with the run's status, not of SIGPIPE."""
    line = f"{launcher_line(tmp_path)} 2> run.log | true; echo ${{PIPESTATUS[0]}} > status"
    assert run_shell(shell, tmp_path, line) == 0
    assert wait_file(tmp_path / "status") == "1\n"
    log = (tmp_path / "run.log").read_text()
    assert "multigpu: stdout is gone" in log, log  # the ranks' stdout lines went there: said once
    assert_report_at_end(log, ranks=(1,))  # rank 0 printed to stdout only


def test_sweep_leaves_a_foreign_child_alone(tmp_path: Path, shell: list[subprocess.Popen[bytes]]) -> None:
    """A child the launcher was given at its start (here a ``sleep`` bash forked before it exec'd the
    launcher) is never signalled, while a rank's detached daemon still goes with the run."""
    daemon = """
import os, pathlib
if int(os.environ["RANK"]) == 1:
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork():
            os._exit(0)
        pathlib.Path("daemon.tmp").write_text(str(os.getpid()))
        os.rename("daemon.tmp", "daemon.pid")
        os.execvp("sleep", ["sleep", "60"])
    os.waitpid(middle, 0)
    while not os.path.exists("daemon.pid"):
        pass
"""
    launcher = launcher_line(tmp_path, HEALTHY + daemon)
    line = f"sleep 30 & echo $! > foreign.pid; exec {launcher} > run.log 2>&1"
    proc = subprocess.Popen(["bash", "-c", line], cwd=tmp_path, env=clean_env(), start_new_session=True)
    shell.append(proc)
    assert proc.wait(timeout=RUN_TIMEOUT) == 0
    foreign = int(wait_file(tmp_path / "foreign.pid"))
    assert alive(foreign), "the launcher killed a process it did not start"
    daemon_pid = int((tmp_path / "daemon.pid").read_text())
    assert not alive(daemon_pid), "a rank's daemon outlived the run"
    os.kill(foreign, signal.SIGTERM)
