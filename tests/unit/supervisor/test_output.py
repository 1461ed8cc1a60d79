"""The output path on its own: line splitting, progress bars, log files that survive a full disk, the
console writer that never blocks its caller, run ids and output folders, and the supervisor's
per-stream files and console streams (torchrun's --log-dir / --redirects / --tee)."""

from __future__ import annotations

import os
import select
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers import PYTHON, assert_gone, clean_env, supervisor_arguments
from multigpu.console.ranks import PrefixedConsole
from multigpu.console.writer import ConsoleWriter
from multigpu.contract.errors import UsageError
from multigpu.record.folder import check_run_id, claim_output
from multigpu.supervisor import reaping
from multigpu.supervisor.loop import Supervisor
from multigpu.supervisor.output import LogFile, display_text
from multigpu.supervisor.states import RunStatus, Worker, WorkerSpec, WorkerState

pytestmark = pytest.mark.timeout(30)


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


@pytest.fixture
def notes() -> list[str]:
    return []


@pytest.fixture
def make(notes: list[str]) -> Iterator[Callable[..., Supervisor]]:
    made: list[Supervisor] = []

    def factory(specs: list[WorkerSpec], **kw: object) -> Supervisor:
        kw.setdefault("grace_period", 0.3)
        sup = Supervisor(specs, **supervisor_arguments(notes, **kw))
        made.append(sup)
        return sup

    yield factory
    for sup in made:
        sup.close(grace_period=0)


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


