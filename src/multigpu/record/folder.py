"""The run's output folder: a run id that is a name, a folder this run can write, and owns alone.

Everything here runs before the first worker starts, so a problem is one line and exit 2 (a
``UsageError``), never a traceback and never a half-started run.

* A run id names a folder under the output root: it must be a single path component, whether the
  user gave it, the environment did (SLURM) or another node's launcher did (adopted at rendezvous).
* Two live runs never write into the same folder: the first takes an exclusive lock on
  ``<folder>/.multigpu.lock`` (``.multigpu-node<N>.lock`` on a multi-node run, whose nodes share
  the folder; ``.multigpu-<host>-<pid>.lock`` for an elastic launcher) for its whole life; a second
  one refuses, naming the first. The run removes the file as it ends (still holding it; a run that
  locked the removed file sees that and locks anew). A folder reused by a later run is that run's:
  its logs and records are replaced.
* Nobody else can redirect what the run writes: the output folder must be this user's, and the folder
  it was created into (and every folder created on the way) this user's or root's; none of them may be
  writable by every user without the sticky bit (group-writable project folders are fine). Otherwise
  another local user could plant a link where a log or record will be written, or swap the folder,
  and the run (as root, say) would write through it; this also covers the files torch writes there
  itself (the ``@record`` error file, flight-recorder dumps).
* The folder's name is resolved one name at a time (``resolve_output``, ``contract.files``), not by the
  kernel: a link on the way is followed only if it is this user's or root's, and in a sticky folder
  every user may create in (/tmp, a shared scratch) only this user's own entry is taken as the output
  folder, so ``/shared/run -> /victim`` planted by someone else is refused, for root too, whatever
  ``fs.protected_symlinks`` says. The folder and everything under it are then made from a descriptor
  of the folder above (``mkdirat``), never through a name another user could have swapped; its
  ``logs`` folder is made (or checked) at the claim, so one planted in a sticky output folder refuses
  the run before any rank starts.
* The launcher's open-file limit is raised to its hard limit; when even that is too low for the ranks
  asked for, one line says so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import shutil
import stat
from pathlib import Path

from multigpu.contract.errors import UsageError
from multigpu.contract.files import Planted, open_folder, resolve_trusted, user_name
from multigpu.contract.limits import lift_open_file_limit

MIN_FREE_BYTES = 64 << 10
FDS_PER_RANK = 6
"""Launcher descriptors per local rank: stdout, stderr, heartbeat, pidfd, log file, one spare."""
FDS_BASE = 32
LOGS = "logs"
"""The ranks' log folder in the output folder (``runner/specs.py``): made or checked at the claim, so
a link or folder another user planted there (in a sticky output folder) refuses the run at once."""


def check_run_id(run_id: str, source: str = "--run-id") -> str:
    """``run_id`` if it is a plain name; a UsageError naming ``source`` otherwise."""
    bad = None
    if not run_id:
        bad = "is empty"
    elif run_id in (".", "..") or "/" in run_id or "\\" in run_id:
        bad = "is a path, not a name (no '/', '..')"
    elif any(ord(c) < 32 or ord(c) == 127 for c in run_id):
        bad = "contains control characters"
    elif len(run_id) > 200:
        bad = "is longer than 200 characters"
    if bad is not None:
        raise UsageError(f"{source} {run_id!r} {bad}; use letters, digits, '-', '_' or '.'")
    return run_id


def _describe(exc: OSError) -> str:
    if isinstance(exc, Planted):
        return f"{exc.strerror}; give the run a folder of your own"
    if exc.errno == errno.EROFS:
        return "it is on a read-only file system"
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return "it (or a folder above it) is a file, not a folder"
    if exc.errno == errno.ENOSPC:
        return "no space left on its device"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return exc.strerror or str(exc)


class RunFolder:
    """The checked, locked output folder of one run (one node); ``release()`` unlocks it."""

    def __init__(self, path: Path, lock_fd: int, lock_path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = lock_fd
        self._lock_path = lock_path

    def release(self) -> None:
        """Remove the lock file (still holding it, so no run can lock it on the way out), then unlock."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                self._lock_path.unlink()
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None


def resolve_output(path: Path, what: str = "output folder") -> Path:
    """``path`` absolute, its links resolved as ``Path.resolve()`` does, but through no link another
    user made (one line naming it and its owner, exit 2): the run's folder is then the real one."""
    try:
        return resolve_trusted(path)
    except OSError as exc:
        raise UsageError(f"{what} {path}: {_describe(exc)}") from None


