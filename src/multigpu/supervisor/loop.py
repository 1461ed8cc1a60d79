"""The supervisor: the one object that owns worker lifetimes.

``start()`` spawns every worker in its own session (so its process group holds everything it starts),
``wait()`` runs one event loop over process descriptors, output pipes, heartbeats and a wake-up pipe
until all ranks succeed, one fails, a hang is seen or a stop is requested, and ``close()`` tears the
group down: optional stack dumps, the stop signal to every group (exited ranks' included), one shared
deadline, SIGKILL for what is left, a bounded reap. ``close()`` is safe to call twice; ``start()``
twice raises. What the workers write is ``output.WorkerOutput``'s business: the loop hands it ready
pipes and never waits on a console.

Progress and the hang decision are ``hangs/``'s: the loop feeds the ``ProgressBook`` every rank's
beats (``beat_pipe.py``) and asks ``verdict.HangWatch`` each turn, which judges a hang on this node
or declares it to the job; ``stack_dumps`` collects stacks and flight records. The loop's own lines
(a hang, a SIGKILL, a late death) are logged (``console/log.py`` shows them).
A rank whose bootstrap said "done" (its script returned, threads and atexit handlers finished) has
succeeded even if the process then dies in torch's exit-time teardown; that is a warning.
Worker states and the other types are in ``states.py``; an exit's meaning in ``exits.py``, the
failures and the result they add up to in ``outcome.py``, the event sources in ``events.py``. The
teardown's wait is the loop's own (``_stop_groups``: output is still read and exits still judged
until the deadline); its signals, SIGKILL and release are ``teardown.py``'s.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections import deque
from collections.abc import Sequence
from functools import partial

from multigpu.contract.failure import WorkerFailure
from multigpu.contract.signals import signal_name
from multigpu.supervisor import exits, reaping, spawning, teardown
from multigpu.supervisor.control import answer
from multigpu.supervisor.events import Events
from multigpu.supervisor.hangs.beat_pipe import read_beats
from multigpu.supervisor.hangs.book import HangPolicy, ProgressBook
from multigpu.supervisor.hangs.stack_dumps import DumpRequest
from multigpu.supervisor.hangs.verdict import HangWatch, Turns
from multigpu.supervisor.outcome import Outcome
from multigpu.supervisor.output import OutputSink, WorkerOutput, mute_all_but
from multigpu.supervisor.run_updates import News
from multigpu.supervisor.settings import Hooks, SupervisorOptions
from multigpu.supervisor.spawning import PopenSpawner, Spawner
from multigpu.supervisor.states import RunResult, Worker, WorkerSpec, WorkerState
from multigpu.supervisor.stop_requests import StopRequests

logger = logging.getLogger(__name__)


class Supervisor:
    """Owns a set of worker processes from start to reaped; see the module docstring."""

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        *,
        sink: OutputSink | None = None,
        options: SupervisorOptions | None = None,
        hooks: Hooks | None = None,
        progress: ProgressBook | None = None,
        spawner: Spawner | None = None,
    ) -> None:
        self.options = options = options or SupervisorOptions()
        self.hooks = hooks = hooks or Hooks()
        self._spawner: Spawner = spawner or PopenSpawner()
        self.workers = [Worker(spec) for spec in specs]
        self._clock = options.clock
        self.progress = progress or ProgressBook(
            HangPolicy(ceiling=options.hang_timeout), (w.rank for w in self.workers), clock=self._clock
        )
        self._output = WorkerOutput(sink, self._clock, hooks.console, options.hold_peer_losses)
        self._events = Events()
        self._stops = StopRequests(self._clock, self._events.wake)
        self._external: deque[WorkerFailure] = deque()
        self._lock = threading.Lock()
        self._started = self._closed = self._closing = False
        self._hangs = HangWatch(
            self.progress, hooks.job_hang, self.dump_stacks, Turns(self.turn, self._clock, self._stops.seen)
        )
        self._outcome = Outcome()
        self._race = exits.StopRace()  # ranks killed by a stop signal we did not send
        self._news = News(hooks, self.progress, self._clock, options.tick_period)

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
                self._news.changed(worker)
                worker.progress = self.progress.started(worker.rank, now, worker.pid, worker.spec.node)
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

    def wait(self, timeout: float | None = None) -> RunResult | None:
        """Run the loop until the run has an outcome (or ``timeout`` seconds pass: then None)."""
        if not self._started:
            raise RuntimeError("Supervisor.wait() before start()")
        deadline = None if timeout is None else self._clock() + timeout
        while (outcome := self._outcome.result(self._stops.signal, self.workers)) is None:
            remaining = None if deadline is None else deadline - self._clock()
            if remaining is not None and remaining <= 0:
                return None
            self.turn(
                _period(
                    self.options, self.progress, self._output, self.workers, remaining, self._race.next_due()
                )
            )
        return outcome

    def settle_peer_losses(self, *, fold: bool) -> None:
        """The root cause is known (``hold_peer_losses``): see ``WorkerOutput.settle_peer_losses``."""
        self._output.settle_peer_losses(fold=fold)

    def final_result(self, result: RunResult) -> RunResult:
        """``result`` again after ``close()``: ranks that failed during teardown may have failed first."""
        return self._outcome.final(result)

    def output_losses(self) -> list[str]:
        """Log files that could not be written in full (a full disk), one line each."""
        return self._output.losses()

    def turn(self, timeout: float | None) -> None:
        """One turn of the loop: what is ready within ``timeout``, then signals, hangs and the tick."""
        self._output.release_held(self._events)
        for kind, obj in self._events.ready(timeout):
            if kind == "out":
                if self._output.take(obj, self._events):  # not when held for a full console
                    self.progress.output(obj.worker.rank, obj.worker.lines.last_at)
            elif kind == "exit":
                self.reap(obj)
            elif kind == "control":
                dump = partial(self.dump_stacks, goes_on=True)  # ``multigpu stacks``: the job goes on
                answer(obj, self.workers, dump, self.progress, self._clock())
            else:
                self._read_beats(obj)
        for worker in reaping.unwatched_exits(self.workers):
            self.reap(worker)
        self._output.show_partials()
        reaping.close_emptied(self.workers)
        self._handle_signals()
        self._judge_pending()
        self._news.tell()
        self._check_hang()
        self._news.tick(self._closing)

    def _read_beats(self, worker: Worker) -> None:
        kinds = read_beats(worker, self._events, self.progress, self._clock)
        if "failing" in kinds and self._stops.signal is None:
            self._mute_others(worker)
        if "failing" in kinds and self.hooks.on_failing is not None:
            self.hooks.on_failing(worker)

    def _mute_others(self, failed: Worker) -> None:
        """The others' output from here on is a consequence, for their logs only; what their pipes hold
        already was written before the failure was seen, and shows (a line is never lost to the order
        in which the loop read the pipes)."""
        others = [w for w in self.workers if w is not failed and not w.lines.muted]
        self._output.drain(s for w in others for s in self._output.of(w))
        mute_all_but(self.workers, failed)

    def reap(self, worker: Worker) -> None:
        """Collect a rank that exited and judge its exit (``exits.settle``)."""
        rc = exits.collect(worker, self._events)
        if rc is None:
            return
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
        moment = exits.Moment(self._closing or interrupted, interrupted, self._outcome.first_time())
        failure = exits.settle(worker, rc, moment, self._output, self.hooks.timer)
        if failure is not None:
            self._outcome.failures.append(failure)
            self._mute_others(worker)
        elif worker.state is WorkerState.SUCCEEDED and not (self._closing or interrupted):
            self.progress.finished(worker.rank, self._clock())
        self._news.changed(worker)

    def _handle_signals(self) -> None:
        while self._external:
            failure = self._external.popleft()
            if self._closing or not self._hangs.job_hangs(failure, self.workers, self._outcome):
                self._outcome.failures.append(failure)
        for signum in self._stops.take(self._closing):
            reaping.forward(self.workers, signum)  # SIGHUP, SIGUSR1/2: the ranks decide

    def _check_hang(self) -> None:
        outcome = self._outcome
        if not (outcome.failures or self._closing or outcome.hung or self._hangs.declared):
            self._hangs.check(self.workers, outcome)

    # ---- teardown ----------------------------------------------------------------------------------

    def dump_stacks(
        self, workers: Sequence[Worker] | None = None, *, goes_on: bool = False
    ) -> DumpRequest | None:
        """Ask live ranks for their Python stacks (to their logs) and flight records; wait briefly.
        Their consoles are muted meanwhile; after a hang or a failure they stay muted (what follows is
        the teardown's consequence), but when the job ``goes_on`` they show again."""
        targets = [w for w in (workers or self.workers) if w.alive and w.pid is not None]
        if not targets:
            return None
        request = DumpRequest(targets, self._clock, self.options.dump_wait)
        while not request.done():
            self.turn(request.next_check_in())
        self._output.drain(s for w in targets for s in self._output.of(w))  # a beat can pass its stacks
        request.finish(unmute=goes_on)
        return request

    def close(
        self, sig: int = signal.SIGTERM, grace_period: float | None = None, dump_stacks: bool = False
    ) -> None:
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
                self._stop_groups(sig, grace)
                for w in self.workers:
                    self._output.drain(self._output.of(w))
                self._news.publish(final=True)
        finally:
            self._news.tell()
            teardown.release(self.workers, self._output, self._events)

    def _stop_groups(self, sig: int, grace: float) -> None:
        """``sig`` to every group; the loop turns until all are gone, ``grace`` passes or a second
        Ctrl-C comes; SIGKILL for the rest (``teardown``), and every rank reaped."""
        workers, clock = self.workers, self._clock
        teardown.signal_groups(workers, sig)
        deadline = clock() + grace
        while clock() < deadline and not self._stops.kill_now and not teardown.all_gone(workers):
            self.turn(0.01)
            teardown.reap_adopted(workers, self.options)
        why = "after a second interrupt" if self._stops.kill_now else f"{grace:g}s after {signal_name(sig)}"
        for w in teardown.kill_rest(workers, why, self.options, self._spawner.spared):
            if w.ending.unkillable:
                self._news.changed(w)
            else:
                self.reap(w)
        teardown.wait_for_groups(workers, self.options)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _period(
    options: SupervisorOptions,
    progress: ProgressBook,
    output: WorkerOutput,
    workers: Sequence[Worker],
    remaining: float | None,
    race_due: float | None,
) -> float:
    """How long one turn may wait: the tick, a quarter of the shortest hang timeout, the next partial
    line due on the console, a short poll where no pidfd tells a rank's exit, or until a rank killed
    by an outside stop signal is judged (``race_due``)."""
    period = options.tick_period
    shortest = progress.shortest_timeout()
    if shortest is not None:
        period = min(period, max(0.01, shortest / 4))
    due = output.due_in()
    if due is not None:
        period = min(period, max(0.01, due))
    if any(w.pidfd is None and w.alive for w in workers):
        period = min(period, 0.05)
    period = period if remaining is None else max(0.0, min(period, remaining))
    return period if race_due is None else max(0.0, min(period, race_due - options.clock()))