def test_log_file_counts_what_a_full_disk_lost(tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    said: list[str] = []
    log = LogFile(Path("/dev/full"), said.append)
    log.write(b"x" * 100)
    log.write(b"y" * 50)
    log.close()
    assert log.lost == 150
    assert len(said) == 1 and "/dev/full" in said[0]
    assert log.loss() is not None and "150 byte(s) not written" in log.loss()  # type: ignore[operator]


@pytest.mark.parametrize("bad", ["../../x", "a/b", "..", ".", "", "tab\tid", "nl\nid", "x" * 201])
def test_run_id_must_be_a_name(bad: str) -> None:
    with pytest.raises(UsageError, match="--run-id"):
        check_run_id(bad)


def test_an_adopted_run_id_is_checked_too() -> None:
    with pytest.raises(UsageError, match="rendezvous"):
        check_run_id("../elsewhere", "the run id agreed at rendezvous")
    assert check_run_id("20261203-090804-f5d6f1") == "20261203-090804-f5d6f1"


def test_a_locked_output_folder_refuses_a_second_run(tmp_path: Path) -> None:
    first = claim_output(tmp_path / "out", "run-one")
    try:
        with pytest.raises(UsageError, match=r"in use by run run-one \(launcher pid \d+\)"):
            claim_output(tmp_path / "out", "run-two")
        other_node = claim_output(tmp_path / "out", "run-one", node=1)  # nodes of one run share it
        other_node.release()
    finally:
        first.release()
    claim_output(tmp_path / "out", "run-two").release()  # free again once the first has ended
    assert not list((tmp_path / "out").glob(".multigpu*.lock"))  # issue 22: no lock left after a run


def test_a_run_that_locked_a_removed_lock_file_locks_anew(tmp_path: Path) -> None:
    """The ending run removes its lock file while a new run may already have it open: the new run must
    not keep a lock on the removed file (a third run would then lock a fresh one beside it)."""
    import fcntl

    folder = tmp_path / "out"
    first = claim_output(folder, "run-one")
    fd = os.open(folder / ".multigpu.lock", os.O_RDWR)
    try:
        first.release()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # this fd holds the removed file's lock
        second = claim_output(folder, "run-two")
        with pytest.raises(UsageError, match="in use by run run-two"):
            claim_output(folder, "run-three")
        second.release()
    finally:
        os.close(fd)


# ---- the console writer -------------------------------------------------------------------------------


def test_console_writer_never_blocks_and_counts_what_it_dropped() -> None:
    """A pipe nobody reads: put() returns at once; once read, one notice says how many were dropped."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    writer = ConsoleWriter(capacity=64 << 10, fds=(out_w, err_w))
    try:
        with writer:
            t0 = time.monotonic()
            for i in range(20000):
                writer.put(out_w, f"line {i:05d} {'x' * 100}\n".encode())
            took = time.monotonic() - t0
            writer.put(err_w, b"stderr is not held back by stdout\n")
            got = bytearray()  # stdout stays unread until stderr's line has arrived
            deadline = time.monotonic() + 5
            while b"not held back" not in got:
                assert time.monotonic() < deadline, "stderr never written while stdout was stalled"
                if select.select([err_r], [], [], 0.1)[0]:
                    got += os.read(err_r, 65536)
            deadline = time.monotonic() + 10
            while b"line(s) dropped" not in got and time.monotonic() < deadline:
                for fd in select.select([out_r, err_r], [], [], 0.1)[0]:
                    got += os.read(fd, 1 << 20)
        print(f"20000 puts into a stalled console took {took * 1000:.1f} ms")
        assert b"console line(s) dropped" in got
    finally:
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)


def test_a_console_that_goes_away_ends_only_that_stream() -> None:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    os.close(out_r)  # `| head -1` has left
    writer = ConsoleWriter(fds=(out_w, err_w))
    try:
        with writer:
            writer.put(out_w, b"into a closed pipe\n")
            assert select.select([err_r], [], [], 5)[0]
            writer.put(out_w, b"more\n")
            writer.put(err_w, b"stderr still works\n")
            got = bytearray()
            deadline = time.monotonic() + 5
            while b"still works" not in got and time.monotonic() < deadline:
                if select.select([err_r], [], [], 0.1)[0]:
                    got += os.read(err_r, 65536)
        assert b"is gone" in got and b"still works" in got
        assert out_w in writer.dead
    finally:
        for fd in (out_w, err_r, err_w):
            os.close(fd)


def test_prefixed_console_redraws_a_bar_in_place_on_a_terminal() -> None:
    class Tty(ConsoleWriter):
        def __init__(self) -> None:
            super().__init__(fds=(1, 2))
            self.ttys = {1: True, 2: True}
            self.got: list[bytes] = []

        def put(self, fd: int, data: bytes, lines: int = 1) -> None:
            self.got.append(data)

    writer = Tty()
    console = PrefixedConsole(writer=writer)
    zero = Worker(WorkerSpec(rank=0, local_rank=0, argv=[], env={}))
    one = Worker(WorkerSpec(rank=1, local_rank=1, argv=[], env={}))
    console.write_partial(zero, "stderr", b"10%")
    console.write_partial(zero, "stderr", b"20%")
    console.write_lines(one, "stderr", [b"a line from rank 1"])
    console.write_lines(zero, "stderr", [b"100%"])
    assert writer.got == [
        b"\r[rank 0] 10%\x1b[K",
        b"\r[rank 0] 20%\x1b[K",
        b"\r\x1b[K[rank 1] a line from rank 1\n\r[rank 0] 20%\x1b[K",  # above the bar, bar redrawn
        b"\r\x1b[K[rank 0] 100%\n",
    ]


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
    make: Callable[..., Supervisor], tmp_path: Path, notes: list[str], monkeypatch: pytest.MonkeyPatch
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
    assert any(f"rank 0 (pid {pid}) did not end" in n and "after SIGKILL" in n for n in notes), notes
    sup.workers[0].popen.wait(timeout=5)  # type: ignore[union-attr]
    assert_gone([pid])


def test_no_console_thread_outlives_its_writer() -> None:
    before = set(threading.enumerate())
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        with ConsoleWriter(fds=(fd,)) as writer:
            writer.put(fd, b"x\n")
    finally:
        os.close(fd)
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]


@pytest.mark.integration
def test_ensure_std_fds_never_reuses_0_to_2(tmp_path: Path) -> None:
    import subprocess

    code = (
        "import os, sys\nfrom multigpu.console.writer import ensure_std_fds\nensure_std_fds()\n"
        "r, w = os.pipe()\nprint(r, w, file=open('fds.txt', 'w'))\n"
    )
    for closed in ("<&-", ">&-", "2>&-", "<&- >&- 2>&-"):
        res = subprocess.run(
            ["bash", "-c", f'exec {PYTHON} -c "$0" {closed}', code],
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            timeout=30,
        )
        assert res.returncode == 0, res.stderr
        assert min(int(x) for x in (tmp_path / "fds.txt").read_text().split()) > 2, closed


def test_a_console_idle_before_close_still_gets_the_last_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found under a full disk: the launcher's last lines came after a quiet spell longer than the stall
    limit, and close() took the idle console for a stalled one and dropped them."""
    from multigpu.console import writer as console

    now = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: now[0])
    r, w = os.pipe()
    try:
        writer = ConsoleWriter(fds=(w,))
        with writer:
            now[0] += 10 * console.STALL_S  # nothing written for a long while; the reader is fine
            writer.put(w, b"output lost: rank_0.log\n", keep=True)
        assert os.read(r, 4096) == b"output lost: rank_0.log\n"
    finally:
        os.close(r)
        os.close(w)


