"""``multigpu report``: a run with one failure and one restart, then its incidents as a table and
``report.html``, rendered in a real headless browser (Debian's Chromium) and checked by what it
drew: the ranks' bars in their colours. The browser test skips, saying so, where Chromium is not
installed (``.ci/run`` installs it)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import struct
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from helpers import assert_gone, run_cli, tier_cannot_run, write_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

JOB = """
    import os, time, torch, torch.distributed as dist, multigpu
    dist.init_process_group("gloo")
    print(f"pid={os.getpid()}", flush=True)
    t = torch.ones(1)
    for step in range(10):
        multigpu.heartbeat(step=step)
        dist.all_reduce(t)
        if step == 3 and dist.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            raise ValueError("loss is NaN")
        time.sleep(0.02)
"""


@pytest.fixture(scope="module")
def restarted_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    job = write_script(tmp, "job.py", JOB)
    res = run_cli(
        [
            "run",
            "--cpu",
            "2",
            "--status",
            "off",
            "--max-restarts",
            "1",
            "--output",
            str(tmp / "out"),
            str(job),
        ],
        cwd=tmp,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((tmp / "out" / "run.json").read_text())
    assert_gone([r["pid"] for a in data["attempts"] for r in a["ranks"].values() if r["pid"]])
    return tmp / "out"


def test_the_incident_table_says_where_the_time_went(restarted_run: Path) -> None:
    res = run_cli(["report", str(restarted_run)], cwd=restarted_run)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].endswith("succeeded, 2 attempt(s), 1 incident(s)")
    assert lines[1].split() == ["attempt", "detect", "stop", "meet", "again", "first", "step", "what"]
    row = lines[2].split()
    assert row[0] == "0" and all(cell.endswith("s") and float(cell[:-1]) >= 0 for cell in row[1:5]), row
    assert "rank 1 (node 0, pid" in lines[2] and "ValueError: loss is NaN" in lines[2]
    incident = json.loads((restarted_run / "run.json").read_text())["incidents"][0]
    order = [
        incident[k]
        for k in ("failed_time", "detected_time", "stopped_time", "next_attempt_time", "next_first_step_time")
    ]
    assert order == sorted(order), incident
    assert (restarted_run / "report.html").is_file()


def test_a_wrong_folder_is_one_line(tmp_path: Path) -> None:
    res = run_cli(["report", str(tmp_path)], cwd=tmp_path)
    assert res.returncode == 2 and "no run.json there" in res.stderr
    assert "Traceback" not in res.stderr


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and raw RGB(A) rows of a PNG, with PNG's filters undone (the standard library
    has no image reader, and Chromium's screenshots are plain 8-bit RGB or RGBA)."""
    data = path.read_bytes()
    pos, chunks, header = 8, b"", b""
    while pos < len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + size]
        header = body if kind == b"IHDR" else header
        chunks += body if kind == b"IDAT" else b""
        pos += 12 + size
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and colour in (2, 6), (depth, colour)
    step = 3 if colour == 2 else 4
    raw, rows, prev = zlib.decompress(chunks), [], bytearray(width * step)
    stride = width * step + 1
    for y in range(height):
        kind, line = raw[y * stride], bytearray(raw[y * stride + 1 : (y + 1) * stride])
        for i in range(len(line)):
            a = line[i - step] if i >= step else 0
            b, c = prev[i], prev[i - step] if i >= step else 0
            pred = {
                0: 0,
                1: a,
                2: b,
                3: (a + b) // 2,
                4: min((a, b, c), key=lambda v: (abs(a + b - c - v), (a, b, c).index(v))),
            }[kind]
            line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, step, rows


def test_the_timeline_draws_every_rank_in_a_real_browser(restarted_run: Path, tmp_path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        tier_cannot_run("Chromium is not installed (apt-get install chromium); the HTML is checked above")
    run_cli(["report", str(restarted_run)], cwd=restarted_run)
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1000,400",
            f"--screenshot={shot}",
            (restarted_run / "report.html").as_uri(),
        ],
        capture_output=True,
        timeout=60,
    )
    assert shot.is_file(), proc.stderr.decode()[-2000:]
    width, step, rows = png_pixels(shot)
    colours = {"succeeded": (0x2E, 0x7D, 0x32), "failed": (0xC6, 0x28, 0x28), "stopped": (0x9E, 0x9E, 0x9E)}
    counts = {
        name: sum(1 for row in rows for x in range(width) if tuple(row[x * step : x * step + 3]) == rgb)
        for name, rgb in colours.items()
    }
    # attempt 0: rank 1 failed, rank 0 stopped; attempt 1: both succeeded; each bar is tens of pixels
    assert all(n > 50 for n in counts.values()), counts


