"""12. The README's "Why switch" rows that no other section measures, beside torchrun.

- **traceback**: rank 1 raises after the group is up; does the launcher's failure summary (torchrun's
  "Root Cause" block; our ``root cause:``) show the exception, without ``@record`` in the script?
- **hang**: rank 1 sleeps while rank 0 waits in an all_reduce; multigpu runs with ``--hang-timeout
  HANG_S``, torchrun has no such option. Seconds until the launcher exited (bounded at BOUND_S), and
  whether the ranks' Python stacks reached the console or the logs.
- **whole lines**: 2 ranks print LINES lines of WIDTH characters each at once into a pipe (``| tee``,
  ``| head``, a CI log); how many lines arrived whole (torchrun's workers write to the pipe directly,
  and a line longer than the pipe's atomic write can be cut by the other rank's).

The other rows (``kill -9``, a rank dying, a usage mistake, start-up, restart) are measured by the
sigkill, death, badinput, launch and start/restart sections.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

from common import (
    LAUNCHERS,
    MULTIGPU,
    REGISTRY,
    TORCHRUN,
    Ctx,
    alternate,
    launcher_argv,
    new_bench_dir,
    start,
    summarize,
    worker_env,
)
from report import cell, table, target

NAME = "claims"
TITLE = "12. Why switch: the traceback in the summary, a hang, whole lines"
HANG_S, BOUND_S = 5.0, 30.0
LINES, WIDTH = 2000, 6000
PER_RUN_S = 2 * 4.0 + (HANG_S + 4.0) + BOUND_S + 2 * 5.0


def estimate(ctx: Ctx) -> float:
    return PER_RUN_S * ctx.runs


def summary_part(launcher: str, text: str) -> str:
    marker = "root cause:" if launcher == MULTIGPU else "Root Cause"
    return text[text.find(marker) :] if marker in text else ""


def traceback_case(ctx: Ctx, launcher: str) -> dict[str, Any]:
    bench_dir = new_bench_dir(ctx.root, f"{NAME}-tb-{launcher}")
    job = start(launcher_argv(launcher, 2, "die.py", ["raise"], output=bench_dir / "mg"), bench_dir)
    try:
        code = job.wait(120)
        shown = "RuntimeError: benchmark: this rank dies by raising" in summary_part(launcher, job.output())
        return {"exit_code": code, "exception_in_summary": shown}
    finally:
        job.finish()


def hang_case(ctx: Ctx, launcher: str) -> dict[str, Any]:
    bench_dir = new_bench_dir(ctx.root, f"{NAME}-hang-{launcher}")
    extra = ["--hang-timeout", f"{HANG_S:g}"] if launcher == MULTIGPU else []
    job = start(launcher_argv(launcher, 2, "hang.py", output=bench_dir / "mg", extra=extra), bench_dir)
    try:
        code = job.wait(BOUND_S)
        logs = "".join(p.read_text(errors="replace") for p in (bench_dir / "mg").rglob("*.log"))
        stacks = bool(STACK_FRAME.search(job.output() + logs))
        return {
            "seconds": None if job.exited is None else job.exited - job.started,
            "exit_code": code,
            "stacks": stacks,
        }
    finally:
        job.finish()


STACK_FRAME = re.compile(r'File "[^"]*hang\.py", line \d+')
"""A frame of the stuck script, as a traceback or faulthandler's dump writes it."""
WHOLE = re.compile(r"R\d:\d{6}:x+")
PREFIX = re.compile(r"^\[rank \d\] ")


def lines_case(ctx: Ctx, launcher: str) -> dict[str, Any]:
    bench_dir = new_bench_dir(ctx.root, f"{NAME}-lines-{launcher}")
    argv = launcher_argv(
        launcher,
        2,
        "long_lines.py",
        [str(LINES), str(WIDTH)],
        output=bench_dir / "mg",
        extra=["--status", "off"] if launcher == MULTIGPU else [],
    )
    popen = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=worker_env(bench_dir),
        cwd=bench_dir,
        start_new_session=True,
    )
    REGISTRY.track(popen, bench_dir)  # type: ignore[arg-type]
    try:
        out, _ = popen.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        popen.kill()
        out, _ = popen.communicate()
    text = out.decode(errors="replace")
    bodies = (PREFIX.sub("", line) for line in text.splitlines())
    whole = sum(1 for body in bodies if len(body) == WIDTH and WHOLE.fullmatch(body))
    return {"whole": whole, "expected": 2 * LINES, "exit_code": popen.returncode}


def run(ctx: Ctx) -> dict[str, Any]:
    cases = {"traceback": traceback_case, "hang": hang_case, "lines": lines_case}
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {c: {k: [] for k in LAUNCHERS} for c in cases}
    for i in range(ctx.runs):
        for case, fn in cases.items():
            for launcher in alternate(i):
                raw[case][launcher].append(fn(ctx, launcher))
    hang = {k: summarize([r["seconds"] for r in v]) for k, v in raw["hang"].items()}
    return {
        "raw": raw,
        "hang_s": HANG_S,
        "bound_s": BOUND_S,
        "lines": LINES,
        "width": WIDTH,
        "summary": {"hang": hang},
    }


def _count(runs: list[dict[str, Any]], key: str) -> str:
    return f"{sum(1 for r in runs if r.get(key))} of {len(runs)}"


def markdown(res: dict[str, Any]) -> list[str]:
    raw = res["raw"]
    rows = [
        [
            "a rank raises: the exception in the launcher's failure summary (runs)",
            *(_count(raw["traceback"][k], "exception_in_summary") for k in LAUNCHERS),
        ],
        [
            f"rank 1 stuck, rank 0 in all_reduce: launcher exited (--hang-timeout {res['hang_s']:g})",
            *(
                cell([r["seconds"] for r in raw["hang"][k]], "s", never=f"never (>{res['bound_s']:g} s)")
                for k in LAUNCHERS
            ),
        ],
        [
            "the same hang: the ranks' Python stacks shown or logged (runs)",
            *(_count(raw["hang"][k], "stacks") for k in LAUNCHERS),
        ],
        [
            f"2 ranks x {res['lines']} lines of {res['width']} characters into a pipe: whole lines",
            *(" / ".join(f"{r['whole']} of {r['expected']}" for r in raw["lines"][k]) for k in LAUNCHERS),
        ],
    ]
    return table(["claim", *LAUNCHERS], rows)


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    raw = res["raw"]
    ours = {case: raw[case][MULTIGPU] for case in raw}
    met = (
        all(r["exception_in_summary"] for r in ours["traceback"])
        and all(r["seconds"] is not None and r["stacks"] for r in ours["hang"])
        and all(r["whole"] == r["expected"] for r in ours["lines"])
    )
    theirs = raw["lines"][TORCHRUN]
    return [
        target(
            "why-switch claims",
            "traceback in every summary, every hang stopped with stacks, every line whole",
            met,
            f"torchrun whole lines: {', '.join(str(r['whole']) for r in theirs)}",
        )
    ]
