"""The job's progress and ETA (``supervisor/eta.py``) as the live view, ``multigpu status`` and the
ledger show them: the slowest rank's step, ``--steps`` as the total."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest

from multigpu.supervisor.control import job_line
from multigpu.supervisor.eta import duration_text, estimate, progress_text
from multigpu.supervisor.hangs.book import HangPolicy, ProgressBook
from multigpu.supervisor.states import RankProgress


def rank(r: int, step: int | None, *intervals: float) -> RankProgress:
    return RankProgress(r, 0.0, 0.0, step=step, intervals=deque(intervals))


def test_the_job_is_as_far_as_its_slowest_rank_and_as_fast() -> None:
    ranks = [rank(0, 50, 0.1, 0.1), rank(1, 48, 0.2, 0.2, 0.3), rank(2, None)]
    assert estimate(ranks, 100) == (48, 100, pytest.approx(52 * 0.2))
    assert estimate(ranks, None) == (48, None, None)  # no total: the step alone
    assert estimate([rank(0, 3)], 10) == (3, 10, None)  # no interval yet
    assert estimate([rank(0, None)], 10) == (None, 10, None)
    assert estimate([rank(0, 12, 1.0)], 10) == (12, 10, 0)  # past the hint: nothing left


def test_the_progress_reads_as_a_person_says_it() -> None:
    assert progress_text(120, 1000, 200.0) == "step 120/1000 (12%), ETA 3m20s"
    assert progress_text(120, None, None) == "step 120"
    assert progress_text(5, 10, None) == "step 5/10 (50%)"
    assert progress_text(None, 10, None) == ""
    assert [duration_text(s) for s in (4.4, 65, 3 * 3600 + 130)] == ["4s", "1m05s", "3h02m"]


def test_multigpu_status_ends_with_the_jobs_line_once_a_step_is_known(tmp_path: Path) -> None:
    book = ProgressBook(HangPolicy(), [0, 1], store=tmp_path / "learned.json")
    assert job_line(book) == ""
    book.total_steps = 10
    for r in (0, 1):
        book.ranks[r].step, book.ranks[r].intervals = 4, deque([0.5])
    assert job_line(book) == "job: step 4/10 (40%), ETA 3s\n"


def test_the_live_views_title_carries_the_progress() -> None:
    from multigpu.console.ranks import PrefixedConsole
    from multigpu.runner.live_view import LiveStatus

    live = LiveStatus("multigpu attempt 0", PrefixedConsole(None))
    assert live.heading() == "multigpu attempt 0"
    book = ProgressBook(HangPolicy(), [0])
    live.book = book
    assert live.heading() == "multigpu attempt 0"  # no step yet
    book.total_steps, book.ranks[0].step, book.ranks[0].intervals = 100, 25, deque([2.0])
    assert live.heading() == "multigpu attempt 0: step 25/100 (25%), ETA 2m30s"
