"""How the launcher opens its own files in the run folder: never through a link someone planted there.

Runs in the launcher (the rank logs in ``supervisor/output.py``, ``run.json`` in ``record/run_json.py``)
and in the OTX caller (function mode's payload, the hyper-parameters). The run folder itself is checked
first (``record/folder.py``: this user's, not writable by every user); these opens are the second wall:

* A folder is reached one name at a time from ``/`` (``open_folder``: ``openat`` with ``O_NOFOLLOW``,
  ``mkdirat``), never by the kernel resolving a whole path: a link on the way is followed only if it is
  this user's or root's, and in a folder every user may create in (sticky, like /tmp) only this user's
  or root's entries are entered. Another user's link (``/shared/run -> /victim``, a ``logs`` link
  planted in a sticky run folder) is refused in one line (``Planted``), whatever
  ``fs.protected_symlinks`` says and for root too.
* A file is created with ``O_EXCL | O_NOFOLLOW``; a link already there (symbolic or hard) is replaced,
  never written through, and a file already there (a log of a run before that reused the folder) is
  emptied; a temporary name comes from ``mkstemp``. A log's name that holds anything but a regular file
  of this user's (a FIFO, a device, another user's file) is refused (``create_file``), never opened in a
  way that could block. Files follow the user's umask, as every Unix tool's do, unless a mode is given.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
import tempfile
from pathlib import Path

NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
FOLDER = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""A folder on the way, opened to walk through it (``O_PATH``: no read permission needed, as for a path)."""
MAX_LINKS = 40
"""Links followed in one walk before it is a loop (the kernel's limit)."""


class Planted(OSError):
    """A name another user could have planted, refused; ``strerror`` says which and whose (one line)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EPERM, message)


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


def _check_entry(parent: int, path: Path, st: os.stat_result) -> None:
    """A ``Planted`` error unless ``path`` (``st``, not followed; in the folder open as ``parent``) is
    safe to go through: a link only if this user's or root's, anything in a sticky folder every user
    may create in only if this user's or root's (nobody else can then remove or replace it)."""
    if st.st_uid in (os.geteuid(), 0):
        return
    if stat.S_ISLNK(st.st_mode):
        raise Planted(
            f"{path} is a link made by user {user_name(st.st_uid)}, who could redirect what this run writes"
        )
    mode = os.fstat(parent).st_mode
    if mode & stat.S_ISVTX and mode & stat.S_IWOTH:
        raise Planted(
            f"{path} belongs to user {user_name(st.st_uid)}, who could redirect what this run writes"
        )


def _walk(path: Path, create: bool, mode: int) -> tuple[int, Path, list[str]]:
    """The deepest existing folder on the way to ``path``, opened (``FOLDER``), its real path, and the
    names still to go (none with ``create``: each missing folder is made, ``mode`` less the umask)."""
    todo = list(reversed(Path(os.getcwd(), path).parts[1:]))
    fd, where, links = os.open("/", FOLDER), Path("/"), 0
    try:
        while todo:
            name = todo.pop()
            try:
                child = os.open(name, FOLDER, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    return fd, where, [name, *reversed(todo)]
                with contextlib.suppress(FileExistsError):  # made meanwhile: checked as it is opened
                    os.mkdir(name, mode if not todo else 0o777, dir_fd=fd)  # ``mode``: the last
                todo.append(name)
                continue
            except OSError as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(where / name)) from None
                _check_entry(fd, where / name, st)
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)) from None
                target = Path(os.readlink(name, dir_fd=fd))
                todo.extend(reversed(target.parts[1:] if target.is_absolute() else target.parts))
                if target.is_absolute():
                    os.close(fd)
                    fd, where = os.open("/", FOLDER), Path("/")
                continue
            try:
                _check_entry(fd, where / name, os.fstat(child))
            except BaseException:
                os.close(child)
                raise
            os.close(fd)
            fd, where = child, where.parent if name == ".." else where / name
    except BaseException:
        os.close(fd)
        raise
    return fd, where, []


def open_folder(path: Path, *, create: bool = False, mode: int = 0o777) -> int:
    """The folder ``path`` (made with its missing parents when ``create``), open as ``FOLDER`` for the
    ``dir_fd`` of what is made in it, reached one name at a time: another user's link or sticky-folder
    entry on the way is a ``Planted`` error, never followed."""
    fd, _where, rest = _walk(path, create, mode)
    if rest:
        os.close(fd)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    return fd


def resolve_trusted(path: Path) -> Path:
    """``path`` absolute with its links resolved, as ``Path.resolve()`` does (a missing tail kept as
    written), but through no link that another user could have planted (``Planted``)."""
    fd, where, rest = _walk(path, False, 0o777)
    os.close(fd)
    return Path(os.path.normpath(where.joinpath(*rest)))


def create_file(path: Path, mode: int = 0o666) -> int:
    """``path`` open for writing, its folder made and reached as ``open_folder`` does: a new file
    (``mode`` less the umask), a link there replaced, or this user's regular file emptied. Anything else
    there (a FIFO, a device, a socket, another user's file) is a ``Planted`` error, found without
    blocking (``O_NONBLOCK``, then ``fstat``): a FIFO planted at a log's path cannot hold the launcher."""
    folder = open_folder(path.parent, create=True)
    try:
        return _create_in(folder, path, mode)
    finally:
        os.close(folder)


def _create_in(folder: int, path: Path, mode: int) -> int:
    name = path.name
    with contextlib.suppress(FileExistsError):
        return os.open(name, NEW_FILE, mode, dir_fd=folder)
    st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink > 1):
        os.unlink(name, dir_fd=folder)
        return os.open(name, NEW_FILE, mode, dir_fd=folder)
    _refuse_unless_own_file(path, st)
    fd = os.open(name, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    try:
        _refuse_unless_own_file(path, os.fstat(fd))  # what was opened, should the name have changed
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refuse_unless_own_file(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise Planted(f"{path} is {_kind(st.st_mode)}, not a regular file")
    if st.st_uid != os.geteuid():
        raise Planted(f"{path} belongs to user {user_name(st.st_uid)}, not to this run's user")


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a folder" if stat.S_ISDIR(mode) else "not a file"


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
    os.close(open_folder(path.parent, create=True, mode=0o700))
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with os.fdopen(create_new(path, 0o600), "wb") as f:
        f.write(data)
