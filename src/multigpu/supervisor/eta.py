"""The job's progress and its ETA, with no change to the script: the step from the ranks' own
``multigpu.heartbeat(step=N)``, the total from ``--steps`` (``OutputConfig.steps``).

Runs in the launcher: the live view and ``multigpu status`` (on the supervisor's loop) and the run's
ledger (``record/ledger.py``, read from any thread: a metrics server's) ask it, from the progress book's
``RankProgress`` records. A job goes as fast as its slowest rank, so its step is the lowest any rank
reported and its pace that rank's median step interval.
"""

from __future__ import annotations

from collections.abc import Sequence

from multigpu.supervisor.states import RankProgress


def estimate(ranks: Sequence[RankProgress], total: int | None) -> tuple[int | None, int | None, float | None]:
    """(the job's step or None before any, ``total``, seconds left or None): the seconds left are the
    steps left at the slowest median step interval; None without a total or a known interval."""
    stepping = [p for p in ranks if p.step is not None]
    if not stepping:
        return None, total, None
    step = min(p.step for p in stepping if p.step is not None)
    medians = [m for p in stepping if (m := p.median_interval()) is not None]
    if total is None or not medians:
        return step, total, None
    return step, total, max(0, total - step) * max(medians)


def duration_text(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h02m``: an ETA as a person reads it."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def progress_text(step: int | None, total: int | None, eta: float | None) -> str:
    """``step 120/1000 (12%), ETA 3m20s``, ``step 120``; "" before any step."""
    if step is None:
        return ""
    if total is None:
        return f"step {step}"
    text = f"step {step}/{total} ({100 * min(step, total) / total:.0f}%)"
    return text if eta is None else f"{text}, ETA {duration_text(eta)}"
