"""Harness-side plumbing: launcher command lines, bounded processes, PID bookkeeping, statistics.

Every process the harness starts is tracked here and ended by PID if it outlives its benchmark; worker
PIDs come from the files the workers write, checked against the kernel's start time before any signal.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"
PYTHON = sys.executable
LOOPBACK = "127.0.0.1"
MULTIGPU = "multigpu"
TORCHRUN = "torchrun"
FLOOR = "floor"
LAUNCHERS = (MULTIGPU, TORCHRUN)


def torchrun_argv() -> list[str]:
    script = Path(PYTHON).parent / "torchrun"
    return [str(script)] if script.exists() else [PYTHON, "-m", "torch.distributed.run"]


def launcher_argv(
    launcher: str,
    nproc: int | str,
    script: str,
    args: Sequence[str] = (),
    output: Path | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line that runs WORKERS/script under ``launcher`` with ``nproc`` CPU workers."""
    target = [str(WORKERS / script), *args]
    if launcher == MULTIGPU:
        out = ["--output", str(output)] if output is not None else []
        return [PYTHON, "-m", "multigpu", "run", "--cpu", str(nproc), *out, *extra, *target]
    if launcher == TORCHRUN:
        return [
            *torchrun_argv(),
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{LOOPBACK}:0",
            "--max-restarts",
            "0",
            *extra,
            *target,
        ]
    raise ValueError(f"unknown launcher {launcher!r}")


def two_node_argv(
    launcher: str,
    node_rank: int,
    port: int,
    script: str,
    args: Sequence[str] = (),
    output: Path | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """Node ``node_rank`` of a static two-node job on loopback, one rank a node: the same torchrun line
    for both launchers (multigpu's ``--output`` and ``extra`` flags go before the script)."""
    nodes = [
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        LOOPBACK,
        "--master-port",
        str(port),
        "--nproc-per-node",
        "1",
    ]
    target = [str(WORKERS / script), *args]
    if launcher == MULTIGPU:
        out = ["--output", str(output)] if output is not None else []
        return [PYTHON, "-m", "multigpu", "run", *nodes, *out, *extra, *target]
    if launcher == TORCHRUN:
        return [*torchrun_argv(), *nodes, *extra, *target]
    raise ValueError(f"unknown launcher {launcher!r}")


def alternate(i: int, names: Sequence[str] = LAUNCHERS) -> list[str]:
    """Run i's order: rotated by one each run, so no launcher always goes first."""
    k = i % len(names)
    return [*names[k:], *names[:k]]


# ---------------------------------------------------------------- processes


def proc_state(pid: int) -> tuple[str, str] | None:
    """(state letter, start time) from /proc/PID/stat, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, OSError):
        return None
    return fields[0], fields[19]


@dataclass(frozen=True)
class Tracked:
    """A process known by PID and start time: never confused with a later process that reuses the PID."""

    pid: int
    start: str
    kind: str = "worker"
    rank: int = -1

    def alive(self) -> bool:
        """Running or stopped; a zombie (dead, waiting to be reaped) counts as gone."""
        state = proc_state(self.pid)
        return state is not None and state[1] == self.start and state[0] not in ("Z", "X")

    def kill(self) -> bool:
        if not self.alive():
            return False
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True


def read_pids(bench_dir: Path) -> list[Tracked]:
    out = []
    for path in sorted((bench_dir / "pids").glob("[0-9]*")):
        try:
            start, kind, rank = path.read_text().split()
        except (OSError, ValueError):
            continue
        out.append(Tracked(int(path.name), start, kind, int(rank)))
    return out


def read_marks(bench_dir: Path, name: str) -> dict[int, float]:
    """marks/NAME.RANK -> {rank: wall time}."""
    out = {}
    for path in (bench_dir / "marks").glob(f"{name}.*"):
        try:
            out[int(path.suffix[1:])] = float(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def wait_until(cond: Callable[[], bool], timeout: float, poll: float = 0.005) -> float | None:
    """Poll cond; the wall time it first held, or None after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return time.time()
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll)


def all_gone(procs: Iterable[Tracked]) -> bool:
    return not any(p.alive() for p in procs)


