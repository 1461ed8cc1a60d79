"""11. Elastic rounds beside torchrun: a node joins a running job; a node's launcher is SIGKILLed.

Two launchers on 127.0.0.1 (``--nnodes 1:2 --max-restarts 1``, c10d rendezvous, 2 CPU workers each,
the same ``--rdzv-conf`` for both launchers), from ``elastic_cases.py``. Measured from the event (the
second node's start; the peer's SIGKILL): until every rank of the new round has initialised its
process group (the round), and until the job ended. Under multigpu the ranks of every round are
forked from each node's warm template.
"""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path
from typing import Any

import elastic_cases
from common import LAUNCHERS, MULTIGPU, TORCHRUN, Ctx, alternate, median, ratio, summarize
from report import cell, ratio_text, table, target

NAME = "elastic"
TITLE = "11. Elastic rounds: a node joins, a node is lost"
CASES = {"join": "a node joins a running job", "lost": "a node's launcher SIGKILLed"}
BOUND_S = 30.0
"""After the event; torchrun's runs on this machine failed or hung past it (the note says which)."""
PER_RUN_S = {"join": 6.0 + BOUND_S, "lost": 6.0 + BOUND_S}


def estimate(ctx: Ctx) -> float:
    return ctx.runs * len(LAUNCHERS) * sum(PER_RUN_S.values())


def one(work: Path, case: str, launcher: str) -> dict[str, Any]:
    if case == "join":
        return elastic_cases.late_join(launcher, work, BOUND_S)
    return elastic_cases.lost_peer(launcher, work, BOUND_S)


def run(ctx: Ctx) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="elastic-", dir=ctx.root))
    (work / "w.py").write_text(textwrap.dedent(elastic_cases.WORKER))
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {c: {k: [] for k in LAUNCHERS} for c in CASES}
    for i in range(ctx.runs):
        for case in CASES:
            for launcher in alternate(i):
                raw[case][launcher].append(one(work, case, launcher))
    summary = {}
    for case, by in raw.items():
        rounds = {k: [r["round_s"] for r in v] for k, v in by.items()}
        ends = {k: [r["seconds"] for r in v] for k, v in by.items()}
        summary[case] = {
            "round_s": {k: summarize(v) for k, v in rounds.items()},
            "seconds": {k: summarize(v) for k, v in ends.items()},
            "ratio_round": ratio(median(rounds[MULTIGPU]), median(rounds[TORCHRUN])),
            "ratio_end": ratio(median(ends[MULTIGPU]), median(ends[TORCHRUN])),
        }
    return {"raw": raw, "summary": summary}


def markdown(res: dict[str, Any]) -> list[str]:
    rows = []
    for case, title in CASES.items():
        by, s = res["raw"][case], res["summary"][case]
        for key, what, ratio_key in (
            ("round_s", "every rank of the new round initialised", "ratio_round"),
            ("seconds", "the job ended", "ratio_end"),
        ):
            rows.append(
                [
                    f"{title}: {what}",
                    *(cell([r[key] for r in by[k]], "s") for k in LAUNCHERS),
                    ratio_text(s[ratio_key]),
                ]
            )
    notes = [
        f"- {k} {case}: {r['note']}"
        for case in CASES
        for k in LAUNCHERS
        for r in res["raw"][case][k]
        if r["seconds"] is None
    ]
    header = ["case", *LAUNCHERS, "ratio (multigpu / torchrun)"]
    return [*table(header, rows), *(["", *notes] if notes else [])]


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    def ok(case: str) -> bool:
        s = res["summary"][case]
        ours, theirs = s["round_s"][MULTIGPU], s["round_s"][TORCHRUN]
        if ours["never"] or "median" not in ours:
            return False
        return "median" not in theirs or ours["median"] <= theirs["median"]

    def measured_text(case: str) -> str:
        by = res["raw"][case]
        ours, theirs = (cell([r["round_s"] for r in by[k]], "s") for k in (MULTIGPU, TORCHRUN))
        return f"{case}: {ours}, torchrun {theirs}"

    measured = ", ".join(measured_text(case) for case in CASES)
    return [
        target(
            "elastic round",
            "every new round formed, no later than under torchrun (or torchrun's never formed)",
            all(ok(case) for case in CASES),
            measured,
        )
    ]
