"""The output path on its own: line splitting, progress bars, log files that survive a full disk, the
console writer that never blocks its caller, run ids and output folders, and the supervisor's
per-stream files and console streams (torchrun's --log-dir / --redirects / --tee)."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import PYTHON, assert_gone, clean_env, logged
from multigpu.supervisor import reaping
from multigpu.supervisor.log_file import LogFile
from multigpu.supervisor.loop import Supervisor
from multigpu.supervisor.output import display_text
from multigpu.supervisor.states import RunStatus, Worker, WorkerSpec, WorkerState


def py(code: str) -> list[str]:
    return [PYTHON, "-c", textwrap.dedent(code)]


class Sink:
    def __init__(self) -> None:
        self.lines: list[tuple[int, str, bytes]] = []
        self.partials: list[tuple[int, str, bytes]] = []

    def write_lines(self, worker: Worker, stream: str, lines: list[bytes]) -> None:
        self.lines.extend((worker.rank, stream, line) for line in lines)

    def write_partial(self, worker: Worker, stream: str, text: bytes) -> None:
        self.partials.append((worker.rank, stream, text))


def run_to_end(sup: Supervisor) -> RunStatus:
    sup.start()
    result = sup.wait(timeout=20)
    assert result is not None
    sup.close()
    return result.status


# ---- pure pieces ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "shown"),
    [(b"plain", b"plain"), (b"\r10%\r20%", b"20%"), (b"done\r\n"[:-1], b"done"), (b"\r\r", b"")],
)
def test_display_text_is_what_a_terminal_leaves(line: bytes, shown: bytes) -> None:
    assert display_text(line) == shown


def test_log_file_counts_what_a_full_disk_lost(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    log = LogFile(tmp_path / "rank_0.log")  # a log's name holds a regular file: a device is refused
    assert log._file is not None and log.error is None
    log._file.close()
    log._file = open("/dev/full", "wb", buffering=0)  # noqa: SIM115 - closed by log.close()
    log.path = Path("/dev/full")
    log.write(b"x" * 100)
    log.write(b"y" * 50)
    log.close()
    assert log.lost == 150
    said = logged(caplog)
    assert len(said) == 1 and "/dev/full" in said[0]
    assert log.loss() is not None and "150 byte(s) not written" in log.loss()  # type: ignore[operator]


# ---- the console writer -------------------------------------------------------------------------------


# ---- the supervisor's output ----------------------------------------------------------------------------


@pytest.mark.integration
def test_stream_files_get_exactly_their_streams_bytes(
    make: Callable[..., Supervisor], tmp_path: Path
) -> None:
    argv = py("""
        import sys
        sys.stdout.write('out-1\\nout-2 no newline'); sys.stdout.flush()
        sys.stderr.write('\\rbar 1\\rbar 2\\n'); sys.stderr.flush()
    """)
    files = {"stdout": tmp_path / "0" / "stdout.log", "stderr": tmp_path / "0" / "stderr.log"}
    sink = Sink()
    spec = WorkerSpec(
        rank=0,
        local_rank=0,
        argv=argv,
        env=clean_env(),
        log_path=tmp_path / "rank_0.log",
        stream_files=files,
        console_streams=frozenset({"stderr"}),
    )
    sup = make([spec], sink=sink)
    assert run_to_end(sup) is RunStatus.SUCCEEDED
    assert files["stdout"].read_bytes() == b"out-1\nout-2 no newline"
    assert files["stderr"].read_bytes() == b"\rbar 1\rbar 2\n"
    assert {s for _, s, _ in sink.lines} == {"stderr"}  # stdout is not on the console
    assert sink.lines == [(0, "stderr", b"bar 2")]
    log = (tmp_path / "rank_0.log").read_bytes()  # both streams, line by line, as written
    assert b"out-1\n" in log and b"\rbar 1\rbar 2\n" in log and b"out-2 no newline" in log
    assert len(log) == len(b"out-1\nout-2 no newline\rbar 1\rbar 2\n")
    assert_gone([w.pid for w in sup.workers if w.pid])


@pytest.mark.integration
def test_an_unfinished_bar_reaches_the_sink_before_its_line_ends(
    make: Callable[..., Supervisor], tmp_path: Path
) -> None:
    go = tmp_path / "go"
    argv = py(f"""
        import os, sys, time
        sys.stderr.write('\\r 50%'); sys.stderr.flush()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        sys.stderr.write('\\r100%\\n')
    """)
    sink = Sink()
    sup = make([WorkerSpec(rank=0, local_rank=0, argv=argv, env=clean_env())], sink=sink)
    sup.start()
    deadline = time.monotonic() + 10
    while not sink.partials:
        assert time.monotonic() < deadline, "the bar never reached the sink"
        assert sup.wait(timeout=0.05) is None
    assert sink.partials == [(0, "stderr", b" 50%")]
    go.touch()
    result = sup.wait(timeout=10)
    sup.close()
    assert result is not None and result.status is RunStatus.SUCCEEDED
    assert sink.lines == [(0, "stderr", b"100%")]
    assert_gone([w.pid for w in sup.workers if w.pid])


@pytest.mark.integration
def test_a_rank_that_survives_sigkill_is_named_not_waited_on(
    make: Callable[..., Supervisor],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Uninterruptible sleep, simulated: SIGKILL does not reach the rank. The wait is bounded."""
    real = reaping.signal_group
    monkeypatch.setattr(
        reaping, "signal_group", lambda pgid, sig: None if sig == signal.SIGKILL else real(pgid, sig)
    )
    monkeypatch.setattr(reaping, "KILL_WAIT_S", 0.3)
    argv = py("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print('ready', flush=True)
        time.sleep(60)
    """)
    sup = make([WorkerSpec(rank=0, local_rank=0, argv=argv, env=clean_env())], grace_period=0.2)
    sup.start()
    pid = sup.workers[0].pid
    assert pid is not None
    try:
        deadline = time.monotonic() + 10
        while not sup.workers[0].lines.tail:
            assert time.monotonic() < deadline
            sup.wait(timeout=0.05)
        t0 = time.monotonic()
        sup.close()
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGKILL)
    assert took < 5
    assert sup.workers[0].ending.unkillable and sup.workers[0].state is WorkerState.STOPPED
    assert any(f"rank 0 (pid {pid}) did not end" in n and "after SIGKILL" in n for n in logged(caplog)), (
        logged(caplog)
    )
    sup.workers[0].popen.wait(timeout=5)  # type: ignore[union-attr]
    assert_gone([pid])


def test_a_drain_reads_a_pipe_that_never_empties_a_bounded_number_of_times(
    make: Callable[..., Supervisor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failure the loop drains the others' pipes before muting them; a rank that writes faster
    than the loop reads must not keep it there (found by review)."""
    from multigpu.supervisor.output import DRAIN_READS

    argv = py("import time; print('ready', flush=True); time.sleep(60)")
    sup = make([WorkerSpec(rank=0, local_rank=0, argv=argv, env=clean_env())])
    sup.start()
    try:
        output = sup._output
        streams = list(output.of(sup.workers[0]))
        reads: list[int] = []
        monkeypatch.setattr(output, "_read_once", lambda stream: reads.append(stream.fd) or 1)  # never empty
        output.drain(streams)
        assert len(reads) == DRAIN_READS * len(streams) and streams
    finally:
        monkeypatch.undo()
        sup.close()
    assert_gone([p for p in [sup.workers[0].pid] if p is not None])


@pytest.mark.integration
def test_a_line_past_the_cap_is_shown_in_pieces_said_once_per_rank_and_logged_whole(
    make: Callable[..., Supervisor],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 43: 100 MB with no newline took the launcher past 400 MiB, held as one line. Here a few MB
    under a lowered cap: the console gets pieces no longer than the cap, the launcher says so once per
    rank (two long lines each), and each rank's log has every byte it wrote, in order."""
    from multigpu.supervisor import output

    cap = 256 << 10
    monkeypatch.setattr(output, "LINE_CAP", cap)
    argv = py("""
        import os, sys
        rank = int(os.environ["RANK"])
        for n in range(2):
            sys.stdout.write(chr(ord("a") + rank + 2 * n) * (3 << 20))
            sys.stdout.write("\\n" if n == 0 else "")
            sys.stdout.flush()
    """)
    sink = Sink()
    specs = [
        WorkerSpec(
            rank=r,
            local_rank=r,
            argv=argv,
            env={**clean_env(), "RANK": str(r)},
            log_path=tmp_path / f"{r}.log",
        )
        for r in (0, 1)
    ]
    sup = make(specs, sink=sink)
    assert run_to_end(sup) is RunStatus.SUCCEEDED
    for r in (0, 1):
        first, second = chr(ord("a") + r).encode(), chr(ord("a") + r + 2).encode()
        written = first * (3 << 20) + b"\n" + second * (3 << 20)
        assert (tmp_path / f"{r}.log").read_bytes() == written
        shown = [line for rank, _, line in sink.lines if rank == r]
        assert shown and all(len(line) <= cap for line in shown), [len(line) for line in shown]
        assert b"".join(shown) == written.replace(b"\n", b"")
        assert len(shown) == 2 * -(-(3 << 20) // cap)  # each line in ceil(3 MiB / cap) pieces
    notices = [line for line in logged(caplog) if "longer than" in line]
    assert sorted(notices) == [
        f"rank {r} wrote a line longer than 256 KiB on its stdout: it is shown in pieces of 256 KiB"
        " (its log file keeps every byte)"
        for r in (0, 1)
    ], logged(caplog)
    assert_gone([w.pid for w in sup.workers if w.pid])


@pytest.mark.integration
@pytest.mark.parametrize(
    ("hold", "fold", "shown"), [(True, True, False), (True, False, True), (False, True, True)]
)
def test_a_rank_that_only_saw_a_peer_die_is_folded_to_its_log_once_another_node_is_the_cause(
    make: Callable[..., Supervisor], tmp_path: Path, hold: bool, fold: bool, shown: bool
) -> None:
    """Issue 44: the supervisor of a job of several nodes holds the traceback until the attempt says
    whose the root cause is (``settle_peer_losses``); a job of one node shows it as it comes."""
    argv = py("""
        import sys
        print("step 5", flush=True)
        sys.stderr.write('Traceback (most recent call last):\\n  File "w.py", line 1, in <module>\\n'
                         'RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:42722\\n')
        sys.exit(1)
    """)
    sink = Sink()
    log = tmp_path / "rank_0.log"
    spec = WorkerSpec(rank=0, local_rank=0, argv=argv, env=clean_env(), log_path=log)
    sup = make([spec], sink=sink, hold_peer_losses=hold)
    sup.start()
    result = sup.wait(timeout=20)
    assert result is not None and result.status is RunStatus.FAILED
    sup.settle_peer_losses(fold=fold)
    sup.close()
    console = b"\n".join(line for _, _, line in sink.lines)
    assert b"step 5" in console
    assert (b"Connection closed by peer" in console) is shown, console
    assert (b"Traceback" in console) is shown, console
    assert b"Connection closed by peer" in log.read_bytes()  # the log keeps every byte
    assert_gone([w.pid for w in sup.workers if w.pid])