class Registry:
    """Every launcher and hand-started rank the harness starts, so each one can be ended by PID."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen[bytes]] = []
        self.dirs: list[Path] = []

    def track(self, popen: subprocess.Popen[bytes], bench_dir: Path | None = None) -> None:
        self.popens.append(popen)
        if bench_dir is not None and bench_dir not in self.dirs:
            self.dirs.append(bench_dir)

    def cleanup(self) -> int:
        """SIGKILL every tracked process still alive (launchers first, then recorded workers); reap."""
        killed = 0
        for p in self.popens:
            if p.poll() is None:
                p.kill()
                killed += 1
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        for d in self.dirs:
            killed += sum(t.kill() for t in read_pids(d))
        self.popens.clear()
        self.dirs.clear()
        return killed


REGISTRY = Registry()


def worker_env(bench_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The harness's environment, minus any distributed variables, plus BENCH_DIR and one thread a rank."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith(("MULTIGPU_", "TORCHELASTIC_"))
    }
    env["BENCH_DIR"] = str(bench_dir)
    env["OMP_NUM_THREADS"] = "1"  # the same for every launcher and the floor (torchrun's own default)
    env.update(extra or {})
    return env


@dataclass
class Job:
    """One launcher (or hand-started rank) run: its Popen, its scratch directory and timings."""

    popen: subprocess.Popen[bytes]
    bench_dir: Path
    started: float
    log_path: Path
    exited: float | None = None
    extra: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait(self, timeout: float) -> int | None:
        """Wait for exit (recording its wall time), or None after timeout (the job is left running)."""
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self.exited = time.time()
        return code

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def procs(self) -> list[Tracked]:
        return read_pids(self.bench_dir)

    def finish(self) -> int:
        """End the launcher and everything it recorded, by PID; the count of processes that needed it."""
        killed = 0
        if self.popen.poll() is None:
            self.popen.kill()
            killed += 1
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        return killed + sum(t.kill() for t in self.procs())


def new_bench_dir(root: Path, name: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    (path / "pids").mkdir()
    (path / "marks").mkdir()
    return path


def start(
    argv: Sequence[str], bench_dir: Path, env: dict[str, str] | None = None, log_name: str = "console.log"
) -> Job:
    """Start argv with stdout and stderr to one file, in its own session (terminal signals stay out)."""
    log_path = bench_dir / log_name
    with open(log_path, "wb") as log:
        started = time.time()
        popen = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env or worker_env(bench_dir),
            cwd=bench_dir,
            start_new_session=True,
        )
    REGISTRY.track(popen, bench_dir)
    return Job(popen, bench_dir, started, log_path)


def start_launcher(
    root: Path,
    name: str,
    launcher: str,
    nproc: int,
    script: str,
    args: Sequence[str] = (),
    extra: Callable[[Path], list[str]] | None = None,
    env: dict[str, str] | None = None,
) -> Job:
    """Start a launcher job in a fresh scratch directory (multigpu's --output is DIR/mg); ``env`` adds
    to the harness's environment."""
    bench_dir = new_bench_dir(root, f"{name}-{launcher}")
    flags = extra(bench_dir) if extra is not None else []
    argv = launcher_argv(launcher, nproc, script, args, output=bench_dir / "mg", extra=flags)
    return start(argv, bench_dir, worker_env(bench_dir, env))


def run_launcher(
    root: Path,
    name: str,
    launcher: str,
    nproc: int,
    script: str,
    args: Sequence[str] = (),
    timeout: float = 120.0,
    extra: Callable[[Path], list[str]] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[Job, int | None]:
    """Start a launcher job, wait for it (bounded), then end whatever is left; (job, exit code)."""
    job = start_launcher(root, name, launcher, nproc, script, args, extra, env)
    code = job.wait(timeout)
    job.finish()
    return job, code


def job_seconds(job: Job, code: int | None) -> float | None:
    """Wall seconds from start to exit of a job that succeeded, else None."""
    return job.exited - job.started if code == 0 and job.exited is not None else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def run_floor(
    root: Path, nproc: int, script: str, args: Sequence[str] = (), timeout: float = 120.0
) -> tuple[float | None, list[int | None]]:
    """The same ranks started by hand, no launcher: (wall seconds from first start to last exit, codes)."""
    bench_dir = new_bench_dir(root, "floor")
    port = free_port()
    started = time.time()
    jobs = []
    for r in range(nproc):
        env = worker_env(
            bench_dir,
            {
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": LOOPBACK,
                "MASTER_PORT": str(port),
            },
        )
        jobs.append(start([PYTHON, str(WORKERS / script), *args], bench_dir, env, f"rank_{r}.log"))
    deadline = started + timeout
    codes = [j.wait(max(0.0, deadline - time.time())) for j in jobs]
    ends = [j.exited for j in jobs]
    for j in jobs:
        j.finish()
    if any(c != 0 for c in codes) or any(e is None for e in ends):
        return None, codes
    return max(e for e in ends if e is not None) - started, codes


def numpy_site(path: Path) -> Path | None:
    """A folder holding NumPy for PYTHONPATH (the harness's venv has none), made once with
    ``pip install --target`` and kept for later runs; None where pip cannot install it (no registry)."""
    if (path / "numpy" / "__init__.py").exists():
        return path
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        done = subprocess.run(
            [
                PYTHON,
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                "--target",
                str(tmp),
                "numpy",
            ],
            capture_output=True,
            timeout=280,
        )
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        return None
    os.replace(tmp, path)
    return path


def with_pythonpath(env: dict[str, str], folder: Path | None) -> dict[str, str]:
    """``env`` with ``folder`` ahead on PYTHONPATH (kept as is when folder is None)."""
    if folder is None:
        return env
    rest = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": str(folder) + (os.pathsep + rest if rest else "")}


def rmtree_quiet(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- statistics


def summarize(values: Sequence[float | None]) -> dict[str, Any]:
    """median, min, max over the numbers; 'never' counts the runs that gave none (a timeout, a failure)."""
    nums = [v for v in values if v is not None]
    out: dict[str, Any] = {"n": len(values), "never": len(values) - len(nums)}
    if nums:
        out.update(median=statistics.median(nums), min=min(nums), max=max(nums))
    return out


def median(values: Sequence[float | None]) -> float | None:
    nums = [v for v in values if v is not None]
    return statistics.median(nums) if nums else None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class Ctx:
    """What every benchmark gets: run count, quick mode, and a scratch directory for its jobs."""

    runs: int
    quick: bool
    root: Path
