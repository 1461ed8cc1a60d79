"""The ranks' lines on the launcher's console, each prefixed with its rank (and node, across nodes).

Runs in the launcher, and in function mode's caller (there without a ``ConsoleWriter``: lines go
straight to the descriptors, between the caller's whole lines). A progress bar (an unfinished line)
is drawn in place on a terminal.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Protocol

from multigpu.console.caller import CALLER_LOCK
from multigpu.console.writer import CLEAR_LINE, ConsoleWriter, isatty


class _Placed(Protocol):
    @property
    def node(self) -> int: ...


class RankLines(Protocol):
    """What the console needs of a worker: its rank and, across nodes, its node."""

    @property
    def rank(self) -> int: ...

    @property
    def spec(self) -> _Placed: ...


def rank_prefix(rank: int, node: int | None = None) -> bytes:
    return (f"[node {node} rank {rank}] " if node is not None else f"[rank {rank}] ").encode()


class PrefixedConsole:
    """Workers' lines on the launcher's stdout/stderr, each prefixed with its rank.

    With a ``ConsoleWriter`` (the CLI) nothing here blocks. Without one (function mode, where the
    console is the user's own Python process) lines are written directly, as before.
    A progress bar (an unfinished line) is drawn in place on a terminal: the bottom line of the
    stream shows the latest bar; other lines are printed above it and the bar is redrawn.
    """

    def __init__(
        self,
        log_ranks: Iterable[int] | None = None,
        qualify_node: bool = False,
        writer: ConsoleWriter | None = None,
    ) -> None:
        self.log_ranks = None if log_ranks is None else frozenset(log_ranks)
        self.qualify_node = qualify_node
        self._writer = writer
        self._prefixes: dict[int, bytes] = {}
        self._bars: dict[int, tuple[tuple[int, str], bytes]] = {}  # fd -> (rank, stream), drawn bar
        self._closed: set[int] = set()

    def shows(self, rank: int) -> bool:
        return self.log_ranks is None or rank in self.log_ranks

    def prefix(self, worker: RankLines) -> bytes:
        p = self._prefixes.get(worker.rank)
        if p is None:
            p = rank_prefix(worker.rank, worker.spec.node if self.qualify_node else None)
            self._prefixes[worker.rank] = p
        return p

    def write_lines(self, worker: RankLines, stream: str, lines: list[bytes]) -> None:
        if not self.shows(worker.rank) or not lines:
            return
        fd = 2 if stream == "stderr" else 1
        p = self.prefix(worker)
        data = p + (b"\n" + p).join(lines) + b"\n"
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

    def write_partial(self, worker: RankLines, stream: str, text: bytes) -> None:
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
        return self._writer.ttys.get(fd, False) if self._writer is not None else isatty(fd)

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
            with CALLER_LOCK:
                while view:
                    view = view[os.write(target, view) :]
        except (OSError, ValueError, AttributeError):  # the console went away: the log files go on
            self._closed.add(fd)
