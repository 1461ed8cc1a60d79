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
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from multigpu.cli.run_parser import Parser
from multigpu.contract.errors import MultiGPUError, UsageError
from multigpu.function.run_history import runs_root
from multigpu.record.report_page import find_run, page, table
from multigpu.record.run_json import LOST, read_fate

READ_KEYS = ("run_id", "status", "attempts")
"""What every command here reads of a record; one without them is refused in one line."""


def read_runs(prog: str, description: str, argv: Sequence[str]) -> list[tuple[Path, dict[str, Any]]]:
    """The records the command line names (``run_dir``, or the newest run here), read: a usage
    mistake or a record that cannot be read is one line, never a traceback."""
    parser = Parser(prog=prog, description=description)
    parser.add_argument(
        "run_dir",
        nargs="?",
        help="a run's output folder (default: the newest under ./multigpu_runs, or among multigpu.launch's "
        "runs in ~/.cache/multigpu/runs)",
    )
    runs = []
    roots = (Path("multigpu_runs"), runs_root(os.environ))
    for path in find_run(parser.parse_args(argv).run_dir, roots):
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise MultiGPUError(f"cannot read {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise MultiGPUError(f"{path} is not a run record multigpu can read ({exc})") from None
        missing = [key for key in READ_KEYS if not isinstance(data, dict) or key not in data]
        if missing:
            raise MultiGPUError(f"{path} is not a run record multigpu can read (no {', '.join(missing)})")
        runs.append((path, data))
    return runs


def cmd_report(argv: Sequence[str]) -> int:
    runs = read_runs(
        "multigpu report",
        "Where a run's time went: its incidents as a table, and report.html beside its run.json.",
        argv,
    )
    code = 0
    for path, data in runs:
        if len(runs) > 1:
            print(f"{path.name}:")
        print("\n".join(table(data)))
        _print_fate(path, data)
        out = path.parent / ("report.html" if len(runs) == 1 else path.with_suffix(".html").name)
        try:
            out.write_text(page(data))
        except OSError as exc:
            print(f"multigpu: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
            code = 1
            continue
        print(f"timeline: {out}")
    return code


def _print_fate(path: Path, data: dict[str, Any]) -> None:
    fate = read_fate(path, data)
    if fate is not None and fate.state != "alive":
        print(fate.line)
    elif data["status"] == LOST:
        launcher = data["launcher"]
        print(
            f"{LOST}: pid {launcher['pid']} on {launcher['host']} was found gone at "
            f"{launcher.get('lost_found_time_utc', '?')}; the record keeps what it last wrote"
        )


def cmd_ask(request: str, argv: Sequence[str]) -> int:
    """``multigpu stacks`` / ``multigpu status``: ask a running launcher, from any shell of its user
    (each node's launcher whose record is in the folder, for a job over several nodes)."""
    what = {
        "stacks": "every live rank's Python stacks, now, without stopping the job",
        "status": "one line per rank of a running job: its state, step and last progress",
    }[request]
    runs = read_runs(f"multigpu {request}", f"Print {what}.", argv)
    code = 0
    for path, data in runs:
        if len(runs) > 1:
            print(f"{path.name}:")
        code = max(code, _ask_one(request, path, data))
    return code


def _ask_one(request: str, path: Path, data: dict[str, Any]) -> int:
    from multigpu.supervisor.control import ask

    folder = path.parent
    fate = read_fate(path, data)
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
        text = ask(name, request, owner=path.stat().st_uid)
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
