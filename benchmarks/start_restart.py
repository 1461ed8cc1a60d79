"""Start-up and restart of multigpu with its warm worker template, without it, and torchrun, in one run.

    python benchmarks/start_restart.py [--runs N] [--counts 1,2,4,8] [--train-steps S] [--out DIR]
        [--only start,restart,train,two_node_start,two_node_restart] [--numpy-site DIR] [--two-node-timeout S]

Start: from launching the tiny gloo job (``workers/joined.py``) to every rank past init_process_group
("joined"), and to the launcher's exit, for 1, 2, 4 and 8 ranks, against one bare rank started by
hand (``python joined.py`` with the env:// variables). Restart: rank 1 dies right after joining,
``--max-restarts 1``; from its death to every rank of the next attempt past init_process_group.
Training: the demo's samples/s (``workers/train.py``) with and without the template. Two nodes: two
launchers on 127.0.0.1, one rank each, started together (the same static torchrun line for all three
variants), timed to both ranks joined and both launchers' exit against one bare rank; and the restart
when rank 1 (node 1) dies, ``--max-restarts 1`` on both nodes. Each twice: without NumPy on the path and
with it (pip-installed once into ``--numpy-site``), where the template once fell back to plain
processes. The variants
alternate run by run. Every process started is ended by PID (torchrun leaves orphans), and the
harness checks, after each job, that none of its descendants is left.
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
from common import (
    LOOPBACK,
    MULTIGPU,
    PYTHON,
    REGISTRY,
    TORCHRUN,
    WORKERS,
    Job,
    alternate,
    free_port,
    launcher_argv,
    median,
    new_bench_dir,
    numpy_site,
    read_marks,
    rmtree_quiet,
    start,
    summarize,
    two_node_argv,
    with_pythonpath,
    worker_env,
)

TEMPLATE = "multigpu"
PLAIN = "multigpu --no-template"
VARIANTS = (TEMPLATE, PLAIN, TORCHRUN)
BARE = "one bare rank"
PARTS = ("start", "restart", "train", "two_node_start", "two_node_restart")
NUMPY_SITE = Path(os.environ.get("BENCH_NUMPY_SITE", "/tmp/multigpu-bench-numpy"))
TIMEOUT_S = 180.0
LEFT_BEHIND: list[int] = []


def argv_of(variant: str, nproc: int, script: str, args: list[str], out: Path, extra: list[str]) -> list[str]:
    if variant == TORCHRUN:
        return launcher_argv(TORCHRUN, nproc, script, args, extra=extra)
    flags = ["--status", "off", *(["--no-template"] if variant == PLAIN else []), *extra]
    return launcher_argv(MULTIGPU, nproc, script, args, output=out, extra=flags)


def sweep() -> None:
    """End any descendant a job left behind, by PID, and count it."""
    for child in psutil.Process().children(recursive=True):
        LEFT_BEHIND.append(child.pid)
        child.kill()


def finish(job: Job) -> int | None:
    code = job.wait(TIMEOUT_S)
    job.finish()
    time.sleep(0.05)
    sweep()
    return code


def launch(
    root: Path, variant: str, nproc: int, script: str, args: list[str], extra: list[str]
) -> tuple[Job, int | None]:
    bench_dir = new_bench_dir(root, variant.replace(" ", "").replace("-", ""))
    job = start(argv_of(variant, nproc, script, args, bench_dir / "mg", extra), bench_dir)
    return job, finish(job)


PHASES = {
    "helper_s": "launch to the template (or store process) created: the launcher's own start",
    "first_rank_s": "launch to the first rank's process created",
    "ranks_created_s": "first rank created to the last",
    "bootstrap_s": "a rank's process created to its script's first line (the slowest rank)",
    "init_s": "the last script start to the last rank past init_process_group",
}


def start_times(job: Job, code: int | None, nproc: int) -> dict[str, float | None]:
    joined = read_marks(job.bench_dir, "joined0")
    ok = code == 0 and len(joined) == nproc and job.exited is not None
    return {
        "joined_s": max(joined.values()) - job.started if ok else None,
        "exit_s": job.exited - job.started if ok and job.exited else None,
        **(phases(job, nproc) if ok else dict.fromkeys(PHASES)),
    }


def phases(job: Job, nproc: int) -> dict[str, float | None]:
    """Where a start went, from the marks ``joined.py`` writes (``_bench.mark_start_phases``)."""
    created, script = read_marks(job.bench_dir, "created"), read_marks(job.bench_dir, "script")
    joined, helper = read_marks(job.bench_dir, "joined0"), read_marks(job.bench_dir, "helper").get(0)
    if not len(created) == len(script) == len(joined) == nproc:
        return dict.fromkeys(PHASES)
    first = min(created.values())
    return {
        "helper_s": None if helper is None else helper - job.started,
        "first_rank_s": first - job.started,
        "ranks_created_s": max(created.values()) - first,
        "bootstrap_s": max(script[r] - created[r] for r in script),
        "init_s": max(joined.values()) - max(script.values()),
    }


def bare(root: Path, site: Path | None = None) -> tuple[Job, int | None]:
    """One rank started by hand with the env:// variables (``site`` ahead on PYTHONPATH if given)."""
    bench_dir = new_bench_dir(root, "bare")
    env = worker_env(
        bench_dir,
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(free_port()),
        },
    )
    env = with_pythonpath(env, site)
    job = start([PYTHON, str(WORKERS / "joined.py")], bench_dir, env)
    return job, finish(job)


