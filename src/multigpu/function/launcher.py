"""The launcher of ``multigpu.launch``: ``python -m multigpu.function.launcher CALLER_PID REPLY_FD TEMP``.

Runs in its own process, started by the caller (``function/launcher_handle.py``), never in the caller: a
notebook kernel that has initialised CUDA or runs threads must not fork, and the launcher's signal
handling, subreaping and exit would not belong in a user's process. Each launch is ``multigpu run``'s
launcher (``runner.attempts.launch``) given a ``RunConfig`` in function mode: every rank is forked from
the node's template, and fail-fast, the root cause, hang detection and ``run.json`` all apply.

It serves one launch after another: each request (a line on stdin naming a pickled request: the config,
the caller's current environment and working directory) is run, and its exit code written to
``REPLY_FD``. The template that forked a launch's ranks stays warm for the next launch
(``template.process.keep_warm``): each launch hands it the caller's current environment, working
directory and ``sys.path`` with each rank it asks for, so a launch right after another never waits
for an ``import torch``. Only a template that cannot serve the next launch is replaced: one started
with another environment (torch reads some variables at import) or other ``preload`` modules, one
that died or failed; a new one is started right after such a launch (``start_early``).

Its fate is tied to the caller's process (``guard_parent``): when the caller dies, however it dies,
this process, its template (parent-death signal) and every rank go, and its keeper
(``launch_folder.keep_tidy_after``) removes the caller's launch folders in ``TEMP``. It ends when stdin closes
(``multigpu.shutdown()``, the caller's exit) or after a Ctrl-C, which it passes to the ranks and then
dies of, as ``multigpu run`` does.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys

from multigpu.contract.errors import Interrupted
from multigpu.contract.exitcodes import EXIT_USAGE


def serve(reply_fd: int) -> None:
    from multigpu.template.process import start_early

    while line := sys.stdin.buffer.readline():
        code = serve_one(line.strip())
        start_early(["run"])  # warm for the next launch, unless the last one's template was kept
        os.write(reply_fd, f"{code}\n".encode())


def serve_one(request_path: bytes) -> int:
    """One launch's exit code. Whatever fails before or in it (an unreadable request, the caller's
    working directory gone, a usage error, an unusable folder) is one line, and the next launch is
    served: a traceback here would be copied into the caller's notebook cell."""
    from multigpu.runner.attempts import launch

    try:
        with open(request_path, "rb") as f:
            request = pickle.load(f)
        os.environ.clear()
        os.environ.update(request["env"])  # the caller's, now: the next template starts with it too
        os.chdir(request["cwd"])
        return launch(request["config"], os.environ)
    except Exception as exc:
        print(f"multigpu: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE


def interrupted(exc: KeyboardInterrupt) -> None:
    """A Ctrl-C that reached here, not the launch's own handling (one before its signal handlers were
    installed, or between launches): one line, the template ended, then this process dies of SIGINT,
    as ``multigpu run`` does (``cli/main.interrupted``); the caller raises ``KeyboardInterrupt``."""
    from multigpu.supervisor.stop_requests import end_with_signal
    from multigpu.template.process import close_early

    text = str(exc) if isinstance(exc, Interrupted) and str(exc) else "interrupted (SIGINT)"
    print(f"multigpu: {text}", file=sys.stderr, flush=True)
    close_early()
    end_with_signal(signal.SIGINT)


def main(argv: list[str]) -> int:
    from multigpu.template.process import close_early, keep_warm, start_early

    start_early(["run"])  # first: the template's import of torch overlaps everything below
    keep_warm()
    caller, reply_fd, *temp = argv
    from multigpu.function.launch_folder import keep_tidy_after
    from multigpu.rank.guard import guard_parent

    if temp:  # before the guard makes this process a subreaper: the keeper must not be in its tree
        keep_tidy_after(int(caller), temp[0])
    guard_parent(int(caller))
    try:
        serve(int(reply_fd))
    except KeyboardInterrupt as exc:
        interrupted(exc)
    finally:
        close_early()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
