"""5. Bad input: a worker count of abc, 0 or -1. Time to the error, lines printed, exit code."""

from __future__ import annotations

from typing import Any

from common import (
    LAUNCHERS,
    MULTIGPU,
    TORCHRUN,
    Ctx,
    alternate,
    launcher_argv,
    median,
    new_bench_dir,
    ratio,
    start,
    summarize,
)
from report import cell, ratio_text, table, target

NAME = "badinput"
TITLE = "5. Bad input: --cpu / --nproc-per-node abc, 0, -1"
VALUES = ("abc", "0", "-1")
PER_RUN_S = len(VALUES) * (0.3 + 2.5)


def estimate(ctx: Ctx) -> float:
    return PER_RUN_S * ctx.runs


def one(ctx: Ctx, launcher: str, value: str) -> dict[str, Any]:
    bench_dir = new_bench_dir(ctx.root, f"{NAME}-{launcher}")
    job = start(launcher_argv(launcher, value, "tiny.py", output=bench_dir / "mg"), bench_dir)
    try:
        code = job.wait(60)
        text = job.output()
        return {
            "seconds": None if job.exited is None else job.exited - job.started,
            "exit_code": code,
            "lines": len(text.splitlines()),
            "traceback": "Traceback (most recent call last)" in text,
            "first_line": text.splitlines()[0] if text else "",
        }
    finally:
        job.finish()


def run(ctx: Ctx) -> dict[str, Any]:
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {v: {k: [] for k in LAUNCHERS} for v in VALUES}
    for i in range(ctx.runs):
        for v in VALUES:
            for launcher in alternate(i):
                raw[v][launcher].append(one(ctx, launcher, v))
    summary = {}
    for v, by in raw.items():
        secs = {k: [r["seconds"] for r in runs] for k, runs in by.items()}
        summary[v] = {
            **{k: summarize(s) for k, s in secs.items()},
            "lines": {k: summarize([r["lines"] for r in runs]) for k, runs in by.items()},
            "ratio": ratio(median(secs[MULTIGPU]), median(secs[TORCHRUN])),
        }
    return {"raw": raw, "summary": summary}


def markdown(res: dict[str, Any]) -> list[str]:
    rows = []
    for v, by in res["raw"].items():
        for k in LAUNCHERS:
            runs = by[k]
            flag = "--cpu" if k == MULTIGPU else "--nproc-per-node"
            rows.append(
                [
                    f"`{flag} {v}`",
                    k,
                    cell([r["seconds"] for r in runs], "s", 3),
                    cell([r["lines"] for r in runs], "", 0),
                    ", ".join(sorted({str(r["exit_code"]) for r in runs})),
                    "yes" if any(r["traceback"] for r in runs) else "no",
                ]
            )
        rows.append([f"`{v}`", "ratio (time)", ratio_text(res["summary"][v]["ratio"]), "", "", ""])
    return table(["input", "launcher", "time to the error", "lines printed", "exit code", "traceback"], rows)


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    runs = [(v, r) for v, by in res["raw"].items() for r in by[MULTIGPU]]
    bad = [
        v
        for v, r in runs
        if not (
            r["exit_code"] == 2
            and r["lines"] <= 4
            and not r["traceback"]
            and r["seconds"] is not None
            and r["seconds"] < 1.0
        )
    ]
    worst = max((r["seconds"] or 0.0 for _, r in runs), default=0.0)
    lines = max((r["lines"] for _, r in runs), default=0)
    return [
        target(
            "bad input",
            "exit 2, <= 4 lines, no traceback, under 1 s (issue 3)",
            not bad and bool(runs),
            f"slowest {worst:.3f} s, at most {lines} line(s)",
            f"missed for {', '.join(sorted(set(bad)))}" if bad else "",
        )
    ]
