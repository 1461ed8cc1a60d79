"""4. SIGTERM and SIGINT to the launcher: time to its exit and until every process is gone."""

from __future__ import annotations

import signal
from typing import Any

from common import LAUNCHERS, MULTIGPU, TORCHRUN, Ctx, alternate, median, ratio, summarize
from holding import signal_and_watch, start_holding
from report import cell, ratio_text, table, target

NAME = "signals"
TITLE = "4. SIGTERM and SIGINT to the launcher"
NPROC = 2
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
BOUND_S = 15.0
EXPECTED_CODE = {"SIGTERM": 143, "SIGINT": -2}
"""SIGTERM: exit 143, as torchrun. SIGINT: the launcher dies of SIGINT itself once every rank is gone
(``supervisor/stop_requests.py``), so a shell sees an interrupted command and a ``for`` loop stops."""
PER_RUN_S = 2 * (4.0 + 5.5)


def estimate(ctx: Ctx) -> float:
    return PER_RUN_S * ctx.runs


def one(ctx: Ctx, launcher: str, name: str) -> dict[str, Any]:
    job = start_holding(ctx, f"{NAME}-{name}", launcher, NPROC)
    if job is None:
        return {"exit_s": None, "gone_s": None, "error": "ranks never became ready"}
    try:
        exited, gone, left = signal_and_watch(job, SIGNALS[name], BOUND_S)
        everything = None if exited is None or gone is None else max(exited, gone)  # the launcher too
        return {
            "exit_s": exited,
            "workers_gone_s": gone,
            "gone_s": everything,
            "exit_code": job.popen.poll(),
            "survivors": len(left),
            "survivor_kinds": sorted(p.kind for p in left),
            "killed_by_harness": job.finish(),
        }
    finally:
        job.finish()


def run(ctx: Ctx) -> dict[str, Any]:
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {name: {k: [] for k in LAUNCHERS} for name in SIGNALS}
    for i in range(ctx.runs):
        for name in SIGNALS:
            for launcher in alternate(i):
                raw[name][launcher].append(one(ctx, launcher, name))
    summary = {}
    for name, by in raw.items():
        gone = {k: [r.get("gone_s") for r in v] for k, v in by.items()}
        summary[name] = {
            **{k: summarize(v) for k, v in gone.items()},
            "ratio": ratio(median(gone[MULTIGPU]), median(gone[TORCHRUN])),
        }
    return {"raw": raw, "bound_s": BOUND_S, "summary": summary}


def _codes(runs: list[dict[str, Any]]) -> str:
    return ", ".join(sorted({str(r.get("exit_code")) for r in runs}))


def markdown(res: dict[str, Any]) -> list[str]:
    rows = []
    never = f"never (>{res['bound_s']:g} s)"
    for name, by in res["raw"].items():
        for k in LAUNCHERS:
            rows.append(
                [
                    name,
                    k,
                    cell([r.get("exit_s") for r in by[k]], "s", 3, never),
                    cell([r.get("gone_s") for r in by[k]], "s", 3, never),
                    _codes(by[k]),
                    str(sum(r.get("survivors") or 0 for r in by[k])),
                ]
            )
        rows.append([name, "ratio (all gone)", "", ratio_text(res["summary"][name]["ratio"]), "", ""])
    return table(
        [
            "signal",
            "launcher",
            "to launcher exit",
            f"to launcher, {NPROC} workers and grandchildren all gone",
            "exit codes",
            "left after the bound",
        ],
        rows,
    )


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, by in res["raw"].items():
        runs = by[MULTIGPU]
        ok = all(r.get("gone_s") is not None and r.get("exit_code") == EXPECTED_CODE[name] for r in runs)
        out.append(
            target(
                f"{name} forwarded",
                f"every process gone after {name}, exit {EXPECTED_CODE[name]}",
                ok,
                f"all gone {cell([r.get('gone_s') for r in runs], 's', 3)}; exit codes {_codes(runs)}",
            )
        )
    return out
