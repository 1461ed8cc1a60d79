"""Where ``multigpu.launch`` and ``multigpu.spawn`` keep a run's record when no ``output=`` is given.

Runs in the caller, before each launch. A launch is a run (``run.json``, the ranks' logs), but a loop
of launches (an HPO search of 1,000 trials, a test suite) must not leave one ``./multigpu_runs/<id>``
per call in the working folder, as ``multigpu run`` does for a run a user started by hand. So a
function launch keeps its record under the user's cache folder, ``$XDG_CACHE_HOME/multigpu/runs/<id>``
(``~/.cache/multigpu/runs/<id>``), created private (0700), and only the last ``KEEP_RUNS`` of them:
before each launch the oldest whole run folders beyond that are removed. Never one a live run holds
(its lock, ``record/folder.claim_output``, is held by its launcher), never an entry that is not this
user's own real folder (a link is not followed, another user's entry is left alone).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

KEEP_RUNS = 50
"""How many function launches' records the cache folder keeps (the newest)."""


def runs_root(env: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/multigpu/runs``, or ``~/.cache/multigpu/runs`` (a relative ``XDG_CACHE_HOME``
    is ignored, as the XDG base directory specification says)."""
    cache = env.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        home = env.get("HOME") or pwd.getpwuid(os.getuid()).pw_dir
        cache = os.path.join(home, ".cache")
    return Path(cache) / "multigpu" / "runs"


def default_output(run_id: str, env: Mapping[str, str], keep: int | None = None) -> Path:
    """The folder of a launch given no ``output``: under ``runs_root``, made room for first, so that
    with it the history holds at most ``keep`` runs. A cache folder that cannot be made is left to
    the launcher's claim of the run folder, which says so in one line."""
    root = runs_root(env)
    with contextlib.suppress(OSError):
        root.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        for folder in (root.parent, root):
            folder.mkdir(mode=0o700, exist_ok=True)
        prune(root, max(0, (KEEP_RUNS if keep is None else keep) - 1))
    return root / run_id


def prune(root: Path, keep: int) -> list[str]:
    """Remove the run folders under ``root`` older than its newest ``keep`` (by last change), each
    whole, except those a live run holds; the names removed. Only this user's real folders count."""
    runs: list[tuple[float, str]] = []
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                    runs.append((st.st_mtime, entry.name))
    removed = []
    for _, name in sorted(runs, reverse=True)[keep:]:
        if _remove_unless_held(root / name):
            removed.append(name)
    return removed


def _remove_unless_held(folder: Path) -> bool:
    """Remove ``folder`` unless a launcher holds one of its locks; the locks taken meanwhile, so that
    no run can claim it while it goes (a run that locks a removed lock file locks anew)."""
    held: list[int] = []
    try:
        for lock in folder.glob(".multigpu*.lock"):
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            held.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live run's
        shutil.rmtree(folder, ignore_errors=True)
        return True
    except OSError:
        return False
    finally:
        for fd in held:
            os.close(fd)
