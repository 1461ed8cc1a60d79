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
from collections.abc import Callable, Iterable

from multigpu.console.log import line_on_stderr

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


class Console:
    """The launcher's console for one ``multigpu run``: made where its ``ConsoleWriter`` is made
    (``runner/attempts.py``) and handed to every part that writes to the console itself; nothing reads
    it from a global. ``say`` shows the launcher's own lines (every module logs them; the run's log
    handler, ``log.lines_through``, calls it); ``writer`` is what the ranks' lines, the live view and the
    summary table go through."""

    def __init__(self, writer: ConsoleWriter | None = None) -> None:
        self._writer = writer

    @property
    def writer(self) -> ConsoleWriter | None:
        """The writer while it takes lines (from its start until it begins to close); else None."""
        writer = self._writer
        return writer if writer is not None and writer.taking else None

    def say(self, message: str) -> None:
        """One line of the launcher's own, through the writer while it takes lines, else onto stderr."""
        writer = self.writer
        if writer is None:
            line_on_stderr(message)
            return
        text = f"multigpu: {message}\n"
        writer.put(2, text.encode(errors="replace"), text.count("\n"), keep=True)

    def ttys(self) -> dict[int, bool]:
        """Which of stdout (1) and stderr (2) are terminals."""
        writer = self.writer
        return writer.ttys if writer is not None else {1: sys.stdout.isatty(), 2: sys.stderr.isatty()}


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
        return self._writer.ttys.get(self._fd, False) if self._writer is not None else isatty(self._fd)

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
        self.ttys = {fd: isatty(fd) for fd in fds}
        self.on_room: Callable[[], None] | None = None
        """Called (on the writer thread) when a full buffer has room again: the loop reads once more."""
        self.taking = False
        """Started and not yet closing: a ``Console`` sends its lines here only meanwhile."""

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
            if (
                not keep
                and channel.queued
                and over > 0
                and (self._stalled() or over > HARD_CAP * self.capacity)
            ):
                channel.dropped += lines
                return
            channel.queue.append((data, lines))
            channel.queued += len(data)
            self._cond.notify_all()

    # ---- lifetime -------------------------------------------------------------------------------------

    def __enter__(self) -> ConsoleWriter:
        self._thread = threading.Thread(target=self._run, name="multigpu-console", daemon=True)
        self._thread.start()
        self.taking = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush while the console reads (up to FLUSH_LIMIT_S), then stop; a stalled console costs
        STALL_S at most, and what it never took is counted in one last notice."""
        self.taking = False
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
            written = os.write(channel.fd, data[channel.offset : channel.offset + WRITE_CHUNK])
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
            self._notice(f"multigpu: {name} is gone ({why}); rank output goes on in the log files\n".encode())
            self._cond.notify_all()


def _drop_notice(count: int) -> bytes:
    return (
        f"multigpu: {count} console line(s) dropped: the console was not reading "
        f"(the rank logs have every line)\n"
    ).encode()


def isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False
