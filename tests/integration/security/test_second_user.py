"""A run is its user's alone, tried as a real second local user would (issue 36).

One second user (``mgpu-aud<PID>``) for the whole test session (``conftest.py``'s ``auditor``), all in one
xdist group so that /etc/passwd is never edited by two workers at once.
"""

from __future__ import annotations

import contextlib
import json
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers import PYTHON, assert_gone, clean_env, pids_in, run_cli, start_cli, write_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.xdist_group("second_user")]


def as_user(user: pwd.struct_passwd, *argv: str) -> None:
    subprocess.run(
        list(argv),
        check=True,
        capture_output=True,
        timeout=30,
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=[],
    )


def plant(user: pwd.struct_passwd, out: Path, victim: Path) -> Path:
    """As ``user``: rank 0's log of the next run into ``out`` made a link to ``victim``."""
    log = out / "logs" / "attempt_0" / "rank_0.log"
    as_user(user, "mkdir", "-p", str(log.parent))
    as_user(user, "ln", "-s", str(victim), str(log))
    assert log.is_symlink()
    return log


HELLO = """
    import os
    print(f"pid={os.getpid()} hello from rank", flush=True)
"""


def test_a_planted_link_in_another_users_folder_writes_nothing(
    auditor: pwd.struct_passwd, shared: Path, victim: Path, tmp_path: Path
) -> None:
    """The issue's audit: the auditor makes OUT and plants rank 0's log as a link to a root-owned file."""
    out = shared / "OUT"
    plant(auditor, out, victim)
    script = write_script(tmp_path, "hello.py", HELLO)
    result = run_cli(["run", "--cpu", "1", "--output", str(out), str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.splitlines()[0] == (
        f"multigpu run: error: output folder {out}: {out} belongs to "
        f"user {auditor.pw_name}, who could redirect what this run writes; give "
        f"the run a folder of your own"
    ), result.stderr
    assert "Traceback" not in result.stderr
    assert "hello from rank" not in result.stdout
    assert victim.read_text() == "root's own\n"


def test_a_link_planted_in_a_folder_open_to_all_writes_nothing(
    auditor: pwd.struct_passwd, shared: Path, victim: Path, tmp_path: Path
) -> None:
    """Root's own OUT, left writable by every user (no sticky bit): refused before anything is written."""
    out = shared / "OUT"
    out.mkdir()
    out.chmod(0o777)
    plant(auditor, out, victim)
    script = write_script(tmp_path, "hello.py", HELLO)
    result = run_cli(["run", "--cpu", "1", "--output", str(out), str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    first = result.stderr.splitlines()[0]
    assert first.startswith(
        f"multigpu run: error: output folder {out}: {out} is writable by every user (and has no sticky bit)"
    ), result.stderr
    assert "Traceback" not in result.stderr
    assert victim.read_text() == "root's own\n"


def test_a_link_left_in_the_users_own_folder_is_replaced(shared: Path, victim: Path, tmp_path: Path) -> None:
    """The second wall: in a folder of the run's own user, a link already where a log goes (left by
    anything) is replaced by the log, not written through."""
    out = tmp_path / "OUT"
    log = out / "logs" / "attempt_0" / "rank_0.log"
    log.parent.mkdir(parents=True)
    log.symlink_to(victim)
    script = write_script(tmp_path, "hello.py", HELLO)
    result = run_cli(["run", "--cpu", "1", "--output", str(out), str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "root's own\n"
    assert not log.is_symlink() and "hello from rank" in log.read_text()
    assert_gone(pids_in(result.stdout))


AS_USER = """
import os, sys
import argparse, datetime, errno, glob, html, json, pwd, re, resource, shutil, socket, struct, textwrap, time
import psutil
import multigpu.cli.main, multigpu.cli.report, multigpu.supervisor.control, multigpu.record.report_page
import multigpu.record.run_json
os.setgroups([])
os.setgid(int(sys.argv[2]))
os.setuid(int(sys.argv[1]))  # from here on this process is the second user, to the kernel too
from multigpu.cli.main import main
sys.exit(main(sys.argv[3:]))
"""


def multigpu_as(user: pwd.struct_passwd, *args: str) -> subprocess.CompletedProcess[str]:
    """``multigpu ARGS`` as ``user``: the interpreter starts as root (its files are under /root, which the
    user cannot read), imports what the command needs, then becomes the user for good."""
    return subprocess.run(
        [PYTHON, "-c", AS_USER, str(user.pw_uid), str(user.pw_gid), *args],
        cwd="/",
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


LONG = """
    import os, pathlib, time
    print(f"pid={os.getpid()}", flush=True)
    pathlib.Path(os.environ["READY"]).touch()
    time.sleep(120)
"""


def test_another_users_status_and_stacks_are_refused_in_one_line(
    auditor: pwd.struct_passwd, shared: Path, tmp_path: Path
) -> None:
    out = shared / "OUT"
    ready = tmp_path / "ready"
    job = write_script(tmp_path, "job.py", LONG)
    proc = start_cli(
        ["run", "--cpu", "1", "--status", "off", "--output", str(out), str(job)],
        cwd=tmp_path,
        env={"READY": str(ready)},
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the rank never got going"
            time.sleep(0.05)
        run_id = json.loads((out / "run.json").read_text())["run_id"]
        for request in ("status", "stacks"):
            theirs = multigpu_as(auditor, request, str(out))
            assert theirs.returncode == 1, (request, theirs.stdout, theirs.stderr)
            assert theirs.stderr == f"refused: run {run_id} belongs to user root\n", (request, theirs.stderr)
            assert theirs.stdout == ""
        own = run_cli(["status", str(out)], cwd=tmp_path)
        assert own.returncode == 0 and own.stdout.startswith("rank 0 pid "), own.stderr
        assert proc.poll() is None, "asking must not stop the job"
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert_gone(pids_in(stdout))


PROBE = """
import socket, sys, urllib.error, urllib.request
for url in sys.argv[1].split():
    try:
        print(url, urllib.request.urlopen(url, timeout=2).status)
    except urllib.error.HTTPError as exc:
        print(url, exc.code)
    except Exception as exc:  # not HTTP (the store): nothing served either
        print(url, type(exc).__name__)
for path in sys.argv[2].split():
    try:
        socket.socket(socket.AF_UNIX).connect(path)
        print(path, "connected")
    except OSError as exc:
        print(path, type(exc).__name__)
"""

DEBUGGED = """
    import os, pathlib, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    print(f"pid={os.getpid()}", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    dist.barrier()
"""


def servers(launcher: int) -> tuple[list[str], list[int]]:
    """The Unix sockets of torch's worker servers and the TCP ports the launcher's tree listens on."""
    import psutil

    conns = []
    for proc in [psutil.Process(launcher), *psutil.Process(launcher).children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
            conns += proc.net_connections("all")
    unix = sorted(
        {
            str(c.laddr)
            for c in conns
            if c.family == socket.AF_UNIX and str(c.laddr).startswith("/tmp/multigpu-debug-")
        }
    )
    ports = sorted({c.laddr.port for c in conns if c.family != socket.AF_UNIX and c.status == "LISTEN"})
    return unix, ports


def test_another_user_reads_no_stacks_from_a_debug_server_job(
    auditor: pwd.struct_passwd, tmp_path: Path
) -> None:
    """Neither the page nor a rank's server answers the second user without the token, and torch's
    worker servers (Unix sockets) cannot even be reached by them."""
    from helpers import free_port

    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if system_python is None:
        pytest.skip("no system python3 for the second user to run (the test's own is under /root)")
    job = write_script(tmp_path, "job.py", DEBUGGED)
    marker, port = tmp_path / "go", free_port()
    proc = start_cli(
        [
            "run",
            "--cpu",
            "2",
            "--grace-period",
            "1",
            "--output",
            str(tmp_path / "out"),
            "--debug-server",
            str(port),
            str(job),
            str(marker),
        ],
        cwd=tmp_path,
    )
    try:
        assert proc.stderr is not None
        line = ""
        while "debug server (torch's" not in line:
            line = proc.stderr.readline()
            assert line, "the launcher ended before its debug server line"
        deadline = time.monotonic() + 60
        while True:
            unix, ports = servers(proc.pid)
            if len(unix) == 2 and port in ports:
                break
            assert time.monotonic() < deadline, (unix, ports)
            time.sleep(0.2)
        urls = [
            f"http://127.0.0.1:{port}/stacks",
            *(f"http://127.0.0.1:{p}/handler/dump_traceback" for p in ports if p != port),
        ]
        probe = subprocess.run(
            [system_python, "-c", PROBE, " ".join(urls), " ".join(unix)],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=120,
            user=auditor.pw_uid,
            group=auditor.pw_gid,
            extra_groups=[],
        )
    finally:
        marker.touch()
        out, _ = proc.communicate(timeout=60)
    answers = dict(line.rsplit(" ", 1) for line in probe.stdout.splitlines())
    assert answers[urls[0]] == "403", probe.stdout + probe.stderr
    assert [p for p in unix if answers[p] != "PermissionError"] == [], probe.stdout
    assert list(answers.values()).count("403") >= 3 and "200" not in answers.values(), probe.stdout
    assert_gone(pids_in(out))
