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

from multigpu.observe.watched import Attempt, Watched
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


class Health:
    """``GET /healthz``'s answers over a run: a failure stays 503 until the next attempt trains.

    The verdict alone turns 503 only while the launcher acts on a failure (stopping the ranks, less
    than a second) and 200 again as soon as the next attempt's ranks start: a probe every few seconds
    would never see it. So when an answer finds a new attempt, the one before is judged too, and a
    rank that failed in it is answered, as is any 503 a probe saw in it, until the new attempt shows
    progress: a rank that reports steps made one (or, where none reports steps, all its ranks run).
    Within one attempt the answer follows the verdict: a rank quiet past its timeout that steps again
    is healthy again. One per run (``of``), shared by ``/healthz`` and ``multigpu_healthy``; read from
    the servers' threads, under its own lock, never the loop's."""

    def __init__(self, watched: Watched) -> None:
        self.watched = watched
        self._lock = threading.Lock()
        self._kept: tuple[str, Attempt] | None = None
        self._last: Attempt | None = None

    def answer(self) -> tuple[int, str]:
        """(status, one line) for ``GET /healthz``."""
        attempt = self.watched.attempt
        if attempt is None:
            return 200, "ok: no rank started yet"
        why = verdict(list(attempt.workers), attempt.progress, self.watched.clock())
        with self._lock:
            last, self._last = self._last, attempt
            failed = _failed(last) if last is not None and last is not attempt else None
            if failed is not None:
                self._kept = (failed, last)  # type: ignore[assignment]
            if why is not None:
                self._kept = (why, attempt)
                return 503, why
            kept = self._kept
            if kept is not None and kept[1] is not attempt and not _trains(attempt, kept[1]):
                return 503, f"{kept[0]}; the next attempt has not trained yet"
            self._kept = None
        return 200, "ok"


def _failed(attempt: Attempt) -> str | None:
    """The line of an ended attempt's failed rank (the lowest), if one failed."""
    for w in sorted(list(attempt.workers), key=lambda w: w.rank):
        if w.state is WorkerState.FAILED:
            return f"rank {w.rank} failed ({w.exit_text})"
    return None


def _trains(attempt: Attempt, failed: Attempt) -> bool:
    """Whether an attempt after the ``failed`` one shows it trains: a step reported by one of its
    ranks where the failed attempt's ranks reported steps; else (a script that reports none) every
    rank running."""
    if any(p.reports_steps for p in list(failed.progress.ranks.values())):
        return any(p.reports_steps for p in list(attempt.progress.ranks.values()))
    workers = list(attempt.workers)
    return bool(workers) and all(w.state is WorkerState.RUNNING for w in workers)


_MAKING = threading.Lock()


def of(watched: Watched) -> Health:
    """The run's one ``Health`` (kept on ``watched``): ``/healthz`` and the ``multigpu_healthy``
    gauge answer alike."""
    with _MAKING:
        if not isinstance(watched.health, Health):
            watched.health = Health(watched)
        return watched.health


def answer(watched: Watched) -> tuple[int, str]:
    """(status, one line) for one ``GET /healthz`` of the run (``of``)."""
    return of(watched).answer()


class _Handler(BaseHTTPRequestHandler):
    health: Health

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/healthz":
            code, text = 404, "not found: GET /healthz"
        else:
            code, text = self.health.answer()
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
    handler = type("HealthHandler", (_Handler,), {"health": of(watched)})
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
