"""1. Whole-job wall time of a tiny gloo job, against the same ranks started by hand (the floor)."""

from __future__ import annotations

from typing import Any

from common import (
    FLOOR,
    LAUNCHERS,
    MULTIGPU,
    TORCHRUN,
    Ctx,
    alternate,
    job_seconds,
    median,
    ratio,
    run_floor,
    run_launcher,
    summarize,
)
from report import cell, ratio_text, table, target

NAME = "launch"
TITLE = "1. Whole-job wall time of a tiny gloo job (init, one all_reduce, exit)"
COUNTS = (1, 2, 4)
PER_RUN_S = 37.0  # floor + both launchers at 1, 2 and 4 ranks, on a quiet 2-core machine


def estimate(ctx: Ctx) -> float:
    return PER_RUN_S * ctx.runs


def one(ctx: Ctx, who: str, nproc: int) -> float | None:
    if who == FLOOR:
        return run_floor(ctx.root, nproc, "tiny.py")[0]
    job, code = run_launcher(ctx.root, NAME, who, nproc, "tiny.py")
    return job_seconds(job, code)


def overheads(job: list[float | None], floor: list[float | None]) -> list[float | None]:
    """Per run: the launcher's job time minus that run's floor."""
    return [None if j is None or f is None else j - f for j, f in zip(job, floor, strict=True)]


def run(ctx: Ctx) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float | None]]] = {
        str(n): {k: [] for k in (*LAUNCHERS, FLOOR)} for n in COUNTS
    }
    for i in range(ctx.runs):
        for n in COUNTS:
            for who in alternate(i, (MULTIGPU, TORCHRUN, FLOOR)):
                samples[str(n)][who].append(one(ctx, who, n))
    out: dict[str, Any] = {"samples_s": samples, "overhead_s": {}, "summary": {}}
    for key, s in samples.items():
        over = {k: overheads(s[k], s[FLOOR]) for k in LAUNCHERS}
        out["overhead_s"][key] = over
        out["summary"][key] = {
            **{k: summarize(v) for k, v in s.items()},
            "overhead": {k: summarize(v) for k, v in over.items()},
            "overhead_ratio": ratio(median(over[MULTIGPU]), median(over[TORCHRUN])),
        }
    return out


def markdown(res: dict[str, Any]) -> list[str]:
    rows = []
    for n, s in res["samples_s"].items():
        over = res["overhead_s"][n]
        rows.append(
            [
                n,
                cell(s[FLOOR], "s"),
                cell(s[MULTIGPU], "s"),
                cell(s[TORCHRUN], "s"),
                cell(over[MULTIGPU], "s"),
                cell(over[TORCHRUN], "s"),
                ratio_text(res["summary"][n]["overhead_ratio"]),
            ]
        )
    return table(
        [
            "workers",
            "by hand (floor)",
            "multigpu",
            "torchrun",
            "multigpu overhead",
            "torchrun overhead",
            "overhead ratio",
        ],
        rows,
    )


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    ratios = {n: s["overhead_ratio"] for n, s in res["summary"].items()}
    met = all(r is not None and r <= 0.25 for r in ratios.values())
    measured = ", ".join(f"{n} worker(s): {ratio_text(r)}" for n, r in ratios.items())
    out = [
        target(
            "launch overhead",
            "multigpu's overhead above hand-started ranks <= 0.25x torchrun's",
            met,
            measured,
        )
    ]
    four = res["summary"].get("4", {}).get(MULTIGPU, {}).get("median")
    bare = res["summary"].get("1", {}).get(FLOOR, {}).get("median")
    r = ratio(four, bare)
    out.append(
        target(
            "launch stretch",
            "a 4-rank multigpu job <= 1.3x one bare rank",
            r is not None and r <= 1.3,
            f"{ratio_text(r)} (4 ranks {four and round(four, 2)} s, "
            f"one bare rank {bare and round(bare, 2)} s)",
        )
    )
    return out
