"""``--metrics-port``: the launcher's Prometheus endpoint, ``/metrics`` in Prometheus's text format.

Runs in the launcher. ``RunCollector`` is a custom collector in a private registry: each scrape reads
``watched.Watched`` on the HTTP server's thread (``prometheus_client``'s), so the supervisor's loop
keeps no metric objects up to date and never waits on a scrape. Every sample carries the run's labels:
``run_id``, ``node`` (this launcher's node index) and ``slurm_job_id`` where SLURM runs the job.
``FAMILIES`` lists every family exported; docs/metrics.md and docs/grafana-dashboard.json use them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from multigpu.observe.health import answer as health_answer
from multigpu.observe.health import rank_timeout
from multigpu.observe.watched import Attempt, Watched
from multigpu.supervisor.eta import estimate
from multigpu.supervisor.states import WorkerState

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

    Family = GaugeMetricFamily | CounterMetricFamily

FAMILIES: dict[str, str] = {
    "multigpu_up": "1 while this node's launcher runs the job",
    "multigpu_healthy": "1 while every rank lives and progresses (as /healthz answers 200), else 0",
    "multigpu_attempt": "the attempt running now (0: the first)",
    "multigpu_ranks": "this node's ranks in each state",
    "multigpu_rank_step": "the last step a rank reported (multigpu.heartbeat(step=N))",
    "multigpu_rank_last_progress_seconds": "seconds since a running rank's last progress (a step, a "
    "section boundary, a heartbeat; its output for a rank that reports none)",
    "multigpu_rank_hang_timeout_seconds": "the hang timeout in force for a rank (given or learned)",
    "multigpu_rank_step_seconds": "a rank's median step interval over its recent steps",
    "multigpu_straggler_lateness_seconds": "how late a rank enters collectives against this node's "
    "other ranks",
    "multigpu_step_rate": "the job's steps per second here: its slowest rank's median step interval, "
    "inverted",
    "multigpu_job_step": "the job's step: the lowest any rank of this node reported",
    "multigpu_job_steps": "the job's step count (--steps)",
    "multigpu_eta_seconds": "seconds left at the slowest rank's median step interval (with --steps)",
    "multigpu_restarts": "restarts of the group after a failure, this run",
    "multigpu_incidents": "attempts that did not succeed, by kind (failed, hung, interrupted, "
    "membership change)",
    "multigpu_lost_seconds": "seconds of the run's wall time lost, by cause",
    "multigpu_preflight_seconds": "how long the nodes' preflight check took",
    "multigpu_preflight_matmul_gflops": "this node's matmul rate in the preflight check",
    "multigpu_preflight_all_reduce_gbps": "this node's all_reduce bandwidth in the preflight check",
    "multigpu_preflight_slow": "1 when the preflight check named this node slow",
}
"""Every family's name (counters without their ``_total``) and its help text."""

COUNTERS = frozenset({"multigpu_restarts", "multigpu_incidents", "multigpu_lost_seconds"})


def exported_names() -> frozenset[str]:
    """Every series name a scrape may hold (a counter's with its ``_total``)."""
    return frozenset(f"{n}_total" if n in COUNTERS else n for n in FAMILIES)


class RunCollector:
    """The launcher's families, read from ``watched`` at each scrape (see the module docstring)."""

    def __init__(self, watched: Watched) -> None:
        self.watched = watched

    def collect(self) -> Iterator[Metric]:
        w = self.watched
        base = {"run_id": w.run_id, "node": w.node_label()}
        if w.slurm_job_id:
            base["slurm_job_id"] = w.slurm_job_id
        families = _Families(base)
        families.add("multigpu_up", 1)
        families.add("multigpu_healthy", 1 if health_answer(w)[0] == 200 else 0)
        families.add("multigpu_restarts", w.restarts())
        attempts = list(w.record.get("attempts", ()))
        families.add("multigpu_attempt", attempts[-1]["attempt"] if attempts else 0)
        kinds: dict[str, int] = {}
        for item in list(w.record.get("incidents", ())):
            kinds[item["kind"]] = kinds.get(item["kind"], 0) + 1
        families.by("multigpu_incidents", "kind", kinds)
        families.by("multigpu_lost_seconds", "cause", w.lost())
        _ranks(families, w.attempt, w.clock())
        _progress(families, w.attempt)
        _preflight(families, w.record.get("preflight"), int(base["node"]))
        yield from families.all()


