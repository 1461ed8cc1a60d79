"""Real user sessions (issue 12): the launcher's own surroundings, not the workers' faults.

Consoles that stall, close, fill or hang up; progress bars on a terminal; long lines; reused, shared
and unwritable output folders; a full disk; Ctrl-C in a shell loop; a script that finished and then
aborted; many ranks under a low open-file limit. Each test bounds its time, orders events with files
(never sleeps), and proves by PID that nothing it started is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import MULTIGPU, alive, assert_gone, clean_env, pids_in, tier_cannot_run, write_script

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(120)]

RUN_TIMEOUT = 60.0

PROLOGUE = """
import os, pathlib, signal, subprocess, sys, time
RANK = int(os.environ["RANK"])
print(f"rank={RANK} pid={os.getpid()}", flush=True)

def ready(name=None):
    pathlib.Path(f"ready_{RANK if name is None else name}").touch()

def wait_for(name, timeout=60):
    deadline = time.monotonic() + timeout
    while not os.path.exists(name):
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.01)
"""


def script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    return write_script(tmp_path, name, PROLOGUE + body)


def args(out: Path, job: Path, *extra: str, nproc: int = 2) -> list[str]:
    return [
        *MULTIGPU,
        "run",
        "--cpu",
        str(nproc),
        "--grace-period",
        "0.5",
        "--status",
        "off",
        "--output",
        str(out),
        *extra,
        str(job),
    ]


def record(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "run.json").read_text())
    return data


def rank_log(out: Path, rank: int) -> bytes:
    return (out / "logs" / "attempt_0" / f"rank_{rank}.log").read_bytes()


def rank_pids(out: Path, timeout: float = 10.0) -> list[int]:
    """The ranks' PIDs from run.json. The record names them once the launcher's loop has taken its
    turn after starting them, which a rank's first file can come before: wait for that, bounded."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [r["pid"] for a in record(out)["attempts"] for r in a["ranks"].values() if r["pid"]]
        if pids or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    assert pids, "the run record names no rank"
    return pids


def wait_files(*paths: Path, timeout: float = RUN_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.02)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test started; any left at the end are SIGKILLed by PID (their group, for shells)."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def start(
    cmd: list[str],
    cwd: Path,
    procs: list[subprocess.Popen[bytes]],
    **kw: Any,
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, cwd=cwd, env=clean_env(), start_new_session=True, **kw)
    procs.append(proc)
    return proc


def shell(line: str, cwd: Path, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=clean_env(), capture_output=True, timeout=timeout
    )


def quoted(cmd: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(c) for c in cmd)


# ---- a console that stalls, closes or fills ----------------------------------------------------------

CHATTY_THEN_FAIL = """
if RANK == 0:
    for i in range(20000):
        print(f"line {i:05d} " + "x" * 100)
    sys.stdout.flush()
    ready()
    time.sleep(60)
else:
    wait_for("ready_0")
    raise ValueError("rank one fails")
"""


