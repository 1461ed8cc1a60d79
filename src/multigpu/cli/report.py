"""``multigpu report [RUN_DIR]``: where a run's time went, from its ``run.json``. Runs in the shell of
whoever asks (no launcher needed; the run may be over or still going).

It prints the run's incidents (``record/incidents.py``) as a table, one line per attempt that did not
succeed, with how long each phase took (failure to detection, detection to every rank stopped, to the
next attempt's ranks starting, to its first step), and writes ``report.html`` beside ``run.json``: one
static file, no script and nothing fetched from a network, with a per-rank timeline of every attempt
(its ranks' lives, coloured by how they ended, and each incident's moments).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from multigpu.contract.errors import MultiGPUError, UsageError
from multigpu.record.report_page import find_run, page, table
from multigpu.record.run_json import LOST, read_fate


def cmd_report(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="multigpu report",
        description=(
            "Where a run's time went: its incidents as a table, and report.html beside its run.json."
        ),
    )
    parser.add_argument(
        "run_dir", nargs="?", help="a run's output folder (default: the newest under ./multigpu_runs)"
    )
    folder = find_run(parser.parse_args(argv).run_dir)
    data = json.loads((folder / "run.json").read_text())
    fate = read_fate(folder / "run.json", data)
    print("\n".join(table(data)))
    if fate is not None and fate.state != "alive":
        print(fate.line)
    elif data["status"] == LOST:
        launcher = data["launcher"]
        print(
            f"{LOST}: pid {launcher['pid']} on {launcher['host']} was found gone at "
            f"{launcher.get('lost_found_time_utc', '?')}; the record keeps what it last wrote"
        )
    out = folder / "report.html"
    out.write_text(page(data))
    print(f"timeline: {out}")
    return 0


def cmd_ask(request: str, argv: Sequence[str]) -> int:
    """``multigpu stacks`` / ``multigpu status``: ask a running launcher, from any shell of its user."""
    import argparse

    from multigpu.supervisor.control import ask

    what = {
        "stacks": "every live rank's Python stacks, now, without stopping the job",
        "status": "one line per rank of a running job: its state, step and last progress",
    }[request]
    parser = argparse.ArgumentParser(prog=f"multigpu {request}", description=f"Print {what}.")
    parser.add_argument(
        "run_dir", nargs="?", help="a run's output folder (default: the newest under ./multigpu_runs)"
    )
    folder = find_run(parser.parse_args(argv).run_dir)
    data = json.loads((folder / "run.json").read_text())
    fate = read_fate(folder / "run.json", data)
    if fate is not None and fate.state != "alive":
        raise MultiGPUError(
            f"run {data['run_id']}: {fate.line}; multigpu report {folder} says what it last recorded"
        )
    name = data.get("control_socket")
    if data.get("end_time") is not None or not name:
        raise UsageError(
            f"run {data['run_id']} is not running ({data['status']}); multigpu report "
            f"{folder} says what happened"
        )
    try:
        text = ask(name, request, owner=(folder / "run.json").stat().st_uid)
    except PermissionError as exc:
        raise MultiGPUError(f"run {data['run_id']}: {exc}") from None
    except OSError as exc:
        raise UsageError(
            f"run {data['run_id']}'s launcher did not answer ({exc.strerror or exc}); "
            "is it still running on this machine?"
        ) from None
    if text.startswith("refused: "):
        print(text.strip().splitlines()[0], file=sys.stderr)
        return 1
    print(text, end="")
    return 0
