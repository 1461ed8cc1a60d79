"""6. Training throughput of the demo model (multigpu.cli.demo.train) under both launchers, samples/s,
and the cost of torch's flight recorder, which multigpu turns on by default (gloo ranks included): the
same multigpu job with ``TORCH_FR_BUFFER_SIZE=0`` runs in the same rotation."""

from __future__ import annotations

import json
from typing import Any

from common import (
    MULTIGPU,
    PYTHON,
    TORCHRUN,
    WORKERS,
    Ctx,
    alternate,
    free_port,
    job_seconds,
    median,
    new_bench_dir,
    ratio,
    run_launcher,
    start,
    summarize,
    worker_env,
)
from report import cell, metric_table, ratio_text, table, target

NAME = "train"
TITLE = "6. Training throughput of the demo model (2 CPU ranks, gloo DDP)"
NPROC = 2
BATCH = 64
"""The demo's batch per rank (benchmarks/workers/train.py)."""
RECORDER_OFF = "multigpu-recorder-off"
"""multigpu with the flight recorder off: the recorder's cost is multigpu's rate over this one's."""
VARIANTS = (MULTIGPU, TORCHRUN, RECORDER_OFF)


def steps(ctx: Ctx) -> int:
    return 200 if ctx.quick else 1000


def estimate(ctx: Ctx) -> float:
    return ctx.runs * (4.0 + 5.5 + 4.0 + 3 * steps(ctx) * 0.004 + 2 * 7.0)


def one(ctx: Ctx, variant: str) -> dict[str, Any]:
    launcher, env = (MULTIGPU, {"TORCH_FR_BUFFER_SIZE": "0"}) if variant == RECORDER_OFF else (variant, None)
    job, code = run_launcher(
        ctx.root, NAME, launcher, NPROC, "train.py", [str(steps(ctx))], timeout=300, env=env
    )
    path = job.bench_dir / "marks" / "train.json"
    if code != 0 or not path.exists():
        return {"samples_per_s": None, "job_s": None, "exit_code": code, "output_tail": job.output()[-3000:]}
    data = json.loads(path.read_text())
    return {
        "samples_per_s": data["samples"] / data["seconds"] if data["seconds"] else None,
        "job_s": job_seconds(job, code),
        "exit_code": code,
        "steps": steps(ctx),
        **data,
    }


def run(ctx: Ctx) -> dict[str, Any]:
    raw: dict[str, list[dict[str, Any]]] = {k: [] for k in VARIANTS}
    for i in range(ctx.runs):
        for variant in alternate(i, VARIANTS):
            raw[variant].append(one(ctx, variant))
    rates = {k: [r["samples_per_s"] for r in v] for k, v in raw.items()}
    from multigpu.contract.environment import FR_BUFFER_DEFAULT  # here: --help works without multigpu

    collective: dict[str, list[float | None]] = {"on": [], "off": []}
    for i in range(ctx.runs):
        for state in alternate(i, ("on", "off")):
            collective[state].append(per_collective(ctx, FR_BUFFER_DEFAULT if state == "on" else "0"))
    summary = {
        **{k: summarize(v) for k, v in rates.items()},
        "ratio": ratio(median(rates[MULTIGPU]), median(rates[TORCHRUN])),
        "recorder_cost": recorder_cost(rates),
        **recorder_step_cost(raw[MULTIGPU], collective),
    }
    return {"raw": raw, "steps": steps(ctx), "nproc": NPROC, "collective_us": collective, "summary": summary}


def recorder_step_cost(
    runs: list[dict[str, Any]], collective: dict[str, list[float | None]]
) -> dict[str, Any]:
    """The recorder's cost per training step, from parts measured without the noise of two ranks:
    (its cost per collective) x (collectives per step, counted by the recorder itself) / (step time)."""
    on, off = median(collective["on"]), median(collective["off"])
    per_step = median(
        [r["collectives"] / r["steps"] for r in runs if r.get("collectives") and r.get("steps")]
    )
    step_us = median([BATCH * NPROC / r["samples_per_s"] * 1e6 for r in runs if r.get("samples_per_s")])
    extra_us = None if on is None or off is None else on - off
    return {
        "recorder_us_per_collective": extra_us,
        "collectives_per_step": per_step,
        "step_us": step_us,
        "recorder_cost_per_step": None
        if extra_us is None or per_step is None or not step_us
        else extra_us * per_step / step_us,
    }