def measure_start(root: Path, runs: int, counts: list[int]) -> dict[str, Any]:
    samples: dict[str, dict[str, list[dict[str, float | None]]]] = {
        str(n): {v: [] for v in VARIANTS} for n in counts
    }
    floor: list[dict[str, float | None]] = []
    for i in range(runs):
        job, code = bare(root)
        floor.append(start_times(job, code, 1))
        for n in counts:
            for variant in alternate(i, VARIANTS):
                job, code = launch(root, variant, n, "joined.py", [], [])
                samples[str(n)][variant].append(start_times(job, code, n))
                print(f"start {n} rank(s) {variant}: {samples[str(n)][variant][-1]}", flush=True)
    return {"samples": samples, "bare": floor}


def measure_restart(root: Path, runs: int) -> dict[str, list[float | None]]:
    out: dict[str, list[float | None]] = {v: [] for v in VARIANTS}
    for i in range(runs):
        for variant in alternate(i, VARIANTS):
            job, code = launch(root, variant, 2, "joined.py", ["fail"], ["--max-restarts", "1"])
            failed = read_marks(job.bench_dir, "failed")
            joined = read_marks(job.bench_dir, "joined1")
            ok = code == 0 and len(failed) == 1 and len(joined) == 2
            out[variant].append(max(joined.values()) - failed[1] if ok else None)
            print(f"restart {variant}: {out[variant][-1]}", flush=True)
            if not ok:
                print(f"  exit {code}, marks {sorted(failed)} {sorted(joined)}: {job.output()[-6000:]}")
    return out


def measure_train(root: Path, runs: int, steps: int) -> dict[str, list[float | None]]:
    out: dict[str, list[float | None]] = {v: [] for v in (TEMPLATE, PLAIN)}
    for i in range(runs):
        for variant in alternate(i, (TEMPLATE, PLAIN)):
            job, code = launch(root, variant, 2, "train.py", [str(steps)], [])
            path = job.bench_dir / "marks" / "train.json"
            data = json.loads(path.read_text()) if code == 0 and path.exists() else None
            out[variant].append(data["samples"] / data["seconds"] if data and data["seconds"] else None)
            print(f"train {variant}: {out[variant][-1]}", flush=True)
    return out


# ---------------------------------------------------------------- two nodes on loopback

NO_NUMPY, WITH_NUMPY = "no NumPy", "NumPy"
PLAIN_LINE = "plain processes"  # multigpu says it with --no-template; with the template, a fallback


def two_node_argv_of(
    variant: str, node: int, port: int, args: list[str], out: Path, extra: list[str]
) -> list[str]:
    launcher = TORCHRUN if variant == TORCHRUN else MULTIGPU
    plain = ["--no-template"] if variant == PLAIN else []
    flags = [] if variant == TORCHRUN else ["--status", "off", *plain]
    return two_node_argv(launcher, node, port, "joined.py", args, out, [*flags, *extra])


