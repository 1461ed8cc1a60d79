"""7. Log throughput: one rank prints 200,000 lines; multigpu's console (to a file) vs torchrun --tee 3."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    LAUNCHERS,
    MULTIGPU,
    TORCHRUN,
    Ctx,
    alternate,
    median,
    ratio,
    read_marks,
    run_launcher,
    summarize,
)
from report import cell, ratio_text, table, target

NAME = "logs"
TITLE = "7. Log throughput: one rank printing 200,000 lines"
LINES = 200_000
MARKER = "bench line "
PER_RUN_S = 2 * 6.0


def estimate(ctx: Ctx) -> float:
    return PER_RUN_S * ctx.runs


def extra_flags(launcher: str) -> Callable[[Path], list[str]] | None:
    if launcher == TORCHRUN:
        return lambda d: ["--tee", "3", "--log-dir", str(d / "tr_logs")]
    return None


def count(path: Path | None) -> int | None:
    if path is None or not path.exists():
        return None
    with open(path, "rb") as f:
        return sum(1 for line in f if MARKER.encode() in line)


def rank0_log(launcher: str, bench_dir: Path) -> Path | None:
    if launcher == MULTIGPU:
        return bench_dir / "mg" / "logs" / "attempt_0" / "rank_0.log"
    found = sorted((bench_dir / "tr_logs").rglob("attempt_0/0/stdout.log"))
    return found[0] if found else None


def one(ctx: Ctx, launcher: str) -> dict[str, Any]:
    job, code = run_launcher(
        ctx.root, NAME, launcher, 1, "spam.py", [str(LINES)], timeout=300, extra=extra_flags(launcher)
    )
    marks = {k: read_marks(job.bench_dir, k).get(0) for k in ("spam_start", "spam_end")}
    start, end = marks["spam_start"], marks["spam_end"]
    console = count(job.log_path)
    logfile = count(rank0_log(launcher, job.bench_dir))
    return {
        "lines_per_s": LINES / (job.exited - start) if job.exited and start else None,
        "writer_lines_per_s": LINES / (end - start) if end and start else None,
        "console_lines": console,
        "log_file_lines": logfile,
        "exit_code": code,
        "complete": console == LINES and logfile == LINES,
    }


def run(ctx: Ctx) -> dict[str, Any]:
    raw: dict[str, list[dict[str, Any]]] = {k: [] for k in LAUNCHERS}
    for i in range(ctx.runs):
        for launcher in alternate(i):
            raw[launcher].append(one(ctx, launcher))
    rates = {k: [r["lines_per_s"] for r in v] for k, v in raw.items()}
    return {
        "raw": raw,
        "lines": LINES,
        "summary": {
            **{k: summarize(v) for k, v in rates.items()},
            "ratio": ratio(median(rates[MULTIGPU]), median(rates[TORCHRUN])),
        },
    }


def _arrived(runs: list[dict[str, Any]], key: str) -> str:
    got = [r[key] for r in runs]
    full = sum(g == LINES for g in got)
    return f"{full}/{len(got)} complete" + ("" if full == len(got) else f" (got {got})")


def markdown(res: dict[str, Any]) -> list[str]:
    rows = []
    for k in LAUNCHERS:
        runs = res["raw"][k]
        rows.append(
            [
                k,
                cell([r["lines_per_s"] for r in runs], "lines/s", 0),
                cell([r["writer_lines_per_s"] for r in runs], "lines/s", 0),
                _arrived(runs, "console_lines"),
                _arrived(runs, "log_file_lines"),
            ]
        )
    rows.append(["ratio", ratio_text(res["summary"]["ratio"]), "", "", ""])
    return table(
        ["launcher", "first line to launcher exit", "as the rank wrote them", "console", "rank 0 log file"],
        rows,
    )


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    r = res["summary"]["ratio"]
    complete = all(x["complete"] for x in res["raw"][MULTIGPU])
    return [
        target(
            "log throughput",
            ">= 1x torchrun --tee 3, every line in console and log file",
            r is not None and r >= 1.0 and complete,
            f"{ratio_text(r)}; every line arrived: {'yes' if complete else 'no'}",
        )
    ]
