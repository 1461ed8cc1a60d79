"""Run the multigpu vs torchrun benchmarks and write results.json, RESULTS.md and launch_time.png.

    python benchmarks/run.py [--quick] [--runs N] [--only NAME,...] [--out benchmarks/results]

Both launchers run the same worker scripts (benchmarks/workers/), alternately, run by run. Every process
started is bounded in time and ended by PID if it outlives its benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import bench_badinput
import bench_claims
import bench_death
import bench_elastic
import bench_idle
import bench_launch
import bench_logs
import bench_scale
import bench_sigkill
import bench_signals
import bench_soak
import bench_train
from common import HERE, REGISTRY, Ctx, log, rmtree_quiet
from report import table

BENCHES: tuple[ModuleType, ...] = (
    bench_launch,
    bench_death,
    bench_sigkill,
    bench_signals,
    bench_badinput,
    bench_train,
    bench_logs,
    bench_idle,
    bench_scale,
    bench_soak,
    bench_elastic,
    bench_claims,
)
BY_NAME = {m.NAME: m for m in BENCHES}
FULL_RUNS, QUICK_RUNS = 5, 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_RUNS} run each, fewer cases, shorter sleeps (a smoke test, ~3 min)",
    )
    p.add_argument(
        "--runs", type=int, help=f"runs per figure (default {FULL_RUNS}, {QUICK_RUNS} with --quick)"
    )
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(BY_NAME)}")
    p.add_argument(
        "--out",
        type=Path,
        help="output directory (default: benchmarks/results, the committed "
        "results; with --quick a scratch folder, so a smoke test never replaces them)",
    )
    p.add_argument(
        "--keep-scratch", action="store_true", help="keep the jobs' scratch directories (debugging)"
    )
    args = p.parse_args(argv)
    args.names = list(BY_NAME) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in BY_NAME]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    if args.runs is not None and args.runs < 1:
        p.error("--runs must be at least 1")
    if args.quick and args.out is not None and args.out.resolve() == (HERE / "results").resolve():
        p.error("--quick never writes into benchmarks/results (the committed numbers); leave out --out")
    if args.out is None and not args.quick:
        args.out = HERE / "results"
    return args


def output_folder(args: argparse.Namespace) -> Path:
    """Where the results go: ``--out``, the committed results, or for ``--quick`` a scratch folder made
    here, once the run is sure to start (a refused run leaves none behind)."""
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="multigpu-bench-quick-"))
    out: Path = args.out
    return out


NEEDS = ("psutil", "torch", "multigpu")
"""What a run imports (``--help`` needs none of them)."""


def missing_requirements() -> str | None:
    """One line naming what this Python lacks and the fix: the README's venv, with the dev extra."""
    import importlib.util

    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        f"benchmarks/run.py: error: {', '.join(missing)} not installed for {sys.executable}; run it "
        f"with the venv's python: .venv/bin/python benchmarks/run.py (set up by "
        f"python3 -m venv .venv && .venv/bin/pip install -e '.[dev]')"
    )


def machine() -> dict[str, Any]:
    from importlib.metadata import version  # not ``import torch``: no NumPy warning, no second lost

    import psutil

    return {
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_at_start": os.getloadavg(),
        "commit": _commit(),
    }


