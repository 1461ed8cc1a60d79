"""Start-up and restart of multigpu with its warm worker template, without it, and torchrun, in one run.

    python benchmarks/start_restart.py [--runs N] [--counts 1,2,4,8] [--train-steps S] [--out DIR]

Start: from launching the tiny gloo job (``workers/joined.py``) to every rank past init_process_group
("joined"), and to the launcher's exit, for 1, 2, 4 and 8 ranks, against one bare rank started by
hand (``python joined.py`` with the env:// variables). Restart: rank 1 dies right after joining,
``--max-restarts 1``; from its death to every rank of the next attempt past init_process_group.
Training: the demo's samples/s (``workers/train.py``) with and without the template. The variants
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
    read_marks,
    rmtree_quiet,
    start,
    summarize,
    worker_env,
)

TEMPLATE = "multigpu"
PLAIN = "multigpu --no-template"
VARIANTS = (TEMPLATE, PLAIN, TORCHRUN)
BARE = "one bare rank"
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


def launch(root: Path, variant: str, nproc: int, script: str, args: list[str], extra: list[str]
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
    return {"joined_s": max(joined.values()) - job.started if ok else None,
            "exit_s": job.exited - job.started if ok and job.exited else None,
            **(phases(job, nproc) if ok else dict.fromkeys(PHASES))}


def phases(job: Job, nproc: int) -> dict[str, float | None]:
    """Where a start went, from the marks ``joined.py`` writes (``_bench.mark_start_phases``)."""
    created, script = read_marks(job.bench_dir, "created"), read_marks(job.bench_dir, "script")
    joined, helper = read_marks(job.bench_dir, "joined0"), read_marks(job.bench_dir, "helper").get(0)
    if not len(created) == len(script) == len(joined) == nproc:
        return dict.fromkeys(PHASES)
    first = min(created.values())
    return {"helper_s": None if helper is None else helper - job.started,
            "first_rank_s": first - job.started,
            "ranks_created_s": max(created.values()) - first,
            "bootstrap_s": max(script[r] - created[r] for r in script),
            "init_s": max(joined.values()) - max(script.values())}


def bare(root: Path) -> tuple[Job, int | None]:
    bench_dir = new_bench_dir(root, "bare")
    env = worker_env(bench_dir, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                                 "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(free_port())})
    job = start([PYTHON, str(WORKERS / "joined.py")], bench_dir, env)
    return job, finish(job)


def measure_start(root: Path, runs: int, counts: list[int]) -> dict[str, Any]:
    samples: dict[str, dict[str, list[dict[str, float | None]]]] = {
        str(n): {v: [] for v in VARIANTS} for n in counts}
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


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def span(values: list[float | None]) -> str:
    s = summarize(values)
    if "median" not in s:
        return "failed"
    never = f", {s['never']} failed" if s["never"] else ""
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}{never})"


def ratio_of(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(res: dict[str, Any]) -> dict[str, Any]:
    bare_joined = median([b["joined_s"] for b in res["start"]["bare"]])
    bare_exit = median([b["exit_s"] for b in res["start"]["bare"]])
    four = res["start"]["samples"].get("4", {})
    restart = {v: median(s) for v, s in res["restart"].items()}
    train = {v: median(s) for v, s in res["train"].items()}
    return {
        "four_ranks_over_bare_joined": {v: ratio_of(median([x["joined_s"] for x in four.get(v, [])]),
                                                    bare_joined) for v in VARIANTS},
        "four_ranks_over_bare_exit": {v: ratio_of(median([x["exit_s"] for x in four.get(v, [])]), bare_exit)
                                      for v in VARIANTS},
        "restart_over_torchrun": {v: ratio_of(restart[v], restart[TORCHRUN]) for v in (TEMPLATE, PLAIN)},
        "train_template_over_plain": ratio_of(train[TEMPLATE], train[PLAIN]),
    }


def markdown(res: dict[str, Any]) -> str:
    """The sections of the parts that were measured (``--only``), each with its ratio."""
    only = res.get("only", ["start", "restart", "train"])
    lines = [f"# Start-up and restart: the warm worker template ({res['when']}, {res['machine']}, "
             f"median (min-max) of {res['runs']} runs)", ""]
    for part, section in (("start", _start_md), ("restart", _restart_md), ("train", _train_md)):
        if part in only:
            lines += section(res)
    lines += [f"Processes left behind by any job and ended by the harness: {len(res['left_behind'])}"]
    return "\n".join(lines) + "\n"


def _start_md(res: dict[str, Any]) -> list[str]:
    s = res["summary"]
    lines = ["## Start: launch to every rank past init_process_group / to the launcher's exit, seconds", "",
             "| ranks | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 1) + "|"]
    for n, by in res["start"]["samples"].items():
        cells = [f"{span([x['joined_s'] for x in by[v]])} / {span([x['exit_s'] for x in by[v]])}"
                 for v in VARIANTS]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "Where each start went (median of the runs, seconds; process creation times are "
              "the kernel's, to 10 ms):", "", "| ranks | variant | " + " | ".join(PHASES.values()) + " |",
              "|---" * (len(PHASES) + 2) + "|"]
    for n, by in res["start"]["samples"].items():
        for v in VARIANTS:
            lines.append(f"| {n} | {v} | " + " | ".join(fmt(median([x.get(k) for x in by[v]]))
                                                      for k in PHASES) + " |")
    b = res["start"]["bare"]
    return [
        *lines, "", f"{BARE} (python joined.py, env:// by hand): joined {span([x['joined_s'] for x in b])}, "
        f"exit {span([x['exit_s'] for x in b])}", "",
        "4 ranks over one bare rank (target 1.25x), to joined: " + ", ".join(
            f"{v} {fmt(r)}x" for v, r in s["four_ranks_over_bare_joined"].items())
        + "; to exit: " + ", ".join(f"{v} {fmt(r)}x" for v, r in s["four_ranks_over_bare_exit"].items()), ""]


def _restart_md(res: dict[str, Any]) -> list[str]:
    lines = ["## Restart: rank 1 dies after joining, `--max-restarts 1`; its death to every rank of the "
             "next attempt past init_process_group, seconds", ""]
    lines += [f"- {v}: {span(vals)}" for v, vals in res["restart"].items()]
    return [*lines, "", "Restart over torchrun's (target at most 0.1x): " + ", ".join(
        f"{v} {fmt(r)}x" for v, r in res["summary"]["restart_over_torchrun"].items()), ""]


def _train_md(res: dict[str, Any]) -> list[str]:
    lines = [f"## Training throughput of the demo model (2 ranks, {res['train_steps']} steps), samples/s", ""]
    lines += [f"- {v}: {span(vals)}" for v, vals in res["train"].items()]
    return [*lines, "", "With the template over without (must not drop): "
                    f"{fmt(res['summary']['train_template_over_plain'])}x", ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--counts", default="1,2,4,8")
    parser.add_argument("--train-steps", type=int, default=600)
    parser.add_argument("--only", default="start,restart,train")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    only = args.only.split(",")
    root = Path(tempfile.mkdtemp(prefix="start-restart-"))
    try:
        res: dict[str, Any] = {
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": args.runs,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "train_steps": args.train_steps, "only": only,
            "start": measure_start(root, args.runs, [int(c) for c in args.counts.split(",")])
            if "start" in only else {"samples": {}, "bare": []},
            "restart": measure_restart(root, args.runs) if "restart" in only else {v: [] for v in VARIANTS},
            "train": measure_train(root, args.runs, args.train_steps) if "train" in only
            else {TEMPLATE: [], PLAIN: []},
        }
    finally:
        REGISTRY.cleanup()
        sweep()
        rmtree_quiet(root)
    res["left_behind"] = LEFT_BEHIND
    res["summary"] = summary(res)
    args.out.mkdir(parents=True, exist_ok=True)
    everything = set(only) >= {"start", "restart", "train"}
    stem = "start_restart" if everything else "start_restart_" + "_".join(only)
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
