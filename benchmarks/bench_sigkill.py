"""3. SIGKILL to the launcher: time until every worker and grandchild is gone (a zombie counts as gone)."""

from __future__ import annotations

import signal
from typing import Any

from common import LAUNCHERS, MULTIGPU, Ctx, alternate, summarize
from holding import signal_and_watch, start_holding
from report import cell, table, target

NAME = "sigkill"
TITLE = "3. After SIGKILL of the launcher: every worker and grandchild gone"
NPROC = 2
BOUND_S = 5.0
PER_RUN_S = 4.0 + 5.0 + BOUND_S  # multigpu start, torchrun start, torchrun's bounded wait


def estimate(ctx: Ctx) -> float:
    return PER_RUN_S * ctx.runs


def one(ctx: Ctx, launcher: str) -> dict[str, Any]:
    job = start_holding(ctx, NAME, launcher, NPROC)
    if job is None:
        return {"seconds": None, "survivors": None, "error": "ranks never became ready"}
    try:
        _, gone, left = signal_and_watch(job, signal.SIGKILL, BOUND_S)
        return {
            "seconds": gone,
            "survivors": len(left),
            "survivor_kinds": sorted(p.kind for p in left),
            "killed_by_harness": job.finish(),
        }
    finally:
        job.finish()


def run(ctx: Ctx) -> dict[str, Any]:
    raw: dict[str, list[dict[str, Any]]] = {k: [] for k in LAUNCHERS}
    for i in range(ctx.runs):
        for launcher in alternate(i):
            raw[launcher].append(one(ctx, launcher))
    return {
        "raw": raw,
        "bound_s": BOUND_S,
        "summary": {k: summarize([r["seconds"] for r in v]) for k, v in raw.items()},
    }


def _survivors(runs: list[dict[str, Any]]) -> str:
    counts = [r["survivors"] for r in runs if r.get("survivors") is not None]
    return f"{sum(counts)} over {len(counts)} run(s)" if counts else "n/a"


def markdown(res: dict[str, Any]) -> list[str]:
    rows = [
        [
            k,
            cell([r["seconds"] for r in res["raw"][k]], "s", 3, never=f"never (>{res['bound_s']:g} s)"),
            _survivors(res["raw"][k]),
        ]
        for k in LAUNCHERS
    ]
    return table(
        [
            "launcher",
            f"SIGKILL to all {NPROC} workers + grandchildren gone",
            "processes left after the bound (then killed by the harness)",
        ],
        rows,
    )


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    s = res["summary"][MULTIGPU]
    met = s["never"] == 0 and s.get("max") is not None and s["max"] <= 1.0
    return [
        target(
            "SIGKILL clean-up",
            "every worker and grandchild gone within 1 s (every run)",
            met,
            f"max {s.get('max', float('nan')):.3f} s, never in {s['never']}/{s['n']}"
            if s.get("max") is not None
            else f"never in {s['never']}/{s['n']}",
        )
    ]
