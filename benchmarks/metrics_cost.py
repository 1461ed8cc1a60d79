"""What ``--metrics-port`` costs the launcher (issue 45: at most +1% of a core, no step-rate change
beyond noise), and how long a scrape takes at 64 ranks.

    python benchmarks/metrics_cost.py [--runs N] [--window S] [--out DIR]

CPU: one launcher, 4 CPU ranks each stepping every 10 ms (``multigpu.heartbeat(step=N)``), with
``--metrics-port 0`` scraped once a second (Prometheus's usual interval is 15 s: this is the harsher
case) and without the option, alternately, run by run. The launcher's own CPU time (user + system,
``/proc``, its ranks not counted) is read over a ``--window`` once every rank has stepped, as a share
of one core; the ranks' step rate is their median step interval in run.json at the window's end.
Scrape latency: a launcher of 64 CPU ranks stepping every 100 ms, ``/metrics`` fetched 50 times back
to back. Every process
started is ended by PID; the harness counts any descendant left. Results go to ``--out`` (default: a
new scratch folder) as ``metrics_cost.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from common import alternate, median, rmtree_quiet, summarize

ON, OFF = "--metrics-port 0", "no metrics"
VARIANTS = (ON, OFF)
TARGET_CORE_PCT = 1.0
SCRAPES = 50
STEPPER = """
import os, sys, time, multigpu
interval, stop = float(sys.argv[1]), sys.argv[2]
step = 0
while not os.path.exists(stop):
    multigpu.heartbeat(step=step)
    step += 1
    time.sleep(interval)