def _ranks(families: _Families, attempt: Attempt | None, now: float) -> None:
    """Each rank's figures, the state counts and the job's step rate (ranks not started: none)."""
    workers = list(attempt.workers) if attempt is not None else []
    states = {s.value: 0 for s in WorkerState}
    for worker in workers:
        states[worker.state.value] += 1
    families.by("multigpu_ranks", "state", states)
    medians: list[float] = []
    for worker in workers:
        assert attempt is not None
        p = attempt.progress.ranks.get(worker.rank)
        if p is None:
            continue
        rank = {"rank": str(worker.rank)}
        if p.step is not None:
            families.add("multigpu_rank_step", p.step, rank)
        if worker.state is WorkerState.RUNNING:  # an age that grows for a rank that ended pages no one
            families.add("multigpu_rank_last_progress_seconds", max(0.0, now - p.last_progress), rank)
        timeout = rank_timeout(attempt.progress, worker.rank)
        if timeout is not None:
            families.add("multigpu_rank_hang_timeout_seconds", timeout, rank)
        median = p.median_interval()
        if median is not None:
            families.add("multigpu_rank_step_seconds", median, rank)
            medians.append(median)
        if p.late_s is not None:
            families.add("multigpu_straggler_lateness_seconds", p.late_s, rank)
    slowest = max(medians, default=0.0)
    families.add("multigpu_step_rate", 1 / slowest if slowest > 0 else 0.0)


def _progress(families: _Families, attempt: Attempt | None) -> None:
    """The job's step, its ``--steps`` and the seconds left (``supervisor/eta.py``), where known."""
    book = attempt.progress if attempt is not None else None
    if book is None:
        return
    step, total, eta = estimate(list(book.ranks.values()), book.total_steps)
    for name, value in (
        ("multigpu_job_step", step),
        ("multigpu_job_steps", total),
        ("multigpu_eta_seconds", eta),
    ):
        if value is not None:
            families.add(name, value)


def _preflight(families: _Families, entry: Mapping[str, Any] | None, node: int) -> None:
    """This node's preflight figures (the check ran: ``runner/preflight_verdict.record_entry``)."""
    if not entry or "seconds" not in entry:
        return
    families.add("multigpu_preflight_seconds", entry["seconds"])
    mine = entry.get("nodes", {}).get(str(node), {})
    for key in ("matmul_gflops", "all_reduce_gbps"):
        if isinstance(mine.get(key), (int, float)):
            families.add(f"multigpu_preflight_{key}", mine[key])
    families.add("multigpu_preflight_slow", 1 if node in entry.get("slow_nodes", ()) else 0)


class _Families:
    """One scrape's families, each made once, its samples labelled with the run's labels."""

    def __init__(self, base: Mapping[str, str]) -> None:
        self.base = dict(base)
        self.made: dict[str, Family] = {}

    def add(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        extra = dict(labels or {})
        family = self._family(name, tuple(extra))
        family.add_metric([*self.base.values(), *extra.values()], value)

    def by(self, name: str, label: str, values: Mapping[str, float]) -> None:
        """One sample per ``label`` value; the family shows, without samples, when there are none."""
        self._family(name, (label,))
        for key, value in sorted(values.items()):
            self.add(name, value, {label: key})

    def _family(self, name: str, extra: Sequence[str]) -> Family:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if name not in self.made:
            kind = CounterMetricFamily if name in COUNTERS else GaugeMetricFamily
            self.made[name] = kind(name, FAMILIES[name], labels=[*self.base, *extra])
        return self.made[name]

    def all(self) -> Iterable[Metric]:
        """Every family, those without a sample this scrape included (their HELP and TYPE show)."""
        for name in FAMILIES:
            yield self.made[name] if name in self.made else self._family(name, ())


@contextlib.contextmanager
def serving(watched: Watched, host: str, port: int) -> Iterator[int]:
    """``/metrics`` on ``host:port`` for the ``with`` block (the port bound is yielded; 0 picks one);
    afterwards the socket is closed and the server's thread joined."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(watched))  # type: ignore[arg-type]
    server, thread = start_http_server(port, addr=host, registry=registry)
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
