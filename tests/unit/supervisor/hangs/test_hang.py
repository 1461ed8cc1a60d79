"""hang.py on its own: the line naming who stopped first (ties named together), the notice that names no
rank, and the ``Hang`` failures a called hang becomes, root cause first. No processes."""

from __future__ import annotations

from types import SimpleNamespace

from multigpu.contract.failure import FailureKind, RankIdentity, WorkerFailure
from multigpu.supervisor.hangs.hang import Hang, Timeout, hang_failures, hang_line, hang_notice
from multigpu.supervisor.states import RankProgress

LIMIT = Timeout(5.0, "learned: 5 x slowest step 1s, floor 2s, ceiling 600s")


def ranks() -> dict[int, RankProgress]:
    """Ranks 1 and 2 stopped at step 10 within a millisecond of each other; rank 0 went on to step 12."""
    return {
        0: RankProgress(0, 108.0, 108.0, step=12),
        1: RankProgress(1, 100.0, 100.0, step=10),
        2: RankProgress(2, 100.001, 100.001, step=10),
    }


def test_ranks_tied_first_are_named_together_and_the_rest_after() -> None:
    quiet = {0: 2.0, 1: 10.0, 2: 9.999}
    culprits, line = hang_line(ranks(), [1, 2, 0], quiet, LIMIT, {1, 2})
    assert culprits == [1, 2, 0]
    assert line == (
        "ranks 1, 2 stopped progressing first: last progress 10.0s ago at step 10 "
        f"(timeout 5s, {LIMIT.why}); rank 0 at step 12, 2.0s ago"
    )


def test_the_notice_names_the_silence_and_the_last_step_but_no_rank() -> None:
    assert hang_notice(ranks(), [0, 1, 2], 10.0, LIMIT) == (
        f"no progress for 10.0s since step 12 (timeout 5s, {LIMIT.why})"
    )
    ceiling = Timeout(600.0, "no rank has shown progress for 600.0s, --hang-timeout 600s")
    assert (
        hang_notice(ranks(), [0], 600.0, ceiling)
        == "no progress for 600.0s since step 12 (--hang-timeout 600s)"
    )


def test_a_hang_becomes_one_failure_per_running_rank_the_first_culprit_its_root_cause() -> None:
    def worker(rank: int) -> SimpleNamespace:
        return SimpleNamespace(
            rank=rank,
            dumps=SimpleNamespace(stacks=[]),
            ended_with=lambda rc: WorkerFailure.from_exit(RankIdentity(rank, rank, 0, 40 + rank), rc),
        )

    hang = Hang([1, 0], "rank 1 stopped progressing first: ...", {0: 2.0, 1: 10.0})
    failures = hang_failures(hang, [worker(0), worker(1)], [], wall_now=1000.0)  # type: ignore[list-item]
    assert [f.rank for f in failures] == [1, 0]
    assert all(f.kind is FailureKind.HANG for f in failures)
    assert failures[0].message == hang.line and failures[1].message == "no progress for 2.0s"
    assert failures[0].time is not None and failures[1].time is not None
    assert failures[0].time < failures[1].time  # the root cause first in time
