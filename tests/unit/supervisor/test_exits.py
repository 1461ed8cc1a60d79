"""What a rank's exit means (``supervisor/exits.py``), on stand-in ranks: the race a rank killed by an
outside stop signal waits out, which exits count as such a stop, and who sent a fatal signal where the
traces say (the node's file timer first). No processes."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from multigpu.contract.failure import FailureKind, RankIdentity, WorkerFailure
from multigpu.supervisor.exits import STOP_RACE_S, StopRace, failure_of, outside_stop, who_killed
from multigpu.supervisor.file_timer import TimerKill, TimerKills


def test_a_held_rank_is_due_when_its_window_closes_or_when_ours_comes() -> None:
    race = StopRace()
    assert not race and race.next_due() is None
    first, second = SimpleNamespace(rank=0), SimpleNamespace(rank=1)
    race.hold(first, -signal.SIGTERM, now=10.0)  # type: ignore[arg-type]
    race.hold(second, -signal.SIGINT, now=10.1)  # type: ignore[arg-type]
    assert race and race.next_due() == 10.0 + STOP_RACE_S
    assert race.due(10.0, all_of_them=False) == []
    due = race.due(10.0 + STOP_RACE_S, all_of_them=False)
    assert [(p.worker, p.rc) for p in due] == [(first, -signal.SIGTERM)]
    assert [p.worker for p in race.due(10.0, all_of_them=True)] == [second]
    assert not race and race.next_due() is None


def _rank(finished: bool = False, record: object = None) -> SimpleNamespace:
    return SimpleNamespace(finished=finished, own_record=lambda: record)


def test_an_outside_stop_is_a_stop_signal_the_rank_did_not_explain() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        assert outside_stop(_rank(), -sig)  # type: ignore[arg-type]
    assert not outside_stop(_rank(), -signal.SIGKILL)  # type: ignore[arg-type]
    assert not outside_stop(_rank(), 1)  # type: ignore[arg-type]
    assert not outside_stop(_rank(finished=True), -signal.SIGTERM)  # type: ignore[arg-type]
    assert not outside_stop(_rank(record=object()), -signal.SIGTERM)  # type: ignore[arg-type]


def test_a_sigabrt_after_nccls_watchdog_line_names_the_watchdog() -> None:
    tail = ["[rank1] Watchdog caught collective operation timeout"]
    watched = SimpleNamespace(oom=None, pid=7, lines=SimpleNamespace(tail=tail))
    assert "NCCL's watchdog" in (who_killed(watched, -signal.SIGABRT) or "")  # type: ignore[arg-type]
    quiet = SimpleNamespace(oom=None, pid=7, lines=SimpleNamespace(tail=["x"]))
    assert who_killed(quiet, -signal.SIGABRT) is None  # type: ignore[arg-type]
    assert who_killed(watched, -signal.SIGKILL) is None  # type: ignore[arg-type]  # no OOM evidence


def test_a_kill_the_file_timer_sent_is_named_before_any_oom_check() -> None:
    oom = SimpleNamespace(explain=lambda pid: "the kernel's OOM killer")
    worker = SimpleNamespace(
        oom=oom,
        pid=40,
        end_time=5.0,
        lines=SimpleNamespace(tail=[]),
        own_record=lambda: None,
        ended_with=lambda rc, record: WorkerFailure.from_exit(RankIdentity(0, 0, 0, 40), rc, record),
    )
    output = SimpleNamespace(of=lambda w: w, drain=lambda stream: None)
    kills = TimerKills()
    kills.note(TimerKill(pid=41, group=40, scope="timer.py#7", seconds=2.0, signal=signal.SIGKILL))
    timed = failure_of(worker, -signal.SIGKILL, False, output, kills)  # type: ignore[arg-type]
    assert timed.kind is FailureKind.TIMER_EXPIRED and timed.killed_by == "the file timer of scope timer.py#7"
    assert timed.describe() == "rank 0 (node 0, pid 40) overstayed its 2 s timer (scope timer.py#7); killed"
    assert timed.launcher_exit_code == 137
    other = failure_of(worker, -signal.SIGKILL, False, output, TimerKills())  # type: ignore[arg-type]
    assert other.kind is None and other.killed_by == "the kernel's OOM killer"
    termed = failure_of(worker, -signal.SIGTERM, False, output, kills)  # type: ignore[arg-type]
    assert termed.kind is None  # the timer sent SIGKILL, not this
