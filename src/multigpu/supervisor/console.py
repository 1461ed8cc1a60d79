"""The console: the launcher's stdout and stderr, written by a thread the supervisor never waits on.

A console is whatever the user gave us: a terminal, a pager that stopped reading, ``head -1`` that
left, ``/dev/full``, a closed descriptor. ``ConsoleWriter`` puts every console write (rank lines, the
launcher's own messages, the live view) into a bounded buffer that a writer thread drains. When the
buffer is full and the console still reads (a ``| tee``, a CI log slower than the ranks), the
supervisor stops reading the ranks' pipes until it has room, so the ranks wait as they would writing
to the console themselves, and no line is lost (``congested``). Only a console that stopped reading
for HOLD_S (a pager, a terminal stopped with Ctrl-S) has lines dropped and counted, and one notice
says how many once it reads again, so it never stops the training; when a descriptor fails (broken
pipe, hang-up, no space) that stream of the console ends and nothing else does. The rank log files
are written elsewhere (``output.py``) and are always complete.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from multigpu.supervisor.states import Worker

CAPACITY = 4 << 20
"""Bytes the console may hold unwritten; a single larger line is still taken when the buffer is empty."""
WRITE_CHUNK = 4096  # PIPE_BUF: after POLLOUT, a write this size does not block on a pipe
STALL_S = 0.25
"""At close, the buffer is flushed only while the console keeps reading; a stalled one gets this long."""
FLUSH_LIMIT_S = 5.0
HARD_CAP = 3
"""Past capacity times this, lines are dropped even while the console reads: the bound for a writer
that does not hold back (what the loop reads in one batch before it sees ``congested``)."""
HOLD_S = 1.0
"""A full buffer holds the ranks' output back while the console wrote something within this long;
past it the console counts as stopped, and lines are dropped instead."""
CLEAR_LINE = b"\x1b[K"

_active: ConsoleWriter | None = None
_caller_lock = threading.Lock()
"""Function mode: held while the caller's own line or a child's line goes to the shared descriptors."""


def say(message: str) -> None:
    """The launcher's own one-line messages, through the active console writer when there is one."""
    text = f"multigpu: {message}\n"
    if _active is not None:
        _active.put(2, text.encode(errors="replace"), text.count("\n"), keep=True)
        return
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(text)
        sys.stderr.flush()


def active_writer() -> ConsoleWriter | None:
    """The CLI's console writer while a run is on; None in function mode."""
    return _active


class WriterFile:
    """A text file object over a ConsoleWriter descriptor, for rich's live view and tables."""

    def __init__(self, writer: ConsoleWriter | None, fd: int = 2) -> None:
        self._writer, self._fd = writer, fd

    def write(self, text: str) -> int:
        if self._writer is not None:
            self._writer.put(self._fd, text.encode(errors="replace"), text.count("\n"))
        else:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.write(text)
        return len(text)

    def flush(self) -> None:
        if self._writer is None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()

    def isatty(self) -> bool:
        return self._writer.ttys.get(self._fd, False) if self._writer is not None else _isatty(self._fd)

    def fileno(self) -> int:
        return self._fd


def ensure_std_fds() -> None:
    """Open /dev/null onto closed descriptors 0-2, before anything else can take those numbers.

    Under some daemons and CI runners the launcher starts with stdin, stdout or stderr closed; the
    next pipe or socket would get that number, and a rank started with ``stdin=DEVNULL`` (a dup2
    onto 0) or our own console writes would then clobber it.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:  # a lower descriptor was closed too and is now filled; keep going
                os.dup2(opened, fd)
                os.close(opened)
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 - the process's own stream


class _Channel:
    """One descriptor of the console: its own queue, so a stalled stdout never holds stderr back."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.queue: deque[tuple[bytes, int]] = deque()
        self.queued = 0
        self.offset = 0  # bytes of the first item already written
        self.dropped = 0
        self.dead: str | None = None

    def lines_left(self) -> int:
        return self.dropped + sum(lines for _, lines in self.queue)