def claim_output(path: Path, run_id: str, node: int | str | None = None) -> RunFolder:
    """Create ``path``, prove it writable with room to spare, and lock it for this run (``node``: this
    node's lock in a folder the job's nodes share; an elastic launcher's is its ``host-pid``)."""
    label = None if node is None else f"node{node}" if isinstance(node, int) else node
    lock = path / (".multigpu.lock" if label is None else f".multigpu-{label}.lock")
    fd = _lock(path, lock)
    while not _still_there(fd, lock):  # the run before removed it as this one locked it: lock anew
        os.close(fd)
        fd = _lock(path, lock)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"run {run_id} (launcher pid {os.getpid()})\n".encode(), 0)
        os.close(open_folder(path / LOGS, create=True))  # this user's before a rank log goes in
        if shutil.disk_usage(path).free < MIN_FREE_BYTES:
            raise OSError(errno.ENOSPC, "no space")
    except OSError as exc:
        os.close(fd)
        raise UsageError(f"output folder {path}: {_describe(exc)}") from None
    return RunFolder(path, fd, lock)


def _first_existing(path: Path) -> Path:
    """``path`` or the nearest folder above it that exists: the one ``mkdir -p`` creates into."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _refuse_if_open(path: Path, folder: Path, owners: tuple[int, ...], what: str = "output folder") -> None:
    """A UsageError unless ``folder`` belongs to one of ``owners`` and is not writable by every user
    without the sticky bit (the one-line refusal names ``path``, the folder asked for)."""
    st = os.stat(folder)
    if not stat.S_ISDIR(st.st_mode):  # a file, a device (/dev/null): no chmod to suggest
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(folder))
    if st.st_uid not in owners:
        raise UsageError(
            f"{what} {path}: {folder} belongs to user {user_name(st.st_uid)}, who "
            f"could redirect what this run writes; give the run a folder of your own"
        )
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UsageError(
            f"{what} {path}: {folder} is writable by every user (and has no sticky "
            f"bit), who could redirect what this run writes; give the run a folder of "
            f"your own, or 'chmod o-w {folder}'"
        )


def check_owned(path: Path, created_into: Path, *, created: bool = True, what: str = "output folder") -> None:
    """A UsageError when another user could redirect this run's writes under ``path``. ``created_into``
    (the folder ``mkdir -p`` creates into, or ``path`` itself when it exists) must be this user's, or
    root's when the run creates its folder inside it; with ``created``, every folder from ``path`` up to
    it must be this user's. None of them may be writable by every user without the sticky bit."""
    uid = os.geteuid()
    top = Path(os.path.abspath(created_into))
    folder = Path(os.path.abspath(path))
    _refuse_if_open(path, top, (uid,) if top == folder else (uid, 0), what)
    while created and folder != top and folder != folder.parent:
        _refuse_if_open(path, folder, (uid,), what)
        folder = folder.parent


def open_checked(path: Path, what: str = "output folder") -> int:
    """``path`` made (with its parents) and checked as a run's folder (``check_owned``), open as a
    ``dir_fd`` for what is made in it; one line (``what`` PATH: why) otherwise. The output folder's
    claim, torchrun's ``--log-dir`` and OTX's manager all go through here."""
    try:
        created_into = _first_existing(path)
        check_owned(path, created_into, created=False, what=what)  # nothing made in another user's folder
        fd = open_folder(path, create=True)  # no link or sticky-folder entry of another user's on the way
        try:
            check_owned(path, created_into, what=what)  # and no folder on the way made by another user
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        raise UsageError(f"{what} {path}: {_describe(exc)}") from None
    return fd


def _lock(path: Path, lock: Path) -> int:
    """The lock file, open and exclusively locked, or one line naming the run that holds it."""
    folder = open_checked(path)
    try:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(lock.name, flags, 0o644, dir_fd=folder)
    except OSError as exc:
        raise UsageError(f"output folder {path}: {_describe(exc)}") from None
    finally:
        os.close(folder)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another run"
        os.close(fd)
        raise UsageError(
            f"output folder {path} is in use by {holder}; give this run its own "
            f"--output (or wait for that run to end)"
        ) from None
    return fd


def _still_there(fd: int, lock: Path) -> bool:
    try:
        return os.stat(lock).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def raise_open_file_limit(nproc: int) -> None:
    """Raise the soft RLIMIT_NOFILE to the hard one; a UsageError when that is still too low."""
    soft = lift_open_file_limit()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    need = FDS_BASE + FDS_PER_RANK * nproc
    if soft < need:
        raise UsageError(
            f"{nproc} rank(s) need about {need} open files in the launcher, but the limit "
            f"is {soft} (hard limit {hard}); raise it, e.g. 'ulimit -n {need}'"
        )