def launch_pair(
    root: Path, variant: str, site: Path | None, args: list[str], extra: list[str], timeout: float
) -> tuple[list[Job], list[int | None]]:
    """Both nodes' launchers started back to back into one scratch directory (the ranks' marks and PIDs
    land together, by global rank); each waited for within one bound, then ended by PID, as is anything
    either left behind. An exit code of None: the launcher was still running at the bound."""
    bench_dir = new_bench_dir(root, "2n-" + variant.replace(" ", "").replace("-", ""))
    env, port = with_pythonpath(worker_env(bench_dir), site), free_port()
    jobs = [
        start(
            two_node_argv_of(variant, i, port, args, bench_dir / f"mg{i}", extra),
            bench_dir,
            env,
            f"node{i}.log",
        )
        for i in (0, 1)
    ]
    deadline = time.monotonic() + timeout
    codes = [job.wait(max(0.0, deadline - time.monotonic())) for job in jobs]
    for job in jobs:
        job.finish()
    time.sleep(0.05)
    sweep()
    return jobs, codes


def pair_outcome(jobs: list[Job], codes: list[int | None]) -> dict[str, Any]:
    """What every two-node sample keeps besides its time: exit codes, whether each node's console said its
    ranks start as plain processes, and (when it failed) the tail of both consoles, printed."""
    logs = [job.output() for job in jobs]
    out = {"codes": codes, "plain_processes": [PLAIN_LINE in log for log in logs]}
    if codes != [0, 0]:
        tails = "\n".join(f"  node {i}: {log[-3000:]}" for i, log in enumerate(logs))
        print(f"  exit codes {codes}:\n{tails}")
    return out


def pair_start(jobs: list[Job], codes: list[int | None]) -> dict[str, Any]:
    joined = read_marks(jobs[0].bench_dir, "joined0")
    launched = min(job.started for job in jobs)
    exits = [job.exited for job in jobs if job.exited is not None]
    ok = codes == [0, 0] and len(joined) == 2 and len(exits) == 2
    return {
        "joined_s": max(joined.values()) - launched if ok else None,
        "exit_s": max(exits) - launched if ok else None,
        **pair_outcome(jobs, codes),
    }


def pair_restart(jobs: list[Job], codes: list[int | None]) -> dict[str, Any]:
    failed, joined = read_marks(jobs[0].bench_dir, "failed"), read_marks(jobs[0].bench_dir, "joined1")
    ok = codes == [0, 0] and 1 in failed and len(joined) == 2
    return {
        "s": max(joined.values()) - failed[1] if ok else None,
        "rejoined": sorted(joined),
        **pair_outcome(jobs, codes),
    }


def measure_two_node_start(
    root: Path, runs: int, sites: dict[str, Path | None], timeout: float
) -> dict[str, Any]:
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {p: {v: [] for v in VARIANTS} for p in sites}
    floor: dict[str, list[dict[str, float | None]]] = {p: [] for p in sites}
    for i in range(runs):
        for path, site in sites.items():
            job, code = bare(root, site)
            floor[path].append(start_times(job, code, 1))
            for variant in alternate(i, VARIANTS):
                jobs, codes = launch_pair(root, variant, site, [], [], timeout)
                samples[path][variant].append(pair_start(jobs, codes))
                print(f"two-node start, {path}, {variant}: {samples[path][variant][-1]}", flush=True)
    return {"samples": samples, "bare": floor}


def measure_two_node_restart(
    root: Path, runs: int, sites: dict[str, Path | None], timeout: float
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    out: dict[str, dict[str, list[dict[str, Any]]]] = {p: {v: [] for v in VARIANTS} for p in sites}
    for i in range(runs):
        for path, site in sites.items():
            for variant in alternate(i, VARIANTS):
                jobs, codes = launch_pair(root, variant, site, ["fail"], ["--max-restarts", "1"], timeout)
                out[path][variant].append(pair_restart(jobs, codes))
                print(f"two-node restart, {path}, {variant}: {out[path][variant][-1]}", flush=True)
    return out


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def span(values: list[float | None]) -> str:
    s = summarize(values)
    if "median" not in s:
        return "failed"
    never = f", {s['never']} failed" if s["never"] else ""
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}{never})"


