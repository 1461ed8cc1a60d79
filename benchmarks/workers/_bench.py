"""Worker-side helpers shared by the benchmark worker scripts (run under either launcher, or by hand).

Every worker records its PID (with the kernel's start time, so the harness never mistakes a reused PID
for one of its own) under ``$BENCH_DIR/pids``, and writes markers the harness polls for.
"""

from __future__ import annotations

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


def init_gloo() -> Any:
    """init_process_group through env://, as every launcher (and the hand-started floor) provides."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist
