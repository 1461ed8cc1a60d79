"""The supervisor: the one object that owns worker lifetimes.

``start()`` spawns every worker in its own session (so its process group holds everything it starts),
``wait()`` runs one event loop over process descriptors, output pipes, heartbeats and a wake-up pipe
until all ranks succeed, one fails, a hang is seen or a stop is requested, and ``close()`` tears the
group down: optional stack dumps, the stop signal to every group (exited ranks' included), one shared
deadline, SIGKILL for what is left, reap. ``close()`` is safe to call twice; ``start()`` twice raises.

Worker states::

    PENDING -> RUNNING -> SUCCEEDED | FAILED      (the rank's own exit)
                       -> STOPPED                 (ended by the launcher's teardown)
"""

from __future__ import annotations

import contextlib
import enum
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from .errors import WorkerFailure, signal_name
from .worker import DUMP_SIGNAL, FAILING_BEAT

LOG_TAIL_LINES = 20
MAX_LINE = 1 << 16


class WorkerState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class RunStatus(str, enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    HUNG = "hung"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one rank; built by the launcher, never changed by the supervisor."""

    rank: int
    local_rank: int
    argv: list[str]
    env: dict[str, str]
    device: str = "cpu"
    node: int = 0
    log_path: Path | None = None
    error_file: Path | None = None
    pass_fds: tuple[int, ...] = ()
    cwd: str | None = None


@dataclass
class Worker:
    spec: WorkerSpec
    state: WorkerState = WorkerState.PENDING
    popen: subprocess.Popen[bytes] | None = None
    pidfd: int | None = None
    start_time: float | None = None
    end_time: float | None = None
    returncode: int | None = None
    last_activity: float = 0.0
    failure: WorkerFailure | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    open_streams: int = 0
    heartbeat_read_fd: int | None = None
    log_file: IO[bytes] | None = None
    capture: list[str] | None = None
    group_open: bool = True
    dump: list[str] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def alive(self) -> bool:
        return self.state is WorkerState.RUNNING and self.returncode is None


@dataclass
class RunResult:
    status: RunStatus
    failures: list[WorkerFailure] = field(default_factory=list)
    signal: int | None = None

    @property
    def root_cause(self) -> WorkerFailure | None:
        return self.failures[0] if self.failures else None


class OutputSink(Protocol):
    """Where whole lines from the workers go besides their log files (the console, a status view)."""

    def write_lines(self, worker: Worker, stream: str, lines: list[bytes]) -> None: ...


class SupervisorListener(Protocol):
    def on_worker_change(self, worker: Worker) -> None: ...


class _Stream:
    """One pipe of one worker, split into whole lines."""

    __slots__ = ("buffer", "fd", "name", "worker")

    def __init__(self, worker: Worker, name: str, fd: int) -> None:
        self.worker, self.name, self.fd = worker, name, fd
        self.buffer = b""


def read_error_file(path: Path | None) -> dict[str, Any] | None:
    """The rank's record (``WorkerFailure.read``: ours or torch's ``@record``), as the keys read here."""
    record = WorkerFailure.read(path)
    if record is None:
        return None
    return {"type": record.error_type, "message": record.message, "traceback": record.traceback,
            "time": record.time}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class Supervisor:
    """Owns a set of worker processes from start to reaped; see the module docstring."""

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        *,
        sink: OutputSink | None = None,
        listener: SupervisorListener | None = None,
        grace_period: float = 5.0,
        hang_timeout: float | None = None,
        tick: Callable[[], None] | None = None,
        tick_period: float = 0.5,
        dump_wait: float = 0.5,
        notify: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        reap_orphans: bool = False,
        on_failing: Callable[[Worker], None] | None = None,
    ) -> None:
        self.workers = [Worker(spec) for spec in specs]
        self._sink = sink
        self._listener = listener
        self.grace_period = grace_period
        self.hang_timeout = hang_timeout
        self._tick = tick
        self._tick_period = tick_period
        self._dump_wait = dump_wait
        self._notify = notify or (lambda msg: print(f"multigpu: {msg}", file=sys.stderr, flush=True))
        self._clock = clock
        self._reap_orphans = reap_orphans
        self._on_failing = on_failing
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._signals: deque[int] = deque()
        self._external: deque[WorkerFailure] = deque()
        self._lock = threading.Lock()
        self._wake_lock = threading.RLock()  # a signal handler may run while the main thread holds it
        self._started = False
        self._closed = False
        self._stop_signal: int | None = None
        self._kill_now = False
        self._failures: list[WorkerFailure] = []
        self._hung = False
        self._closing = False
        self._last_finish = float("-inf")
        self._last_tick = 0.0

    # ---- start -------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise RuntimeError("Supervisor.start() called twice; make a new Supervisor per attempt")
        self._started = True
        now = self._clock()
        try:
            for worker in self.workers:
                self._spawn(worker, now)
        except BaseException:
            self.close(grace_period=0)
            raise

    def _spawn(self, worker: Worker, now: float) -> None:
        spec = worker.spec
        if spec.log_path is not None:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            worker.log_file = open(spec.log_path, "ab", buffering=0)  # noqa: SIM115 - owned by the worker
        hb_r, hb_w = os.pipe()
        os.set_blocking(hb_r, False)
        os.set_blocking(hb_w, False)
        env = dict(spec.env, MULTIGPU_HEARTBEAT_FD=str(hb_w))
        try:
            worker.popen = subprocess.Popen(
                spec.argv, env=env, cwd=spec.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, pass_fds=(*spec.pass_fds, hb_w),
            )
        except BaseException:
            os.close(hb_r)
            raise
        finally:
            os.close(hb_w)
        worker.heartbeat_read_fd = hb_r
        self._selector.register(hb_r, selectors.EVENT_READ, ("beat", worker))
        worker.state = WorkerState.RUNNING
        worker.start_time = time.time()
        worker.last_activity = now
        for name, pipe in (("stdout", worker.popen.stdout), ("stderr", worker.popen.stderr)):
            assert pipe is not None
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            self._selector.register(fd, selectors.EVENT_READ, ("out", _Stream(worker, name, fd)))
            worker.open_streams += 1
        try:
            worker.pidfd = os.pidfd_open(worker.popen.pid)
            self._selector.register(worker.pidfd, selectors.EVENT_READ, ("exit", worker))
        except (AttributeError, OSError):
            worker.pidfd = None  # no pidfds: exits are found by polling each tick
        self._changed(worker)

    # ---- signals and stop requests (safe from a signal handler or another thread) ---------------------

    def request_signal(self, signum: int) -> None:
        """Record a signal for the loop to act on; does nothing else, so it is safe in a handler."""
        self._signals.append(signum)
        self._wake()

    def request_stop(self) -> None:
        self.request_signal(signal.SIGTERM)

    def abort(self, failure: WorkerFailure) -> None:
        """End the run as failed for a cause outside this group (another node failed). Thread-safe."""
        self._external.append(failure)
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:  # a late call from another thread must not write to a reused descriptor
            if self._wake_w < 0:
                return
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"\0")

    # ---- the loop ----------------------------------------------------------------------------------

    def poll(self) -> RunResult | None:
        """Handle what is ready now, without blocking; a result once the run has an outcome."""
        self._process_events(0)
        return self._outcome()

    def wait(self, timeout: float | None = None) -> RunResult | None:
        """Run the loop until the run has an outcome (or ``timeout`` seconds pass: then None)."""
        if not self._started:
            raise RuntimeError("Supervisor.wait() before start()")
        deadline = None if timeout is None else self._clock() + timeout
        while True:
            outcome = self._outcome()
            if outcome is not None:
                return outcome
            remaining = None if deadline is None else deadline - self._clock()
            if remaining is not None and remaining <= 0:
                return None
            self._process_events(self._select_timeout(remaining))

    def _select_timeout(self, remaining: float | None) -> float:
        period = self._tick_period
        if self.hang_timeout is not None:
            period = min(period, max(0.01, self.hang_timeout / 4))
        if any(w.pidfd is None and w.alive for w in self.workers):
            period = min(period, 0.05)
        return period if remaining is None else max(0.0, min(period, remaining))

    def _outcome(self) -> RunResult | None:
        if self._stop_signal is not None:
            return RunResult(RunStatus.INTERRUPTED, self._sorted_failures(), self._stop_signal)
        if self._failures:
            status = RunStatus.HUNG if self._hung else RunStatus.FAILED
            return RunResult(status, self._sorted_failures())
        if all(w.state is WorkerState.SUCCEEDED for w in self.workers):
            return RunResult(RunStatus.SUCCEEDED)
        return None

    def final_result(self, result: RunResult) -> RunResult:
        """``result`` again after ``close()``: ranks that failed during teardown may have failed first."""
        if result.status in (RunStatus.FAILED, RunStatus.HUNG):
            return RunResult(result.status, self._sorted_failures(), result.signal)
        return result

    def _sorted_failures(self) -> list[WorkerFailure]:
        return sorted(self._failures, key=lambda f: f.time if f.time is not None else float("inf"))

    def _process_events(self, timeout: float | None) -> None:
        for key, _ in self._selector.select(timeout):
            if self._selector.get_map().get(key.fd) is not key:
                continue  # closed earlier in this batch (a failed rank's pipes are drained at once)
            kind, obj = key.data
            if kind == "out":
                self._read_stream(obj)
            elif kind == "exit":
                self._reap(obj)
            elif kind == "beat":
                self._read_beats(obj)
            else:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
        for worker in self.workers:
            if worker.pidfd is None and worker.alive and worker.popen and worker.popen.poll() is not None:
                self._reap(worker)
        if any(w.group_open and w.returncode is not None for w in self.workers):
            self._open_groups()
        self._handle_signals()
        self._check_hang()
        self._maybe_tick()

    def _maybe_tick(self) -> None:
        if self._tick is None:
            return
        now = self._clock()
        if now - self._last_tick >= self._tick_period:
            self._last_tick = now
            self._tick()

    def _read_beats(self, worker: Worker) -> None:
        fd = worker.heartbeat_read_fd
        assert fd is not None
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        if data:
            worker.last_activity = self._clock()
            if FAILING_BEAT in data and self._on_failing is not None:
                self._on_failing(worker)
        else:
            self._selector.unregister(fd)
            os.close(fd)
            worker.heartbeat_read_fd = None

    def _read_stream(self, stream: _Stream) -> None:
        try:
            data = os.read(stream.fd, MAX_LINE)
        except BlockingIOError:
            return
        if not data:
            self._end_stream(stream)
            return
        stream.worker.last_activity = self._clock()
        buffer = stream.buffer + data
        cut = buffer.rfind(b"\n")
        if cut < 0:
            if len(buffer) < MAX_LINE:
                stream.buffer = buffer
                return
            buffer += b"\n"  # a very long line without a newline: pass it on as it is
            cut = len(buffer) - 1
        stream.buffer = buffer[cut + 1:]
        self._emit(stream, buffer[: cut + 1])

    def _end_stream(self, stream: _Stream) -> None:
        if stream.buffer:
            self._emit(stream, stream.buffer + b"\n")
            stream.buffer = b""
        self._selector.unregister(stream.fd)
        worker = stream.worker
        pipe = worker.popen.stdout if stream.name == "stdout" else worker.popen.stderr  # type: ignore[union-attr]
        if pipe is not None:
            pipe.close()
        worker.open_streams -= 1

    def _emit(self, stream: _Stream, chunk: bytes) -> None:
        """``chunk`` holds whole lines only; it goes to the log file in one write, then to the sink."""
        worker = stream.worker
        if worker.log_file is not None:
            worker.log_file.write(chunk)
        lines = chunk.split(b"\n")[:-1]
        worker.tail.extend(line.decode(errors="replace") for line in lines[-LOG_TAIL_LINES:])
        if worker.capture is not None:
            worker.capture.extend(line.decode(errors="replace") for line in lines)
        if self._sink is not None:
            self._sink.write_lines(worker, stream.name, lines)

    def _reap(self, worker: Worker) -> None:
        if worker.returncode is not None or worker.popen is None:
            return
        rc = worker.popen.wait()
        worker.returncode = rc
        worker.end_time = time.time()
        if worker.pidfd is not None:
            self._selector.unregister(worker.pidfd)
            os.close(worker.pidfd)
            worker.pidfd = None
        if self._closing or self._stop_signal is not None:
            worker.state = WorkerState.SUCCEEDED if rc == 0 else WorkerState.STOPPED
            if rc != 0 and self._stop_signal is None and read_error_file(worker.spec.error_file):
                # It raised on its own while we tore down: it may even have failed first.
                worker.state = WorkerState.FAILED
                worker.failure = self._failure_of(worker)
                self._failures.append(worker.failure)
        elif rc == 0:
            worker.state = WorkerState.SUCCEEDED
            self._last_finish = self._clock()
        else:
            worker.state = WorkerState.FAILED
            worker.failure = self._failure_of(worker)
            self._failures.append(worker.failure)
        self._changed(worker)

    def _failure_of(self, worker: Worker) -> WorkerFailure:
        rc = worker.returncode
        assert rc is not None
        # Read what the pipes still hold so the tail and the traceback are complete.
        self._drain_worker(worker, deadline=self._clock() + 0.2)
        record = read_error_file(worker.spec.error_file) or {}
        if record and rc < 0 and self._closing:
            rc = 1  # it raised, then our teardown cut its exit short: the exception is what it did
        return WorkerFailure(
            rank=worker.rank,
            local_rank=worker.spec.local_rank,
            node=worker.spec.node,
            pid=worker.pid,
            exit_code=rc if rc >= 0 else None,
            signal=signal_name(-rc) if rc < 0 else None,
            error_type=record.get("type"),
            message=record.get("message"),
            traceback=record.get("traceback"),
            time=record.get("time") or worker.end_time,
            log_tail=list(worker.tail),
            log_path=str(worker.spec.log_path) if worker.spec.log_path else None,
        )

    def _drain_worker(self, worker: Worker, deadline: float) -> None:
        """Read a worker's pipes until EOF or the deadline (grandchildren may hold them open)."""
        streams = [key.data[1] for key in self._selector.get_map().values()
                   if key.data[0] == "out" and key.data[1].worker is worker]
        while streams and self._clock() < deadline:
            ready = selectors.DefaultSelector()
            for s in streams:
                ready.register(s.fd, selectors.EVENT_READ, s)
            try:
                events = ready.select(max(0.0, deadline - self._clock()))
            finally:
                ready.close()
            if not events:
                break
            for key, _ in events:
                self._read_stream(key.data)
            streams = [s for s in streams if s.fd in self._selector.get_map()]

    def _changed(self, worker: Worker) -> None:
        if self._listener is not None:
            self._listener.on_worker_change(worker)

    def _handle_signals(self) -> None:
        while self._external:
            self._failures.append(self._external.popleft())
        while self._signals:
            signum = self._signals.popleft()
            if signum in (signal.SIGINT, signal.SIGTERM):
                if self._stop_signal is not None or self._closing:
                    if signum == signal.SIGINT:
                        self._kill_now = True  # a second Ctrl-C: no more grace
                    continue
                self._stop_signal = signum
            else:
                self._forward(signum)

    def _forward(self, signum: int) -> None:
        for worker in self.workers:
            if worker.alive and worker.pid is not None:
                _signal_group(worker.pid, signum)

    def _check_hang(self) -> None:
        if self.hang_timeout is None or self._failures or self._closing or self._hung:
            return
        running = [w for w in self.workers if w.alive]
        if not running:
            return
        now = self._clock()
        # A rank that finished is progress too: the ones left may have been waiting on it.
        silent = now - max(self._last_finish, *(w.last_activity for w in running))
        if silent < self.hang_timeout:
            return
        self._notify(f"no rank has shown progress for {silent:.1f}s (--hang-timeout "
                     f"{self.hang_timeout:g}); dumping every rank's stacks and stopping the run")
        self._hung = True  # before dumping: dump_stacks runs the loop, which must not come back here
        self.dump_stacks(running)
        for w in running:
            dumped = w.dump
            self._failures.append(WorkerFailure(
                rank=w.rank, local_rank=w.spec.local_rank, node=w.spec.node, pid=w.pid,
                error_type="Hang", message=f"no progress for {silent:.1f}s",
                traceback="\n".join(dumped) or None, time=time.time() - silent + w.rank * 1e-6,
                log_tail=list(w.tail),
                log_path=str(w.spec.log_path) if w.spec.log_path else None,
            ))

    # ---- teardown ----------------------------------------------------------------------------------

    def dump_stacks(self, workers: Sequence[Worker] | None = None) -> None:
        """Ask live ranks to write their Python stacks to their logs, then wait briefly for them."""
        targets = [w for w in (workers or self.workers) if w.alive and w.pid is not None]
        if not targets:
            return
        activity = {w.rank: w.last_activity for w in targets}
        for w in targets:
            w.capture = []
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, DUMP_SIGNAL)  # type: ignore[arg-type]
        deadline = self._clock() + self._dump_wait
        while self._clock() < deadline:
            self._process_events(0.02)
            pending = [w for w in targets if w.alive and w.last_activity == activity[w.rank]]
            quiet = all(self._clock() - w.last_activity >= 0.03 for w in targets if w.alive)
            if not pending and quiet:
                break
        for w in targets:
            w.dump, w.capture = w.capture or [], None

    def close(self, sig: int = signal.SIGTERM, grace_period: float | None = None,
              dump_stacks: bool = False) -> None:
        """Stop every group: ``sig``, one shared deadline, SIGKILL the rest, reap. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        grace = self.grace_period if grace_period is None else grace_period
        try:
            if self._started:
                self._closing = True  # from here on, an exit is the launcher's doing
                if dump_stacks:
                    self.dump_stacks()
                self._terminate(sig, grace)
        finally:
            self._release()

    def _open_groups(self) -> list[int]:
        """Process groups that still have members. Once a group is empty its id (the rank's pid) may be
        reused by an unrelated process, so it is never signalled again."""
        for w in self.workers:
            if w.group_open and (w.pid is None or (w.returncode is not None and not _group_alive(w.pid))):
                w.group_open = False
        return [w.pid for w in self.workers if w.group_open and w.pid is not None]

    def _terminate(self, sig: int, grace: float) -> None:
        self._closing = True
        for pgid in self._open_groups():
            _signal_group(pgid, sig)
        deadline = self._clock() + grace
        while self._clock() < deadline and not self._kill_now:
            if not any(w.alive for w in self.workers) and not self._open_groups():
                break
            self._process_events(0.01)
            self._reap_adopted()
        stragglers = [w for w in self.workers if w.alive]
        groups = self._open_groups()
        if stragglers or groups:
            if stragglers:
                why = "a second interrupt" if self._kill_now else f"{grace:g}s after {signal_name(sig)}"
                ranks = ", ".join(f"rank {w.rank} (pid {w.pid})" for w in stragglers)
                self._notify(f"{ranks} still running {why}; sending SIGKILL")
            for pgid in groups:
                _signal_group(pgid, signal.SIGKILL)
        self._kill_escaped()
        for w in self.workers:
            if w.popen is not None and w.returncode is None:
                w.popen.wait()
                self._reap(w)
        end = self._clock() + 1.0
        while self._open_groups() and self._clock() < end:
            self._reap_adopted()
            time.sleep(0.005)
        for w in self.workers:
            self._drain_worker(w, deadline=self._clock() + 0.2)

    def _kill_escaped(self) -> None:
        """As a subreaper, also end descendants that left their worker's process group (setsid)."""
        if not self._reap_orphans:
            return
        import psutil

        workers = {w.pid for w in self.workers}
        for child in psutil.Process().children(recursive=True):
            if child.pid not in workers:
                with contextlib.suppress(psutil.Error):
                    child.kill()

    def _reap_adopted(self) -> None:
        """Reap orphans re-parented to this launcher (it is a child subreaper in CLI mode)."""
        if not self._reap_orphans:
            return
        import psutil

        workers = {w.pid for w in self.workers if w.returncode is None}
        for child in psutil.Process().children():
            if child.pid in workers:
                continue
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(child.pid, os.WNOHANG)

    def _release(self) -> None:
        for key in list(self._selector.get_map().values()):
            kind, obj = key.data
            if kind == "out":
                self._end_stream(obj)
        for w in self.workers:
            if w.heartbeat_read_fd is not None:
                with contextlib.suppress(KeyError):
                    self._selector.unregister(w.heartbeat_read_fd)
                os.close(w.heartbeat_read_fd)
                w.heartbeat_read_fd = None
            if w.pidfd is not None:
                with contextlib.suppress(KeyError):
                    self._selector.unregister(w.pidfd)
                os.close(w.pidfd)
                w.pidfd = None
            if w.log_file is not None:
                w.log_file.close()
                w.log_file = None
        self._selector.close()
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
