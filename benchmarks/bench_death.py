"""2. From a rank's death to the launcher's exit with every worker gone: exit(3), raise, SIGKILL, and
raise with a DataLoader-style grandchild still holding the rank's stdout and stderr; multigpu with its
warm template and with ``--no-template`` (plain ranks and a separate store process), beside torchrun."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import (
    MULTIGPU,
    TORCHRUN,
    Ctx,
    all_gone,
    alternate,
    median,
    ratio,
    read_marks,
    start_launcher,
    summarize,
    wait_until,
)
from report import cell, ratio_text, table, target

NAME = "death"
TITLE = "2. Rank death to launcher exit, every worker reaped"
MODES = ("exit", "raise", "kill", "grandchild")
DYING_RANK = 1
GONE_BOUND_S = 15.0
PER_JOB_S = {2: 3.0, 4: 4.0}  # launch + teardown, averaged over the variants
NO_TEMPLATE = "multigpu --no-template"
VARIANTS = (MULTIGPU, NO_TEMPLATE, TORCHRUN)
MULTIGPU_VARIANTS = (MULTIGPU, NO_TEMPLATE)


def counts(ctx: Ctx) -> tuple[int, ...]:
    return (2,) if ctx.quick else (2, 4)


def estimate(ctx: Ctx) -> float:
    return ctx.runs * len(MODES) * len(VARIANTS) * sum(PER_JOB_S[n] for n in counts(ctx))


def one(ctx: Ctx, variant: str, mode: str, nproc: int) -> dict[str, Any]:
    launcher = TORCHRUN if variant == TORCHRUN else MULTIGPU
    flags = ["--no-template"] if variant == NO_TEMPLATE else []
    job = start_launcher(
        ctx.root,
        f"{NAME}-{mode}{nproc}",
        launcher,
        nproc,
        "die.py",
        [mode, str(DYING_RANK)],
        extra=lambda _dir: flags,
    )
    try:
        code = job.wait(90)
        procs = [p for p in job.procs() if p.kind != "grandchild"]
        grandchildren = [p for p in job.procs() if p.kind == "grandchild"]
        left_at_exit = sum(p.alive() for p in procs)
        gone = wait_until(lambda: all_gone(procs), GONE_BOUND_S) if job.exited is not None else None
        grandchildren_left = sum(p.alive() for p in grandchildren)
        death = read_marks(job.bench_dir, "death").get(DYING_RANK)
        end = None if gone is None or job.exited is None else max(gone, job.exited)
        seconds = None if end is None or death is None else end - death
        out: dict[str, Any] = {
            "seconds": seconds,
            "exit_code": code,
            "left_at_launcher_exit": left_at_exit,
            "grandchildren_left": grandchildren_left,
            "dying_rank_exit_s": dying_rank_exit(job.bench_dir, death),
            "killed_by_harness": job.finish(),
        }
        if death is None:  # the rank failed before its planned death: keep the evidence
            out["error"] = "no death mark: the job failed some other way"
            out["output_tail"] = job.output()[-4000:]
        return out
    finally:
        job.finish()


def dying_rank_exit(bench_dir: Path, death: float | None) -> float | None:
    """multigpu only: how long the dying rank's own process took to end after its mark (from run.json)."""
    try:
        record = json.loads((bench_dir / "mg" / "run.json").read_text())
        end = record["attempts"][0]["ranks"][str(DYING_RANK)]["end_time"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return None if death is None or end is None else float(end) - death


def run(ctx: Ctx) -> dict[str, Any]:
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {
        f"{m}/{n}": {k: [] for k in VARIANTS} for m in MODES for n in counts(ctx)
    }
    for i in range(ctx.runs):
        for n in counts(ctx):
            for m in MODES:
                for variant in alternate(i, VARIANTS):
                    raw[f"{m}/{n}"][variant].append(one(ctx, variant, m, n))
    summary = {}
    for case, by in raw.items():
        secs = {k: [r["seconds"] for r in v] for k, v in by.items()}
        summary[case] = {
            **{k: summarize(v) for k, v in secs.items()},
            "ratio": ratio(median(secs[MULTIGPU]), median(secs[TORCHRUN])),
            "ratio_no_template": ratio(median(secs[NO_TEMPLATE]), median(secs[TORCHRUN])),
        }
    return {"raw": raw, "summary": summary}


def _seconds(res: dict[str, Any], case: str) -> dict[str, list[float | None]]:
    return {k: [r["seconds"] for r in v] for k, v in res["raw"][case].items()}


def markdown(res: dict[str, Any]) -> list[str]:
    rows = []
    for case in res["raw"]:
        secs, summary = _seconds(res, case), res["summary"][case]
        rows.append(
            [
                f"{case.split('/')[0]}, {case.split('/')[1]} workers",
                *(cell(secs.get(v, []), "s", never="no number") for v in VARIANTS),
                ratio_text(summary["ratio"]),
                ratio_text(summary.get("ratio_no_template")),
            ]
        )
    header = ["case", "multigpu", "multigpu --no-template", "torchrun", "ratio", "ratio (--no-template)"]
    lines = table(header, rows)
    errors = [
        f"{case} {k}" for case, by in res["raw"].items() for k, v in by.items() for r in v if "error" in r
    ]
    if errors:
        lines += [
            "",
            f"Runs that failed before the planned death (output in results.json): {', '.join(errors)}.",
        ]
    left = {
        k: sum(r["left_at_launcher_exit"] for v in res["raw"].values() for r in v.get(k, []))
        for k in VARIANTS
    }
    codes = {
        k: sorted({str(r["exit_code"]) for v in res["raw"].values() for r in v.get(k, [])}) for k in VARIANTS
    }
    own = [
        r["dying_rank_exit_s"]
        for v in res["raw"].values()
        for r in v[MULTIGPU]
        if r.get("dying_rank_exit_s") is not None
    ]
    by_mode = {
        m: cell(
            [
                r.get("dying_rank_exit_s")
                for c, v in res["raw"].items()
                if c.startswith(m)
                for r in v[MULTIGPU]
            ],
            "s",
        )
        for m in MODES
    }
    if own:
        lines += [
            "",
            "Of multigpu's time, the dying rank's own process took this long to end after its mark "
            "(run.json), before the launcher could see the exit: "
            + "; ".join(f"{m} {c}" for m, c in by_mode.items())
            + ".",
        ]
    orphans = {
        k: sum(
            r.get("grandchildren_left", 0)
            for c, v in res["raw"].items()
            if c.startswith("grandchild")
            for r in v.get(k, [])
        )
        for k in VARIANTS
    }
    lines += [
        "",
        "The grandchild case times the ranks (the launcher's exit and every rank gone); the "
        "DataLoader-style grandchildren still alive after that (all runs): "
        + ", ".join(f"{k} {orphans[k]}" for k in VARIANTS)
        + ".",
    ]
    lines += [
        "",
        "Workers still alive when the launcher exited (all runs): "
        + ", ".join(f"{k} {left[k]}" for k in VARIANTS)
        + ". Launcher exit codes: "
        + "; ".join(f"{k} {', '.join(codes[k])}" for k in VARIANTS)
        + ".",
    ]
    return lines


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    ratios = {
        f"{case}{'' if key == 'ratio' else ' --no-template'}": s.get(key)
        for case, s in res["summary"].items()
        for key in ("ratio", "ratio_no_template")
    }
    met = all(r is not None and r <= 0.3 for r in ratios.values())
    worst = max(ratios, key=lambda c: ratios[c] if ratios[c] is not None else float("inf"))
    return [
        target(
            "rank death to exit",
            "<= 0.3x torchrun's time, every case",
            met,
            ", ".join(f"{c}: {ratio_text(r)}" for c, r in ratios.items()),
            f"worst case {worst}",
        )
    ]
