"""The Supervisor in-process, with tiny ``python -c`` workers that never import torch.

Grace periods, hang timeouts and dump waits are injected small, so each test takes milliseconds to a
few seconds. Every test that starts processes proves by PID that they are gone afterwards.
"""

from __future__ import annotations

import os
import re
import signal
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import PYTHON, assert_gone, clean_env, logged, pids_in, write_script
from multigpu.contract.failure import WorkerFailure
from multigpu.contract.names import FR_DUMP_ENV
from multigpu.supervisor.loop import Supervisor
from multigpu.supervisor.states import RunResult, RunStatus, Worker, WorkerSpec, WorkerState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

GRACE = 0.3


class Sink:
    """Collects every whole line the supervisor hands on, per (rank, stream)."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str, bytes]] = []

    def write_lines(self, worker: Worker, stream: str, lines: list[bytes]) -> None:
        self.lines.extend((worker.rank, stream, line) for line in lines)

    def of(self, rank: int, stream: str | None = None) -> list[bytes]:
        return [line for r, s, line in self.lines if r == rank and (stream is None or s == stream)]


def py(code: str) -> list[str]:
    return [PYTHON, "-c", textwrap.dedent(code)]


def spec(
    rank: int, argv: list[str], tmp_path: Path, *, world: int = 2, error_file: bool = False
) -> WorkerSpec:
    err = tmp_path / f"error_rank_{rank}.json"
    env = clean_env({"RANK": str(rank), "WORLD_SIZE": str(world)})
    if error_file:
        env["MULTIGPU_ERROR_FILE"] = str(err)
    return WorkerSpec(
        rank=rank,
        local_rank=rank,
        argv=argv,
        env=env,
        log_path=tmp_path / f"rank_{rank}.log",
        error_file=err if error_file else None,
    )


def bootstrap(script: Path) -> list[str]:
    """The real worker bootstrap (faulthandler, error file), running a plain script."""
    return [PYTHON, "-m", "multigpu.rank", "script", str(script)]


def worker_pids(sup: Supervisor) -> list[int]:
    pids = [w.pid for w in sup.workers if w.pid is not None]
    assert len(pids) == len(sup.workers)
    return pids


def pump_until(sup: Supervisor, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Run the supervisor's loop until ``predicate()`` holds (a run outcome must not come first)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        outcome = sup.wait(timeout=0.05)
        assert outcome is None or predicate(), f"run ended early: {outcome}"


def said(sup: Supervisor, rank: int, text: str) -> Callable[[], bool]:
    return lambda: any(text in line for line in sup.workers[rank].lines.tail)


def finish(sup: Supervisor, timeout: float = 15.0) -> RunResult:
    result = sup.wait(timeout=timeout)
    assert result is not None, f"no outcome within {timeout}s"
    return result


# ---- outcomes ---------------------------------------------------------------------------------------


def test_all_succeed(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    sup = make([spec(r, py("print('done')"), tmp_path) for r in range(3)])
    sup.start()
    pids = worker_pids(sup)
    result = finish(sup)
    sup.close()
    assert result.status is RunStatus.SUCCEEDED
    assert result.failures == [] and result.root_cause is None
    assert [w.state for w in sup.workers] == [WorkerState.SUCCEEDED] * 3
    assert [w.returncode for w in sup.workers] == [0, 0, 0]
    assert_gone(pids)


def test_one_exits_nonzero_others_stopped(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    sleeper = py("import time; print('up', flush=True); time.sleep(30)")
    sup = make(
        [
            spec(0, sleeper, tmp_path),
            spec(1, py("import sys; sys.exit(3)"), tmp_path),
            spec(2, sleeper, tmp_path),
        ]
    )
    sup.start()
    pids = worker_pids(sup)
    result = finish(sup)
    assert result.status is RunStatus.FAILED
    root = result.root_cause
    assert root is not None
    assert (root.rank, root.exit_code, root.signal, root.pid) == (1, 3, None, pids[1])
    assert root.launcher_exit_code == 3
    sup.close()
    assert [w.state for w in sup.workers] == [WorkerState.STOPPED, WorkerState.FAILED, WorkerState.STOPPED]
    assert sup.workers[0].returncode == -signal.SIGTERM
    assert_gone(pids)


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (WorkerFailure(rank=0, local_rank=0, pid=1, exit_code=3), 3),
        (WorkerFailure(rank=0, local_rank=0, pid=1, exit_code=1), 1),
        (WorkerFailure(rank=0, local_rank=0, pid=1, signal="SIGSEGV"), 128 + signal.SIGSEGV),
        (WorkerFailure(rank=0, local_rank=0, pid=1, signal="SIGKILL"), 137),
        (WorkerFailure(rank=0, local_rank=0, pid=1, signal="SIGTERM"), 143),
        (WorkerFailure(rank=0, local_rank=0, pid=1), 1),  # a hang: neither code nor signal
    ],
)
def test_launcher_exit_code_mapping(failure: WorkerFailure, expected: int) -> None:
    assert failure.launcher_exit_code == expected


def test_killed_by_signal_is_named(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    sup = make([spec(0, py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), tmp_path)])
    sup.start()
    pids = worker_pids(sup)
    result = finish(sup)
    sup.close()
    root = result.root_cause
    assert result.status is RunStatus.FAILED and root is not None
    assert (root.signal, root.exit_code, root.launcher_exit_code) == ("SIGKILL", None, 137)
    assert "killed by SIGKILL" in root.describe()
    assert_gone(pids)


def test_ignored_sigterm_escalates_to_sigkill(
    make: Callable[..., Supervisor], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stubborn = py("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print('ignoring', flush=True)
        time.sleep(30)
    """)
    sup = make([spec(0, stubborn, tmp_path)])
    sup.start()
    pids = worker_pids(sup)
    pump_until(sup, said(sup, 0, "ignoring"))
    t0 = time.monotonic()
    sup.close(grace_period=GRACE)
    took = time.monotonic() - t0
    print(f"close() with a SIGTERM-ignoring rank took {took:.3f}s (grace {GRACE}s)")
    assert took >= GRACE * 0.9  # the grace period was granted before escalating
    assert sup.workers[0].returncode == -signal.SIGKILL
    assert sup.workers[0].state is WorkerState.STOPPED
    assert any(
        "SIGKILL" in n and "rank 0" in n and f"{GRACE:g}s after SIGTERM" in n for n in logged(caplog)
    ), logged(caplog)
    assert_gone(pids)


