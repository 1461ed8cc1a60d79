"""The supervisor: the one object that owns worker lifetimes.

``start()`` spawns every worker in its own session (so its process group holds everything it starts),
``wait()`` runs one event loop over process descriptors, output pipes, heartbeats and a wake-up pipe
until all ranks succeed, one fails, a hang is seen or a stop is requested, and ``close()`` tears the
group down: optional stack dumps, the stop signal to every group (exited ranks' included), one shared
deadline, SIGKILL for what is left, a bounded reap. ``close()`` is safe to call twice; ``start()``
twice raises. What the workers write is ``output.WorkerOutput``'s business: the loop hands it ready
pipes and never waits on a console.

Progress and the hang decision are ``hang.ProgressBook``'s: the loop feeds it every rank's beats
(``contract/beats.BeatDecoder``) and asks it each turn; ``dumps`` collects stacks and flight records.
A rank whose bootstrap said "done" (its script returned, threads and atexit handlers finished) has
succeeded even if the process then dies in torch's exit-time teardown; that is a warning.
Worker states and the other types are in ``states.py``; an exit's meaning in ``exits.py``, the
teardown in ``teardown.py``, the event sources in ``events.py``.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import deque
from collections.abc import Sequence

from multigpu.contract.errors import HANG, WorkerFailure
from multigpu.supervisor import exits, hang, jobhang, reaping, spawning, teardown
from multigpu.supervisor.control import answer
from multigpu.supervisor.events import Events, read_ready
from multigpu.supervisor.hang import HangPolicy, ProgressBook, hang_failures
from multigpu.supervisor.output import OutputSink, Stream, WorkerOutput
from multigpu.supervisor.run_updates import News
from multigpu.supervisor.settings import Hooks, SupervisorOptions
from multigpu.supervisor.spawning import PopenSpawner, Spawner
from multigpu.supervisor.stack_dumps import DumpRequest, flight_record
from multigpu.supervisor.states import (
    RunResult,
    RunStatus,
    Worker,
    WorkerSpec,
    WorkerState,
)
from multigpu.supervisor.stop_requests import StopRequests


class Supervisor:
    """Owns a set of worker processes from start to reaped; see the module docstring."""

    def __init__(self, specs: Sequence[WorkerSpec], *, sink: OutputSink | None = None,
                 options: SupervisorOptions | None = None, hooks: Hooks | None = None,
                 progress: ProgressBook | None = None, spawner: Spawner | None = None) -> None:
        self.options = options = options or SupervisorOptions()
        self.hooks = hooks = hooks or Hooks()
        self._spawner: Spawner = spawner or PopenSpawner()
        self.workers = [Worker(spec) for spec in specs]
        self._clock = options.clock
        self._notify = hooks.notify
        self.progress = progress or ProgressBook(HangPolicy(ceiling=options.hang_timeout),
                                                 (w.rank for w in self.workers), clock=self._clock,
                                                 notify=self._notify)
        self._output = WorkerOutput(sink, self._notify, self._clock, hooks.console)
        self._events = Events()
        self._stops = StopRequests(self._clock, self._events.wake)
        self._external: deque[WorkerFailure] = deque()
        self._lock = threading.Lock()
        self._started = self._closed = self._closing = self._hung = self._declared = False
        self._failures: list[WorkerFailure] = []
        self._race = exits.StopRace()  # ranks killed by a stop signal we did not send
        self._news = News(hooks, self.progress, self._clock, options.tick_period)
        self._detected: float | None = None

    # ---- start -------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise RuntimeError("Supervisor.start() called twice; make a new Supervisor per attempt")
        self._started = True
        now = self._clock()
        try:
            self._spawner.prepare([w.spec for w in self.workers])
            for worker in self.workers:
                spawning.bring_up(worker, self._spawner, self._output, self._events, now, self.hooks.guard)
                self.changed(worker)
                self.progress.started(worker.rank, now)
                worker.progress = self.progress.ranks[worker.rank]
        except BaseException:
            self.close(grace_period=0)
            raise
        if self.hooks.control is not None:
            self._events.watch(self.hooks.control.fileno(), "control", self.hooks.control)
        self._news.tell()

    # ---- signals and stop requests (safe from a signal handler or another thread) ---------------------

    def request_signal(self, signum: int) -> None:
        """Record a signal (and when it came) for the loop to act on; does nothing else, so it is safe
        in a handler."""
        self._stops.record(signum)

    def request_stop(self) -> None:
        self.request_signal(signal.SIGTERM)

    def abort(self, failure: WorkerFailure) -> None:
        """End the run as failed for a cause outside this group (another node failed). Thread-safe."""
        self._external.append(failure)
        self._events.wake()

    # ---- the loop ----------------------------------------------------------------------------------

    def poll(self) -> RunResult | None:
        """Handle what is ready now, without blocking; a result once the run has an outcome."""
        self.turn(0)
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
            period = _period(self.options, self.progress, self._output, self.workers, remaining)
            due = self._race.next_due()
            if due is not None:
                period = max(0.0, min(period, due - self._clock()))
            self.turn(period)

    def _outcome(self) -> RunResult | None:
        stop = self._stops.signal
        if (stop is not None or self._failures) and self._detected is None:
            self._detected = time.time()
        if stop is not None:
            return RunResult(RunStatus.INTERRUPTED, self._sorted_failures(), stop, self._detected)
        if self._failures:
            status = RunStatus.HUNG if self._hung else RunStatus.FAILED
            return RunResult(status, self._sorted_failures(), detected_time=self._detected)
        if all(w.state is WorkerState.SUCCEEDED for w in self.workers):
            return RunResult(RunStatus.SUCCEEDED)
        return None

    def final_result(self, result: RunResult) -> RunResult:
        """``result`` again after ``close()``: ranks that failed during teardown may have failed first."""
        if result.status in (RunStatus.FAILED, RunStatus.HUNG):
            return RunResult(result.status, self._sorted_failures(), result.signal, result.detected_time)
        return result

    def _sorted_failures(self) -> list[WorkerFailure]:
        return by_time(self._failures)

    def turn(self, timeout: float | None) -> None:
        """One turn of the loop: what is ready within ``timeout``, then signals, hangs and the tick."""
        self._output.release_held(self._events)
        for kind, obj in self._events.ready(timeout):
            if kind == "out":
                if self._output.hold(obj, self._events):
                    continue
                self._read_stream(obj)
                self.progress.output(obj.worker.rank, obj.worker.last_output)
            elif kind == "exit":
                self.reap(obj)
            elif kind == "control":
                answer(obj, self.workers, self.dump_stacks, self.progress, self._clock())
            else:
                self._read_beats(obj)
        for worker in self.workers:
            if worker.pidfd is None and worker.alive and worker.popen and worker.popen.poll() is not None:
                self.reap(worker)
        self._output.show_partials()
        if any(w.group_open and w.returncode is not None for w in self.workers):
            reaping.open_groups(self.workers)
        self._handle_signals()
        self._judge_pending()
        self._news.tell()
        self._check_hang()
        self._news.tick(self._closing)

    def _read_beats(self, worker: Worker) -> None:
        fd = worker.heartbeat_read_fd
        data = b"" if fd is None else read_ready(fd)
        if data is None or fd is None:
            return
        if not data:
            self._events.forget(fd, close=True)
            worker.heartbeat_read_fd = None
        else:
            kinds = hang.feed_beats(self.progress, worker, data, self._clock())
            if "failing" in kinds and self._stops.signal is None:
                self._mute_all_but(worker)
            if "failing" in kinds and self.hooks.on_failing is not None:
                self.hooks.on_failing(worker)

    def _mute_all_but(self, failed: Worker) -> None:
        """A rank failed (it said so, or it exited): what the others say from here on is a consequence,
        for their logs only; the report names each of them in one line."""
        for other in self.workers:
            other.muted = other.muted or (other is not failed and other.alive)

    def _read_stream(self, stream: Stream) -> None:
        if not self._output.read(stream):
            self._events.forget(stream.fd)

    def reap(self, worker: Worker) -> None:
        """Collect a rank that exited and judge its exit (``exits.settle``)."""
        if worker.returncode is not None or worker.popen is None:
            return
        rc = worker.returncode = worker.popen.wait()
        worker.end_time = time.time()
        if worker.pidfd is not None:
            self._events.forget(worker.pidfd, close=True)
            worker.pidfd = None
        self._read_beats(worker)  # a "done" it sent just before exiting may still be in the pipe
        # A stop signal recorded but not yet handled counts: SLURM's scancel and time limit send SIGTERM
        # to every process of the step, and a rank may die of it a moment before this loop handles ours,
        # or before ours arrives at all: then the rank is judged a moment later (``exits.Pending``).
        interrupted = self._stops.seen()
        if not (interrupted or self._closing) and exits.outside_stop(worker, rc):
            self._race.hold(worker, rc, self._clock())
            return
        self._judge(worker, rc, interrupted)

    def _judge_pending(self, now: bool = False) -> None:
        """Judge the ranks a stop signal killed, once ours came or the race window closed (``now``)."""
        if not self._race:
            return
        stop = self._stops.seen()
        for p in self._race.due(self._clock(), all_of_them=now or stop):
            self._judge(p.worker, p.rc, stop)

    def _judge(self, worker: Worker, rc: int, interrupted: bool) -> None:
        first = min((f.time for f in self._failures if f.time is not None), default=None)
        failure = exits.settle(worker, rc, ending=self._closing or interrupted, interrupted=interrupted,
                               output=self._output, notify=self._notify, first_failure=first)
        if failure is not None:
            self._failures.append(failure)
            self._mute_all_but(worker)
        elif worker.state is WorkerState.SUCCEEDED and not (self._closing or interrupted):
            self.progress.finished(worker.rank, self._clock())
        self.changed(worker)

    def output_losses(self) -> list[str]:
        """Log files that could not be written in full (a full disk), one line each."""
        return self._output.losses()

    def changed(self, worker: Worker) -> None:
        """Note a rank whose state changed; the listener hears of every change of a turn at once."""
        self._news.changed(worker)

    def _handle_signals(self) -> None:
        while self._external:
            failure = self._external.popleft()
            if not self._job_hang(failure):
                self._failures.append(failure)
        for signum in self._stops.take(self._closing):
            reaping.forward(self.workers, signum)  # SIGHUP, SIGUSR1/2: the ranks decide

    def _check_hang(self) -> None:
        if self._failures or self._closing or self._hung or self._declared:
            return
        running = [w for w in self.workers if w.alive]
        hang = self.progress.check([w.rank for w in running], self._clock())
        if hang is not None and self.hooks.job_hang is not None:  # every node hears of it, this one too
            self._declared = True
            self.hooks.job_hang.declare(hang.notice)
        elif hang is not None:
            since = self._collect_stacks(hang.notice)
            flight = flight_record(running, {w.rank for w in self.workers}, since - 1.0)
            self._failures.extend(hang_failures(hang, running, flight, time.time()))

    def _job_hang(self, notice: WorkerFailure) -> bool:
        """The job hangs (a node said so through the store): dump this node's ranks, then judge with
        every node (``jobhang.py``). False for any other failure from outside, and once this node has
        an outcome of its own."""
        exchange = self.hooks.job_hang
        if notice.error_type != HANG or exchange is None or self._hung or self._closing or self._failures:
            return False  # a rank here failed already: that failure and the notice are ordered by time
        self._collect_stacks(notice.message or "")
        self._failures.extend(jobhang.gather_verdict(exchange, notice, self.workers, self.progress,
                                                     self.turn, self._clock, self._stops.seen))
        return True

    def _collect_stacks(self, notice: str) -> float:
        """Say what is known, then dump every live rank's stacks; when the request went out."""
        self._notify(f"hang: {notice}; collecting every rank's stacks")
        self._hung = True  # before dumping: dump_stacks runs the loop, which must not come back here
        request = self.dump_stacks([w for w in self.workers if w.alive])
        return request.wall_start if request is not None else time.time()

    # ---- teardown ----------------------------------------------------------------------------------

    def dump_stacks(self, workers: Sequence[Worker] | None = None) -> DumpRequest | None:
        """Ask live ranks for their Python stacks (to their logs) and flight records; wait briefly."""
        targets = [w for w in (workers or self.workers) if w.alive and w.pid is not None]
        if not targets:
            return None
        request = DumpRequest(targets, self._clock, self.options.dump_wait)
        while not request.done():
            self.turn(request.next_check_in())
        self._output.drain(s for w in targets for s in self._output.of(w))  # a beat can pass its stacks
        request.finish()
        return request

    def close(self, sig: int = signal.SIGTERM, grace_period: float | None = None,
              dump_stacks: bool = False) -> None:
        """Stop every group: ``sig``, one shared deadline, SIGKILL the rest, reap. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._judge_pending(now=True)
        grace = self.options.grace_period if grace_period is None else grace_period
        try:
            if self._started:
                self._closing = True  # from here on, an exit is the launcher's doing
                if dump_stacks:
                    self.dump_stacks()
                self._stops.told_at = self._clock()
                if sig == signal.SIGINT:  # the user's Ctrl-C: the report says where each rank was
                    self._output.hide_interrupts()
                teardown.stop_groups(self.workers, sig, grace, self, self.options, self._spawner.spared,
                                     self._notify)
                for w in self.workers:
                    self._output.drain(self._output.of(w))
                self._news.publish(final=True)
        finally:
            self._news.tell()
            teardown.release(self.workers, self._output, self._events)


    @property
    def kill_now(self) -> bool:
        """A second Ctrl-C came: the teardown's grace is over."""
        return self._stops.kill_now

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _period(options: SupervisorOptions, progress: ProgressBook, output: WorkerOutput,
            workers: Sequence[Worker], remaining: float | None) -> float:
    """How long one turn may wait: the tick, a quarter of the shortest hang timeout, the next partial
    line due on the console, or a short poll where no pidfd tells a rank's exit."""
    period = options.tick_period
    shortest = progress.shortest_timeout()
    if shortest is not None:
        period = min(period, max(0.01, shortest / 4))
    due = output.due_in()
    if due is not None:
        period = min(period, max(0.01, due))
    if any(w.pidfd is None and w.alive for w in workers):
        period = min(period, 0.05)
    return period if remaining is None else max(0.0, min(period, remaining))


def by_time(failures: Sequence[WorkerFailure]) -> list[WorkerFailure]:
    """The first failure in time first: the root cause (a failure of unknown time last).

    Cause before time in one case: a rank that failed only because a peer's connection closed comes
    after a lost node or store, whatever the clocks say. A lost node's time is when the watcher last
    saw its counter move, up to a beat after the node really died, so the peer's "Connection reset"
    can carry the earlier time although the loss caused it."""
    ordered = sorted(failures, key=lambda f: f.time if f.time is not None else float("inf"))
    lost = next((f for f in ordered if f.explains(ordered[0])), None) if ordered else None
    if lost is None:
        return ordered
    return [lost, *(f for f in ordered if f is not lost)]
