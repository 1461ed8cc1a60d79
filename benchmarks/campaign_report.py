"""The fault campaign's summary and Markdown (issue 41), run in the harness process once both launchers'
campaigns are done: per class and launcher, then the mix-weighted lost time per failure and the
effective training time it projects, beside the 1,000-node detection figure of ``fate_scale``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from campaign_stats import (
    BOUND_S,
    INJECTION,
    LLAMA_MTBI_S,
    MIX,
    effective_share,
    mix_weighted,
    weighted_quantile,
)
from report import cell, table

NEVER_S = BOUND_S
NODE_LOSS = ("host", "network")
OVERALL = [
    "launcher",
    "lost median / p99",
    "with rejoin median / p99",
    "mean",
    "training share",
    "wrong / left",
]


def per_failure(rec: dict[str, Any]) -> float | None:
    """The time one failure cost the job: to every rank past its lost step, plus, for a lost node, the
    stall its repaired return caused."""
    if rec.get("lost_s") is None:
        return None
    return float(rec["lost_s"]) + float(rec.get("rejoin_s") or 0.0)


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Per launcher: per class lists, the mix-weighted median, p99 and mean lost per failure (with and
    without the rejoin), the campaign's own median and p99, and the effective share at 2.5 h."""
    out: dict[str, Any] = {"user_restart_s": statistics.median(res["user_restart_s"])}
    for kind, run in res["runs"].items():
        recs = [r for r in run["faults"] if "skipped" not in r]
        classes = {c: [r for r in recs if r["kind"] == c] for c in MIX if any(r["kind"] == c for r in recs)}
        summ: dict[str, Any] = {}
        for key, fn in (("lost", lambda r: r.get("lost_s")), ("per_failure", per_failure)):
            weighted = mix_weighted({c: [fn(r) for r in rs] for c, rs in classes.items()}, NEVER_S)
            total = sum(w for _, w in weighted)
            summ[key] = {
                "median": weighted_quantile(weighted, 0.5),
                "p99": weighted_quantile(weighted, 0.99),
                "mean": sum(v * w for v, w in weighted) / total if total else None,
                "never": sum(1 for r in recs if fn(r) is None),
            }
        plain = sorted(NEVER_S if r.get("lost_s") is None else r["lost_s"] for r in recs)
        summ["campaign_median"] = statistics.median(plain) if plain else None
        summ["campaign_max"] = plain[-1] if plain else None
        mean = summ["per_failure"]["mean"]
        summ["effective"] = effective_share(mean) if mean is not None else None
        summ["wrong"] = sum(r.get("wrong", 0) for r in recs)
        summ["left"] = sum(r.get("left", 0) for r in recs) + run["end"]["left_at_end"]
        out[kind] = summ
    return out


def class_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for c in MIX:
        for kind, run in res["runs"].items():
            recs = [r for r in run["faults"] if r["kind"] == c and "skipped" not in r]
            if not recs:
                continue
            never = f"never recovered in {NEVER_S:.0f} s"
            rows.append(
                [
                    f"{c} ({MIX[c][0]}/420)",
                    kind,
                    str(len(recs)),
                    cell([r.get("detect_s") for r in recs], "s", never="none"),
                    cell([r.get("lost_s") for r in recs], "s", never=never),
                    ", ".join(str(r.get("rolled_back")) for r in recs),
                    cell([r.get("rejoin_s") for r in recs], "s") if c in NODE_LOSS else "-",
                    str(sum(r.get("left", 0) for r in recs)),
                    str(sum(r.get("wrong", 0) for r in recs)),
                ]
            )
    return rows