def times(value: float | None) -> str:
    """A ratio as '0.52x', or '-' where either side gave no number."""
    return "-" if value is None else f"{value:.2f}x"


def ratio_of(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(res: dict[str, Any]) -> dict[str, Any]:
    bare_joined = median([b["joined_s"] for b in res["start"]["bare"]])
    bare_exit = median([b["exit_s"] for b in res["start"]["bare"]])
    four = res["start"]["samples"].get("4", {})
    restart = {v: median(s) for v, s in res["restart"].items()}
    train = {v: median(s) for v, s in res["train"].items()}
    return {
        "four_ranks_over_bare_joined": {
            v: ratio_of(median([x["joined_s"] for x in four.get(v, [])]), bare_joined) for v in VARIANTS
        },
        "four_ranks_over_bare_exit": {
            v: ratio_of(median([x["exit_s"] for x in four.get(v, [])]), bare_exit) for v in VARIANTS
        },
        "restart_over_torchrun": {v: ratio_of(restart[v], restart[TORCHRUN]) for v in (TEMPLATE, PLAIN)},
        "train_template_over_plain": ratio_of(train[TEMPLATE], train[PLAIN]),
        "two_node": two_node_summary(res),
    }


def two_node_summary(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per Python path: the two-node start over torchrun's and over one bare rank (to joined, to exit),
    the restart over torchrun's, and how many restarts of each variant completed."""
    start = res["two_node_start"]
    out: dict[str, dict[str, Any]] = {}
    for path, by in start["samples"].items():
        out[path] = {}
        for key, name in (("joined_s", "joined"), ("exit_s", "exit")):
            med = {v: median([x[key] for x in by[v]]) for v in VARIANTS}
            floor = median([b[key] for b in start["bare"][path]])
            out[path][f"start_over_torchrun_{name}"] = {
                v: ratio_of(med[v], med[TORCHRUN]) for v in (TEMPLATE, PLAIN)
            }
            out[path][f"start_over_bare_{name}"] = {v: ratio_of(med[v], floor) for v in VARIANTS}
    for path, by in res["two_node_restart"].items():
        med = {v: median([x["s"] for x in by[v]]) for v in VARIANTS}
        out.setdefault(path, {})["restart_over_torchrun"] = {
            v: ratio_of(med[v], med[TORCHRUN]) for v in (TEMPLATE, PLAIN)
        }
        out[path]["restarts_completed"] = {
            v: [sum(x["s"] is not None for x in by[v]), len(by[v])] for v in VARIANTS
        }
    return out


def markdown(res: dict[str, Any]) -> str:
    """The sections of the parts that were measured (``--only``), each with its ratio."""
    only = res.get("only", list(PARTS))
    lines = [
        f"# Start-up and restart: the warm worker template ({res['when']}, {res['machine']}, "
        f"median (min-max) of {res['runs']} runs)",
        "",
    ]
    for part, section in (
        ("start", _start_md),
        ("restart", _restart_md),
        ("train", _train_md),
        ("two_node_start", _two_node_start_md),
        ("two_node_restart", _two_node_restart_md),
    ):
        if part in only:
            lines += section(res)
    lines += [f"Processes left behind by any job and ended by the harness: {len(res['left_behind'])}"]
    return "\n".join(lines) + "\n"


def _start_md(res: dict[str, Any]) -> list[str]:
    s = res["summary"]
    lines = [
        "## Start: launch to every rank past init_process_group / to the launcher's exit, seconds",
        "",
        "| ranks | " + " | ".join(VARIANTS) + " |",
        "|---" * (len(VARIANTS) + 1) + "|",
    ]
    for n, by in res["start"]["samples"].items():
        cells = [
            f"{span([x['joined_s'] for x in by[v]])} / {span([x['exit_s'] for x in by[v]])}" for v in VARIANTS
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Where each start went (median of the runs, seconds; process creation times are "
        "the kernel's, to 10 ms):",
        "",
        "| ranks | variant | " + " | ".join(PHASES.values()) + " |",
        "|---" * (len(PHASES) + 2) + "|",
    ]
    for n, by in res["start"]["samples"].items():
        for v in VARIANTS:
            lines.append(
                f"| {n} | {v} | " + " | ".join(fmt(median([x.get(k) for x in by[v]])) for k in PHASES) + " |"
            )
    b = res["start"]["bare"]
    return [
        *lines,
        "",
        f"{BARE} (python joined.py, env:// by hand): joined {span([x['joined_s'] for x in b])}, "
        f"exit {span([x['exit_s'] for x in b])}",
        "",
        "4 ranks over one bare rank (target 1.25x), to joined: "
        + ", ".join(f"{v} {fmt(r)}x" for v, r in s["four_ranks_over_bare_joined"].items())
        + "; to exit: "
        + ", ".join(f"{v} {fmt(r)}x" for v, r in s["four_ranks_over_bare_exit"].items()),
        "",
    ]


def _restart_md(res: dict[str, Any]) -> list[str]:
    lines = [
        "## Restart: rank 1 dies after joining, `--max-restarts 1`; its death to every rank of the "
        "next attempt past init_process_group, seconds",
        "",
    ]
    lines += [f"- {v}: {span(vals)}" for v, vals in res["restart"].items()]
    return [
        *lines,
        "",
        "Restart over torchrun's (target at most 0.1x): "
        + ", ".join(f"{v} {fmt(r)}x" for v, r in res["summary"]["restart_over_torchrun"].items()),
        "",
    ]


def _train_md(res: dict[str, Any]) -> list[str]:
    lines = [f"## Training throughput of the demo model (2 ranks, {res['train_steps']} steps), samples/s", ""]
    lines += [f"- {v}: {span(vals)}" for v, vals in res["train"].items()]
    return [
        *lines,
        "",
        "With the template over without (must not drop): "
        f"{fmt(res['summary']['train_template_over_plain'])}x",
        "",
    ]


def _pair_cell(samples: list[dict[str, Any]]) -> str:
    return f"{span([x['joined_s'] for x in samples])} / {span([x['exit_s'] for x in samples])}"


def _fallbacks(samples: list[dict[str, Any]]) -> str:
    return f"{sum(any(x.get('plain_processes', [])) for x in samples)} of {len(samples)}"


def _two_node_start_md(res: dict[str, Any]) -> list[str]:
    start, s = res["two_node_start"], res["summary"]["two_node"]
    lines = [
        "## Two-node start: two launchers on 127.0.0.1 (`--nnodes 2 --node-rank I --master-addr "
        "127.0.0.1 --master-port P --nproc-per-node 1`), started together; launch to both ranks past "
        "init_process_group / to both launchers' exit, seconds",
        "",
        "| PYTHONPATH | " + " | ".join([*VARIANTS, BARE]) + " |",
        "|---" * (len(VARIANTS) + 2) + "|",
    ]
    for path, by in start["samples"].items():
        cells = [_pair_cell(by[v]) for v in VARIANTS] + [_pair_cell(start["bare"][path])]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    lines += ["", f"{BARE}: `python joined.py` alone, env:// by hand, on the same PYTHONPATH.", ""]
    for path, by in start["samples"].items():
        r = s[path]
        lines.append(
            f"- {path}: over torchrun's, to joined / to exit: "
            + ", ".join(
                f"{v} {times(r['start_over_torchrun_joined'][v])} / {times(r['start_over_torchrun_exit'][v])}"
                for v in (TEMPLATE, PLAIN)
            )
            + "; over one bare rank: "
            + ", ".join(
                f"{v} {times(r['start_over_bare_joined'][v])} / {times(r['start_over_bare_exit'][v])}"
                for v in VARIANTS
            )
            + f"; runs where a node's template fell back to {PLAIN_LINE}: "
            f"{_fallbacks(by[TEMPLATE])}"
        )
    return [*lines, ""]


def _two_node_restart_md(res: dict[str, Any]) -> list[str]:
    lines = [
        "## Two-node restart: rank 1 (node 1) dies after joining, `--max-restarts 1` on both nodes; its "
        "death to both ranks of the next attempt past init_process_group, seconds",
        "",
        "| PYTHONPATH | " + " | ".join(VARIANTS) + " |",
        "|---" * (len(VARIANTS) + 1) + "|",
    ]
    for path, by in res["two_node_restart"].items():
        done = res["summary"]["two_node"][path]["restarts_completed"]
        cells = [f"{span([x['s'] for x in by[v]])}, {done[v][0]} of {done[v][1]} restarted" for v in VARIANTS]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    lines.append("")
    for path, by in res["two_node_restart"].items():
        over = res["summary"]["two_node"][path]["restart_over_torchrun"]
        failed = {v: [x["codes"] for x in by[v] if x["s"] is None] for v in VARIANTS}
        lines.append(
            f"- {path}: over torchrun's: "
            + ", ".join(f"{v} {times(r)}" for v, r in over.items())
            + "; the failed runs' exit codes (node 0, node 1; None: still running at the "
            f"{res['two_node_timeout']:.0f} s bound, ended by PID): "
            + ", ".join(f"{v} {failed[v] or 'none'}" for v in VARIANTS)
            + f"; runs where a node's template fell back to {PLAIN_LINE}: "
            + _fallbacks(by[TEMPLATE])
        )
    return [*lines, ""]


def python_paths(only: list[str], folder: Path) -> dict[str, Path | None]:
    """The PYTHONPATHs the two-node parts run on: none, and a NumPy folder (made once) if pip can."""
    if not {"two_node_start", "two_node_restart"} & set(only):
        return {}
    site = numpy_site(folder)
    if site is None:
        print(
            f"pip could not install NumPy into {folder}: the two-node parts run without it only", flush=True
        )
    return {NO_NUMPY: None, **({WITH_NUMPY: site} if site is not None else {})}


def measure(args: argparse.Namespace, only: list[str], root: Path) -> dict[str, Any]:
    """Every part in ``only``; the others are left empty (and unwritten in the markdown)."""
    sites, runs, bound = python_paths(only, args.numpy_site), args.runs, args.two_node_timeout
    return {
        "start": measure_start(root, runs, [int(c) for c in args.counts.split(",")])
        if "start" in only
        else {"samples": {}, "bare": []},
        "restart": measure_restart(root, runs) if "restart" in only else {v: [] for v in VARIANTS},
        "train": measure_train(root, runs, args.train_steps)
        if "train" in only
        else {TEMPLATE: [], PLAIN: []},
        "two_node_start": measure_two_node_start(root, runs, sites, bound)
        if "two_node_start" in only
        else {"samples": {}, "bare": {}},
        "two_node_restart": measure_two_node_restart(root, runs, sites, bound)
        if "two_node_restart" in only
        else {},
        "python_paths": {p: None if f is None else str(f) for p, f in sites.items()},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--counts", default="1,2,4,8")
    parser.add_argument("--train-steps", type=int, default=600)
    parser.add_argument("--only", default=",".join(PARTS), help="comma separated: " + ", ".join(PARTS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--numpy-site",
        type=Path,
        default=NUMPY_SITE,
        help=f"folder NumPy is pip-installed into once, for the two-node parts (default {NUMPY_SITE})",
    )
    parser.add_argument(
        "--two-node-timeout",
        type=float,
        default=60.0,
        help="seconds a two-node job may run before both launchers are ended (default 60)",
    )
    args = parser.parse_args()
    unknown = set(args.only.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"--only: unknown part(s) {', '.join(sorted(unknown))} (known: {', '.join(PARTS)})")
    return args


def main() -> int:
    args = parse_args()
    only = args.only.split(",")
    root = Path(tempfile.mkdtemp(prefix="start-restart-"))
    try:
        res: dict[str, Any] = {
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "runs": args.runs,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "train_steps": args.train_steps,
            "two_node_timeout": args.two_node_timeout,
            "only": only,
            **measure(args, only, root),
        }
    finally:
        REGISTRY.cleanup()
        sweep()
        rmtree_quiet(root)
    res["left_behind"] = LEFT_BEHIND
    res["summary"] = summary(res)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "start_restart" if set(only) >= set(PARTS) else "start_restart_" + "_".join(only)
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
