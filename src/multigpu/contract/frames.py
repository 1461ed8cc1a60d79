"""Which frames of a stack or traceback are multigpu's own: one rule, by module.

A frame is ours when the module it runs in is part of the ``multigpu`` package. The rank's bootstrap
drops our leading frames (and the standard library's that start the user's code) from a traceback,
the crash-loop policy looks for the innermost frame that is neither ours nor a library's, and
function mode does not interrupt our own code (``otx/interrupt_caller.py``, which names the shipped
applications it may interrupt). Text tracebacks carry file names only: ``module_of_file`` maps them
to modules. Standard library only.
"""

from __future__ import annotations

import functools
import os
import re
from types import FrameType

PACKAGE = "multigpu"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTERS = frozenset({"runpy", "multiprocessing.spawn"})
"""Standard-library modules that start the user's code for the bootstrap (script, module, function)."""


def own_module(name: str | None) -> bool:
    return bool(name) and (name == PACKAGE or str(name).startswith(PACKAGE + "."))


def module_of(frame: FrameType) -> str | None:
    name = frame.f_globals.get("__name__")
    return name if isinstance(name, str) else None


def own_frame(frame: FrameType) -> bool:
    return own_module(module_of(frame))


def starter_frame(frame: FrameType) -> bool:
    """A frame of ours or of the standard library's code that runs the user's target."""
    return own_frame(frame) or module_of(frame) in STARTERS


def module_of_file(filename: str) -> str | None:
    """The ``multigpu`` module a traceback's file name belongs to, or None."""
    path = os.path.abspath(filename)
    if not path.startswith(PACKAGE_DIR + os.sep):
        return None
    relative = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))
    parts = os.path.splitext(relative)[0].split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def own_file(filename: str) -> bool:
    return own_module(module_of_file(filename))


def library_file(filename: str) -> bool:
    """Not the user's: ours, the standard library's or an installed package's (traceback text)."""
    if filename.startswith("<") or "site-packages" in filename or "dist-packages" in filename:
        return True
    return own_file(filename) or os.path.abspath(filename).startswith(_library_roots())


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """The standard library's and the installed packages' folders (asked once, when first needed)."""
    import sysconfig

    paths = sysconfig.get_paths()
    roots = {paths.get(name, "") for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(sorted(r for r in roots if r))


_FILE_LINE = re.compile(r'^(?P<indent>\s*)File "(?P<file>[^"]+)", line \d+')


def fold_own_frames(text: str) -> str:
    """``text`` (a traceback, or faulthandler's stack dump) with each run of our own frames folded into
    one line, ``  ... 3 multigpu frames ...``: a report shows the user's code, not our machinery.

    Runs in the launcher, on the report. A frame is its ``File "...", line N`` line and the more
    indented lines under it (the source line, the ``^^^`` markers)."""
    out: list[str] = []
    run: list[str] = []  # the indent of each own frame in the current run

    def flush() -> None:
        if run:
            out.append(f"{run[0]}... {len(run)} multigpu frame{'s' if len(run) > 1 else ''} ...")
            run.clear()

    inside_own: str | None = None  # the indent of the own frame whose lines are being skipped
    for line in text.splitlines():
        match = _FILE_LINE.match(line)
        if match is None and inside_own is not None and line.startswith(inside_own + " "):
            continue
        inside_own = None
        if match is not None and own_file(match.group("file")):
            run.append(match.group("indent"))
            inside_own = match.group("indent")
            continue
        flush()
        out.append(line)
    flush()
    return "\n".join(out)


_THREAD = re.compile(r"^\s*(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):")


def fold_own_threads(dump: str) -> str:
    """faulthandler's stack dump without the threads that are multigpu's own (the rank's dump and
    parent-watch threads: nothing but our frames and ``threading``'s), counted in one last line.

    Runs in the launcher, on the report: a hang report shows where the user's threads are. The
    rank's log keeps the whole dump."""
    blocks: list[list[str]] = [[]]
    for line in dump.splitlines():
        if _THREAD.match(line):
            blocks.append([])
        blocks[-1].append(line)
    kept = [block for block in blocks if not _own_thread(block)]
    dropped = len(blocks) - len(kept)
    lines = [line for block in kept for line in block]
    if dropped:
        while lines and not lines[-1].strip():
            lines.pop()
        lines.append(f"... {dropped} multigpu thread{'s' if dropped > 1 else ''} ...")
    return "\n".join(lines)


def _own_thread(block: list[str]) -> bool:
    files = [m.group("file") for line in block if (m := _FILE_LINE.match(line))]
    return (
        bool(block)
        and _THREAD.match(block[0]) is not None
        and any(own_file(f) for f in files)
        and all(own_file(f) or os.path.basename(f) == "threading.py" for f in files)
    )
