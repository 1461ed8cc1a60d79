"""A launch's private folder in the caller's temporary folder, and its removal when its caller died.

``private_folder`` runs in the caller: ``mkdtemp`` (0700, this user's alone) holding the payload, the
request (the caller's whole environment) and the ranks' values, removed when the launch ends. A
caller killed mid-launch (SIGKILL, or SIGTERM with no handler) removes nothing, and no hook of its
own can. So the folder holds a lock, ``CALLER_LOCK``, that the caller keeps for the launch's life:
the kernel releases it the moment the caller dies, however it dies, and a folder whose lock is free
is a dead caller's. Two things then remove it: the launcher's keeper (``keep_tidy_after``), a small
process that waits for the caller's death and sweeps at once, and, should that not run (the machine
lost power, the keeper was killed too), the next launch's ``sweep`` of this user's folders.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import stat
import tempfile
from pathlib import Path

PREFIX = "multigpu-launch-"
CALLER_LOCK = ".caller.lock"
"""Locked (``flock``) by the caller while its launch runs: free once the caller is gone."""


class PrivateFolder:
    """One launch's folder and the caller's lock on it; ``remove`` takes both away."""

    def __init__(self) -> None:
        sweep(Path(tempfile.gettempdir()))
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX))
        self._lock: int | None = None
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(self.path / CALLER_LOCK, flags, 0o600)
            self._lock = fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"caller pid {os.getpid()}\n".encode())  # once held: a sweep skips it empty
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """The folder goes, then the lock (a sweep never sees it free while the folder is there)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock)
            self._lock = None


def sweep(temp: Path) -> list[Path]:
    """Remove the launch folders in ``temp`` whose caller died; the folders removed. Only this user's
    own real folders are looked at (never a link, never another user's), and only one with a free
    caller lock goes: a live caller's is held, and a folder still being made has none yet (or an
    empty one, written once its caller holds it)."""
    removed: list[Path] = []
    with contextlib.suppress(OSError), os.scandir(temp) as entries:
        for entry in entries:
            if entry.name.startswith(PREFIX) and _own_folder(entry) and _remove_if_orphaned(Path(entry.path)):
                removed.append(Path(entry.path))
    return removed


def _own_folder(entry: os.DirEntry[str]) -> bool:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _remove_if_orphaned(folder: Path) -> bool:
    try:
        fd = os.open(folder / CALLER_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not os.pread(fd, 64, 0):
            return False  # a caller between creating its lock and taking it: not a dead one's
    except OSError:
        return False  # its caller lives
    else:
        shutil.rmtree(folder, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def keep_tidy_after(caller: int, temp: str) -> None:
    """Start the keeper of ``caller``'s launch folders in ``temp``: a process of its own (forked twice,
    in a session of its own, so that the launcher's end of its group does not take it along when the
    caller dies) that sweeps ``temp`` once the caller has died, and leaves quietly when the launcher
    ends first. Called by the launcher before anything else forks or holds a thread."""
    try:
        caller_fd, launcher_fd = os.pidfd_open(caller), os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return  # no pidfd here: the next launch's sweep removes them
    try:
        middle = os.fork()
    except OSError:
        middle = -1
    if middle:
        os.close(caller_fd)
        os.close(launcher_fd)
        if middle > 0:
            os.waitpid(middle, 0)
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        _keep(caller_fd, launcher_fd, Path(temp))
    finally:
        os._exit(0)


def _keep(caller_fd: int, launcher_fd: int, temp: Path) -> None:
    """The keeper: nothing held but the two pidfds; wait, and sweep if the caller is the one gone."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    keep = {caller_fd, launcher_fd}
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    select.select([caller_fd, launcher_fd], [], [])
    caller_gone, _, _ = select.select([caller_fd], [], [], 0)  # the launcher dies of its caller's death
    if caller_gone:
        sweep(temp)
