"""The supervisor: the one object that owns worker lifetimes.

``start()`` spawns every worker in its own session (so its process group holds everything it starts),
``wait()`` runs one event loop over process descriptors, output pipes, heartbeats and a wake-up pipe
until all ranks succeed, one fails, a hang is seen or a stop is requested, and ``close()`` tears the
group down: optional stack dumps, the stop signal to every group (exited ranks' included), one shared
deadline, SIGKILL for what is left, a bounded reap. ``close()`` is safe to call twice; ``start()``
twice raises. What the workers write is ``output.WorkerOutput``'s business: the loop hands it ready
pipes and never waits on a console.

Progress and the hang decision are ``hang.ProgressBook``'s: the loop feeds it every rank's beats
(``progress.BeatDecoder``) and asks it each turn; ``rank_dumps`` collects stacks and flight records.
A rank whose bootstrap said "done" (its script returned, threads and atexit handlers finished) has
succeeded even if the process then dies in torch's exit-time teardown; that is a warning.
Worker states and the other types are in ``states.py``.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from . import reaping
from .console import say
from .errors import WorkerFailure, signal_name
from .hang import HangPolicy, ProgressBook, hang_failures
from .output import OutputSink, Stream, WorkerOutput
from .rank_dumps import DumpRequest, flight_record
from .spawning import PopenSpawner, Spawner, start_rank
from .states import (
    LOG_TAIL_LINES,
    RunResult,
    RunStatus,
    SupervisorListener,
    Worker,
    WorkerSpec,
    WorkerState,
    read_error_file,
)

__all__ = ["LOG_TAIL_LINES", "STOP_SIGNALS", "RunResult", "RunStatus", "Supervisor", "SupervisorListener",
           "Worker", "WorkerSpec", "WorkerState", "read_error_file"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)
"""Signals that stop the run; the others the launcher catches (SIGHUP, SIGUSR1/2) go to the ranks."""


PROGRESS_EVERY_S = 5.0
"""How often step times go to the listener (run.json), besides the end of the attempt."""


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
        progress: ProgressBook | None = None,
        spawner: Spawner | None = None,
    ) -> None:
        self._spawner: Spawner = spawner or PopenSpawner()
        self.workers = [Worker(spec) for spec in specs]
        self._listener = listener
        self.grace_period = grace_period
        self.progress = progress or ProgressBook(HangPolicy(ceiling=hang_timeout),
                                                 (w.rank for w in self.workers), clock=clock,
                                                 notify=notify or say)
        self._tick = tick
        self._tick_period = tick_period
        self._dump_wait = dump_wait
        self._notify = notify or say
        self._clock = clock
        self._output = WorkerOutput(sink, self._notify, clock)
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
        self._last_tick = 0.0
        self._published = float("-inf")

    # ---- start -------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise RuntimeError("Supervisor.start() called twice; make a new Supervisor per attempt")
        self._started = True
        now = self._clock()
        try:
            self._spawner.prepare([w.spec for w in self.workers])
            for worker in self.workers:
                self._spawn(worker, now)
                self.progress.started(worker.rank, now)
                worker.progress = self.progress.ranks[worker.rank]
        except BaseException:
            self.close(grace_period=0)
            raise

    def _spawn(self, worker: Worker, now: float) -> None:
        self._output.open(worker)
        worker.popen, hb_r = start_rank(self._spawner, worker.spec)
        worker.heartbeat_read_fd = hb_r
        self._selector.register(hb_r, selectors.EVENT_READ, ("beat", worker))
        worker.state = WorkerState.RUNNING
        worker.start_time = time.time()
        worker.last_output = now
        pipes = (("stdout", worker.popen.stdout), ("stderr", worker.popen.stderr))
        for stream in self._output.attach(worker, pipes):
            self._selector.register(stream.fd, selectors.EVENT_READ, ("out", stream))
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
        shortest = self.progress.shortest_timeout()
        if shortest is not None:
            period = min(period, max(0.01, shortest / 4))
        due = self._output.due_in()
        if due is not None:
            period = min(period, max(0.01, due))
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
                self.progress.output(obj.worker.rank, obj.worker.last_output)
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
        self._output.show_partials()
        if any(w.group_open and w.returncode is not None for w in self.workers):
            reaping.open_groups(self.workers)
        self._handle_signals()
        self._check_hang()
        self._maybe_tick()

    def _maybe_tick(self) -> None:
        now = self._clock()
        if now - self._published >= PROGRESS_EVERY_S:
            self.publish_progress()
        if self._tick is None:
            return
        if now - self._last_tick >= self._tick_period:
            self._last_tick = now
            self._tick()

    def publish_progress(self) -> None:
        """Hand every rank's step times to the listener (run.json), and keep the learned timeouts."""
        self._published = self._clock()
        self.progress.maybe_save(self._published, force=self._closing)
        on_progress = getattr(self._listener, "on_progress", None)
        if on_progress is not None:
            on_progress(self.progress.snapshot())

    def _read_beats(self, worker: Worker) -> None:
        fd = worker.heartbeat_read_fd
        if fd is None:
            return
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        if data:
            beats = worker.decoder.feed(data)
            self.progress.feed(worker.rank, beats, self._clock())
            kinds = {b.kind for b in beats}
            worker.finished |= "done" in kinds
            worker.recorded |= "dumped" in kinds
            if "failing" in kinds and self._on_failing is not None:
                self._on_failing(worker)
        else:
            self._selector.unregister(fd)
            os.close(fd)
            worker.heartbeat_read_fd = None

    def _read_stream(self, stream: Stream) -> None:
        if not self._output.read(stream):
            self._selector.unregister(stream.fd)

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
        self._read_beats(worker)  # a "done" it sent just before exiting may still be in the pipe
        if rc != 0 and worker.finished:
            self._finished_anyway(worker, rc)
            rc = 0
        if self._closing or self._stop_signal is not None:
            worker.state = WorkerState.SUCCEEDED if rc == 0 else WorkerState.STOPPED
            if rc != 0 and self._stop_signal is None and self._error_record(worker):
                # It raised on its own while we tore down: it may even have failed first.
                worker.state = WorkerState.FAILED
                worker.failure = self._failure_of(worker)
                self._failures.append(worker.failure)
        elif rc == 0:
            worker.state = WorkerState.SUCCEEDED
            self.progress.finished(worker.rank, self._clock())
        else:
            worker.state = WorkerState.FAILED
            worker.failure = self._failure_of(worker)
            self._failures.append(worker.failure)
        self._changed(worker)

    def _finished_anyway(self, worker: Worker, rc: int) -> None:
        how = signal_name(-rc) if rc < 0 else f"exit code {rc}"
        worker.late_death = how
        self._notify(f"rank {worker.rank} (pid {worker.pid}) ended with {how} after its script had "
                     f"finished (an exit-time crash, e.g. in torch's C++ teardown); its work is done, "
                     f"so it counts as a success")

    def _error_record(self, worker: Worker) -> dict[str, Any] | None:
        """The rank's error record, if this very process wrote it (never an earlier run's file)."""
        path = worker.spec.error_file
        record = read_error_file(path)
        if not record or path is None:
            return None
        pid = record.get("pid")
        if pid is not None:
            return record if pid == worker.pid else None
        try:  # torch's @record format carries no pid: it must at least be newer than the process
            fresh = path.stat().st_mtime >= (worker.start_time or 0) - 1.0
        except OSError:
            return None
        return record if fresh else None

    def _failure_of(self, worker: Worker) -> WorkerFailure:
        rc = worker.returncode
        assert rc is not None
        # Read what the pipes hold now, so the tail and the traceback are complete; not a moment
        # more: a DataLoader-style child may keep them open long after the rank itself has gone.
        self._output.drain(self._output.of(worker))
        record = self._error_record(worker) or {}
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

    def output_losses(self) -> list[str]:
        """Log files that could not be written in full (a full disk), one line each."""
        return self._output.losses()

    def _changed(self, worker: Worker) -> None:
        if self._listener is not None:
            self._listener.on_worker_change(worker)

    def _handle_signals(self) -> None:
        while self._external:
            self._failures.append(self._external.popleft())
        while self._signals:
            signum = self._signals.popleft()
            if signum in STOP_SIGNALS:
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
                reaping.signal_group(worker.pid, signum)

    def _check_hang(self) -> None:
        if self._failures or self._closing or self._hung:
            return
        running = [w for w in self.workers if w.alive]
        hang = self.progress.check([w.rank for w in running], self._clock())
        if hang is None:
            return
        self._notify(f"hang: {hang.line}; dumping every rank's stacks and stopping the run")
        self._hung = True  # before dumping: dump_stacks runs the loop, which must not come back here
        request = self.dump_stacks(running)
        since = request.wall_start if request is not None else time.time()
        flight = flight_record(running, {w.rank for w in self.workers}, since - 1.0)
        self._failures.extend(hang_failures(hang, running, flight, time.time()))

    # ---- teardown ----------------------------------------------------------------------------------

    def dump_stacks(self, workers: Sequence[Worker] | None = None) -> DumpRequest | None:
        """Ask live ranks for their Python stacks (to their logs) and flight records; wait briefly."""
        targets = [w for w in (workers or self.workers) if w.alive and w.pid is not None]
        if not targets:
            return None
        request = DumpRequest(targets, self._clock, self._dump_wait)
        while not request.done():
            self._process_events(0.02)
        request.finish()
        return request

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
                self.publish_progress()
        finally:
            self._release()

    def _terminate(self, sig: int, grace: float) -> None:
        self._closing = True
        for pgid in reaping.open_groups(self.workers):
            reaping.signal_group(pgid, sig)
        deadline = self._clock() + grace
        while self._clock() < deadline and not self._kill_now:
            if not any(w.alive for w in self.workers) and not reaping.open_groups(self.workers):
                break
            self._process_events(0.01)
            self._reap_adopted()
        stragglers = [w for w in self.workers if w.alive]
        groups = reaping.open_groups(self.workers)
        if stragglers or groups:
            if stragglers:
                why = "a second interrupt" if self._kill_now else f"{grace:g}s after {signal_name(sig)}"
                ranks = ", ".join(f"rank {w.rank} (pid {w.pid})" for w in stragglers)
                self._notify(f"{ranks} still running {why}; sending SIGKILL")
            for pgid in groups:
                reaping.signal_group(pgid, signal.SIGKILL)
        if self._reap_orphans:
            reaping.kill_escaped(self.workers, self._spawner.spared())
        for w in reaping.reap_killed(self.workers, self._notify):
            if w.unkillable:
                self._changed(w)
            else:
                self._reap(w)
        end = self._clock() + 1.0
        while reaping.open_groups(self.workers) and self._clock() < end:
            self._reap_adopted()
            time.sleep(0.005)
        for w in self.workers:
            self._output.drain(self._output.of(w))

    def _reap_adopted(self) -> None:
        if self._reap_orphans:
            reaping.reap_adopted(self.workers)

    def _release(self) -> None:
        self._output.close()
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
        self._selector.close()
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