LONG = """
    import os, pathlib, time, multigpu
    print(f"pid={os.getpid()}", flush=True)
    rank, spoke = os.environ["RANK"], False
    for step in range(100000):
        multigpu.heartbeat(step=step)
        if step == 3:
            pathlib.Path(f"ready_{rank}").touch()
        if not spoke and os.path.exists("speak"):  # a line written after the test's request
            print(f"rank {rank} still speaks", flush=True)
            pathlib.Path(f"spoke_{rank}").touch()
            spoke = True
        time.sleep(0.02)
"""


def test_stacks_and_status_from_another_shell_leave_the_job_running(tmp_path: Path) -> None:

    from helpers import start_cli

    job = write_script(tmp_path, "job.py", LONG)
    out = tmp_path / "out"
    args = ["run", "--cpu", "2", "--status", "off", "--steps", "100000", "--output", str(out), str(job)]
    proc = start_cli(args, cwd=tmp_path)
    try:
        ready = [tmp_path / "ready_0", tmp_path / "ready_1"]
        deadline = time.monotonic() + 60
        while not all(p.exists() for p in ready):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks never got going"
            time.sleep(0.05)
        status = run_cli(["status", str(out)], cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        *lines, job_line = status.stdout.splitlines()
        assert [line.split()[:2] for line in lines] == [["rank", "0"], ["rank", "1"]]
        assert all(" running, step " in line for line in lines), lines
        assert re.fullmatch(r"job: step \d+/100000 \(\d+%\), ETA \d+m\d\ds", job_line), job_line
        stacks = run_cli(["stacks", str(out)], cwd=tmp_path)
        assert stacks.returncode == 0, stacks.stderr
        assert stacks.stdout.count('job.py", line') == 2 and "rank 1 (pid" in stacks.stdout
        assert "_answer_dumps" not in stacks.stdout and "multigpu threads ..." in stacks.stdout
        assert proc.poll() is None, "asking must not stop the job"
        (tmp_path / "speak").touch()
        while not all((tmp_path / f"spoke_{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline + 60 and proc.poll() is None, "the ranks stopped"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        console, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # the job's console shows its ranks again once their stacks are taken
    assert "rank 0 still speaks" in console and "rank 1 still speaks" in console, console
    after = run_cli(["status", str(out)], cwd=tmp_path)
    assert after.returncode == 2 and "is not running (interrupted)" in after.stderr
    data = json.loads((out / "run.json").read_text())
    assert_gone([r["pid"] for a in data["attempts"] for r in a["ranks"].values() if r["pid"]])


def test_a_killed_launcher_is_named_lost_and_its_record_closed(tmp_path: Path) -> None:
    """Issue 31: after ``kill -9`` of the launcher, ``status`` and ``report`` say it is gone (pid and
    host), and the run's own user closes the record as ``launcher lost``; its ranks die with it."""
    from helpers import start_cli

    job = write_script(tmp_path, "job.py", LONG)
    out = tmp_path / "out"
    proc = start_cli(["run", "--cpu", "2", "--status", "off", "--output", str(out), str(job)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready_{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks never got going"
            time.sleep(0.05)
        data = json.loads((out / "run.json").read_text())
        assert data["launcher"]["pid"] == proc.pid and data["status"] == "running"
        alive = run_cli(["status", str(out)], cwd=tmp_path)
        assert alive.returncode == 0, alive.stderr  # a live launcher is still asked, as before
        proc.kill()
        proc.communicate(timeout=30)  # reaped: no zombie left to look alive
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lost = (
        f"launcher lost: pid {proc.pid} on {socket.gethostname()} is gone (its run.json still says running)"
    )
    status = run_cli(["status", str(out)], cwd=tmp_path)
    assert status.returncode == 1 and lost in status.stderr, status.stderr
    assert "Traceback" not in status.stderr
    closed = json.loads((out / "run.json").read_text())
    assert closed["status"] == "launcher lost" and closed["end_time"] is not None
    report = run_cli(["report", str(out)], cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert report.stdout.splitlines()[0].endswith(": launcher lost, 1 attempt(s), 0 incident(s)")
    assert f"launcher lost: pid {proc.pid} on {socket.gethostname()} was found gone at" in report.stdout
    assert_gone([r["pid"] for r in data["attempts"][0]["ranks"].values() if r["pid"]], timeout=10)


def test_report_on_a_killed_launcher_says_lost_before_status_does(tmp_path: Path) -> None:
    """``report`` alone finds the loss too (the record said ``running``) and closes the record."""
    from helpers import start_cli

    job = write_script(tmp_path, "job.py", LONG)
    out = tmp_path / "out"
    proc = start_cli(["run", "--cpu", "1", "--status", "off", "--output", str(out), str(job)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready_0").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the rank never got going"
            time.sleep(0.05)
        proc.kill()
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    report = run_cli(["report", str(out)], cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert (
        f"launcher lost: pid {proc.pid} on {socket.gethostname()} is gone (its run.json still says "
        "running)" in report.stdout
    ), report.stdout
    data = json.loads((out / "run.json").read_text())
    assert data["status"] == "launcher lost"
    assert_gone([r["pid"] for r in data["attempts"][0]["ranks"].values() if r["pid"]], timeout=10)
