"""10. Consecutive multigpu runs: processes, harness descriptors, /dev/shm entries and listening
sockets on 127.0.0.1 left behind (all must be zero)."""

from __future__ import annotations

import os
import time
from typing import Any

from common import LOOPBACK, MULTIGPU, Ctx, Tracked, run_launcher, start_launcher
from report import table, target

NAME = "soak"
TITLE = "10. Consecutive multigpu runs: what is left behind"
NPROC = 2
PER_JOB_S = 3.0


def total(ctx: Ctx) -> int:
    return 10 if ctx.quick else 100


def estimate(ctx: Ctx) -> float:
    return PER_JOB_S * (total(ctx) + 1)


def listening() -> set[tuple[int, int | None]]:
    """(port, pid) of every TCP socket listening on 127.0.0.1 (pid None where not ours to see)."""
    import psutil  # here, not at import: run.py --help works without it

    return {
        (c.laddr.port, c.pid)
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.ip == LOOPBACK
    }


def snapshot() -> dict[str, Any]:
    import psutil  # here, not at import: run.py --help works without it

    me = psutil.Process()
    return {
        "fds": set(os.listdir("/proc/self/fd")),
        "shm": set(os.listdir("/dev/shm")),
        "listen": listening(),
        "children": {c.pid for c in me.children(recursive=True)},
    }


def one(ctx: Ctx) -> tuple[int | None, list[Tracked], list[int]]:
    """(exit code, recorded processes still alive at the launcher's exit, launcher pid)."""
    job = start_launcher(ctx.root, NAME, MULTIGPU, NPROC, "tiny.py")
    try:
        code = job.wait(120)
        return code, [p for p in job.procs() if p.alive()], [job.pid, *(p.pid for p in job.procs())]
    finally:
        job.finish()


def run(ctx: Ctx) -> dict[str, Any]:
    run_launcher(ctx.root, NAME, MULTIGPU, NPROC, "tiny.py")  # warm-up: the harness's own lazy descriptors
    before = snapshot()
    codes, left, pids = [], [], set()
    started = time.time()
    for _ in range(total(ctx)):
        code, alive, ours = one(ctx)
        codes.append(code)
        left += alive
        pids.update(ours)
    elapsed = time.time() - started
    time.sleep(0.5)
    after = snapshot()
    new_listen = after["listen"] - before["listen"]
    return {
        "runs": total(ctx),
        "nproc": NPROC,
        "seconds": elapsed,
        "failed_runs": sum(c != 0 for c in codes),
        "exit_codes": sorted({str(c) for c in codes}),
        "processes_left": len(left),
        "process_kinds_left": sorted(p.kind for p in left),
        "children_left": len(after["children"] - before["children"]),
        "fds_left": len(after["fds"] - before["fds"]),
        "fds_closed": len(before["fds"] - after["fds"]),
        "shm_left": sorted(after["shm"] - before["shm"]),
        "listening_left_ours": sorted(p for p, pid in new_listen if pid in pids),
        "listening_new_any": sorted(p for p, _ in new_listen),
    }


def leftovers(res: dict[str, Any]) -> dict[str, int]:
    return {
        "processes": res["processes_left"] + res["children_left"],
        "harness descriptors": res["fds_left"],
        "/dev/shm entries": len(res["shm_left"]),
        "listening sockets": len(res["listening_left_ours"]),
    }


def markdown(res: dict[str, Any]) -> list[str]:
    rows = [[k, str(v)] for k, v in leftovers(res).items()]
    rows.append(["failed runs", f"{res['failed_runs']} (exit codes {', '.join(res['exit_codes'])})"])
    lines = table([f"left after {res['runs']} runs of {res['nproc']} ranks (multigpu)", "count"], rows)
    lines += [
        "",
        f"{res['runs']} runs took {res['seconds']:.0f} s. New listening sockets on 127.0.0.1 "
        f"owned by anyone: {len(res['listening_new_any'])}; /dev/shm entries are machine-wide, so "
        "other activity on the machine shows up there too.",
    ]
    return lines


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    left = leftovers(res)
    met = not any(left.values()) and res["failed_runs"] == 0
    return [
        target(
            "nothing left behind",
            f"zero after {res['runs']} runs",
            met,
            ", ".join(f"{k} {v}" for k, v in left.items()) + f", failed runs {res['failed_runs']}",
        )
    ]