def test_stalled_reader_does_not_delay_failure_detection(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """stdout is a pipe nobody reads (a paused pager): rank 1's failure still ends the run."""
    out = tmp_path / "out"
    err = (tmp_path / "stderr.txt").open("wb")
    r, w = os.pipe()
    try:
        proc = start(args(out, script(tmp_path, CHATTY_THEN_FAIL)), tmp_path, procs, stdout=w, stderr=err)
        os.close(w)
        rc = proc.wait(timeout=RUN_TIMEOUT)  # the pipe is never read until the launcher has exited
    finally:
        err.close()
        os.close(r)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert rc == 1, stderr
    assert "ValueError: rank one fails" in stderr
    assert "console line(s) dropped" in stderr
    assert record(out)["status"] == "failed" and record(out)["exit_code"] == 1
    log = rank_log(out, 0).decode()
    assert all(f"line {i:05d} " in log for i in (0, 9999, 19999))  # the log kept every line
    assert len(re.findall(r"^line \d{5} x{100}$", log, re.MULTILINE)) == 20000
    assert_gone(rank_pids(out))


def test_a_console_slower_than_the_ranks_loses_no_line(tmp_path: Path) -> None:
    """A pipe that is read, only slower than two ranks write (``| tee``, a CI log): 24 MB of long lines
    reach it whole and all of them, the ranks held back meanwhile; nothing is dropped."""
    job = script(
        tmp_path,
        """
for i in range(2000):
    print(f"R{RANK}:{i:06d}:" + "x" * 5990)
sys.stdout.flush()
print(f"pid={os.getpid()}", flush=True)
""",
    )
    out = tmp_path / "out"
    res = subprocess.run(
        args(out, job), cwd=tmp_path, env=clean_env(), capture_output=True, timeout=RUN_TIMEOUT
    )
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    lines = [line for line in res.stdout.decode().splitlines() if ":" in line and "pid=" not in line]
    whole = [line for line in lines if re.fullmatch(r"\[rank \d\] R\d:\d{6}:x{5990}", line)]
    assert len(whole) == 4000, (len(whole), len(lines))
    assert b"dropped" not in res.stderr
    assert_gone(pids_in(res.stdout.decode()))


def test_stalled_reader_then_sigterm(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    job = script(
        tmp_path,
        """
for i in range(20000):
    print(f"line {i:05d} " + "x" * 100)
sys.stdout.flush()
ready()
time.sleep(60)
""",
    )
    out = tmp_path / "out"
    r, w = os.pipe()
    try:
        proc = start(args(out, job), tmp_path, procs, stdout=w, stderr=w)
        os.close(w)
        wait_files(tmp_path / "ready_0", tmp_path / "ready_1")
        pids = rank_pids(out)
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        os.close(r)
    assert rc == 143
    assert record(out)["status"] == "interrupted" and record(out)["exit_code"] == 143
    assert_gone(pids)


@pytest.mark.parametrize(
    "redirect", ["<&-", ">&-", "2>&-", ">&- 2>&- <&-", ">/dev/full 2>/dev/full", "</dev/null >/dev/null 2>&1"]
)
def test_closed_or_redirected_std_streams(tmp_path: Path, redirect: str) -> None:
    job = script(
        tmp_path,
        """
print(f"hello from {RANK}", flush=True)
print(f"fds {sorted(int(f) for f in os.listdir('/proc/self/fd'))[:3]}", flush=True)
""",
    )
    out = tmp_path / "out"
    res = shell(f"exec {quoted(args(out, job))} {redirect}", tmp_path)
    assert res.returncode == 0, res.stderr.decode()
    assert b"Traceback" not in res.stderr
    for rank in (0, 1):
        assert f"hello from {rank}".encode() in rank_log(out, rank)
    assert record(out)["status"] == "succeeded"
    assert_gone(rank_pids(out))


def test_head_closes_the_pipe(tmp_path: Path) -> None:
    job = script(
        tmp_path,
        """
for i in range(3000):
    print(f"line {i}", flush=True)
""",
    )
    out = tmp_path / "out"
    res = shell(f"{quoted(args(out, job))} | head -1; exit ${{PIPESTATUS[0]}}", tmp_path)
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.count(b"\n") == 1
    assert b"Traceback" not in res.stderr
    assert rank_log(out, 1).decode().count("line ") == 3000
    assert_gone(rank_pids(out))


def test_demo_into_head_ends_quietly_and_trains_on(tmp_path: Path) -> None:
    """Found by hand: ``multigpu demo | head -8`` exited 1 with a BrokenPipeError traceback, when the
    demo's rank 0 was the calling process and printed to the closed pipe itself (the demo is a
    ``multigpu run`` now; its own closing lines meet the closed pipe the same way)."""
    import psutil

    out = tmp_path / "out"
    line = (
        f"{quoted([*MULTIGPU, 'demo', '--cpu', '2', '--steps', '40', '-o', str(out)])} | head -1; "
        "exit ${PIPESTATUS[0]}"
    )
    proc = subprocess.Popen(
        ["bash", "-c", line], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    seen: set[int] = set()
    deadline = time.monotonic() + RUN_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:  # the demo's processes, by PID
        seen |= {p.pid for p in proc_descendants(psutil.Process(proc.pid))}
        time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, stderr.decode()
    assert stdout.decode().startswith("[rank 0] demo: 2 rank(s) on cpu") and stdout.count(b"\n") == 1
    assert b"Traceback" not in stderr and b"Error" not in stderr
    assert_gone(seen)


def proc_descendants(proc: Any) -> list[Any]:
    import psutil

    with contextlib.suppress(psutil.Error):
        return list(proc.children(recursive=True))
    return []


# ---- terminals: progress bars, long lines, hang-ups ----------------------------------------------------

BAR = """
if RANK == 0:
    for i in range(3):
        sys.stderr.write(f"\\rstep {i}/3 |" + "#" * i)
        sys.stderr.flush()
        wait_for(f"seen_{i}")
    sys.stderr.write("\\rstep 3/3 |###\\n")
    print("after the bar", flush=True)
"""


def read_until(fd: int, needle: bytes, seen: bytearray, timeout: float = RUN_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while needle not in seen:
        assert time.monotonic() < deadline, f"{needle!r} never reached the terminal: {bytes(seen)[-500:]!r}"
        if select.select([fd], [], [], 0.1)[0]:
            try:
                seen.extend(os.read(fd, 65536))
            except OSError:
                return


@pytest.mark.parametrize("status", ["off", "on"])
def test_progress_bar_is_live_and_drawn_in_place_on_a_terminal(
    tmp_path: Path, status: str, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Each update reaches the terminal before the rank goes on (a handshake), on one line."""
    out = tmp_path / "out"
    cmd = args(out, script(tmp_path, BAR))
    cmd[cmd.index("--status") + 1] = status
    master, slave = pty.openpty()
    seen = bytearray()
    try:
        proc = start(cmd, tmp_path, procs, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
        os.close(slave)
        for i in range(3):
            read_until(master, f"step {i}/3".encode(), seen)
            (tmp_path / f"seen_{i}").touch()
        read_until(master, b"multigpu: summary" if status == "off" else b"summary", seen)
        rc = proc.wait(timeout=RUN_TIMEOUT)
    finally:
        os.close(master)
    assert rc == 0
    screen = bytes(seen)
    if status == "off":
        assert b"[rank 0] step 0/3" in screen
        # redrawn in place: no update ever ends a line of its own
        assert not any(f"step {i}/3 |{'#' * i}\r\n".encode() in screen for i in range(3))
        assert b"[rank 0] step 3/3 |###\r\n" in screen
    assert b"\rstep 0/3 |\rstep 1/3 |#\rstep 2/3 |##\rstep 3/3 |###\n" in rank_log(out, 0)  # as written
    assert_gone(rank_pids(out))


def test_a_one_megabyte_line_is_one_line(tmp_path: Path) -> None:
    job = script(
        tmp_path,
        """
if RANK == 1:
    sys.stdout.write("{" + "y" * (1 << 20) + "}\\n")
    sys.stdout.flush()
""",
    )
    out = tmp_path / "out"
    console = tmp_path / "console.txt"
    res = shell(f"{quoted(args(out, job))} >{console}", tmp_path)
    assert res.returncode == 0, res.stderr.decode()
    lines = [ln for ln in console.read_bytes().split(b"\n") if b"yyy" in ln]
    assert lines == [b"[rank 1] {" + b"y" * (1 << 20) + b"}"]
    assert rank_log(out, 1).endswith(b"{" + b"y" * (1 << 20) + b"}\n")
    assert_gone(rank_pids(out))


def test_terminal_hang_up_ends_only_the_console(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    job = script(
        tmp_path,
        """
ready()
wait_for("hung_up")
for i in range(2000):
    print(f"after hang-up {i}", flush=True)
""",
    )
    out = tmp_path / "out"
    master, slave = pty.openpty()
    proc = start(args(out, job), tmp_path, procs, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    wait_files(tmp_path / "ready_0", tmp_path / "ready_1")
    os.close(master)  # the terminal is gone: every write to it now fails with EIO
    (tmp_path / "hung_up").touch()
    rc = proc.wait(timeout=RUN_TIMEOUT)
    assert rc == 0
    assert record(out)["status"] == "succeeded" and record(out)["exit_code"] == 0
    assert rank_log(out, 1).decode().count("after hang-up") == 2000
    assert_gone(rank_pids(out))


# ---- output folders -----------------------------------------------------------------------------------


def test_reused_output_reports_only_this_runs_failure(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = script(
        tmp_path,
        """
if RANK == 1:
    raise ValueError("error of run one")
""",
        "one.py",
    )
    second = script(
        tmp_path,
        """
if RANK == 1:
    os.kill(os.getpid(), signal.SIGKILL)
""",
        "two.py",
    )
    res1 = subprocess.run(
        args(out, first), cwd=tmp_path, env=clean_env(), capture_output=True, timeout=RUN_TIMEOUT
    )
    assert b"error of run one" in res1.stderr
    pids = rank_pids(out)
    res2 = subprocess.run(
        args(out, second), cwd=tmp_path, env=clean_env(), capture_output=True, timeout=RUN_TIMEOUT
    )
    assert res2.returncode == 128 + signal.SIGKILL, res2.stderr.decode()
    assert b"rank 1 (node 0, pid" in res2.stderr and b"was killed by SIGKILL" in res2.stderr
    assert b"error of run one" not in res2.stderr
    assert b"error of run one" not in rank_log(out, 1)  # the folder is this run's now
    assert_gone(pids + rank_pids(out))


def test_two_live_runs_never_share_a_folder(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    out = tmp_path / "out"
    job = script(
        tmp_path,
        """
ready()
wait_for("go")
""",
    )
    first = start(args(out, job), tmp_path, procs, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_files(tmp_path / "ready_0", tmp_path / "ready_1")
    second = subprocess.run(
        args(out, job), cwd=tmp_path, env=clean_env(), capture_output=True, timeout=RUN_TIMEOUT
    )
    (tmp_path / "go").touch()
    _, err = first.communicate(timeout=RUN_TIMEOUT)
    assert first.returncode == 0, err.decode()
    assert second.returncode == 2
    lines = second.stderr.decode().strip().splitlines()
    assert len(lines) == 2 and "is in use by run" in lines[0] and "pid" in lines[0], lines
    assert record(out)["status"] == "succeeded"
    assert_gone(rank_pids(out))


@contextlib.contextmanager
def tmpfs(size: str, *options: str) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="multigpu-tmpfs-"))
    opts = ",".join((f"size={size}", *options))
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True
        ).returncode
        != 0
    ):
        where.rmdir()
        tier_cannot_run("cannot mount a tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10)
        where.rmdir()


@pytest.mark.parametrize("case", ["a file", "under a file", "read-only", "full"])
def test_output_folder_problems_are_one_line_before_any_worker(tmp_path: Path, case: str) -> None:
    job = script(tmp_path, "pathlib.Path(f'started_{RANK}').touch()\n")
    with contextlib.ExitStack() as stack:
        if case == "a file":
            out = tmp_path / "taken"
            out.write_text("x")
        elif case == "under a file":
            (tmp_path / "taken").write_text("x")
            out = tmp_path / "taken" / "sub"
        elif case == "read-only":
            out = stack.enter_context(tmpfs("1m", "ro")) / "out"
        else:
            root = stack.enter_context(tmpfs("64k"))
            with contextlib.suppress(OSError), open(root / "filler", "wb") as f:
                f.write(b"\0" * (1 << 20))
            out = root / "out"
        res = subprocess.run(
            args(out, job), cwd=tmp_path, env=clean_env(), capture_output=True, timeout=RUN_TIMEOUT
        )
    lines = res.stderr.decode().strip().splitlines()
    assert res.returncode == 2, res.stderr.decode()
    assert len(lines) == 2 and "output folder" in lines[0], lines  # the error, and where --help is
    assert "Traceback" not in res.stderr.decode()
    assert not list(tmp_path.glob("started_*"))


def test_disk_fills_during_the_run(tmp_path: Path) -> None:
    job = script(
        tmp_path,
        """
for i in range(30000):
    print(f"line {i:05d} " + "z" * 100)
""",
    )
    with tmpfs("1m") as root:
        out = root / "out"
        res = subprocess.run(
            args(out, job), cwd=tmp_path, env=clean_env(), capture_output=True, timeout=RUN_TIMEOUT
        )
        data = record(out)
        pids = rank_pids(out)
    stderr = res.stderr.decode()
    assert res.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "output lost" in stderr and "No space left on device" in stderr
    assert data["status"] == "succeeded" and data["exit_code"] == 0
    assert data["output_lost"] and all("not written" in loss for loss in data["output_lost"])
    assert_gone(pids)


@pytest.mark.parametrize("run_id", ["../../x", "a/b", "..", "bad\nid"])
def test_run_id_is_a_name(tmp_path: Path, run_id: str) -> None:
    job = script(tmp_path, "pathlib.Path(f'started_{RANK}').touch()\n")
    res = subprocess.run(
        [*MULTIGPU, "run", "--cpu", "1", "--run-id", run_id, str(job)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        timeout=RUN_TIMEOUT,
    )
    assert res.returncode == 2
    assert res.stderr.decode().count("\n") == 2 and "--run-id" in res.stderr.decode()
    assert not list(tmp_path.glob("started_*")) and not (tmp_path / "multigpu_runs").exists()


# ---- signals and shell loops --------------------------------------------------------------------------


def test_ctrl_c_stops_a_shell_loop(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    job = script(
        tmp_path,
        """
ready(f"{RANK}_{sys.argv[1]}")
time.sleep(60)
""",
    )
    run = quoted(args(Path("out_$i"), job)[:-1]).replace("'out_$i'", '"out_$i"')
    loop = write_script(
        tmp_path,
        "loop.sh",
        f"""
        for i in 1 2 3; do
            {run} {quoted([str(job)])} $i
            echo finished $i
        done
    """,
    )
    proc = start(["bash", str(loop)], tmp_path, procs, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_files(tmp_path / "ready_0_1", tmp_path / "ready_1_1")
    pids = rank_pids(tmp_path / "out_1")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
    out, err = proc.communicate(timeout=30)
    assert b"finished" not in out, (out, err)
    assert not (tmp_path / "out_2").exists()
    assert record(tmp_path / "out_1")["status"] == "interrupted"
    assert_gone(pids)


# ---- a script that finished ---------------------------------------------------------------------------


def test_abort_after_the_script_finished_is_a_success(tmp_path: Path) -> None:
    """torch's C++ teardown may abort after the user's code returned: the work is done. Fresh processes
    (--no-template): a rank forked from the template leaves without interpreter teardown, so it has none."""
    job = script(
        tmp_path,
        """
import builtins, threading

class AbortAtTeardown:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGABRT)

def late_worker():
    time.sleep(0.2)
    pathlib.Path(f"thread_done_{RANK}").touch()

threading.Thread(target=late_worker).start()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(2)  # never shut down: interpreter exit does it, and so must the bootstrap
pool.submit(print, "from the pool", flush=True)
if RANK == 1:
    sys.modules["abort_at_teardown"] = AbortAtTeardown()  # freed only at interpreter teardown
print("work done", flush=True)
""",
    )
    out = tmp_path / "out"
    res = subprocess.run(
        args(out, job, "--no-template"),
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        timeout=RUN_TIMEOUT,
    )
    stderr = res.stderr.decode()
    assert res.returncode == 0, stderr
    assert "rank 1" in stderr and "SIGABRT after its script had finished" in stderr
    assert record(out)["status"] == "succeeded"
    assert (tmp_path / "thread_done_1").exists()
    assert_gone(rank_pids(out))


def test_abort_before_the_script_finished_is_a_failure(tmp_path: Path) -> None:
    """A non-daemon thread still running is part of the script: an abort then is a failure."""
    job = script(
        tmp_path,
        """
import threading

def dies():
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGABRT)

if RANK == 1:
    threading.Thread(target=dies).start()
""",
    )
    out = tmp_path / "out"
    res = subprocess.run(
        args(out, job), cwd=tmp_path, env=clean_env(), capture_output=True, timeout=RUN_TIMEOUT
    )
    assert res.returncode == 128 + signal.SIGABRT, res.stderr.decode()
    assert record(out)["status"] == "failed"
    assert_gone(rank_pids(out))


# ---- what a rank starts -------------------------------------------------------------------------------


def test_heartbeat_fd_does_not_reach_grandchildren(tmp_path: Path) -> None:
    job = script(
        tmp_path,
        """
import multigpu
multigpu.heartbeat()  # still works in the rank itself
code = ("import os; print('env', os.environ.get('MULTIGPU_HEARTBEAT_FD')); "
        "print('fds', sorted(os.listdir('/proc/self/fd')))")
subprocess.run([sys.executable, "-c", code], check=True)
""",
    )
    out = tmp_path / "out"
    res = subprocess.run(
        args(out, job), cwd=tmp_path, env=clean_env(), capture_output=True, timeout=RUN_TIMEOUT
    )
    assert res.returncode == 0, res.stderr.decode()
    for rank in (0, 1):
        log = rank_log(out, rank).decode()
        assert "env None" in log
        fds = eval(log.split("fds ", 1)[1].splitlines()[0])  # the child's own: 0-2 and the listing
        assert len(fds) <= 4, fds
    assert_gone(rank_pids(out))


def test_output_of_a_ranks_children_is_not_its_progress(tmp_path: Path) -> None:
    job = script(
        tmp_path,
        """
loop = "import time\\nwhile True:\\n    print('child output', flush=True); time.sleep(0.05)"
chatter = subprocess.Popen([sys.executable, "-c", loop])
print(f"gc={chatter.pid}", flush=True)
time.sleep(60)
""",
    )
    out = tmp_path / "out"
    res = subprocess.run(
        args(out, job, "--hang-timeout", "2"),
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        timeout=RUN_TIMEOUT,
    )
    stderr = res.stderr.decode()
    assert res.returncode != 0, stderr
    assert "no rank has shown progress" in stderr
    assert_gone(rank_pids(out) + pids_in(stderr, "gc"))


def test_sixty_four_ranks_under_a_low_open_file_limit(tmp_path: Path) -> None:
    job = write_script(tmp_path, "tiny.py", "import os\nprint('rank', os.environ['RANK'])\n")
    out = tmp_path / "out"
    cmd = [*MULTIGPU, "run", "--cpu", "64", "--status", "off", "--output", str(out), str(job)]
    res = shell(f"ulimit -Sn 128 && exec {quoted(cmd)}", tmp_path, timeout=110)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    assert sum(1 for line in res.stdout.decode().splitlines() if "] rank " in line) == 64
    assert_gone(rank_pids(out))


def test_a_hard_open_file_limit_too_low_is_one_line(tmp_path: Path) -> None:
    job = write_script(tmp_path, "tiny.py", "open('started', 'w')\n")
    cmd = [*MULTIGPU, "run", "--cpu", "64", "--output", str(tmp_path / "out"), str(job)]
    res = shell(f"ulimit -n 128 && exec {quoted(cmd)}", tmp_path)
    assert res.returncode == 2
    assert "open files" in res.stderr.decode() and res.stderr.decode().count("\n") == 2
    assert not (tmp_path / "started").exists()


@pytest.mark.parametrize("stuck", ["SIGSTOP", "GIL"])
def test_a_rank_that_cannot_run_its_watchdog_is_gone_after_launcher_sigkill(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], stuck: str
) -> None:
    """Rank 1 is stopped, or holds the GIL in a long C call (a catastrophic regex): its watch thread
    cannot run, yet it and its child are gone soon after the launcher is SIGKILLed."""
    job = script(
        tmp_path,
        """
import re
child = subprocess.Popen(["sleep", "60"])
pathlib.Path(f"gc_{RANK}").write_text(str(child.pid))  # a file: the launcher's copy of stdout dies with it
ready()
if RANK == 1 and sys.argv[1] == "GIL":
    pathlib.Path("in_c_call").touch()
    re.match(r"(a+)+$", "a" * 40 + "b")  # minutes inside the regex engine, the GIL held
time.sleep(60)
""",
    )
    out = tmp_path / "out"
    proc = start([*args(out, job), stuck], tmp_path, procs, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    wait_files(tmp_path / "ready_0", tmp_path / "ready_1")
    pids = rank_pids(out)
    if stuck == "SIGSTOP":
        os.kill(pids[1], signal.SIGSTOP)
    else:
        wait_files(tmp_path / "in_c_call")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    grandchildren = [int((tmp_path / f"gc_{r}").read_text()) for r in (0, 1)]
    t0 = time.monotonic()
    assert_gone(pids + grandchildren, timeout=5)
    print(f"{stuck}: rank and its child gone {time.monotonic() - t0:.2f}s after the launcher's SIGKILL")
    assert not any(alive(p) for p in pids)


def test_no_numpy_warning_on_the_first_screen(tmp_path: Path) -> None:
    """torch without numpy warns at import, once per rank; a newcomer's first run must not show it."""
    job = write_script(tmp_path, "uses_torch.py", "import torch\nprint('imported', torch.__version__)\n")
    res = subprocess.run(
        [*MULTIGPU, "run", "--cpu", "2", "--status", "off", "--output", str(tmp_path / "out"), str(job)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        timeout=RUN_TIMEOUT,
    )
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.count(b"imported") == 2
    assert b"Failed to initialize NumPy" not in res.stderr + res.stdout
    assert b"Warning" not in res.stderr
    assert_gone(rank_pids(tmp_path / "out"))
