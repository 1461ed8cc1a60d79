"""The end-of-run report: the root cause first (the first failure in time), then one line for every
other rank. Runs in the launcher, after the summary table. Tracebacks and stack dumps show the user's
frames; runs of multigpu's own are folded into one line (``contract/frames.fold_own_frames``), and a
stack dump leaves out multigpu's own threads (``fold_own_threads``)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterable

from multigpu.contract.failure import Subject, WorkerFailure
from multigpu.contract.frames import fold_own_frames, fold_own_threads, library_file, own_file
from multigpu.contract.signals import signal_name
from multigpu.supervisor.states import RunResult, RunStatus, Worker, WorkerState


def _indent(text: str, by: str = "    ") -> str:
    return "\n".join(by + line for line in text.rstrip().splitlines())


def format_failure(failure: WorkerFailure, *, tail_lines: int = 10) -> str:
    parts = [failure.describe()]
    if failure.traceback:
        parts.append(_indent(fold_own_frames(failure.traceback)))
    tail = failure.log_tail
    if failure.traceback:  # the traceback is printed above: show what the rank said before it
        starts = [i for i, line in enumerate(tail) if "Traceback (most recent call last)" in line]
        tail = tail[: starts[-1]] if starts else tail
    if tail:
        where = f" ({failure.log_path})" if failure.log_path else ""
        parts.append(f"  last lines of its log{where}:")
        parts.append(_indent("\n".join(tail[-tail_lines:])))
    return "\n".join(parts)


def format_report(result: RunResult, workers: list[Worker], *, attempt: int = 0) -> str:
    """A multi-line report for a run that did not succeed."""
    if result.status is RunStatus.INTERRUPTED:
        head = f"attempt {attempt} interrupted by {signal_name(result.signal or 0)}"
    elif result.status is RunStatus.HUNG:
        culprit = result.root_cause.message if result.root_cause and result.root_cause.message else None
        head = f"attempt {attempt} hung: {culprit}" if culprit else f"attempt {attempt} hung"
        head += "\nstack dumps of every rank follow, the rank that stopped first first"
    else:
        head = f"attempt {attempt} failed"
    lines = [head]
    root = result.root_cause
    if root is not None and result.status is not RunStatus.HUNG:
        lines.append("root cause: " + format_failure(root))
    elif root is not None:
        for failure in first_per_rank([f for f in result.failures if f.subject is Subject.RANK]):
            lines.append(f"rank {failure.rank} (pid {failure.pid}) stacks:")
            dump = fold_own_threads(failure.traceback) if failure.traceback else "(no stack dump arrived)"
            lines.append(_indent(fold_own_frames(dump)))
    failed = {f.rank for f in result.failures}
    ctrl_c = result.status is RunStatus.INTERRUPTED and result.signal == signal.SIGINT
    lines += [
        line
        for w in workers
        if w.rank not in failed and (line := (ctrl_c and interrupted_line(w)) or other_rank_line(w))
    ]
    return "\n".join(lines)


def first_per_rank(failures: list[WorkerFailure]) -> list[WorkerFailure]:
    """Each rank once, at its first place: a rank that also died while its stacks were read has one
    dump on the console, not two (the job's hang notice, no rank, has none)."""
    first: dict[int, WorkerFailure] = {}
    for f in failures:
        first.setdefault(f.rank, f)
    return list(first.values())


def interrupted_line(w: Worker) -> str | None:
    """``rank 1 interrupted in train.py:42 (model = DDP(model))``: where the user's Ctrl-C found a
    rank, from its ``KeyboardInterrupt`` traceback (its error file, else its last lines), which went
    to its log only (``folding.InterruptTracebacks``); None when it left no such traceback."""
    record = w.own_record() if w.state is WorkerState.STOPPED else None
    text = record.traceback if record is not None and record.error_type == "KeyboardInterrupt" else None
    text = text or last_interrupt_traceback(w.lines.tail)
    if text is None:
        return None
    where = innermost_user_frame(text)
    if where:
        return f"rank {w.rank} interrupted in {where}"
    function = running_in(text)
    if function:
        return f"rank {w.rank} interrupted while running, in {function}"
    return f"rank {w.rank} interrupted while starting, before its script ran"


_FRAME_IN = re.compile(r'^\s*File "([^"]+)", line \d+, in (.+)$', re.M)


def running_in(traceback: str) -> str | None:
    """The function of the innermost frame past our start-up, when the rank had reached code that is
    not ours though in no file of the user's: a function sent by ``multigpu.launch`` from a notebook
    cell (``<dynamic-code>``), ``exec``'d code, an installed package's. None while only our code and
    the standard library's (``runpy``, the import system) had run: the rank was starting."""
    found = None
    for filename, function in _FRAME_IN.findall(traceback):
        if not own_file(filename) and not filename.startswith("<frozen") and not _standard(filename):
            found = function.strip()
    return found


def _standard(filename: str) -> bool:
    """The standard library's own files (not an installed package's, which may lie below it)."""
    import sysconfig

    path = os.path.abspath(filename)
    roots = {sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib")}
    return "-packages" not in path and path.startswith(tuple(roots))


def last_interrupt_traceback(lines: Iterable[str]) -> str | None:
    """The last traceback in ``lines`` when it ends in ``KeyboardInterrupt``."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in lines]  # torch's excepthook's prefix
    heads = [i for i, line in enumerate(lines) if line.rstrip() == "Traceback (most recent call last):"]
    if not heads:
        return None
    block = lines[heads[-1] :]
    ends = [line for line in block[1:] if line[:1] not in ("", " ", "\t")]
    return "\n".join(block) if ends and ends[0].startswith("KeyboardInterrupt") else None


_FRAME = re.compile(r'^(\s*)File "([^"]+)", line (\d+)')


def innermost_user_frame(traceback: str) -> str | None:
    """``file:line (source)`` of the innermost frame of the user's own code in a traceback's text
    (neither ours, nor the standard library's, nor an installed package's), or None."""
    lines = traceback.splitlines()
    found = None
    for i, line in enumerate(lines):
        match = _FRAME.match(line)
        if match is None or library_file(match.group(2)):
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        source = nxt.strip() if nxt.startswith(match.group(1) + " ") and not _FRAME.match(nxt) else ""
        found = f"{_display_path(match.group(2))}:{match.group(3)}"
        if source and source.strip("^~ "):
            found += f" ({source})"
    return found


def _display_path(path: str) -> str:
    """A file as the user would name it: relative to here when it lies below, else as written."""
    relative = os.path.relpath(path) if os.path.isabs(path) else path
    return path if relative.startswith("..") else relative


def other_rank_line(w: Worker) -> str | None:
    """What happened to a rank that is not the root cause, in one line (None: it succeeded)."""
    if w.state is WorkerState.FAILED and w.ending.failure is not None:
        return f"also failed: {w.ending.failure.describe()}"
    if w.ending.unkillable or w.state is WorkerState.STOPPED:
        return f"rank {w.rank} (pid {w.pid}): {rank_reason(w)}"
    return None


def rank_reason(w: Worker) -> str:
    """Why a rank ended, in words: written here once, read by the report and by run.json."""
    how, failure = w.exit_text, w.ending.failure
    if w.ending.unkillable:
        return "did not end after SIGKILL (uninterruptible sleep, e.g. a driver call); it was left running"
    if w.state is WorkerState.STOPPED and failure is not None:
        why = "a peer's connection closed" if failure.saw_a_peer_die else failure.error_type
        return f"stopped after the root cause ({how}, {why}; see its log)"
    if w.state is WorkerState.STOPPED:
        return f"stopped by the launcher ({how})"
    if failure is not None:
        return failure.describe().split(") ", 1)[-1]  # "exited with code 1: ValueError: ..."
    return f"{w.state.value} ({how})" if w.returncode is not None else w.state.value


def plain_summary(workers: list[Worker]) -> str:
    rows = []
    for w in workers:
        end = w.exit_text
        took = (w.end_time or time.time()) - (w.start_time or time.time())
        rows.append(
            f"  rank {w.rank:<3} pid {w.pid!s:<8} {w.spec.device:<8} {w.state.value:<10} "
            f"{end:<10} {took:6.1f}s"
        )
    return "\n".join(["multigpu: summary", *rows])