def _commit() -> str:
    """The commit measured, with ``+dirty`` when the tree had uncommitted changes (the results this
    run writes as it goes do not count: every section after the first would read as dirty)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()

    dirty = "+dirty" if git("status", "--porcelain", "--", ":/", ":(top,exclude)benchmarks/results") else ""
    return (git("rev-parse", "--short", "HEAD") or "unknown") + dirty


def multigpu_version() -> str:
    from multigpu import __version__

    return str(__version__)


def run_one(mod: ModuleType, ctx: Ctx) -> dict[str, Any]:
    log(f"{mod.TITLE}: starting (about {mod.estimate(ctx) / 60:.1f} min)")
    started, load = time.time(), list(os.getloadavg())
    try:
        result: dict[str, Any] = mod.run(ctx)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        log(f"{mod.NAME} FAILED: {result['error']}")
    finally:
        killed = REGISTRY.cleanup()
    result["elapsed_s"] = round(time.time() - started, 1)
    result["measured"] = {
        "commit": _commit(),
        "load_average_at_start": load,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    result["stragglers_killed_by_harness"] = killed
    log(f"{mod.NAME}: done in {result['elapsed_s']:.0f} s")
    return result


def load_previous(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def targets_section(results: dict[str, Any]) -> list[str]:
    rows = []
    for mod in BENCHES:
        res = results.get(mod.NAME)
        if res is None or "error" in res:
            continue
        for t in mod.targets(res):
            met = {True: "**met**", False: "**missed**", None: "n/a"}[t["met"]]
            rows.append([t["name"], t["goal"], met, t["measured"], t["note"]])
    return [
        "## Targets (from the issues: 3, 4, 6, 21 and 24)",
        "",
        *table(["target", "goal", "result", "measured", "note"], rows),
        "",
    ]


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# multigpu vs torchrun",
        "",
        f"Machine: {m['nproc']} cores ({m['usable_cpus']} usable), {m['memory_gib']} GiB, "
        f"{m['platform']}; Python {m['python']}, torch {m['torch']}, multigpu "
        f"{results.get('multigpu', '?')} at commit {m.get('commit', '?')}; {m['date']}; "
        "load average at start "
        f"{', '.join(f'{x:.2f}' for x in m['load_average_at_start'])}.",
        "",
        f"Mode: {results['mode']}, {results['runs']} run(s) per figure, launchers alternated run by "
        "run. Cells are median [min-max] over the runs; 'never' counts runs that hit the bound. "
        "Ratios compare medians. Raw samples: results.json; plot: launch_time.png.",
        "",
        *targets_section(results),
    ]
    for mod in BENCHES:
        res = results.get(mod.NAME)
        if res is None:
            continue
        lines += [f"## {mod.TITLE}", ""]
        if "error" in res:
            lines += [f"This benchmark failed: `{res['error']}` (traceback in results.json).", ""]
            continue
        stamp = res.get("measured", {})
        again = (
            f"; re-measured alone at commit {stamp['commit']}, {stamp['date']}"
            if stamp.get("commit") not in (None, m.get("commit"))
            else ""
        )
        lines += [*mod.markdown(res), "", f"_{res['elapsed_s']:.0f} s{again}_", ""]
    return "\n".join(lines)


def write_outputs(results: dict[str, Any], out: Path) -> None:
    write_json(out / "results.json", results)
    (out / "RESULTS.md").write_text(markdown(results))
    try:
        import matplotlib  # noqa: F401  (only the plot needs it)
    except ImportError:
        if not _said["no_plot"]:
            log("no plot: it needs matplotlib (.venv/bin/pip install -e '.[bench]'); the numbers are written")
            _said["no_plot"] = True
        return
    try:
        from plot import plot

        plot(results, out / "launch_time.png")
    except Exception as exc:  # the numbers matter more than the picture
        log(f"plot failed: {type(exc).__name__}: {exc}")


_said = {"no_plot": False}


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    problem = missing_requirements()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop)
    runs = args.runs or (QUICK_RUNS if args.quick else FULL_RUNS)
    output_folder(args).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="multigpu-bench-"))
    ctx = Ctx(runs=runs, quick=args.quick, root=scratch)
    mods = [BY_NAME[n] for n in args.names]
    estimate = sum(m.estimate(ctx) for m in mods) / 60
    log(
        f"{len(mods)} benchmark(s), {runs} run(s) each: estimated {estimate:.1f} min on a quiet "
        f"2-core machine; scratch {scratch}"
    )
    results = load_previous(args.out / "results.json") if args.only else {}
    if "machine" not in results:  # a partial run keeps the full run's header; each section has its stamp
        results.update(
            machine=machine(),
            multigpu=multigpu_version(),
            runs=runs,
            mode="quick" if args.quick else "full",
            python_executable=sys.executable,
        )
    started = time.time()
    try:
        for mod in mods:
            results[mod.NAME] = run_one(mod, ctx)
            write_outputs(results, args.out)
    except KeyboardInterrupt:
        log("interrupted: ending every process started, writing what was measured")
        return 130
    finally:
        REGISTRY.cleanup()
        write_outputs(results, args.out)
        if not args.keep_scratch:
            rmtree_quiet(scratch)
        log(f"total {(time.time() - started) / 60:.1f} min; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
