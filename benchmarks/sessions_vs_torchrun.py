"""Issue 12's table, measured: each user-session case under `multigpu run` and under torchrun.

An ad-hoc script (not part of run.py): python benchmarks/sessions_vs_torchrun.py [CASE ...]
Prints one markdown row per case: what each launcher did (exit code, seconds, what the console showed).
Jobs are tiny CPU scripts that never init a process group, so torchrun and multigpu run the same code.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

VENV = Path(sys.executable).parent
MG = [sys.executable, "-m", "multigpu", "run", "--cpu", "2", "--grace-period", "0.5", "--status", "off"]
TR = [
    str(VENV / "torchrun"),
    "--nproc-per-node",
    "2",
    "--rdzv-backend",
    "c10d",
    "--rdzv-endpoint",
    "127.0.0.1:0",
    "--max-restarts",
    "0",
]
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("MULTIGPU_")},
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
PRELUDE = "import os, sys, time, pathlib, signal\nRANK = int(os.environ['RANK'])\n"


def cmd(launcher: str, job: Path, out: Path, *extra: str) -> list[str]:
    if launcher == "multigpu":
        return [*MG, "--output", str(out), *extra, str(job)]
    return [*TR, "--log-dir", str(out), *extra, str(job)]


def write(d: Path, body: str) -> Path:
    path = d / "job.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return path


def bash(line: str, cwd: Path, timeout: float = 60) -> tuple[int, float, bytes, bytes]:
    t0 = time.monotonic()
    try:
        res = subprocess.run(["bash", "-c", line], cwd=cwd, env=ENV, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -999, timeout, b"", b""
    return res.returncode, time.monotonic() - t0, res.stdout, res.stderr


def q(parts: list[str]) -> str:
    return " ".join(shlex.quote(p) for p in parts)


def end(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


CHATTY = """
if RANK == 0:
    for i in range(20000):
        print(f"line {i:05d} " + "x" * 100)
    sys.stdout.flush()
    pathlib.Path("ready_0").touch()
    time.sleep(30)
else:
    {after}
