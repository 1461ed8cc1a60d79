"""torchrun's file-timer watchdog as the launcher hosts it (``supervisor/file_timer.py``): torch's own
``FileTimerServer`` in this process, fed torch's own requests; the rank it kills is a ``sleep`` here."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

from multigpu.contract.failure import FailureKind, WorkerFailure
from multigpu.runner.crash_loop import CrashLoopPolicy
from multigpu.supervisor import file_timer
from multigpu.supervisor.file_timer import FileTimerHost, TimerKill, TimerKills, hosted


def _request(path: str, pid: int, scope: str, after: float, sig: int = signal.SIGKILL) -> None:
    """What torch's ``FileTimerClient.acquire`` writes (for a pid other than the writer's)."""
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerRequest

    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "wt") as fifo:
        fifo.write(FileTimerRequest(pid, scope, time.time() + after, sig).to_json() + "\n")


def test_the_watchdog_starts_only_when_torchruns_variable_is_one(tmp_path: Path) -> None:
    with hosted({}, "run") as none, hosted({file_timer.ENABLE_ENV: "true"}, "run") as other:
        assert none is None and other is None
    path = str(tmp_path / "timer")
    with hosted({file_timer.ENABLE_ENV: "1", file_timer.TIMER_FILE_ENV: path}, "run") as host:
        assert host is not None and host.path == path and stat.S_ISFIFO(os.stat(path).st_mode)
    assert not os.path.exists(path)  # removed with the attempt
    default = file_timer.timer_path({})
    assert os.path.basename(default).startswith("watchdog_timer_")  # node-local, as torchrun's
    assert default != file_timer.timer_path({})  # one per attempt


def test_an_expired_timer_kills_its_rank_notes_why_first_and_spares_the_launcher(tmp_path: Path) -> None:
    host = FileTimerHost(str(tmp_path / "timer"), "run")
    host.start()
    rank = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        started = time.monotonic()
        _request(host.path, rank.pid, "/work/train.py#7", after=0.5)
        assert rank.wait(timeout=10) == -signal.SIGKILL
        took = time.monotonic() - started
        assert 0.4 < took < 3, took
        kill = host.kills.of(rank.pid, signal.SIGKILL)
        assert kill is not None and kill.group == rank.pid
        assert kill.message == "overstayed its 0.5 s timer (scope train.py#7); killed"
        assert host.kills.of(rank.pid, signal.SIGTERM) is None
        time.sleep(0.1)  # torch's server would now SIGKILL its own process: this test is still here
    finally:
        rank.kill()
        rank.wait()
        stopping = time.monotonic()
        host.stop()
    assert time.monotonic() - stopping < 0.5 and not os.path.exists(host.path)


def test_a_released_timer_kills_nothing(tmp_path: Path) -> None:
    with hosted({file_timer.ENABLE_ENV: "1", file_timer.TIMER_FILE_ENV: str(tmp_path / "t")}, "run") as host:
        assert host is not None
        rank = subprocess.Popen(["sleep", "30"], start_new_session=True)
        try:
            _request(host.path, rank.pid, "s#1", after=0.3)
            fd = os.open(host.path, os.O_WRONLY | os.O_NONBLOCK)
            release = {"version": 1, "pid": rank.pid, "scope_id": "s#1", "expiration_time": -1, "signal": 0}
            with os.fdopen(fd, "wt") as fifo:  # FileTimerClient.release
                fifo.write(json.dumps(release) + "\n")
            time.sleep(0.8)
            assert rank.poll() is None and host.kills.of(rank.pid, signal.SIGKILL) is None
        finally:
            rank.kill()
            rank.wait()


def test_stop_without_any_client_lets_the_blocked_thread_go_at_once(tmp_path: Path) -> None:
    before = threading.active_count()
    for _ in range(3):
        host = FileTimerHost(str(tmp_path / "timer"), "run")
        host.start()
        started = time.monotonic()
        host.stop()
        assert time.monotonic() - started < 0.5
    time.sleep(0.05)
    assert threading.active_count() == before  # no thread left blocked opening the FIFO


def test_the_kill_reads_as_one_line_and_is_one_signature_per_scope() -> None:
    kills = TimerKills()
    kills.note(TimerKill(pid=41, group=40, scope="/home/u/timer.py#7", seconds=2.02, signal=signal.SIGKILL))
    assert kills.of(40, signal.SIGKILL) is kills.of(41, signal.SIGKILL) is not None  # the rank, or its child
    assert kills.of(42, signal.SIGKILL) is None
    kill = kills.of(40, signal.SIGKILL)
    assert kill is not None and kill.message == "overstayed its 2 s timer (scope timer.py#7); killed"
    failure = WorkerFailure(
        rank=0,
        local_rank=0,
        pid=40,
        signal="SIGKILL",
        error_type=FailureKind.TIMER_EXPIRED,
        message=kill.message,
        killed_by=kill.killer,
    )
    assert failure.describe() == "rank 0 (node 0, pid 40) overstayed its 2 s timer (scope timer.py#7); killed"
    again = WorkerFailure.from_dict(failure.to_dict())
    assert again.kind is FailureKind.TIMER_EXPIRED and again.describe() == failure.describe()
    policy = CrashLoopPolicy()
    assert policy.check(failure, 0) is None
    verdict = policy.check(again, 1)
    assert verdict is not None and "file timer of scope timer.py#7" in verdict
    unnamed = TimerKill(1, 1, f"{threading.__file__.replace('threading', 'contextlib')}#137", 2.0, 9)
    assert unnamed.message == (
        "overstayed its 2 s timer (scope contextlib.py#137: expires() was given no scope=); killed"
    )
    assert TimerKill(1, 1, "warmup", 0.3, 9).message == "overstayed its 0.3 s timer (scope warmup); killed"
