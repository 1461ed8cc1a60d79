"""``multigpu report``'s rendering: a run's incidents as a table, and ``report.html``, one static page
with a per-rank timeline of every attempt. Runs in the shell of whoever asks (no launcher needed).

The page holds no script and fetches nothing from a network: each rank's life is an SVG bar,
coloured by how it ended, with each incident's moments marked on it and an orange band while the
rank was a straggler.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from multigpu.contract.errors import UsageError
from multigpu.record.incidents import PHASES, phase_seconds
from multigpu.record.ledger import ledger_line

COLOURS = {
    "succeeded": "#2e7d32",
    "failed": "#c62828",
    "stopped": "#9e9e9e",
    "running": "#1565c0",
    "hung": "#ef6c00",
    "interrupted": "#6a1b9a",
    "launcher lost": "#616161",
}


def run_records(folder: Path) -> list[Path]:
    """A run folder's records: its ``run.json``, or, for a job over several nodes, each node's
    ``run_node<N>.json`` that this machine holds (one per node whose output is here)."""
    if (folder / "run.json").is_file():
        return [folder / "run.json"]
    return sorted(folder.glob("run_node*.json"), key=lambda p: (len(p.name), p.name))


def find_run(arg: str | None, roots: Sequence[Path] = (Path("multigpu_runs"),)) -> list[Path]:
    """The records of the run folder asked for, or of the newest run under any of ``roots`` (``multigpu
    run``'s ./multigpu_runs, and the cache folder where ``multigpu.launch`` keeps its runs); a
    UsageError naming what is missing."""
    if arg is not None:
        records = run_records(Path(arg))
        if not records:
            raise UsageError(f"{arg}: no run.json there; give a run's output folder")
        return records
    runs = sorted(
        (p for root in roots for p in root.glob("*/run*.json") if run_records(p.parent)),
        key=lambda p: p.stat().st_mtime,
    )
    if not runs:
        where = " or ".join(str(root) if root.is_absolute() else f"./{root}" for root in roots)
        raise UsageError(f"no run under {where}; give a run's output folder")
    return run_records(runs[-1].parent)


def seconds_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def table(data: dict[str, Any]) -> list[str]:
    items = data.get("incidents") or []
    lines = [
        f"run {data['run_id']}: {data['status']}, {len(data['attempts'])} attempt(s), "
        f"{len(items)} incident(s)"
    ]
    if items:
        head = ["attempt", *(name for _, _, name in PHASES), "what"]
        rows = [[str(i["attempt"]), *map(seconds_text, phase_seconds(i)), i["what"]] for i in items]
        widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head) - 1)]
        for row in [head, *rows]:
            lines.append(
                "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
            )
    spent = ledger_line(data.get("ledger") or {})  # where the time went, after the incidents
    return lines if spent is None else [*lines, spent]


def timeline_svg(data: dict[str, Any]) -> str:
    """One row per rank; a bar per attempt from the rank's start to its end, coloured by its state;
    a red line at each incident's failure and a dashed one where the next attempt began."""
    ranks = sorted({int(r) for a in data["attempts"] for r in a["ranks"]})
    starts = [r["start_time"] for a in data["attempts"] for r in a["ranks"].values() if r.get("start_time")]
    ends = [
        r.get("end_time") or data.get("end_time") or r["start_time"]
        for a in data["attempts"]
        for r in a["ranks"].values()
        if r.get("start_time")
    ]
    if not ranks or not starts:
        return "<p>No rank started.</p>"
    t0, t1 = min(starts), max(max(ends), min(starts) + 0.001)
    width, row, left = 900, 28, 80

    def x(t: float) -> float:
        return float(left + (t - t0) / (t1 - t0) * (width - left - 10))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{row * len(ranks) + 40}">']
    for i, rank in enumerate(ranks):
        parts.append(f'<text x="4" y="{i * row + 20}" font-size="13">rank {rank}</text>')
        for attempt in data["attempts"]:
            r = attempt["ranks"].get(str(rank))
            if not r or not r.get("start_time"):
                continue
            end = r.get("end_time") or data.get("end_time") or t1
            colour = COLOURS.get(r.get("state", ""), "#607d8b")
            parts.append(
                f'<rect class="life" x="{x(r["start_time"]):.1f}" y="{i * row + 6}" '
                f'width="{max(x(end) - x(r["start_time"]), 2):.1f}" height="{row - 10}" '
                f'fill="{colour}"><title>attempt {attempt["attempt"]}: rank {rank} '
                f"{html.escape(r.get('state', ''))}</title></rect>"
            )
            parts.extend(_straggling(attempt, rank, end, i * row, x))
    bottom = row * len(ranks) + 10
    parts.extend(_incident_lines(data.get("incidents") or [], bottom, x))
    parts.append(
        f'<text x="{left}" y="{bottom + 24}" font-size="12">0 s</text>'
        f'<text x="{width - 70}" y="{bottom + 24}" font-size="12">{t1 - t0:.1f} s</text></svg>'
    )
    return "".join(parts)


def _incident_lines(incidents: list[dict[str, Any]], bottom: int, x: Callable[[float], float]) -> list[str]:
    """A red line at each incident's failure, a dashed blue one where the next attempt began."""
    lines = []
    for item in incidents:
        lines.append(
            f'<line class="failure" x1="{x(item["failed_time"]):.1f}" y1="0" '
            f'x2="{x(item["failed_time"]):.1f}" y2="{bottom}" stroke="#b71c1c" stroke-width="2"/>'
        )
        if item.get("next_attempt_time"):
            lines.append(
                f'<line class="restart" x1="{x(item["next_attempt_time"]):.1f}" y1="0" '
                f'x2="{x(item["next_attempt_time"]):.1f}" y2="{bottom}" stroke="#0d47a1" '
                f'stroke-dasharray="4 3"/>'
            )
    return lines


def _straggling(
    attempt: dict[str, Any], rank: int, end: float, top: float, x: Callable[[float], float]
) -> list[str]:
    """An orange band inside the rank's bar while it was a straggler (``progress.straggling``)."""
    progress = (attempt.get("progress") or {}).get(str(rank)) or {}
    bands = []
    for span in progress.get("straggling") or []:
        until = span.get("end_time") or end
        title = html.escape(progress.get("straggler") or f"rank {rank} was a straggler")
        bands.append(
            f'<rect class="straggler" x="{x(span["start_time"]):.1f}" y="{top + 10}" '
            f'width="{max(x(until) - x(span["start_time"]), 2):.1f}" height="10" '
            f'fill="#ff9800"><title>{title}</title></rect>'
        )
    return bands


def ledger_html(data: dict[str, Any]) -> str:
    """Where the time went: effective training time as a percentage, then every cause that took any."""
    ledger = data.get("ledger") or {}
    seconds, wall = ledger.get("seconds"), ledger.get("wall_seconds")
    if not isinstance(seconds, dict) or not isinstance(wall, (int, float)) or wall <= 0:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(cause)}</td><td>{value:.1f}s</td><td>{100 * value / wall:.1f}%</td></tr>"
        for cause, value in sorted(seconds.items(), key=lambda item: -item[1])
        if value > 0
    )
    return (
        f"<h2>where the time went</h2><p class='goodput'>effective training time: "
        f"{ledger.get('effective_training_percent')}% of {wall:.1f}s</p>"
        f"<table><tr><th>cause</th><th>time</th><th>share</th></tr>{rows}</table>"
    )


def page(data: dict[str, Any]) -> str:
    head = "".join(f"<th>{name}</th>" for name in ("attempt", *(n for _, _, n in PHASES), "what"))
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(c)}</td>"
            for c in (str(i["attempt"]), *map(seconds_text, phase_seconds(i)), i["what"])
        )
        + "</tr>"
        for i in data.get("incidents") or []
    )
    run = html.escape(data["run_id"])
    style = "body{font-family:sans-serif;margin:20px}td,th{padding:2px 10px;text-align:left}"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>multigpu run {run}</title>"
        f"<style>{style}</style></head><body><h1>run {run}: {html.escape(data['status'])}</h1>"
        f"{timeline_svg(data)}{ledger_html(data)}<h2>incidents</h2><table><tr>{head}</tr>{rows}</table></body></html>\n"
    )