def per_collective(ctx: Ctx, size: str) -> float | None:
    """Microseconds per tiny gloo all_reduce (world size 1, best of 5 x 20,000) with
    ``TORCH_FR_BUFFER_SIZE=size``; None when the worker failed or recorded nothing it should have."""
    bench_dir = new_bench_dir(ctx.root, f"collective-fr{size}")
    env = worker_env(bench_dir, {"TORCH_FR_BUFFER_SIZE": size, "MASTER_PORT": str(free_port())})
    job = start([PYTHON, str(WORKERS / "collective.py")], bench_dir, env)
    code = job.wait(120)
    job.finish()
    path = bench_dir / "marks" / "collective.json"
    if code != 0 or not path.exists():
        return None
    data = json.loads(path.read_text())
    return float(data["us"]) if (data["recorded"] > 0) == (size != "0") else None


def recorder_cost(rates: dict[str, list[float | None]]) -> float | None:
    """The throughput the flight recorder costs, as a fraction: 1 - (recorder on) / (recorder off)."""
    on_off = ratio(median(rates.get(MULTIGPU, [])), median(rates.get(RECORDER_OFF, [])))
    return None if on_off is None else 1.0 - on_off


def markdown(res: dict[str, Any]) -> list[str]:
    rates = {k: [r["samples_per_s"] for r in v] for k, v in res["raw"].items()}
    jobs = {k: [r["job_s"] for r in v] for k, v in res["raw"].items()}
    rows = [
        {
            "label": f"samples/s ({res['steps']} steps, batch 64 per rank)",
            "samples": rates,
            "ratio": res["summary"]["ratio"],
        },
        {
            "label": "whole job",
            "unit": "s",
            "samples": jobs,
            "ratio": ratio(median(jobs[MULTIGPU]), median(jobs[TORCHRUN])),
        },
    ]
    lines = metric_table(rows, first="metric", digits=1)
    if RECORDER_OFF not in rates:
        return lines
    summary = res["summary"]
    collective = res.get("collective_us", {})
    per_step, step_us = summary.get("collectives_per_step"), summary.get("step_us")
    return [
        *lines,
        "",
        "The flight recorder's cost (on by default, gloo ranks included): multigpu against "
        "itself in the same rotation, and one gloo process timing a tiny all_reduce (world size 1: no "
        "peer's scheduling in the noise; best of 5 x 20,000 per run):",
        "",
        *table(
            [
                "measure",
                "recorder on (default, 2000 entries)",
                "recorder off (TORCH_FR_BUFFER_SIZE=0)",
                "cost",
            ],
            [
                [
                    f"samples/s ({res['steps']} steps)",
                    cell(rates[MULTIGPU], digits=1),
                    cell(rates[RECORDER_OFF], digits=1),
                    percent(summary.get("recorder_cost")),
                ],
                [
                    "one all_reduce",
                    cell(collective.get("on", []), "us", 2),
                    cell(collective.get("off", []), "us", 2),
                    us(summary.get("recorder_us_per_collective")),
                ],
            ],
        ),
        "",
        f"Per training step: {us(summary.get('recorder_us_per_collective'))} per collective x "
        f"{'n/a' if per_step is None else f'{per_step:.2f}'} collectives per step (counted by the "
        f"recorder) / a {us(step_us)} step = **{percent(summary.get('recorder_cost_per_step'), 2)}**. "
        "The samples/s comparison cannot resolve this: its run-to-run spread is a few percent.",
        "",
    ]


def us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f} us" if abs(value) < 100 else f"{value:,.0f} us"


def percent(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * 100:+.{digits}f}%"


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    r = res["summary"]["ratio"]
    cost = res["summary"].get("recorder_cost_per_step")
    return [
        target(
            "training throughput", ">= 0.98x torchrun's samples/s", r is not None and r >= 0.98, ratio_text(r)
        ),
        target(
            "flight recorder cost",
            "< 1% of a training step (on by default, gloo included)",
            None if cost is None else cost < 0.01,
            f"{percent(cost, 2)} per step "
            f"({us(res['summary'].get('recorder_us_per_collective'))} per collective)",
        ),
    ]
