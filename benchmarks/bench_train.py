"""6. Training throughput of the demo model (multigpu.cli.demo.train) under both launchers, samples/s."""

from __future__ import annotations

import json
from typing import Any

from common import (
    LAUNCHERS,
    MULTIGPU,
    TORCHRUN,
    Ctx,
    alternate,
    job_seconds,
    median,
    ratio,
    run_launcher,
    summarize,
)
from report import metric_table, ratio_text, target

NAME = "train"
TITLE = "6. Training throughput of the demo model (2 CPU ranks, gloo DDP)"
NPROC = 2


def steps(ctx: Ctx) -> int:
    return 200 if ctx.quick else 1000


def estimate(ctx: Ctx) -> float:
    return ctx.runs * (4.0 + 5.5 + 2 * steps(ctx) * 0.004)


def one(ctx: Ctx, launcher: str) -> dict[str, Any]:
    job, code = run_launcher(ctx.root, NAME, launcher, NPROC, "train.py", [str(steps(ctx))], timeout=300)
    path = job.bench_dir / "marks" / "train.json"
    if code != 0 or not path.exists():
        return {"samples_per_s": None, "job_s": None, "exit_code": code, "output_tail": job.output()[-3000:]}
    data = json.loads(path.read_text())
    return {"samples_per_s": data["samples"] / data["seconds"] if data["seconds"] else None,
            "job_s": job_seconds(job, code), "exit_code": code, **data}


def run(ctx: Ctx) -> dict[str, Any]:
    raw: dict[str, list[dict[str, Any]]] = {k: [] for k in LAUNCHERS}
    for i in range(ctx.runs):
        for launcher in alternate(i):
            raw[launcher].append(one(ctx, launcher))
    rates = {k: [r["samples_per_s"] for r in v] for k, v in raw.items()}
    return {"raw": raw, "steps": steps(ctx), "nproc": NPROC,
            "summary": {**{k: summarize(v) for k, v in rates.items()},
                        "ratio": ratio(median(rates[MULTIGPU]), median(rates[TORCHRUN]))}}


def markdown(res: dict[str, Any]) -> list[str]:
    rates = {k: [r["samples_per_s"] for r in v] for k, v in res["raw"].items()}
    jobs = {k: [r["job_s"] for r in v] for k, v in res["raw"].items()}
    rows = [{"label": f"samples/s ({res['steps']} steps, batch 64 per rank)", "samples": rates,
             "ratio": res["summary"]["ratio"]},
            {"label": "whole job", "unit": "s", "samples": jobs,
             "ratio": ratio(median(jobs[MULTIGPU]), median(jobs[TORCHRUN]))}]
    return metric_table(rows, first="metric", digits=1)


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    r = res["summary"]["ratio"]
    return [target("training throughput", ">= 0.98x torchrun's samples/s", r is not None and r >= 0.98,
                   ratio_text(r))]