def aims(res: dict[str, Any]) -> list[str]:
    s, user = res["summary"], res["summary"]["user_restart_s"]
    ours = s.get("multigpu")
    if ours is None:
        return []
    med, p99 = ours["per_failure"]["median"], ours["per_failure"]["p99"]

    def mark(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    return [
        f"- median lost per failure <= user's restart cost ({user:.2f} s) + 1.5 s: {mark(med <= user + 1.5)}"
        f" ({med:.2f} s, {med - user:+.2f} s beyond it)",
        f"- p99 lost per failure <= 5 s: {mark(p99 <= 5)} ({p99:.2f} s; {p99 - user:+.2f} s beyond the "
        f"user's cost: {mark(p99 - user <= 5)} read that way)",
        f"- zero wrong verdicts: {mark(ours['wrong'] == 0)} ({ours['wrong']})",
        f"- zero processes left: {mark(ours['left'] == 0)} ({ours['left']})",
    ]


def overall_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for kind in res["runs"]:
        s = res["summary"][kind]

        def f(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2f} s"

        eff = s["effective"]
        rows.append(
            [
                kind,
                f"{f(s['lost']['median'])} / {f(s['lost']['p99'])}",
                f"{f(s['per_failure']['median'])} / {f(s['per_failure']['p99'])}",
                f"{f(s['per_failure']['mean'])}" + f" ({s['per_failure']['never']} never)",
                "n/a" if eff is None else f"{100 * eff:.3f}%",
                f"{s['wrong']} / {s['left']}",
            ]
        )
    return rows


def at_scale(path: Path = Path(__file__).parent / "results" / "fate_scale.json") -> str:
    """The detection part at 1,000 nodes, quoted from ``fate_scale.py``'s committed results (its
    simulation: one store, 1,000 simulated nodes; not re-run here)."""
    if not path.exists():
        return "The 1,000-node detection figure: results/fate_scale.json is missing."
    found = json.loads(path.read_text())
    rows = [c for c in found["cases"] if c["nodes"] == 1000 and c["protocol"] == "new"]
    if not rows:
        return "The 1,000-node detection figure: no 1000-node row in results/fate_scale.json."
    c, when = rows[0], found.get("machine_1000", {}).get("date", "?")
    return (
        f"Detection at 1,000 nodes (quoted from [fate_scale.md](fate_scale.md), {when}, not re-run: one "
        f"store, 1,000 simulated nodes on this machine): every node knew of a node's death in "
        f"{c['death']['median_s']:.2f} s (median; max {c['death']['max_s']:.2f} s) and of a published "
        f"failure (a rank's exception) in {c['published']['median_s']:.2f} s (max "
        f"{c['published']['max_s']:.2f} s); {c['aborted_healthy']} of 1000 healthy nodes aborted; store "
        f"p99 round trip {c['p99_rtt_ms']} ms: compare the detection column of the host and network "
        "rows above."
    )


def markdown(res: dict[str, Any]) -> str:
    user = res["summary"]["user_restart_s"]
    lines = [
        "# Fault campaign: time lost per failure (benchmarks/fault_campaign.py, issue 41)",
        "",
        f"{res['when']}, commit {res['commit'].strip()}, {res['machine']}, load average {res['load_start']}"
        f" at the start, {res['load_end']} at the end; one run took {res['wall_s']:.0f} s. Seed "
        f"{res['seed']}; {len(res['faults'])} faults per launcher, several per job, in this order: "
        + ", ".join(f"{k}@{'S (torchrun: A)' if k == 'store' else t}" for k, t in res["faults"])
        + ". The user's own restart cost (the same script alone, a clean start to its first step, "
        f"median of {len(res['user_restart_s'])}): {user:.2f} s.",
        "",
        "Per fault class (Llama 3's count of 419 in brackets). Cells: median [min-max]. Lost: from the "
        "fault to every rank of the round past the highest step logged before it; rejoin: the stall the "
        "repaired node's return caused the round of 3.",
        "",
        *table(
            ["class", "launcher", "n", "detection", "lost", "steps rolled back", "rejoin", "left", "wrong"],
            class_rows(res),
        ),
        "",
        "Per failure, weighted by the mix (each class's share of 420 spread over its samples; a fault "
        f"never recovered counts as {NEVER_S:.0f} s, a lower bound), and the share of wall time spent "
        f"training at one interruption per {LLAMA_MTBI_S / 3600:.1f} h:",
        "",
        *table(OVERALL, overall_rows(res)),
        "",
        at_scale(),
        "",
        "Aims (issue 41), multigpu:",
        "",
        *aims(res),
        "",
        "Injections: " + "; ".join(f"{c}: {INJECTION[c]}" for c in MIX) + ".",
        "",
    ]
    if res.get("notes"):
        lines += ["Notes (from this run's logs, added to the json after it):", ""]
        lines += [f"- {n}" for n in res["notes"]] + [""]
    return "\n".join(lines) + "\n"