def test_function_mode_console_never_splices_a_child_line_into_the_callers_half_printed_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in CI: rank 0 (the caller) printed "REPORT {...}" while a child's line arrived; print()
    writes the text and the newline separately, and the console's flush put the child's line between."""
    import io

    r, w = os.pipe()
    try:
        stdout = io.TextIOWrapper(io.FileIO(w, "w", closefd=False), write_through=False)
        monkeypatch.setattr("sys.stdout", stdout)
        console = PrefixedConsole()
        child = Worker(WorkerSpec(rank=1, local_rank=1, argv=[], env={}))
        stdout.write("REPORT {rank 0}")  # print()'s first write; its "\n" has not come yet
        console.write_lines(child, "stdout", [b"REPORT {rank 1}"])
        stdout.write("\n")
        stdout.flush()
        lines = os.read(r, 4096).decode().splitlines()
        assert sorted(lines) == ["REPORT {rank 0}", "[rank 1] REPORT {rank 1}"]
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("write_through", [True, False], ids=["unbuffered", "block-buffered"])
def test_caller_lines_keep_the_callers_print_whole_when_its_stdout_is_unbuffered(
    monkeypatch: pytest.MonkeyPatch, write_through: bool
) -> None:
    """Found in CI (PYTHONUNBUFFERED=1): print()'s text and newline were two writes to the descriptor,
    and a child's line from the watcher thread landed between them. A block-buffered stream has the
    same hole at its 8 KiB boundary. Under ``caller_lines`` only whole lines reach the descriptor."""
    import io

    from multigpu.console.caller import caller_lines

    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        raw = io.TextIOWrapper(io.FileIO(w, "w", closefd=False), write_through=write_through)
        monkeypatch.setattr("sys.stdout", raw)
        console = PrefixedConsole()
        child = Worker(WorkerSpec(rank=1, local_rank=1, argv=[], env={}))
        with caller_lines():
            assert sys.stdout is not raw and sys.stdout.fileno() == w
            sys.stdout.write("REPORT {rank 0}")  # print()'s first write
            console.write_lines(child, "stdout", [b"REPORT {rank 1}"])
            sys.stdout.write("\n")
            sys.stdout.write("partial")  # no newline yet: still the caller's at the end
        assert sys.stdout is raw
        text = os.read(r, 4096).decode()
        assert text == "[rank 1] REPORT {rank 1}\nREPORT {rank 0}\npartial"
    finally:
        os.close(r)
        os.close(w)


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