"""


def start(root: Path, nproc: int, interval: float, metrics: bool) -> tuple[subprocess.Popen[str], Path, Path]:
    """A launcher of ``nproc`` stepping ranks; (its process, its stop file, its output folder)."""
    script = root / "stepper.py"
    script.write_text(STEPPER)
    out = Path(tempfile.mkdtemp(dir=root, prefix="run-"))
    stop = out / "stop"
    argv = [sys.executable, "-m", "multigpu", "run", "--cpu", str(nproc), "--status", "off"]
    argv += ["--output", str(out / "o"), *(["--metrics-port", "0"] if metrics else [])]
    proc = subprocess.Popen(
        [*argv, str(script), str(interval), str(stop)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    return proc, stop, out / "o"


def metrics_url(proc: subprocess.Popen[str]) -> str:
    assert proc.stderr is not None
    while line := proc.stderr.readline():
        if found := re.search(r"metrics: (http://\S+/metrics)", line):
            return found.group(1)
    raise RuntimeError("the launcher printed no metrics address")


def progress(out: Path) -> dict[str, Any]:
    """Every rank's progress as run.json has it now ({} before the first report)."""
    try:
        attempts = json.loads((out / "run.json").read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        return {}
    return dict(attempts[-1].get("progress") or {}) if attempts else {}


def wait_steps(out: Path, nproc: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len([p for p in progress(out).values() if p.get("step")]) < nproc:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks did not all step within {timeout:g}s")
        time.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def finish(proc: subprocess.Popen[str], stop: Path) -> int:
    stop.touch()
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    return proc.returncode


def one_run(root: Path, variant: str, window: float) -> dict[str, Any]:
    """One launcher's CPU share and its ranks' step rate over ``window`` seconds of stepping."""
    proc, stop, out = start(root, 4, 0.01, metrics=variant == ON)
    try:
        url = metrics_url(proc) if variant == ON else None
        wait_steps(out, 4, 120)
        t0, cpu0 = time.monotonic(), cpu_seconds(proc.pid)
        while (now := time.monotonic()) < t0 + window:
            if url is not None:
                urllib.request.urlopen(url, timeout=5).read()
            time.sleep(min(1.0, max(0.0, t0 + window - now)))
        t1, cpu1 = time.monotonic(), cpu_seconds(proc.pid)
        medians = [p["median_step_s"] for p in progress(out).values()]  # the last 20 steps' (5 s old at most)
    finally:
        code = finish(proc, stop)
    return {
        "code": code,
        "core_pct": 100 * (cpu1 - cpu0) / (t1 - t0),
        "steps_per_s": statistics.mean(1 / m for m in medians),
    }


def scrape_latency(root: Path) -> dict[str, Any]:
    """``SCRAPES`` back-to-back fetches of ``/metrics`` from a launcher of 64 stepping ranks (ms)."""
    proc, stop, out = start(root, 64, 0.1, metrics=True)
    try:
        url = metrics_url(proc)
        wait_steps(out, 64, 300)
        took, size = [], 0
        for _ in range(SCRAPES):
            t = time.perf_counter()
            size = len(urllib.request.urlopen(url, timeout=10).read())
            took.append(1000 * (time.perf_counter() - t))
    finally:
        code = finish(proc, stop)
    took.sort()
    return {
        "code": code,
        "ms": took,
        "median_ms": statistics.median(took),
        "p95_ms": took[int(0.95 * len(took)) - 1],
        "max_ms": took[-1],
        "bytes": size,
    }


def summary(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    on, off = (median([r["core_pct"] for r in raw[v]]) for v in VARIANTS)
    added = on - off if on is not None and off is not None else None
    rate_on, rate_off = (median([r["steps_per_s"] for r in raw[v]]) for v in VARIANTS)
    return {
        "core_pct": {v: summarize([r["core_pct"] for r in raw[v]]) for v in VARIANTS},
        "steps_per_s": {v: summarize([r["steps_per_s"] for r in raw[v]]) for v in VARIANTS},
        "added_core_pct": added,
        "within_target": added is not None and added <= TARGET_CORE_PCT,
        "step_rate_ratio": rate_on / rate_off if rate_on and rate_off else None,
    }


def span(s: dict[str, Any], fmt: str = ".2f") -> str:
    if "median" not in s:
        return "failed"
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def markdown(res: dict[str, Any]) -> str:
    s, lat = res["summary"], res["scrape_64"]
    added = "-" if s["added_core_pct"] is None else f"{s['added_core_pct']:+.2f}"
    ratio = "-" if s["step_rate_ratio"] is None else f"{s['step_rate_ratio']:.3f}"
    lines = [
        f"# --metrics-port's cost ({res['when']}, {res['machine']}, load {res['load']}, "
        f"median (min-max) of {res['runs']} runs of {res['window']:g} s)",
        "",
        "Launcher of 4 CPU ranks stepping every 10 ms; with metrics, `/metrics` scraped once a second.",
        "",
        "| variant | launcher CPU, % of one core | steps/s per rank |",
        "|---|---|---|",
        *(f"| {v} | {span(s['core_pct'][v])} | {span(s['steps_per_s'][v], '.1f')} |" for v in VARIANTS),
        "",
        f"Added by the metrics (median on - median off): {added} % of a core (target: at most "
        f"{TARGET_CORE_PCT:g} %; {'met' if s['within_target'] else 'NOT met'}); step rate on/off: {ratio}.",
        "",
        f"Scrape latency, 64 CPU ranks stepping every 100 ms, {SCRAPES} scrapes back to back: median "
        f"{lat['median_ms']:.1f} ms, p95 {lat['p95_ms']:.1f} ms, max {lat['max_ms']:.1f} ms "
        f"({lat['bytes']} bytes a scrape).",
        f"Processes left behind at the end: {len(res['left_after'])}",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per variant (default 3)")
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured per run (default 20)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the results (default: scratch)")
    args = parser.parse_args()
    if args.runs < 1 or args.window <= 0:
        parser.error("--runs must be at least 1 and --window positive")
    out = args.out or Path(tempfile.mkdtemp(prefix="metrics-cost-results-"))
    root = Path(tempfile.mkdtemp(prefix="metrics-cost-"))
    res: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": args.runs,
        "window": args.window,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    raw: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    try:
        for i in range(args.runs):
            for variant in alternate(i, VARIANTS):
                raw[variant].append(one_run(root, variant, args.window))
                print(f"run {i + 1} {variant}: {raw[variant][-1]}", flush=True)
        res["scrape_64"] = scrape_latency(root)
    finally:
        rmtree_quiet(root)
    res["raw"], res["summary"] = raw, summary(raw)
    res["left_after"] = [p.pid for p in psutil.Process().children(recursive=True)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics_cost.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "metrics_cost.md").write_text(markdown(res))
    print(markdown(res))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
