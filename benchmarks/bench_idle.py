"""8. Launcher overhead: CPU seconds of the launcher process alone (user + sys) while 4 ranks sleep.

Both launchers run at once, each with its own 4 ranks: once a launcher's ranks are all ready the
machine is idle apart from the launchers, and the window of each is measured separately, so running
them together halves the time and exposes both to the same conditions.
"""

from __future__ import annotations

import time
from typing import Any

from common import (
    LAUNCHERS,
    MULTIGPU,
    TORCHRUN,
    Ctx,
    Job,
    alternate,
    median,
    ratio,
    read_marks,
    start_launcher,
    summarize,
)
from report import cell, ratio_text, table, target

NAME = "idle"
TITLE = "8. Launcher CPU while 4 ranks sleep"
NPROC = 4
MARGIN_S = 0.5
START_BOUND_S = 120.0


def sleep_s(ctx: Ctx) -> float:
    return 10.0 if ctx.quick else 30.0


def estimate(ctx: Ctx) -> float:
    return ctx.runs * (sleep_s(ctx) + 9.0)


def cpu(pid: int) -> float | None:
    import psutil  # here, not at import: run.py --help works without it

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(t.user + t.system)


def sample(jobs: dict[str, Job], until: float) -> dict[str, list[tuple[float, float]]]:
    """(wall time, launcher CPU seconds) every 0.1 s for each launcher, until `until` or all exit."""
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in jobs}
    while time.time() < until and any(j.popen.poll() is None for j in jobs.values()):
        for k, j in jobs.items():
            c = cpu(j.pid)
            if c is not None and j.popen.poll() is None:
                out[k].append((time.time(), c))
        time.sleep(0.1)
    return out


def window_share(
    points: list[tuple[float, float]], ready: dict[int, float], seconds: float
) -> tuple[float | None, float | None]:
    """(% of one core, window seconds) between the last rank's ready and the first rank's wake-up."""
    if len(ready) < NPROC:
        return None, None
    lo, hi = max(ready.values()) + MARGIN_S, min(ready.values()) + seconds - MARGIN_S
    inside = [p for p in points if lo <= p[0] <= hi]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 1.0:
        return None, None
    span = inside[-1][0] - inside[0][0]
    return 100.0 * (inside[-1][1] - inside[0][1]) / span, span


def one_pair(ctx: Ctx, i: int) -> dict[str, dict[str, Any]]:
    """Both launchers at once (started in alternating order), each launcher's own window measured."""
    secs = sleep_s(ctx)
    jobs: dict[str, Job] = {}
    try:
        for launcher in alternate(i):
            jobs[launcher] = start_launcher(
                ctx.root, NAME, launcher, NPROC, "hold.py", [str(secs), "--no-child"]
            )
        points = sample(jobs, time.time() + START_BOUND_S + secs)
        return {k: measure(jobs[k], points[k], secs) for k in LAUNCHERS}
    finally:
        for j in jobs.values():
            j.finish()


def measure(job: Job, points: list[tuple[float, float]], secs: float) -> dict[str, Any]:
    ready = read_marks(job.bench_dir, "ready")
    pct, span = window_share(points, ready, secs)
    return {
        "core_pct": pct,
        "window_s": span,
        "ranks_ready": len(ready),
        "exit_code": job.wait(30),
        "launcher_cpu_s_total": points[-1][1] if points else None,
    }


def run(ctx: Ctx) -> dict[str, Any]:
    raw: dict[str, list[dict[str, Any]]] = {k: [] for k in LAUNCHERS}
    for i in range(ctx.runs):
        for k, r in one_pair(ctx, i).items():
            raw[k].append(r)
    pct = {k: [r["core_pct"] for r in v] for k, v in raw.items()}
    return {
        "raw": raw,
        "sleep_s": sleep_s(ctx),
        "nproc": NPROC,
        "summary": {
            **{k: summarize(v) for k, v in pct.items()},
            "ratio": ratio(median(pct[MULTIGPU]), median(pct[TORCHRUN])),
        },
    }


def markdown(res: dict[str, Any]) -> list[str]:
    rows = []
    for k in LAUNCHERS:
        runs = res["raw"][k]
        rows.append(
            [
                k,
                cell([r["core_pct"] for r in runs], "% of a core", 3),
                cell([r.get("window_s") for r in runs], "s", 1),
                cell([r.get("launcher_cpu_s_total") for r in runs], "CPU s", 2),
            ]
        )
    rows.append(["ratio", ratio_text(res["summary"]["ratio"]), "", ""])
    return table(
        [
            "launcher",
            f"while {res['nproc']} ranks sleep {res['sleep_s']:g} s",
            "measured window",
            "launcher CPU for the whole job",
        ],
        rows,
    )


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    s = res["summary"][MULTIGPU]
    med = s.get("median")
    return [
        target(
            "launcher idle overhead",
            "under 1% of a core",
            med is not None and med < 1.0,
            f"{med:.3f}% (median)" if med is not None else "n/a",
        )
    ]
