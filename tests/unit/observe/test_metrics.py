"""The collector on fake ranks, parsed back with prometheus_client's own parser: every family, the
run's labels on every sample, the values read from the launcher's state; and the Grafana dashboard
in docs/ asks only for series we export."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from multigpu.observe import metrics
from multigpu.observe.watched import Watched
from multigpu.supervisor.states import WorkerState
from unit.observe.fakes import ranks, steps, watched

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana-dashboard.json"


def scrape(seen: Watched) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Series name -> (labels, value) of one scrape, through the text format and its parser."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.RunCollector(seen))  # type: ignore[arg-type]
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        out.setdefault(family.name, [])
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


RECORD = {
    "attempts": [{"attempt": 0}, {"attempt": 1}, {"attempt": 2}],
    "incidents": [
        {"kind": "failed", "failed_time": 10.0, "detected_time": 11.0, "stopped_time": 12.0},
        {"kind": "hung", "failed_time": 20.0, "detected_time": 28.0, "stopped_time": 30.0},
    ],
    "preflight": {
        "seconds": 1.5,
        "nodes": {"0": {"matmul_gflops": 50.0, "all_reduce_gbps": 2.0}, "1": {"matmul_gflops": 9.0}},
        "slow_nodes": [1],
    },
}


def test_every_family_with_the_runs_labels_and_the_launchers_values() -> None:
    workers, book, clock = ranks(2)
    steps(book, clock, 6, 0.5, (0, 1))
    steps(book, clock, 2, 0.5, (0,))  # rank 1: 1 s behind
    book.ranks[1].late_s = 0.25
    book.total_steps = 25  # --steps 25
    seen = watched(dict(RECORD), slurm_job_id="4242", clock=clock)
    seen.attach(workers, book)
    got = scrape(seen)
    assert {n for n in metrics.FAMILIES} <= set(got)
    for samples in got.values():
        for labels, _ in samples:
            assert labels["run_id"] == "run-1" and labels["node"] == "0" and labels["slurm_job_id"] == "4242"
    by_rank = {s[0]["rank"]: s[1] for s in got["multigpu_rank_step"]}
    assert by_rank == {"0": 7.0, "1": 5.0}
    quiet = {s[0]["rank"]: s[1] for s in got["multigpu_rank_last_progress_seconds"]}
    assert quiet == {"0": 0.0, "1": 1.0}
    assert [(s[0]["rank"], s[1]) for s in got["multigpu_straggler_lateness_seconds"]] == [("1", 0.25)]
    assert {s[0]["state"]: s[1] for s in got["multigpu_ranks"]}["running"] == 2.0
    assert got["multigpu_step_rate"][0][1] == 2.0  # 0.5 s per step
    assert [got[n][0][1] for n in ("multigpu_job_step", "multigpu_job_steps")] == [5.0, 25.0]
    assert got["multigpu_eta_seconds"][0][1] == 10.0  # 20 steps left at 0.5 s
    assert got["multigpu_restarts_total"][0][1] == 2.0
    assert {s[0]["kind"]: s[1] for s in got["multigpu_incidents_total"]} == {"failed": 1.0, "hung": 1.0}
    lost = {s[0]["cause"]: s[1] for s in got["multigpu_lost_seconds_total"]}
    assert lost == {
        "restarting": 1.0 + 1.0,
        "hang_undetected": 8.0,
        "hang_handling": 2.0,
    }
    assert got["multigpu_preflight_matmul_gflops"][0][1] == 50.0
    assert got["multigpu_preflight_slow"][0][1] == 0.0
    assert got["multigpu_up"][0][1] == 1.0 and got["multigpu_healthy"][0][1] == 1.0


def test_a_given_lost_seconds_provider_is_what_is_exported() -> None:
    seen = watched(lost_seconds=lambda: {"training": 0.0, "preemption": 12.5})
    lost = {s[0]["cause"]: s[1] for s in scrape(seen)["multigpu_lost_seconds_total"]}
    assert lost == {"training": 0.0, "preemption": 12.5}


def test_before_any_rank_no_rank_series_and_no_slurm_label() -> None:
    got = scrape(watched())
    assert got["multigpu_rank_step"] == [] and "slurm_job_id" not in got["multigpu_up"][0][0]
    assert got["multigpu_step_rate"][0][1] == 0.0


def test_a_failed_rank_makes_the_job_unhealthy() -> None:
    workers, book, clock = ranks(2)
    seen = watched(clock=clock)
    seen.attach(workers, book)
    workers[0].to(WorkerState.FAILED)
    got = scrape(seen)
    assert got["multigpu_healthy"][0][1] == 0.0
    assert {s[0]["state"]: s[1] for s in got["multigpu_ranks"]}["failed"] == 1.0


def test_the_server_serves_the_scrape_and_closes() -> None:
    seen = watched()
    with metrics.serving(seen, "127.0.0.1", 0) as port:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        assert "multigpu_up{" in text
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        raise AssertionError("the server still answers after its block")
    except urllib.error.URLError as exc:
        assert isinstance(exc.reason, ConnectionRefusedError)


def dashboard_series() -> set[str]:
    """Every metric name in every PromQL expression of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    assert exprs, "the dashboard has no queries"
    functions = {"rate", "increase", "sum", "max", "min", "avg", "by", "time", "without", "count", "on"}
    names: set[str] = set()
    for expr in exprs:
        bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"|\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
        names |= {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare) if w not in functions}
    return names


def test_the_grafana_dashboard_queries_only_exported_series() -> None:
    asked = dashboard_series()
    assert asked <= metrics.exported_names(), sorted(asked - metrics.exported_names())
    assert "multigpu_rank_step" in asked and "multigpu_lost_seconds_total" in asked


def test_the_guide_lists_every_exported_family() -> None:
    page = (DASHBOARD.parent / "metrics.md").read_text()
    listed = set(re.findall(r"^\| `(multigpu_\w+)` \|", page, re.M))
    assert listed == metrics.exported_names()


def test_a_rank_that_no_longer_runs_has_no_last_progress_age() -> None:
    """The guide's alert is ``multigpu_rank_last_progress_seconds > 600``: a rank that finished while
    another still trains, or the last attempt's ranks while the nodes meet again, made no progress
    because they no longer run, and must not page anyone."""
    workers, book, clock = ranks(2)
    steps(book, clock, 3, 0.5, (0, 1))
    workers[1].to(WorkerState.SUCCEEDED)
    book.finished(1, clock.now)
    steps(book, clock, 1400, 0.5, (0,))  # rank 0 trains on for 700 s
    seen = watched(clock=clock)
    seen.attach(workers, book)
    ages = {s[0]["rank"]: s[1] for s in scrape(seen)["multigpu_rank_last_progress_seconds"]}
    assert ages == {"0": 0.0}
