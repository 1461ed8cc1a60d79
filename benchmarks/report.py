"""Formatting shared by the benchmark modules: 'median [min-max]' cells, Markdown tables, targets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common import LAUNCHERS, summarize


def fmt_num(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def cell(values: Sequence[float | None], unit: str = "", digits: int = 2, never: str = "never") -> str:
    """'median [min-max] unit' over the runs that gave a number, plus how many gave none."""
    s = summarize(values)
    u = f" {unit}" if unit else ""
    if s["n"] == 0:
        return "not run"
    if s["never"] == s["n"]:
        return f"{never} ({s['n']}/{s['n']})"
    text = f"{fmt_num(s['median'], digits)} [{fmt_num(s['min'], digits)}-{fmt_num(s['max'], digits)}]{u}"
    if s["never"]:
        text += f", {never} in {s['never']}/{s['n']}"
    return text


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def ratio_text(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def metric_rows(rows: Sequence[dict[str, Any]], digits: int = 2, never: str = "never") -> list[list[str]]:
    """rows of {'label', 'unit', 'samples': {launcher: [...]}, 'ratio'} -> table cells."""
    out = []
    for r in rows:
        out.append(
            [
                r["label"],
                *(cell(r["samples"].get(name, []), r.get("unit", ""), digits, never) for name in LAUNCHERS),
                ratio_text(r.get("ratio")),
            ]
        )
    return out


def metric_table(
    rows: Sequence[dict[str, Any]], first: str = "case", digits: int = 2, never: str = "never"
) -> list[str]:
    return table(
        [first, "multigpu", "torchrun", "ratio (multigpu / torchrun)"], metric_rows(rows, digits, never)
    )


def target(name: str, goal: str, met: bool | None, measured: str, note: str = "") -> dict[str, Any]:
    """An issue target: met True/False, or None when it could not be judged (a benchmark failed)."""
    return {"name": name, "goal": goal, "met": met, "measured": measured, "note": note}
