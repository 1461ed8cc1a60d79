"""The health verdict (``GET /healthz``) on fake ranks and a fake clock: 200 while every rank lives
and progresses, 503 naming the rank once one failed or stopped progressing past its timeout."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from multigpu.observe import health
from multigpu.supervisor.states import WorkerState
from unit.observe.fakes import ranks, steps, watched


def test_a_rank_without_steps_is_judged_by_the_jobs_silence() -> None:
    workers, book, clock = ranks(2, ceiling=8.0)
    steps(book, clock, 30, 0.5, (0,))  # rank 1 reports no step; rank 0 progresses: the job is not silent
    assert health.verdict(workers, book, clock.now) is None


def test_healthy_while_every_rank_steps() -> None:
    workers, book, clock = ranks(2)
    steps(book, clock, 5, 0.5, (0, 1))
    assert health.verdict(workers, book, clock.now) is None


def test_a_rank_quiet_past_its_learned_timeout_is_named() -> None:
    workers, book, clock = ranks(2, ceiling=8.0)
    steps(book, clock, 5, 0.5, (0, 1))
    steps(book, clock, 10, 0.5, (0,))  # rank 1 stopped stepping 5 s ago; its learned timeout: 2.5 s
    why = health.verdict(workers, book, clock.now)
    assert why is not None and why.startswith("rank 1 made no progress for 5.0s, past its hang timeout")


def test_before_the_first_step_the_given_timeout_rules() -> None:
    workers, book, clock = ranks(2, ceiling=8.0)
    clock.now += 7.9
    assert health.verdict(workers, book, clock.now) is None
    clock.now += 0.2
    why = health.verdict(workers, book, clock.now)
    assert why == "rank 0 made no progress for 8.1s, past its hang timeout 8s"  # as quiet: the lowest


def test_without_a_hang_timeout_the_learned_step_time_still_judges() -> None:
    workers, book, clock = ranks(2, ceiling=None)
    steps(book, clock, 5, 1.0, (0, 1))
    clock.now += 4.0
    assert health.verdict(workers, book, clock.now) is None  # clamp(5 x 1 s, floor 2 s) = 5 s
    clock.now += 1.5
    why = health.verdict(workers, book, clock.now)
    assert why is not None and "past its hang timeout 5s" in why
    book.finished(0, clock.now)  # once a rank has finished, the others may wait on anything
    clock.now += 100
    assert health.verdict(workers, book, clock.now) is None


def test_a_failed_rank_is_named_first() -> None:
    workers, book, clock = ranks(3)
    workers[2].to(WorkerState.FAILED)
    workers[2].returncode = 3
    workers[0].to(WorkerState.STOPPED)
    assert health.verdict(workers, book, clock.now) == "rank 2 failed (exit 3)"


def test_of_the_stopped_ranks_the_one_that_stopped_progressing_first_is_named() -> None:
    workers, book, clock = ranks(2)
    steps(book, clock, 5, 0.5, (0, 1))
    steps(book, clock, 3, 0.5, (0,))
    for w in workers:
        w.to(WorkerState.STOPPED)
    why = health.verdict(workers, book, clock.now)
    assert why is not None and why.startswith("rank 1 was stopped by the launcher")


def test_finished_ranks_are_healthy() -> None:
    workers, book, clock = ranks(2)
    for w in workers:
        w.to(WorkerState.SUCCEEDED)
    clock.now += 100
    assert health.verdict(workers, book, clock.now) is None


def test_the_server_answers_healthz_and_closes(tmp_path: object) -> None:
    workers, book, clock = ranks(2)
    seen = watched(clock=clock)
    with health.serving(seen, "127.0.0.1", 0) as port:
        url = f"http://127.0.0.1:{port}/healthz"
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert (reply.status, reply.read()) == (200, b"ok: no rank started yet\n")
        seen.attach(workers, book)
        workers[1].to(WorkerState.FAILED)
        workers[1].returncode = -9
        try:
            urllib.request.urlopen(url, timeout=5)
            raise AssertionError("a failed rank answered 200")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503 and exc.read() == b"rank 1 failed (SIGKILL)\n"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
            raise AssertionError("a path other than /healthz answered 200")
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
    try:
        urllib.request.urlopen(url, timeout=5)
        raise AssertionError("the server still answers after its block")
    except urllib.error.URLError as exc:
        assert isinstance(exc.reason, ConnectionRefusedError)


GUIDE = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"


def test_the_guides_kubernetes_probe_reaches_the_loopback_server() -> None:
    """The server listens on loopback only, and a Kubernetes ``httpGet`` probe connects to the pod's
    address, where nothing listens: the guide's probe runs inside the pod. Its command, run against the
    server, succeeds on 200 and fails on 503."""
    guide = GUIDE.read_text()
    probe = guide[guide.index("livenessProbe:") :].split("```", 1)[0]
    assert "httpGet" not in probe, probe
    found = re.search(r"command: (\[.*\])", probe)
    assert found is not None, probe
    command = json.loads(found.group(1))
    workers, book, clock = ranks(2)
    seen = watched(clock=clock)
    seen.attach(workers, book)
    with health.serving(seen, "127.0.0.1", 0) as port:
        run = [sys.executable, *command[1:-1], command[-1].replace("8081", str(port))]
        assert subprocess.run(run, capture_output=True, timeout=30).returncode == 0
        workers[1].to(WorkerState.FAILED)
        assert subprocess.run(run, capture_output=True, timeout=30).returncode != 0


def test_a_failure_is_answered_until_the_next_attempt_steps() -> None:
    """A probe every few seconds must see a failure the launcher restarted from in under a second:
    the 503 stays through the restart until the next attempt's ranks report a step."""
    workers, book, clock = ranks(2)
    seen = watched(clock=clock)
    seen.attach(workers, book)
    probe = health.Health(seen)
    steps(book, clock, 3, 0.5, (0, 1))
    assert probe.answer() == (200, "ok")
    workers[1].to(WorkerState.FAILED)
    workers[1].returncode = 3
    assert probe.answer() == (503, "rank 1 failed (exit 3)")
    again, fresh, _ = ranks(2)
    seen.attach(again, fresh)  # the restart: its ranks run, none has stepped yet
    assert probe.answer() == (503, "rank 1 failed (exit 3); the next attempt has not trained yet")
    steps(fresh, clock, 1, 0.5, (0,))
    assert probe.answer() == (200, "ok")