def test_close_twice_is_safe_and_start_twice_raises(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    sup = make([spec(0, py("import time; time.sleep(30)"), tmp_path)])
    sup.start()
    pids = worker_pids(sup)
    with pytest.raises(RuntimeError, match="twice"):
        sup.start()
    assert worker_pids(sup) == pids  # nothing new was spawned
    sup.close()
    sup.close()
    sup.close(grace_period=0)
    assert sup.workers[0].state is WorkerState.STOPPED
    assert_gone(pids)


def test_close_without_start_is_safe(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    sup = make([spec(0, py("pass"), tmp_path)])
    sup.close()
    sup.close()
    assert sup.workers[0].state is WorkerState.PENDING
    with pytest.raises(RuntimeError):
        sup.wait(timeout=0)


def test_grandchild_of_an_exited_rank_is_ended(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    """The rank exits by itself; its group (holding the grandchild) is still signalled at close."""
    ready = str(tmp_path / "ready")
    spawner = py(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen(['sleep', '60'])
        print(f'gc={{child.pid}}', flush=True)
        while not os.path.exists({ready!r}):
            time.sleep(0.01)
        sys.exit(2)
    """)
    sleeper = py(f"""
        import pathlib, subprocess, time
        child = subprocess.Popen(['sleep', '60'])
        print(f'gc={{child.pid}}', flush=True)
        pathlib.Path({ready!r}).touch()
        time.sleep(30)
    """)
    sup = make([spec(0, sleeper, tmp_path), spec(1, spawner, tmp_path)])
    sup.start()
    pids = worker_pids(sup)
    result = finish(sup)
    assert result.status is RunStatus.FAILED and result.root_cause is not None
    assert result.root_cause.rank == 1 and result.root_cause.exit_code == 2
    sup.close()
    grandchildren = [pid for r in range(2) for pid in pids_in((tmp_path / f"rank_{r}.log").read_text(), "gc")]
    assert len(grandchildren) == 2
    assert pids_in("\n".join(result.root_cause.log_tail), "gc") == grandchildren[1:]
    assert_gone(pids + grandchildren)


# ---- signals ----------------------------------------------------------------------------------------


def test_request_sigterm_interrupts(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    sleeper = py("import time; print('up', flush=True); time.sleep(30)")
    sup = make([spec(r, sleeper, tmp_path) for r in range(2)])
    sup.start()
    pids = worker_pids(sup)
    pump_until(sup, lambda: all(said(sup, r, "up")() for r in range(2)))
    sup.request_signal(signal.SIGTERM)
    result = finish(sup, timeout=5)
    assert result.status is RunStatus.INTERRUPTED
    assert result.signal == signal.SIGTERM and result.failures == []
    sup.close(sig=signal.SIGTERM)
    assert [w.state for w in sup.workers] == [WorkerState.STOPPED] * 2
    assert [w.returncode for w in sup.workers] == [-signal.SIGTERM] * 2
    assert_gone(pids)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2], ids=["SIGUSR1", "SIGUSR2"])
def test_user_signals_are_forwarded(
    make: Callable[..., Supervisor], tmp_path: Path, sig: signal.Signals
) -> None:
    handler = py(f"""
        import signal, sys, time
        def on_signal(signum, frame):
            print('got', signal.Signals(signum).name, flush=True)
            sys.exit(0)
        signal.signal(signal.{sig.name}, on_signal)
        print('ready', flush=True)
        time.sleep(30)
        sys.exit(5)
    """)
    sup = make([spec(r, handler, tmp_path) for r in range(2)])
    sup.start()
    pids = worker_pids(sup)
    pump_until(sup, lambda: all(said(sup, r, "ready")() for r in range(2)))
    sup.request_signal(sig)
    result = finish(sup, timeout=10)
    sup.close()
    assert result.status is RunStatus.SUCCEEDED
    assert all(said(sup, r, f"got {sig.name}")() for r in range(2))
    assert_gone(pids)


# ---- hangs and stack dumps ----------------------------------------------------------------------------


def test_hang_timeout_dumps_stacks_and_fails(
    make: Callable[..., Supervisor], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = write_script(
        tmp_path,
        "silent.py",
        """
        import time

        def stuck_in_here():
            time.sleep(60)

        stuck_in_here()
    """,
    )
    sup = make([spec(r, bootstrap(script), tmp_path) for r in range(2)], hang_timeout=1.0)
    sup.start()
    pids = worker_pids(sup)
    t0 = time.monotonic()
    result = finish(sup, timeout=15)
    print(f"hang detected and dumped after {time.monotonic() - t0:.2f}s (hang_timeout 1.0s)")
    assert result.status is RunStatus.HUNG
    assert sorted(f.rank for f in result.failures) == [0, 1]
    for failure in result.failures:
        assert failure.error_type == "Hang"
        assert failure.traceback is not None, f"rank {failure.rank}: no stack dump captured"
        assert "most recent call first" in failure.traceback
        assert "stuck_in_here" in failure.traceback and "silent.py" in failure.traceback
    assert any("hang-timeout" in n for n in logged(caplog)), logged(caplog)
    sup.close()
    for r in range(2):
        assert "stuck_in_here" in (tmp_path / f"rank_{r}.log").read_text()
    assert_gone(pids)


def test_heartbeats_keep_a_silent_run_alive(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    beating = py("""
        import time
        import multigpu
        for _ in range(20):
            multigpu.heartbeat()
            time.sleep(0.1)
    """)
    sup = make([spec(0, beating, tmp_path)], hang_timeout=1.0)
    sup.start()
    pids = worker_pids(sup)
    t0 = time.monotonic()
    result = finish(sup, timeout=15)
    took = time.monotonic() - t0
    sup.close()
    assert result.status is RunStatus.SUCCEEDED, result
    assert took > 1.0  # it really outlived the hang timeout without a line of output
    assert list(sup.workers[0].lines.tail) == []  # no output at all: only heartbeats showed progress
    assert_gone(pids)


def waiting_and_failing(tmp_path: Path, body: str, function: str) -> tuple[Path, list[str]]:
    """A script that runs ``body`` inside ``function`` for good, and a rank that fails (exit 1) once
    the script is inside it: a live rank to dump after a failure."""
    ready = tmp_path / "ready"
    waiting = write_script(
        tmp_path,
        f"{function}.py",
        f"""
        import pathlib, re, time

        def {function}():
            pathlib.Path({str(ready)!r}).touch()
            {body}

        {function}()
    """,
    )
    failing = py(f"""
        import os, sys, time
        while not os.path.exists({str(ready)!r}):
            time.sleep(0.01)
        sys.exit(1)
    """)
    return waiting, failing


def test_teardown_after_failure_dumps_live_ranks(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    """close(dump_stacks=True) after a failure: the rank still running writes its stacks to its log."""
    waiting, failing = waiting_and_failing(tmp_path, "time.sleep(60)", "waiting_for_peer")
    sup = make([spec(0, bootstrap(waiting), tmp_path), spec(1, failing, tmp_path)])
    sup.start()
    pids = worker_pids(sup)
    result = finish(sup)
    assert result.status is RunStatus.FAILED
    sup.close(dump_stacks=True)
    log = (tmp_path / "rank_0.log").read_text()
    assert "most recent call first" in log and "waiting_for_peer" in log
    assert sup.workers[0].state is WorkerState.STOPPED
    assert_gone(pids)


def answering(rank: int, script: Path, tmp_path: Path) -> WorkerSpec:
    """A bootstrapped rank whose dump thread is armed (``FR_DUMP_ENV`` set; empty: no flight record)."""
    s = spec(rank, bootstrap(script), tmp_path)
    s.env[FR_DUMP_ENV] = ""
    return s


def test_the_dump_thread_says_when_its_stacks_are_written(
    make: Callable[..., Supervisor], tmp_path: Path
) -> None:
    """A rank with the dump thread answers FR_SIGNAL itself: its stacks are in its log, written by
    that thread (the current thread of the dump), and it said so with the "stacks" beat."""
    waiting, failing = waiting_and_failing(tmp_path, "time.sleep(60)", "waiting_for_peer")
    sup = make([answering(0, waiting, tmp_path), spec(1, failing, tmp_path)])
    sup.start()
    pids = worker_pids(sup)
    assert finish(sup).status is RunStatus.FAILED
    sup.close(dump_stacks=True)
    assert sup.workers[0].dumps.stacked
    log = (tmp_path / "rank_0.log").read_text()
    assert "waiting_for_peer" in log
    current = log[log.index("Current thread") :]
    assert "_answer_dumps" in current.split("\n\n")[0], log  # the thread's dump, not faulthandler's handler
    assert_gone(pids)


def test_a_rank_holding_the_gil_gets_faulthandlers_dump(
    make: Callable[..., Supervisor], tmp_path: Path
) -> None:
    """The dump thread cannot run while the main thread holds the GIL (a regex that backtracks for
    ever): after ANSWER_S the launcher asks faulthandler's C handler, which still writes the stacks."""
    spinning, failing = waiting_and_failing(
        tmp_path, 're.match(r"(a+)+$", "a" * 64 + "b")', "backtracking_for_ever"
    )
    sup = make([answering(0, spinning, tmp_path), spec(1, failing, tmp_path)], dump_wait=5.0)
    sup.start()
    pids = worker_pids(sup)
    assert finish(sup).status is RunStatus.FAILED
    sup.close(dump_stacks=True)
    assert not sup.workers[0].dumps.stacked
    log = (tmp_path / "rank_0.log").read_text()
    current = log[log.index("Current thread") :].split("\n\n")[0]
    assert "backtracking_for_ever" in current, log  # the handler ran in the thread holding the GIL
    assert_gone(pids)


# ---- output and root cause ----------------------------------------------------------------------------


def test_output_lines_are_whole_and_logged(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    chatty = py("""
        import sys, time
        for i in range(200):
            sys.stdout.write(f'out-{i:03d}-'); sys.stdout.flush()
            sys.stderr.write(f'err-{i:03d}-'); sys.stderr.flush()
            if i % 50 == 0:
                time.sleep(0.01)
            sys.stdout.write('x' * 40 + '\\n'); sys.stdout.flush()
            sys.stderr.write('y' * 40 + '\\n'); sys.stderr.flush()
        sys.stdout.write('no newline at the end')
    """)
    sink = Sink()
    sup = make([spec(0, chatty, tmp_path)], sink=sink)
    sup.start()
    pids = worker_pids(sup)
    result = finish(sup)
    sup.close()
    assert result.status is RunStatus.SUCCEEDED
    out, err = sink.of(0, "stdout"), sink.of(0, "stderr")
    assert out == [f"out-{i:03d}-{'x' * 40}".encode() for i in range(200)] + [b"no newline at the end"]
    assert err == [f"err-{i:03d}-{'y' * 40}".encode() for i in range(200)]
    log_lines = (tmp_path / "rank_0.log").read_text().splitlines()
    assert len(log_lines) == 401
    pattern = re.compile(r"(out-\d{3}-x{40}|err-\d{3}-y{40}|no newline at the end)")
    assert all(pattern.fullmatch(line) for line in log_lines), [
        ln for ln in log_lines if not pattern.fullmatch(ln)
    ][:3]
    assert sorted(log_lines) == sorted(line.decode() for line in out + err)
    assert_gone(pids)


def test_root_cause_is_first_failure_in_time(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    """Both ranks fail before the loop looks: the earlier exception is the root cause, not rank 0."""
    late = write_script(
        tmp_path,
        "late.py",
        """
        import time
        time.sleep(0.8)
        raise RuntimeError('second')
    """,
    )
    early = write_script(
        tmp_path,
        "early.py",
        """
        import time
        time.sleep(0.1)
        raise ValueError('first')
    """,
    )
    sup = make(
        [
            spec(0, bootstrap(late), tmp_path, error_file=True),
            spec(1, bootstrap(early), tmp_path, error_file=True),
        ]
    )
    sup.start()
    pids = worker_pids(sup)
    deadline = time.monotonic() + 10
    while any(os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None for pid in pids):
        assert time.monotonic() < deadline, "workers did not both exit"
        time.sleep(0.05)
    sup.turn(0)  # the exits that are ready now, in one turn: ordered by their time, not by the loop
    result = sup.wait(timeout=0)
    assert result is not None and result.status is RunStatus.FAILED
    assert [f.rank for f in result.failures] == [1, 0]
    root = result.root_cause
    assert root is not None
    assert (root.rank, root.error_type, root.message) == (1, "ValueError", "first")
    assert root.traceback is not None and "early.py" in root.traceback
    sup.close()
    assert_gone(pids)


def test_ranks_that_never_answer_the_dump_signal(
    make: Callable[..., Supervisor], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No stack dump arrives (the signal is ignored): one hang report per rank, not a loop of them."""
    deaf = py("import signal, time; signal.signal(signal.SIGURG, signal.SIG_IGN); time.sleep(30)")
    sup = make([spec(r, deaf, tmp_path) for r in range(2)], hang_timeout=0.3, dump_wait=0.3)
    sup.start()
    pids = worker_pids(sup)
    result = finish(sup, timeout=10)
    assert result.status is RunStatus.HUNG
    assert sorted(f.rank for f in result.failures) == [0, 1]
    assert all(f.traceback is None for f in result.failures)
    assert len([n for n in logged(caplog) if "hang-timeout" in n]) == 1, logged(caplog)
    sup.close()
    assert_gone(pids)


def test_start_failure_cleans_up(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    """A rank that cannot be started: start() raises, the ranks already started are ended."""
    sup = make(
        [
            spec(0, py("import time; time.sleep(30)"), tmp_path),
            spec(1, [str(tmp_path / "no-such-program")], tmp_path),
        ]
    )
    with pytest.raises(FileNotFoundError):
        sup.start()
    pid = sup.workers[0].pid
    assert pid is not None
    assert sup.workers[0].state is WorkerState.STOPPED
    assert_gone([pid])


def test_abort_from_another_thread_fails_the_run(make: Callable[..., Supervisor], tmp_path: Path) -> None:
    """abort(): a cause outside the group (another node failed) ends the run as failed, ranks stopped."""
    import threading

    sleeper = py("import time; print('up', flush=True); time.sleep(30)")
    sup = make([spec(r, sleeper, tmp_path) for r in range(2)])
    sup.start()
    pids = worker_pids(sup)
    pump_until(sup, lambda: all(said(sup, r, "up")() for r in range(2)))
    remote = WorkerFailure(rank=5, local_rank=1, pid=None, exit_code=6, node=2, time=time.time())
    thread = threading.Thread(target=sup.abort, args=(remote,))
    thread.start()
    thread.join()
    result = finish(sup, timeout=5)
    assert result.status is RunStatus.FAILED and result.root_cause is remote
    assert result.root_cause.launcher_exit_code == 6
    sup.close()
    assert [w.state for w in sup.workers] == [WorkerState.STOPPED] * 2
    assert_gone(pids)


def test_root_cause_is_first_in_time_even_when_a_later_failure_is_reaped_first(
    make: Callable[..., Supervisor], tmp_path: Path
) -> None:
    """The real cause (rank 0 raised first) is still finishing when a rank hit by it exits; after
    teardown the report names the first failure in time, not the first one reaped."""
    cause = py(f"""
        import json, os, time
        json.dump({{"type": "ValueError", "message": "the cause", "time": time.time(),
                    "traceback": "Traceback...\\nValueError: the cause"}},
                  open(os.environ["MULTIGPU_ERROR_FILE"], "w"))
        open({str(tmp_path / "raised")!r}, "w").close()
        time.sleep(1.0)  # a slow exit: atexit handlers, flushing
        raise SystemExit(1)
    """)
    victim = py(f"""
        import json, os, time
        while not os.path.exists({str(tmp_path / "raised")!r}):
            time.sleep(0.01)
        json.dump({{"type": "RuntimeError", "message": "peer closed", "time": time.time()}},
                  open(os.environ["MULTIGPU_ERROR_FILE"], "w"))
        raise SystemExit(1)
    """)
    sup = make([spec(0, cause, tmp_path, error_file=True), spec(1, victim, tmp_path, error_file=True)])
    sup.start()
    pids = worker_pids(sup)
    first = finish(sup)
    assert first.root_cause is not None and first.root_cause.rank == 1  # reaped first
    sup.close()
    final = sup.final_result(first)
    assert final.root_cause is not None
    assert (final.root_cause.rank, final.root_cause.message) == (0, "the cause")
    assert final.root_cause.exit_code == 1 and final.root_cause.signal is None
    assert [f.rank for f in final.failures] == [0, 1]
    assert_gone(pids)


def test_a_long_line_without_newline_reaches_the_sink(
    make: Callable[..., Supervisor], tmp_path: Path
) -> None:
    seen: list[bytes] = []

    class Sink:
        def write_lines(self, worker: object, stream: str, lines: list[bytes]) -> None:
            seen.extend(lines)

    argv = py("import sys; sys.stdout.write('x' * 200000); sys.stdout.flush()")
    sup = make([spec(0, argv, tmp_path)], sink=Sink())
    sup.start()
    pids = worker_pids(sup)
    assert finish(sup).status is RunStatus.SUCCEEDED
    sup.close()
    assert sum(len(line) for line in seen) == 200000
    assert all(line for line in seen), "no empty lines invented at the cut"
    assert_gone(pids)


def test_a_failure_that_only_saw_a_peer_die_is_not_the_root_cause() -> None:
    """Rank 0's collective failed because rank 1 died (the OOM killer): rank 1 is the root cause even
    when rank 0's exit was reaped first; a peer-closed error alone stays the root cause."""
    cut_off = WorkerFailure(
        rank=0,
        local_rank=0,
        pid=10,
        exit_code=1,
        error_type="RuntimeError",
        message="[pair.cc:553] Connection closed by peer [127.0.0.1]:15502. GLHF!",
    )
    killed = WorkerFailure(rank=1, local_rank=1, pid=11, signal="SIGKILL")
    assert RunResult(RunStatus.FAILED, [cut_off, killed]).root_cause is killed
    assert RunResult(RunStatus.FAILED, [killed, cut_off]).root_cause is killed
    assert RunResult(RunStatus.FAILED, [cut_off]).root_cause is cut_off
    raised = WorkerFailure(rank=2, local_rank=2, pid=12, exit_code=1, error_type="ValueError", message="x")
    assert RunResult(RunStatus.FAILED, [raised, killed]).root_cause is raised


@pytest.mark.parametrize("ours", [True, False], ids=["then-ours", "alone"])
def test_a_rank_killed_by_an_outside_sigterm_waits_for_ours(
    make: Callable[..., Supervisor], tmp_path: Path, ours: bool
) -> None:
    """SLURM's scancel signals every process of the step, a rank sometimes before its launcher: the
    run is interrupted, not failed. A rank SIGTERMed by someone else, with no stop signal for us,
    fails (named) once the short race window has passed."""
    sleeper = py("import time; print('up', flush=True); time.sleep(30)")
    sup = make([spec(r, sleeper, tmp_path) for r in range(2)])
    sup.start()
    pids = worker_pids(sup)
    pump_until(sup, lambda: all(said(sup, r, "up")() for r in range(2)))
    os.kill(pids[1], signal.SIGTERM)  # the scheduler reaches rank 1 first
    pump_until(sup, lambda: sup.workers[1].returncode is not None)  # reaped, not yet judged
    if ours:
        sup.request_signal(signal.SIGTERM)  # ...then the launcher
    result = finish(sup, timeout=5)
    sup.close(sig=signal.SIGTERM)
    if ours:
        assert result.status is RunStatus.INTERRUPTED and result.failures == [], result
        assert [w.state for w in sup.workers] == [WorkerState.STOPPED] * 2
    else:
        assert result.status is RunStatus.FAILED and result.root_cause is not None, result
        assert (result.root_cause.rank, result.root_cause.signal) == (1, "SIGTERM")
    assert_gone(pids)
