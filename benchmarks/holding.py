"""Shared by the launcher-killed and signal benchmarks: a job whose ranks (and grandchildren) are up."""

from __future__ import annotations

import os
import time

from common import Ctx, Job, Tracked, read_marks, start_launcher, wait_until

HOLD_S = "120"


def start_holding(
    ctx: Ctx, name: str, launcher: str, nproc: int, child: bool = True, seconds: str = HOLD_S
) -> Job | None:
    """Start hold.py and wait (bounded) until every rank is ready and has recorded its grandchild."""
    args = [seconds] if child else [seconds, "--no-child"]
    job = start_launcher(ctx.root, name, launcher, nproc, "hold.py", args)
    expected = nproc * (2 if child else 1)
    ready = wait_until(
        lambda: len(read_marks(job.bench_dir, "ready")) == nproc and len(job.procs()) == expected,
        120,
        poll=0.02,
    )
    if ready is None:
        job.finish()
        return None
    return job


def signal_and_watch(job: Job, sig: int, bound: float) -> tuple[float | None, float | None, list[Tracked]]:
    """Send sig to the launcher; (seconds to its exit, seconds until every recorded process is gone,
    the processes still alive after the bound). Leftovers are the caller's to end (job.finish())."""
    procs = job.procs()
    t0 = time.time()
    os.kill(job.pid, sig)
    exited: float | None = None
    gone: float | None = None
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and (exited is None or gone is None):
        if exited is None and job.popen.poll() is not None:
            exited = time.time() - t0
        if gone is None and not any(p.alive() for p in procs):
            gone = time.time() - t0
        time.sleep(0.002)
    return exited, gone, [p for p in procs if p.alive()]
