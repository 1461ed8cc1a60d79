"""The launcher's open-file limit, raised once for every process it starts.

Runs in the launcher: before it starts the node's template (``template/process.py``, which may come
before the command line is even parsed) and again when it checks the limit against the ranks it will
start (``record/folder.py``). The template and every rank it forks inherit the raised limit, as ranks
started fresh do; a template left at a low soft limit could not take the descriptor numbers the
launcher hands a rank (64 ranks under ``ulimit -Sn 128``). Standard library only.
"""

from __future__ import annotations

import contextlib
import resource


def lift_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (where it can); the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return soft
