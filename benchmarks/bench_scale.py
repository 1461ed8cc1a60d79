"""9. Scale: whole-job time and launcher peak RSS (sampled every 20 ms): the tiny gloo job on 8 and 16
CPU workers, and a rank that prints one line (``one_line.py``: no torch) on 32 and 64, where the
launcher's own cost per rank is all there is to see. Target: 32 and 64 ranks within 1.1x torchrun."""

from __future__ import annotations

import threading
from typing import Any

from common import (
    LAUNCHERS,
    MULTIGPU,
    TORCHRUN,
    Ctx,
    Job,
    alternate,
    job_seconds,
    median,
    ratio,
    start_launcher,
    summarize,
)
from report import metric_table, ratio_text, target

NAME = "scale"
TITLE = "9. Scale: 8 and 16 CPU workers (tiny job), 32 and 64 (one line each)"
SCRIPTS = {8: "tiny.py", 16: "tiny.py", 32: "one_line.py", 64: "one_line.py"}
PER_JOB_S = {8: 10.5, 16: 19.0, 32: 2.5, 64: 3.5}
TARGET_RATIO = 1.1
"""32 and 64 one-line ranks: at most this times torchrun's job time."""


def counts(ctx: Ctx) -> tuple[int, ...]:
    return (8, 64) if ctx.quick else (8, 16, 32, 64)


def estimate(ctx: Ctx) -> float:
    return ctx.runs * len(LAUNCHERS) * sum(PER_JOB_S[n] for n in counts(ctx))


def peak_rss(job: Job, stop: threading.Event, out: list[int]) -> None:
    import psutil  # here, not at import: run.py --help works without it

    try:
        proc = psutil.Process(job.pid)
        while not stop.is_set():
            out.append(int(proc.memory_info().rss))
            stop.wait(0.02)
    except psutil.Error:
        pass


def one(ctx: Ctx, launcher: str, nproc: int) -> dict[str, Any]:
    job = start_launcher(ctx.root, f"{NAME}{nproc}", launcher, nproc, SCRIPTS[nproc])
    rss: list[int] = []
    stop = threading.Event()
    sampler = threading.Thread(target=peak_rss, args=(job, stop, rss), daemon=True)
    sampler.start()
    try:
        code = job.wait(300)
    finally:
        stop.set()
        sampler.join(5)
        job.finish()
    return {
        "seconds": job_seconds(job, code),
        "peak_rss_mib": max(rss) / 2**20 if rss else None,
        "exit_code": code,
    }


def run(ctx: Ctx) -> dict[str, Any]:
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(n): {k: [] for k in LAUNCHERS} for n in counts(ctx)
    }
    for i in range(ctx.runs):
        for n in counts(ctx):
            for launcher in alternate(i):
                raw[str(n)][launcher].append(one(ctx, launcher, n))
    summary = {}
    for key, by in raw.items():
        secs = {k: [r["seconds"] for r in v] for k, v in by.items()}
        rss = {k: [r["peak_rss_mib"] for r in v] for k, v in by.items()}
        summary[key] = {
            "seconds": {k: summarize(v) for k, v in secs.items()},
            "peak_rss_mib": {k: summarize(v) for k, v in rss.items()},
            "ratio_s": ratio(median(secs[MULTIGPU]), median(secs[TORCHRUN])),
            "ratio_rss": ratio(median(rss[MULTIGPU]), median(rss[TORCHRUN])),
        }
    return {"raw": raw, "summary": summary}


def markdown(res: dict[str, Any]) -> list[str]:
    rows = []
    for n, by in res["raw"].items():
        rows.append(
            {
                "label": f"{n} workers: job time",
                "unit": "s",
                "samples": {k: [r["seconds"] for r in v] for k, v in by.items()},
                "ratio": res["summary"][n]["ratio_s"],
            }
        )
        rows.append(
            {
                "label": f"{n} workers: launcher peak RSS",
                "unit": "MiB",
                "samples": {k: [r["peak_rss_mib"] for r in v] for k, v in by.items()},
                "ratio": res["summary"][n]["ratio_rss"],
            }
        )
    return metric_table(rows, first="metric", digits=1)


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    ratios = {n: res["summary"][n]["ratio_s"] for n in ("32", "64") if n in res["summary"]}
    if not ratios:
        return []
    met = all(r is not None and r <= TARGET_RATIO for r in ratios.values())
    return [
        target(
            "many ranks on one node",
            f"<= {TARGET_RATIO}x torchrun's job time at 32 and 64 ranks",
            met,
            ", ".join(f"{n} ranks: {ratio_text(r)}" for n, r in ratios.items()),
        )
    ]
