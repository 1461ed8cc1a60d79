"""The console side of worker output: whole lines, each prefixed with its rank, one writer."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO

from .supervisor import Worker


def rank_prefix(rank: int, node: int | None = None) -> bytes:
    return (f"[node {node} rank {rank}] " if node is not None else f"[rank {rank}] ").encode()


class PrefixedConsole:
    """Writes workers' lines to the launcher's stdout/stderr; the per-rank log files keep everything."""

    def __init__(self, log_ranks: Iterable[int] | None = None, qualify_node: bool = False,
                 stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None) -> None:
        self.log_ranks = None if log_ranks is None else frozenset(log_ranks)
        self.qualify_node = qualify_node
        self._out = stdout or sys.stdout.buffer
        self._err = stderr or sys.stderr.buffer
        self._prefixes: dict[int, bytes] = {}
        self._closed = False

    def shows(self, rank: int) -> bool:
        return self.log_ranks is None or rank in self.log_ranks

    def prefix(self, worker: Worker) -> bytes:
        p = self._prefixes.get(worker.rank)
        if p is None:
            p = rank_prefix(worker.rank, worker.spec.node if self.qualify_node else None)
            self._prefixes[worker.rank] = p
        return p

    def write_lines(self, worker: Worker, stream: str, lines: list[bytes]) -> None:
        if not self.shows(worker.rank):
            return
        if self._closed:
            return
        p = self.prefix(worker)
        out = self._err if stream == "stderr" else self._out
        try:
            out.write(b"".join(p + line + b"\n" for line in lines))
            out.flush()
        except OSError:  # the console went away (`| head`, a closed terminal): the log files go on
            self._closed = True