class ConsoleWriter:
    """Bounded buffers of console writes and the thread that drains them; see the module docstring."""

    def __init__(self, capacity: int = CAPACITY, fds: Iterable[int] = (1, 2)) -> None:
        self.capacity = capacity
        self._channels = {fd: _Channel(fd) for fd in fds}
        self._notice_fds = tuple(reversed(self._channels))  # stderr (the last given) first
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_progress = time.monotonic()
        self.ttys = {fd: _isatty(fd) for fd in fds}
        self.on_room: Callable[[], None] | None = None
        """Called (on the writer thread) when a full buffer has room again: the loop reads once more."""

    @property
    def dead(self) -> dict[int, str]:
        return {fd: ch.dead for fd, ch in self._channels.items() if ch.dead is not None}

    # ---- the producer side (the supervisor's loop): never blocks -------------------------------------

    def congested(self) -> bool:
        """A buffer is full and the console is still reading: hold the ranks' output back for now."""
        with self._cond:
            return self._full() and not self._stalled()

    def _full(self) -> bool:
        return any(ch.queued > self.capacity for ch in self._channels.values() if ch.dead is None)

    def _stalled(self) -> bool:
        return time.monotonic() - self._last_progress > HOLD_S

    def put(self, fd: int, data: bytes, lines: int = 1, *, keep: bool = False) -> None:
        """Queue ``data``. Past the capacity it is dropped and counted once the console has stopped
        reading; while it reads, the caller holds back (``congested``), and what it read is kept. The
        launcher's own few notices (``keep``) are never crowded out by the ranks' lines."""
        with self._cond:
            channel = self._channels.get(fd)
            if channel is None or channel.dead is not None or self._stop:
                return
            over = channel.queued + len(data) - self.capacity
            if not keep and channel.queued and over > 0 and (
                    self._stalled() or over > HARD_CAP * self.capacity):
                channel.dropped += lines
                return
            channel.queue.append((data, lines))
            channel.queued += len(data)
            self._cond.notify_all()

    # ---- lifetime -------------------------------------------------------------------------------------

    def __enter__(self) -> ConsoleWriter:
        global _active
        self._thread = threading.Thread(target=self._run, name="multigpu-console", daemon=True)
        self._thread.start()
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush while the console reads (up to FLUSH_LIMIT_S), then stop; a stalled console costs
        STALL_S at most, and what it never took is counted in one last notice."""
        global _active
        if _active is self:
            _active = None
        deadline = time.monotonic() + FLUSH_LIMIT_S
        with self._cond:
            # A console that was idle is not stalled: it gets STALL_S from now to take what is left.
            self._last_progress = max(self._last_progress, time.monotonic())
            while self._pending() and time.monotonic() < deadline:
                if time.monotonic() - self._last_progress > STALL_S:
                    break
                self._cond.wait(0.02)
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=STALL_S)  # a thread stuck in a write is a daemon: left behind
        with self._cond:
            lost = sum(ch.lines_left() for ch in self._channels.values() if ch.dead is None)
        err = self._channels[self._notice_fds[0]] if self._notice_fds else None
        if lost and err is not None and err.dead is None and select.select([], [err.fd], [], 0)[1]:
            with contextlib.suppress(OSError):
                os.write(err.fd, _drop_notice(lost))

    # ---- the writer thread ----------------------------------------------------------------------------

    def _pending(self) -> list[_Channel]:
        return [ch for ch in self._channels.values() if ch.queue and ch.dead is None]

    def _run(self) -> None:
        poller = select.poll()
        while True:
            with self._cond:
                while not self._pending() and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                pending = {ch.fd: ch for ch in self._pending()}
            for fd in pending:
                poller.register(fd, select.POLLOUT)
            try:
                events = poller.poll(100)
            except InterruptedError:
                events = []
            finally:
                for fd in pending:
                    poller.unregister(fd)
            for fd, ev in events:
                self._write_some(pending[fd], ev)

    def _write_some(self, channel: _Channel, event: int) -> None:
        data, _ = channel.queue[0]
        try:
            if event & (select.POLLERR | select.POLLNVAL):
                raise OSError(errno.EPIPE, "the console went away")
            written = os.write(channel.fd, data[channel.offset: channel.offset + WRITE_CHUNK])
        except (InterruptedError, BlockingIOError):
            return
        except OSError as exc:  # EPIPE, EIO (hang-up), ENOSPC, EBADF...: this stream is over
            self._end(channel, exc.strerror or str(exc))
            return
        with self._cond:
            self._last_progress = time.monotonic()
            was_full = channel.queued > self.capacity
            channel.offset += written
            if channel.offset >= len(data):
                channel.queue.popleft()
                channel.queued -= len(data)
                channel.offset = 0
            if was_full and channel.queued <= self.capacity and self.on_room is not None:
                self.on_room()
            if channel.dropped and channel.queued <= self.capacity // 2:
                count, channel.dropped = channel.dropped, 0
                self._notice(_drop_notice(count))
            self._cond.notify_all()

    def _notice(self, text: bytes) -> None:
        """Queue one of our own notices on stderr (stdout if stderr is gone); caller holds the lock."""
        for fd in self._notice_fds:
            channel = self._channels[fd]
            if channel.dead is None:
                channel.queue.append((text, 1))
                channel.queued += len(text)
                return

    def _end(self, channel: _Channel, why: str) -> None:
        """One stream of the console is gone; say so once on the other if it still works."""
        with self._cond:
            channel.dead = why
            channel.queue.clear()
            channel.queued = channel.offset = channel.dropped = 0
            name = {1: "stdout", 2: "stderr"}.get(channel.fd, f"descriptor {channel.fd}")
            self._notice(f"multigpu: {name} is gone ({why}); rank output goes on in the log files\n"
                         .encode())
            self._cond.notify_all()


def _drop_notice(count: int) -> bytes:
    return (f"multigpu: {count} console line(s) dropped: the console was not reading "
            f"(the rank logs have every line)\n").encode()


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def rank_prefix(rank: int, node: int | None = None) -> bytes:
    return (f"[node {node} rank {rank}] " if node is not None else f"[rank {rank}] ").encode()


class PrefixedConsole:
    """Workers' lines on the launcher's stdout/stderr, each prefixed with its rank.

    With a ``ConsoleWriter`` (the CLI) nothing here blocks. Without one (function mode, where the
    console is the user's own Python process) lines are written directly, as before.
    A progress bar (an unfinished line) is drawn in place on a terminal: the bottom line of the
    stream shows the latest bar; other lines are printed above it and the bar is redrawn.
    """

    def __init__(self, log_ranks: Iterable[int] | None = None, qualify_node: bool = False,
                 writer: ConsoleWriter | None = None) -> None:
        self.log_ranks = None if log_ranks is None else frozenset(log_ranks)
        self.qualify_node = qualify_node
        self._writer = writer
        self._prefixes: dict[int, bytes] = {}
        self._bars: dict[int, tuple[tuple[int, str], bytes]] = {}  # fd -> (rank, stream), drawn bar
        self._closed: set[int] = set()

    def shows(self, rank: int) -> bool:
        return self.log_ranks is None or rank in self.log_ranks

    def prefix(self, worker: Worker) -> bytes:
        p = self._prefixes.get(worker.rank)
        if p is None:
            p = rank_prefix(worker.rank, worker.spec.node if self.qualify_node else None)
            self._prefixes[worker.rank] = p
        return p

    def write_lines(self, worker: Worker, stream: str, lines: list[bytes]) -> None:
        if not self.shows(worker.rank) or not lines:
            return
        fd = 2 if stream == "stderr" else 1
        p = self.prefix(worker)
        data = b"".join(p + line + b"\n" for line in lines)
        bar = self._bars.get(fd)
        if bar is not None:
            owner, drawn = bar
            if owner == (worker.rank, stream):  # the bar's own line ended: it replaces the bar
                del self._bars[fd]
                data = b"\r" + (CLEAR_LINE if self._tty(fd) else b"") + data
            else:  # print above the bar, then draw it again
                data = self._erase(fd) + data + (drawn if self._tty(fd) else b"")
                if not self._tty(fd):
                    del self._bars[fd]
        self._put(fd, data, len(lines))

    def write_partial(self, worker: Worker, stream: str, text: bytes) -> None:
        if not self.shows(worker.rank):
            return
        fd = 2 if stream == "stderr" else 1
        drawn = b"\r" + self.prefix(worker) + text + (CLEAR_LINE if self._tty(fd) else b"")
        bar = self._bars.get(fd)
        data = drawn
        if bar is not None and bar[0] != (worker.rank, stream) and not self._tty(fd):
            data = b"\n" + drawn  # a pipe or file: a new bar starts on its own line
        self._bars[fd] = ((worker.rank, stream), drawn)
        self._put(fd, data, 0)

    def _erase(self, fd: int) -> bytes:
        return b"\r" + CLEAR_LINE if self._tty(fd) else b"\n"

    def _tty(self, fd: int) -> bool:
        return self._writer.ttys.get(fd, False) if self._writer is not None else _isatty(fd)

    def _put(self, fd: int, data: bytes, lines: int) -> None:
        if self._writer is not None:
            self._writer.put(fd, data, lines)
            return
        if fd in self._closed:
            return
        out = sys.stderr if fd == 2 else sys.stdout
        try:
            # Straight to the descriptor, never through ``out``'s buffer, and between the caller's
            # whole lines (``CallerLines``): function mode's caller is a rank too.
            view = memoryview(data)
            target = out.fileno()
            with _caller_lock:
                while view:
                    view = view[os.write(target, view):]
        except (OSError, ValueError, AttributeError):  # the console went away: the log files go on
            self._closed.add(fd)


class CallerLines:
    """Function mode's caller (rank 0) writes whole lines, so a child's line never lands inside one.

    ``print()`` writes its text and its newline separately (two writes when stdout is unbuffered, as
    with ``PYTHONUNBUFFERED``), and a block-buffered stream flushes at 8 KiB, mid-line; the children's
    lines come from another thread. This stand-in for ``sys.stdout``/``sys.stderr`` holds a partial
    line until its newline (or an explicit ``flush()``, as a progress bar's ``\r`` update does) and
    writes it under the lock the children's lines take. Everything else is the real stream's.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._partial = ""

    def write(self, text: str) -> int:
        with _caller_lock:
            self._partial += text
            cut = self._partial.rfind("\n") + 1
            if cut:
                whole, self._partial = self._partial[:cut], self._partial[cut:]
                self._stream.write(whole)
                self._stream.flush()
        return len(text)

    def flush(self) -> None:
        with _caller_lock:
            partial, self._partial = self._partial, ""
            if partial:
                self._stream.write(partial)
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def caller_lines() -> Iterator[None]:
    """Guard the caller's stdout and stderr while children share its console; put them back after."""
    guards = {name: CallerLines(getattr(sys, name)) for name in ("stdout", "stderr")}
    for name, guard in guards.items():
        setattr(sys, name, guard)
    try:
        yield
    finally:
        for name, guard in guards.items():
            with contextlib.suppress(OSError, ValueError):  # a closed console: nothing to save
                guard.flush()
            if getattr(sys, name) is guard:  # the caller may have replaced it since: theirs stays
                setattr(sys, name, guard._stream)
