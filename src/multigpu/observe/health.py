"""torchrun's ``TORCHELASTIC_HEALTH_CHECK_PORT``, honoured: ``GET /healthz`` on that port (loopback)
answers 200 while every rank lives and progresses, 503 with one line naming the rank once one failed
or made no progress past its hang timeout (``--hang-timeout``, or the one learned from its step
times). torchrun reads the variable and starts nothing ("No health check server started").

Runs in the launcher: the verdict is pure (``verdict``), the server is the standard library's, on its
own threads, reading ``watched.Watched``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from multigpu.observe.watched import Watched
from multigpu.supervisor.hangs.book import ProgressBook
from multigpu.supervisor.states import Worker, WorkerState

HEALTH_PORT_ENV = "TORCHELASTIC_HEALTH_CHECK_PORT"


def rank_timeout(progress: ProgressBook, rank: int) -> float | None:
    """The rank's hang timeout now: the book's (given or learned), else, without ``--hang-timeout``,
    the one its learned step time would give (factor x slowest step, at least the floor); None before
    anything is known."""
    seconds = progress.timeout_seconds(rank)
    if seconds is not None:
        return seconds
    p, slowest = progress.ranks.get(rank), progress.learned.slowest_step
    if p is None or not p.reports_steps or slowest is None or p.section is not None:
        return None
    return progress.policy.clamp(slowest)


def verdict(workers: Sequence[Worker], progress: ProgressBook, now: float) -> str | None:
    """None while every rank lives and progresses; else one line naming the rank: a failed rank first
    (the lowest), then the running rank quiet longest past its timeout, then, of the ranks the launcher
    stopped, the one that stopped progressing first (``ProgressBook.order``: a hang's culprit)."""
    ordered = sorted(workers, key=lambda w: w.rank)
    for w in ordered:
        if w.state is WorkerState.FAILED:
            return f"rank {w.rank} failed ({w.exit_text})"
    late: list[tuple[float, int, float]] = []
    for w in ordered:
        p = progress.ranks.get(w.rank)
        limit = rank_timeout(progress, w.rank)
        quiet = None if p is None else now - p.last_progress
        if w.state is WorkerState.RUNNING and quiet is not None and limit is not None and quiet >= limit:
            late.append((quiet, -w.rank, limit))
    if late:
        quiet, rank, limit = max(late)
        return f"rank {-rank} made no progress for {quiet:.1f}s, past its hang timeout {limit:g}s"
    stopped = [w.rank for w in ordered if w.state is WorkerState.STOPPED and w.rank in progress.ranks]
    if stopped:
        first = progress.order(stopped)[0]
        return f"rank {first} was stopped by the launcher (of the stopped ranks, its progress stopped first)"
    return None


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