def test_a_failure_no_probe_saw_is_answered_once_the_next_attempt_runs() -> None:
    """A probe every 10 s misses a restart of under a second: the answer after it judges the attempt
    that ended too."""
    workers, book, clock = ranks(2)
    seen = watched(clock=clock)
    seen.attach(workers, book)
    probe = health.of(seen)
    steps(book, clock, 3, 0.5, (0, 1))
    assert probe.answer() == (200, "ok")
    workers[1].to(WorkerState.FAILED)
    workers[1].returncode = 3  # no probe meanwhile: the launcher restarts at once
    again, fresh, _ = ranks(2)
    seen.attach(again, fresh)
    assert probe.answer() == (503, "rank 1 failed (exit 3); the next attempt has not trained yet")
    steps(fresh, clock, 1, 0.5, (0,))
    assert probe.answer() == (200, "ok")


def test_within_one_attempt_the_answer_follows_the_verdict() -> None:
    """A rank quiet past its learned timeout (a long evaluation outside a section) that steps again is
    healthy again: a 503 kept for the rest of the attempt would have a liveness probe kill a healthy
    job."""
    workers, book, clock = ranks(2, ceiling=None)
    seen = watched(clock=clock)
    seen.attach(workers, book)
    probe = health.of(seen)
    steps(book, clock, 30, 0.5, (0, 1))
    clock.now += 100
    assert probe.answer()[0] == 503
    steps(book, clock, 2, 0.5, (0, 1))
    assert probe.answer() == (200, "ok")


def test_the_gauge_and_the_port_answer_alike() -> None:
    workers, book, clock = ranks(2)
    seen = watched(clock=clock)
    seen.attach(workers, book)
    assert health.of(seen) is health.of(seen)
    steps(book, clock, 3, 0.5, (0, 1))
    workers[1].to(WorkerState.FAILED)
    workers[1].returncode = 3
    assert health.answer(seen)[0] == 503
    seen.attach(*ranks(2)[:2])
    assert health.answer(seen)[0] == 503  # the memory is the run's, whoever asks
