"""Worker-side helpers shared by the benchmark worker scripts (run under either launcher, or by hand).

Every worker records its PID (with the kernel's start time, so the harness never mistakes a reused PID
for one of its own) under ``$BENCH_DIR/pids``, and writes markers the harness polls for.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any


def bench_dir() -> Path:
    return Path(os.environ["BENCH_DIR"])


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def start_time_of(pid: int) -> str:
    """Field 22 of /proc/PID/stat (clock ticks since boot): with the PID, names one process for good."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def record_pid(pid: int | None = None, kind: str = "worker") -> None:
    pid = os.getpid() if pid is None else pid
    write_atomic(bench_dir() / "pids" / str(pid), f"{start_time_of(pid)} {kind} {rank()}\n")


def mark(name: str, value: float | None = None) -> None:
    """A marker file holding a wall-clock time (default: now)."""
    write_atomic(bench_dir() / "marks" / f"{name}.{rank()}", repr(time.time() if value is None else value))


def created_at(pid: int) -> float:
    """Wall-clock time the kernel created ``pid`` (its start time, to the clock tick: 10 ms)."""
    ticks = int(start_time_of(pid))
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def launcher_helpers(launcher: int) -> list[int]:
    """The launcher's children that run ``multigpu.template`` (the warm template or the store process)."""
    found = []
    for task in os.listdir(f"/proc/{launcher}/task"):
        with open(f"/proc/{launcher}/task/{task}/children") as f:
            for pid in map(int, f.read().split()):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        if b"multigpu.template" in c.read():
                            found.append(pid)
                except OSError:
                    continue
    return found


def mark_start_phases() -> None:
    """At a script's first line: when its process was created and when the script began; on rank 0
    also when its launcher (the parent) and the launcher's template or store process were created.
    The start benchmark splits a job's start into phases with these."""
    mark("script")
    mark("created", created_at(os.getpid()))
    if rank() != 0:
        return
    launcher = os.getppid()
    with contextlib.suppress(OSError, ValueError):
        mark("launcher", created_at(launcher))
        helpers = launcher_helpers(launcher)
        if helpers:
            mark("helper", min(created_at(pid) for pid in helpers))


def init_gloo() -> Any:
    """init_process_group through env://, as every launcher (and the hand-started floor) provides."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist
