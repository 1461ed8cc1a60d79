"""What ``--preflight`` adds to a healthy two-node job's start (issue 34: at most 5 s).

    python benchmarks/preflight_cost.py [--runs N] [--out DIR]

Two launchers on 127.0.0.1, one CPU rank each, the same static line as ``start_restart.py``'s
two-node start (torchrun's ``--nnodes 2 --node-rank N --master-addr --master-port --nproc-per-node
1``, plus ``--status off``), started together, with ``--preflight on`` and with ``--no-preflight``,
alternately, run by run. Timed from the first launcher's start to both ranks past init_process_group
(``workers/joined.py``'s ``joined0`` marks: the job's first step could start), and to both launchers'
exit. Beside it, the check's own time as run.json records it (``preflight.seconds``: from forking
the check to its verdict) and the figures it measured. Every process started is ended by PID; the
harness counts any descendant left. Results go to ``--out`` (default: a new scratch folder) as
``preflight_cost.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from common import alternate, median, rmtree_quiet, summarize
from start_restart import LEFT_BEHIND, TEMPLATE, launch_pair, pair_start

ON, OFF = "--preflight on", "--no-preflight"
VARIANTS = (ON, OFF)
TIMEOUT_S = 180.0
TARGET_S = 5.0


def one_run(root: Path, variant: str) -> dict[str, Any]:
    """Both nodes of one job, started back to back (``start_restart.launch_pair``, whose multigpu line
    has ``--status off``); their times, exit codes and node 0's record of the check."""
    jobs, codes = launch_pair(root, TEMPLATE, None, [], variant.split(), TIMEOUT_S)
    times = pair_start(jobs, codes)
    record = jobs[0].bench_dir / "mg0" / "run_node0.json"
    check = json.loads(record.read_text()).get("preflight") if record.exists() else None
    return {
        "codes": codes,
        "first_step_s": times["joined_s"],
        "exit_s": times["exit_s"],
        "check_s": check.get("seconds") if check else None,
        "verdict": check.get("verdict") if check else None,
        "nodes": check.get("nodes") if check else None,
    }


def measure(root: Path, runs: int) -> dict[str, list[dict[str, Any]]]:
    raw: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for i in range(runs):
        for variant in alternate(i, VARIANTS):
            raw[variant].append(one_run(root, variant))
            print(f"run {i + 1} {variant}: {raw[variant][-1]}", flush=True)
    return raw


def summary(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    on = median([r["first_step_s"] for r in raw[ON]])
    off = median([r["first_step_s"] for r in raw[OFF]])
    added = on - off if on is not None and off is not None else None
    return {
        "first_step_s": {v: summarize([r["first_step_s"] for r in raw[v]]) for v in VARIANTS},
        "exit_s": {v: summarize([r["exit_s"] for r in raw[v]]) for v in VARIANTS},
        "check_s": summarize([r["check_s"] for r in raw[ON]]),
        "added_s": added,
        "within_target": added is not None and added <= TARGET_S,
        "verdicts": [r["verdict"] for r in raw[ON]],
    }


def span(s: dict[str, Any]) -> str:
    if "median" not in s:
        return "failed"
    never = f", {s['never']} failed" if s["never"] else ""
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}{never})"


def markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    added = "-" if s["added_s"] is None else f"{s['added_s']:.2f}"
    lines = [
        f"# --preflight on a healthy two-node job ({res['when']}, {res['machine']}, load {res['load']}, "
        f"median (min-max) of {res['runs']} runs)",
        "",
        "| variant | launch to both ranks past init_process_group, s | launch to both launchers' exit, s |",
        "|---|---|---|",
        *(f"| `{v}` | {span(s['first_step_s'][v])} | {span(s['exit_s'][v])} |" for v in VARIANTS),
        "",
        f"Added to the first step by the check (median on - median off): {added} s "
        f"(target: at most {TARGET_S:g} s; {'met' if s['within_target'] else 'NOT met'}).",
        f"The check's own time (run.json `preflight.seconds`, fork to verdict): {span(s['check_s'])} s; "
        f"verdicts: {', '.join(map(str, s['verdicts']))}.",
        f"Processes left behind at the end: {len(res['left_after'])}",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    from multigpu.contract.prctl import set_child_subreaper

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per variant (default 3)")
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for the results (default: a new scratch folder)"
    )
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    set_child_subreaper()
    out = args.out or Path(tempfile.mkdtemp(prefix="preflight-cost-results-"))
    root = Path(tempfile.mkdtemp(prefix="preflight-cost-"))
    res: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": args.runs,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    try:
        res["raw"] = measure(root, args.runs)
    finally:
        rmtree_quiet(root)
    res["summary"] = summary(res["raw"])
    res["left_after"] = [*LEFT_BEHIND, *(p.pid for p in psutil.Process().children(recursive=True))]
    out.mkdir(parents=True, exist_ok=True)
    (out / "preflight_cost.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "preflight_cost.md").write_text(markdown(res))
    print(markdown(res))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
