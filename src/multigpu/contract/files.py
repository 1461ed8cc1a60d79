"""How the launcher opens its own files in the run folder: never through a link someone planted there.

Runs in the launcher (the rank logs in ``supervisor/output.py``, ``run.json`` in ``record/run_json.py``)
and in the OTX caller (function mode's payload). The run folder itself is checked first
(``record/folder.py``: this user's, not writable by every user); these opens are the second wall: a
file is created with ``O_EXCL | O_NOFOLLOW``; a link already there (symbolic or hard) is replaced,
never written through, and a file already there (a log of a run before that reused the folder) is
emptied; a temporary name comes from ``mkstemp``. Files follow the user's umask, as every Unix tool's do,
unless a mode is given. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import tempfile
from pathlib import Path

NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def user_name(uid: int) -> str:
    """A uid as the refusals name its user (``uid N`` where it has no name here)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def current_umask() -> int:
    """This process's umask, read without changing it where /proc says it (``os.umask`` sets it)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def create_new(path: Path, mode: int = 0o666) -> int:
    """A descriptor for ``path`` open for writing, never through a link: a new file of this user's
    (``mode`` less the umask), or the file already there, emptied. A link there (symbolic, or a hard
    link to a file elsewhere) is removed and a new file made in its place; anything else already there
    (a device such as /dev/null, a pipe) is opened as it is, as ``open(path, "wb")`` would."""
    try:
        return os.open(path, NEW_FILE, mode)
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink > 1):
            os.unlink(path)
            return os.open(path, NEW_FILE, mode)
    return os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)


def temporary_beside(path: Path) -> tuple[int, Path]:
    """A new temporary file in ``path``'s folder, named by ``mkstemp`` and given the umask's mode (as
    the file it will replace would have), for a write-then-rename."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
    except OSError:
        os.close(fd)
        os.unlink(name)
        raise
    return fd, Path(name)


def open_existing(path: Path, flags: int) -> int:
    """``path``, which must be a file already there and not a link, opened with ``flags``."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


def write_private(path: Path, data: bytes) -> None:
    """``data`` in a new file only this user can read (0600), in a folder made 0700: a payload is code
    the ranks run (each checks the mode before loading it: ``rank/bootstrap.open_payload``), a launch
    request holds the caller's environment. One left by an earlier run is removed, never reused."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with os.fdopen(create_new(path, 0o600), "wb") as f:
        f.write(data)