"""


def stalled_reader(launcher: str, d: Path) -> str:
    job = write(d, CHATTY.replace("{after}", 'time.sleep(2)\n    raise ValueError("rank one fails")'))
    r, w = os.pipe()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd(launcher, job, d / "out"),
        cwd=d,
        env=ENV,
        stdout=w,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.close(w)
    rc = end(proc, 30)
    os.close(r)
    return f"exit {rc} after {time.monotonic() - t0:.1f}s" if rc is not None else "still running at 30s"


def stalled_then_sigterm(launcher: str, d: Path) -> str:
    job = write(d, CHATTY.replace("{after}", "time.sleep(30)"))
    r, w = os.pipe()
    proc = subprocess.Popen(
        cmd(launcher, job, d / "out"),
        cwd=d,
        env=ENV,
        stdout=w,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.close(w)
    deadline = time.monotonic() + 60
    while not (d / "ready_0").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = end(proc, 10)
    os.close(r)
    return f"exit {rc} {time.monotonic() - t0:.2f}s after SIGTERM" if rc is not None else "running 10s later"


def redirected(how: str) -> Callable[[str, Path], str]:
    def case(launcher: str, d: Path) -> str:
        job = write(d, 'print(f"hello {RANK}", flush=True)\n')
        rc, secs, _, err = bash(f"exec {q(cmd(launcher, job, d / 'out'))} {how}", d, 60)
        tb = ", traceback" if b"Traceback" in err else ""
        return f"exit {rc} in {secs:.1f}s{tb}" if rc != -999 else "hung (killed at 60s)"

    return case


def progress_bar(launcher: str, d: Path) -> str:
    job = write(
        d,
        """
    if RANK == 0:
        for i in range(5):
            pathlib.Path(f"t{i}").write_text(repr(time.time()))
            sys.stderr.write(f"\\rstep {i}/5"); sys.stderr.flush()
            time.sleep(0.5)
        sys.stderr.write("\\n")
    """,
    )
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        cmd(launcher, job, d / "out"), cwd=d, env=ENV, stdout=slave, stderr=slave, start_new_session=True
    )
    os.close(slave)
    seen, arrivals = bytearray(), {}
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if select.select([master], [], [], 0.02)[0]:
            with contextlib.suppress(OSError):
                seen += os.read(master, 65536)
        for i in range(5):
            if i not in arrivals and f"step {i}/5".encode() in seen:
                arrivals[i] = time.time()
    os.close(master)
    end(proc, 5)
    lags = [arrivals[i] - float((d / f"t{i}").read_text()) for i in arrivals if (d / f"t{i}").exists()]
    in_place = b"step 1/5\r\n" not in seen and b"step 1/5\n" not in seen
    return (
        (
            f"{len(arrivals)}/5 updates live, lag max {max(lags):.2f}s, "
            f"{'in place' if in_place else 'one line per update'}"
        )
        if lags
        else "no update reached the tty"
    )


def hang_up(launcher: str, d: Path) -> str:
    job = write(
        d,
        """
    pathlib.Path(f"ready_{RANK}").touch()
    while not os.path.exists("hung_up"):
        time.sleep(0.01)
    for i in range(2000):
        print(f"after {i}", flush=True)
    """,
    )
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        cmd(launcher, job, d / "out"), cwd=d, env=ENV, stdout=slave, stderr=slave, start_new_session=True
    )
    os.close(slave)
    deadline = time.monotonic() + 60
    while not ((d / "ready_0").exists() and (d / "ready_1").exists()) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.close(master)
    proc.send_signal(signal.SIGHUP)
    (d / "hung_up").touch()
    rc = end(proc, 30)
    status = _status(d / "out")
    return f"exit {rc}{status}"


def _status(out: Path) -> str:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads((out / "run.json").read_text())
        return f", run.json {data['status']!r}"
    return ""


def sigquit(launcher: str, d: Path) -> str:
    job = write(d, 'pathlib.Path(f"ready_{RANK}").touch()\ntime.sleep(30)\n')
    proc = subprocess.Popen(
        cmd(launcher, job, d / "out"),
        cwd=d,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not ((d / "ready_0").exists() and (d / "ready_1").exists()) and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGQUIT)
    rc = end(proc, 15)
    return f"exit {rc} after {time.monotonic() - t0:.2f}s{_status(d / 'out')}"


def long_line(launcher: str, d: Path) -> str:
    job = write(d, 'if RANK == 1:\n    print("{" + "y" * (1 << 20) + "}", flush=True)\n')
    rc, _secs, out, _ = bash(q(cmd(launcher, job, d / "out")), d, 60)
    pieces = [ln for ln in out.split(b"\n") if b"yyy" in ln]
    return f"exit {rc}, {len(pieces)} console line(s), longest {max(map(len, pieces), default=0)} bytes"


def many_ranks(launcher: str, d: Path) -> str:
    job = write(d, 'print("rank", RANK)\n')
    c = cmd(launcher, job, d / "out")
    c[c.index("2")] = "64"
    rc, secs, out, _err = bash(f"ulimit -Sn 128 && exec {q(c)}", d, 120)
    lines = [ln for ln in out.decode(errors="replace").splitlines() if re.search(r"(^|\] )rank \d+$", ln)]
    return f"exit {rc} in {secs:.1f}s, {len(lines)} of 64 rank lines on the console"


def ctrl_c_loop(launcher: str, d: Path) -> str:
    job = write(d, 'pathlib.Path(f"ready_{RANK}_{sys.argv[1]}").touch()\ntime.sleep(30)\n')
    base = q(cmd(launcher, job, Path("OUT"))[:-1]).replace("OUT", "out_$i")
    loop = d / "loop.sh"
    loop.write_text(f"for i in 1 2 3; do {base} {shlex.quote(str(job))} $i; echo finished $i; done\n")
    proc = subprocess.Popen(
        ["bash", str(loop)],
        cwd=d,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not (d / "ready_1_1").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    started = sorted({p.name.rsplit("_", 1)[1] for p in d.glob("ready_*_*")})
    return f"loop {'went on' if b'finished' in out else 'stopped'} (iterations started: {', '.join(started)})"


def bad_folder(launcher: str, d: Path) -> str:
    job = write(d, "pass\n")
    (d / "taken").write_text("x")
    rc, _, _, err = bash(q(cmd(launcher, job, d / "taken" / "sub")), d, 60)
    return f"exit {rc}, {err.decode(errors='replace').count(chr(10))} stderr line(s)"


@contextlib.contextmanager
def tmpfs(d: Path, *options: str) -> Iterator[Path]:
    where = d / "mnt"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def read_only_folder(launcher: str, d: Path) -> str:
    job = write(d, "pass\n")
    with tmpfs(d, "size=1m", "ro") as mnt:
        rc, _, _, err = bash(q(cmd(launcher, job, mnt / "out")), d, 60)
    return f"exit {rc}, {err.decode(errors='replace').count(chr(10))} stderr line(s)"


def disk_fills(launcher: str, d: Path) -> str:
    job = write(d, 'for i in range(30000):\n    print(f"line {i:05d} " + "z" * 100)\n')
    with tmpfs(d, "size=1m") as mnt:
        extra = ["--redirects", "3"] if launcher == "torchrun" else []
        rc, _, _, err = bash(q(cmd(launcher, job, mnt / "out", *extra)), d, 60)
        status = _status(mnt / "out")
    tb = ", traceback" if b"Traceback" in err else ""
    return f"exit {rc}{status}{tb}"


def two_at_once(launcher: str, d: Path) -> str:
    job = write(d, 'pathlib.Path(f"ready_{RANK}_{os.getpid()}").touch()\ntime.sleep(3)\n')
    first = subprocess.Popen(
        cmd(launcher, job, d / "out"),
        cwd=d,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while len(list(d.glob("ready_*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    rc, _, _, err = bash(q(cmd(launcher, job, d / "out")), d, 60)
    rc1 = end(first, 60)
    return f"first exit {rc1}; second exit {rc}, {err.decode(errors='replace').count(chr(10))} stderr line(s)"


CASES: dict[str, Callable[[str, Path], str]] = {
    "output folder read-only": read_only_folder,
    "disk fills during the run (1 MiB tmpfs)": disk_fills,
    "two runs at once, same --output / --log-dir": two_at_once,
    "stdout to a reader that stops; rank 1 raises": stalled_reader,
    "the same stalled reader, then SIGTERM": stalled_then_sigterm,
    "stdin closed (<&-)": redirected("<&-"),
    "stdout closed (>&-)": redirected(">&-"),
    "stderr closed (2>&-)": redirected("2>&-"),
    "stdout and stderr to /dev/full": redirected(">/dev/full 2>&1"),
    "tqdm-style bar on a terminal": progress_bar,
    "output folder under a file": bad_folder,
    "terminal hangs up (pty closed + SIGHUP)": hang_up,
    "SIGQUIT to the launcher": sigquit,
    "one 1 MiB line": long_line,
    "64 ranks under ulimit -Sn 128": many_ranks,
    "Ctrl-C in a shell for loop": ctrl_c_loop,
}


def end_leftovers(settle_s: float = 2.0) -> int:
    """End, by PID, whatever a case left running (torchrun's orphaned workers, mostly) and count it.

    The benchmark is a child subreaper, so every orphan of a case is re-parented here and can be found
    among our own descendants, however it detached."""
    import psutil

    deadline = time.monotonic() + settle_s
    left = psutil.Process().children(recursive=True)
    while left and time.monotonic() < deadline:  # a launcher's own teardown may still be finishing
        time.sleep(0.1)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=5)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:  # adopted orphans are ours to reap
            pass
    return len(left)


def main() -> None:
    from multigpu.contract.prctl import set_child_subreaper

    set_child_subreaper()
    wanted = sys.argv[1:]
    print("| case | multigpu now | torchrun |\n| --- | --- | --- |")
    for name, case in CASES.items():
        if wanted and not any(w in name for w in wanted):
            continue
        cells = []
        for launcher in ("multigpu", "torchrun"):
            with tempfile.TemporaryDirectory(prefix="sessions-") as tmp:
                try:
                    cells.append(case(launcher, Path(tmp)))
                except Exception as exc:
                    cells.append(f"harness error: {exc!r}")
                left = end_leftovers()
                if left:
                    cells[-1] += f"; {left} process(es) left running (ended by the benchmark)"
        print(f"| {name} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
