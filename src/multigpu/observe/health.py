"""torchrun's ``TORCHELASTIC_HEALTH_CHECK_PORT``, honoured: ``GET /healthz`` on that port (loopback)
answers 200 while every rank lives and progresses, 503 with one line naming the rank once one failed
or made no progress past its hang timeout (``--hang-timeout``, or the one learned from its step
times). torchrun reads the variable and starts nothing ("No health check server started").

Runs in the launcher: the verdict is pure (``verdict``), the server is the standard library's, on its
own threads, reading ``watched.Watched``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from multigpu.observe.watched import Watched
from multigpu.supervisor.hangs.book import ProgressBook
from multigpu.supervisor.states import Worker, WorkerState

HEALTH_PORT_ENV = "TORCHELASTIC_HEALTH_CHECK_PORT"


def rank_timeout(progress: ProgressBook, rank: int) -> float | None:
    """The rank's hang timeout now: the book's (given or learned), else, without ``--hang-timeout``,
    the one its learned step time would give (factor x slowest step, at least the floor) once this
    attempt saw its warm-up steps; None where the book would wait at the ceiling (before the first
    steps, inside a section, once a rank has finished)."""
    seconds = progress.timeout_seconds(rank)
    if seconds is not None:
        return seconds
    p, slowest = progress.ranks.get(rank), progress.learned.slowest_step
    if p is None or not p.reports_steps or slowest is None or p.section is not None:
        return None
    if len(p.intervals) < progress.policy.warmup or progress.last_finish > -math.inf:
        return None
    return progress.policy.clamp(slowest)


def verdict(workers: Sequence[Worker], progress: ProgressBook, now: float) -> str | None:
    """None while every rank lives and progresses; else one line naming the rank: a failed rank first
    (the lowest), then the rank quiet longest past its timeout, then, of the ranks the launcher
    stopped, the one that stopped progressing first (``ProgressBook.order``: a hang's culprit).

    As the launcher judges a hang (``book.ProgressBook.check``): a rank that reports steps by its own
    timeout; one that reports none only once no rank has shown progress for the ceiling (its quiet
    output says nothing while the others progress)."""
    ordered = sorted(workers, key=lambda w: w.rank)
    for w in ordered:
        if w.state is WorkerState.FAILED:
            return f"rank {w.rank} failed ({w.exit_text})"
    running = [w.rank for w in ordered if w.state is WorkerState.RUNNING and w.rank in progress.ranks]
    late = _late(progress, running, now)
    if late:
        quiet, rank, limit = max(late)
        return f"rank {-rank} made no progress for {quiet:.1f}s, past its hang timeout {limit:g}s"
    stopped = [w.rank for w in ordered if w.state is WorkerState.STOPPED and w.rank in progress.ranks]
    if stopped:
        first = progress.order(stopped)[0]
        return f"rank {first} was stopped by the launcher (of the stopped ranks, its progress stopped first)"
    return None


def _late(progress: ProgressBook, running: Sequence[int], now: float) -> list[tuple[float, int, float]]:
    """(quiet seconds, minus the rank, its timeout) of each running rank past its timeout."""
    ranks = {r: progress.ranks[r] for r in running}
    late = []
    for r, p in ranks.items():
        limit = rank_timeout(progress, r) if p.reports_steps else None
        if limit is not None and now - p.last_progress >= limit:
            late.append((now - p.last_progress, -r, limit))
    ceiling = progress.policy.ceiling
    if late or ceiling is None or not ranks:
        return late
    silent = now - max(progress.last_finish, progress.job_at, *(p.last_progress for p in ranks.values()))
    if silent < ceiling:
        return []
    first = progress.order(list(ranks))[0]
    return [(now - ranks[first].last_progress, -first, ceiling)]


def answer(watched: Watched) -> tuple[int, str]:
    """(status, one line) for ``GET /healthz``."""
    attempt = watched.attempt
    if attempt is None:
        return 200, "ok: no rank started yet"
    why = verdict(list(attempt.workers), attempt.progress, watched.clock())
    return (200, "ok") if why is None else (503, why)


class _Handler(BaseHTTPRequestHandler):
    watched: Watched

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/healthz":
            code, text = 404, "not found: GET /healthz"
        else:
            code, text = answer(self.watched)
        body = (text + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: a probe every few seconds is not a line on the console."""


@contextlib.contextmanager
def serving(watched: Watched, host: str, port: int) -> Iterator[int]:
    """The health server on ``host:port`` for the ``with`` block (the port bound is yielded);
    afterwards its socket is closed and its thread joined."""
    handler = type("HealthHandler", (_Handler,), {"watched": watched})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="multigpu-health", daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
