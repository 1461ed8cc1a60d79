"""One attempt of ``multigpu run`` on this node: its supervisor, its console, its fate shared with the
other nodes, and its result. Runs in the launcher; the attempts loop (``attempts.py``) runs every
attempt, whatever the membership, through here.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from multigpu.config.run import RunConfig
from multigpu.console.ranks import PrefixedConsole
from multigpu.console.writer import Console
from multigpu.contract.failure import FailureKind, Subject, WorkerFailure
from multigpu.contract.signals import signal_name
from multigpu.observe.watched import Watched
from multigpu.record.failure_report import plain_summary
from multigpu.record.run_json import RunRecord, complete_error_files
from multigpu.rendezvous.failure_sharing import (
    FateMonitor,
    mark_done,
    settle_root,
    share_failure,
    share_interrupt,
)
from multigpu.rendezvous.hang_store import StoreHangs
from multigpu.rendezvous.job import JobStore
from multigpu.rendezvous.node_lateness import JobTiming, node_address
from multigpu.runner.membership import Meeting, Membership
from multigpu.runner.preempt_watch import PreemptWatch
from multigpu.runner.sentinel_handle import node_sentinel
from multigpu.supervisor.control import ControlSocket, socket_name
from multigpu.supervisor.file_timer import TimerKills
from multigpu.supervisor.hangs.book import progress_book
from multigpu.supervisor.loop import Supervisor
from multigpu.supervisor.settings import Hooks, SupervisorOptions
from multigpu.supervisor.states import RunResult, RunStatus, Worker, WorkerSpec
from multigpu.supervisor.stop_requests import capture_signals

if TYPE_CHECKING:
    from multigpu.runner.live_view import LiveStatus

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """One run on this node, for all its attempts: what each attempt starts from (made by
    ``attempts.py``, which runs the attempts)."""

    config: RunConfig
    members: Membership
    record: RunRecord
    output_dir: Path
    base_env: Mapping[str, str]
    cvd: str | None
    """``CUDA_VISIBLE_DEVICES`` for the ranks (GPU jobs)."""
    reaper: bool = False
    """This launcher is a child subreaper: it ends and reaps what left the ranks' groups."""
    watch: PreemptWatch | None = None
    over: bool = False
    """The job is over for every node (an elastic rendezvous is then closed: a latecomer is told so)."""
    console: Console = field(default_factory=Console)
    """The run's console (``launch``'s writer): the ranks' lines, the live view and the summary go
    through it; without a writer they go straight to stderr."""
    watched: Watched | None = None
    """What ``/metrics`` and ``/healthz`` read (``observe/``), when the run serves either."""


def exit_code(result: RunResult) -> int:
    """The launcher's exit code for an attempt's result (``contract/exitcodes.py`` lists them)."""
    if result.status is RunStatus.SUCCEEDED:
        return 0
    if result.status is RunStatus.INTERRUPTED:
        return 128 + (result.signal or signal.SIGTERM)
    root = result.root_cause
    return root.launcher_exit_code if root is not None else 1


def _use_live_view(config: RunConfig, console: Console) -> bool:
    if config.output.status == "on":
        return True
    ttys = console.ttys()
    return config.output.status == "auto" and ttys.get(1, False) and ttys.get(2, False)


def _membership_change(result: RunResult) -> bool:
    """An elastic round ended for a joining node: nothing failed, so there are no stacks to dump."""
    return result.root_cause is not None and result.root_cause.kind is FailureKind.MEMBERSHIP_CHANGE


def _lost_node_first(result: RunResult, monitor: FateMonitor | None) -> RunResult:
    """``result`` with a lost node as its root cause, when that is why our rank failed.

    Only the ambiguous case waits: our own rank failed because a peer's connection closed under its
    collective (gloo's "Connection closed by peer") and no node's failure is known yet. A peer rank
    that died on a live node is published by its launcher at once, and that ends the wait; a node
    that is gone entirely (its launcher killed, the machine down) is found by its silence."""
    root = result.root_cause
    if monitor is None or root is None or root.subject is not Subject.RANK or not root.saw_a_peer_die:
        return result
    verdict = monitor.await_verdict()
    if verdict is None or verdict.subject is Subject.RANK:
        return result  # a peer's own failure: share_failure and settle_root order it by time
    return RunResult(result.status, [verdict, *result.failures], result.signal, result.detected_time)


def _another_nodes(root: WorkerFailure | None, node: int) -> bool:
    """The root cause is another node's (that node lost, stopped, or its rank failed first) or the
    store's: our ranks that only saw a peer's connection close say nothing new on the console."""
    if root is None or root.subject is Subject.JOB:
        return False
    return root.subject is Subject.STORE or root.node != node


def _end(
    supervisor: Supervisor, result: RunResult, run: Run, meeting: Meeting, monitor: FateMonitor | None
) -> RunResult:
    """Stop the attempt's ranks the way its outcome asks, and settle its result with the other nodes."""
    job = meeting.job
    if job is not None and result.status in (RunStatus.FAILED, RunStatus.HUNG):
        result = share_failure(job, _lost_node_first(result, monitor))
    supervisor.settle_peer_losses(fold=_another_nodes(result.root_cause, meeting.config.group_rank))
    if result.status is RunStatus.INTERRUPTED:
        sig = result.signal or signal.SIGTERM
        told = monitor.verdict if monitor is not None else None
        if told is None or told.kind is not FailureKind.INTERRUPTED:
            told = None
            if job is not None:
                share_interrupt(job, sig)  # before our ranks go: the other nodes stop theirs at once
        heard = (
            f"{signal_name(sig)} received"
            if told is None
            else f"node {told.node}'s launcher received {signal_name(sig)}"
        )
        logger.info(
            f"{heard}: stopping every rank (grace {meeting.config.supervision.grace_period:g}s; Ctrl-C "
            "again to kill now)"
        )
        supervisor.close(sig=sig)
    else:
        supervisor.close(dump_stacks=result.status is RunStatus.FAILED and not _membership_change(result))
    result = supervisor.final_result(result)
    complete_error_files(supervisor.workers)
    for loss in supervisor.output_losses():
        logger.warning(f"output lost: {loss}")
    run.record.note_losses(supervisor.output_losses())
    if job is not None:
        result = settle_root(job, result)
    warned = run.watch is not None and run.watch.warned
    if job is not None and result.status is RunStatus.SUCCEEDED and not warned:
        mark_done(job)  # after a preemption warning: once the record says so (preemption.finish_preempted)
    return result


def _on_remote(supervisor: Supervisor, job: JobStore) -> Callable[[WorkerFailure], None]:
    """What a failure elsewhere in the job does here (the fate monitor's thread calls it): a node told
    to stop stops a static job's every node, with its signal, as ``scancel`` would; anything else
    (and a stopped node in an elastic job: it left) ends this attempt as failed."""

    def act(failure: WorkerFailure) -> None:
        if failure.kind is FailureKind.INTERRUPTED and job.interrupt_stops_job and failure.signal:
            supervisor.request_signal(int(signal.Signals[failure.signal]))
        else:
            supervisor.abort(failure)

    return act


@contextlib.contextmanager
def open_control(record: RunRecord) -> Iterator[ControlSocket | None]:
    """This attempt's control socket (``multigpu stacks``/``status``), named in run.json; None where it
    cannot be made (the run goes on without it)."""
    try:
        control: ControlSocket | None = ControlSocket(socket_name(record.data["run_id"]))
    except OSError:
        control = None
    record.data["control_socket"] = control.name if control is not None else None
    try:
        yield control
    finally:
        if control is not None:
            control.close()


def run_attempt(
    run: Run, meeting: Meeting, specs: list[WorkerSpec], timer: TimerKills | None = None
) -> tuple[RunResult, list[Worker]]:
    """One attempt on this node, from its ranks' start to their end; its result and its ranks' records.
    ``specs``: the ranks it starts; ``timer``: the kills of the attempt's file timer, where the node
    hosts one. The ranks' lines, the live view and the summary go through the run's console; the
    launcher's own lines are logged (the run's handler shows them on the same console)."""
    config, console = meeting.config, run.console
    ranks = PrefixedConsole(config.output.log_ranks, qualify_node=config.multi_node, writer=console.writer)
    live = None
    if _use_live_view(config, console):
        from multigpu.runner.live_view import LiveStatus

        live = LiveStatus(f"multigpu attempt {meeting.attempt}", ranks, console.writer)
    with ExitStack() as stack:
        supervisor = Supervisor(
            specs,
            sink=live or ranks,
            options=_options(run, meeting),
            hooks=_hooks(run, meeting.job, stack, live, timer),
            spawner=run.members.spawner,
            progress=progress_book(config, run.record.path.parent, specs),
        )
        stack.callback(supervisor.close)
        run.record.ledger.watch(supervisor.progress)
        if run.watched is not None:
            run.watched.attach(supervisor.workers, supervisor.progress)
        if live is not None:
            live.workers, live.book = supervisor.workers, supervisor.progress
            stack.enter_context(live)
        preempt = run.watch
        stack.enter_context(
            capture_signals(
                preempt.attach(stack, supervisor) if preempt is not None else supervisor.request_signal
            )
        )
        supervisor.start()
        monitor = _fate_monitor(supervisor, meeting.job, stack, run.config)
        result = supervisor.wait()
        assert result is not None
        result = _end(supervisor, result, run, meeting, monitor)
    if live is not None:
        from multigpu.runner.live_view import print_summary_table

        print_summary_table(supervisor.workers, console.writer)
    else:
        logger.info(plain_summary(supervisor.workers).removeprefix("multigpu: "))
    return result, supervisor.workers


def _options(run: Run, meeting: Meeting) -> SupervisorOptions:
    """The attempt's supervisor options. A job of several nodes: a rank's traceback that only says a
    peer's connection closed waits off the console for the root cause its fate monitor settles
    (``_end``)."""
    return SupervisorOptions(
        grace_period=meeting.config.supervision.grace_period,
        reap_orphans=run.reaper,
        hold_peer_losses=meeting.job is not None,
    )


def _hooks(
    run: Run, job: JobStore | None, stack: ExitStack, live: LiveStatus | None, timer: TimerKills | None
) -> Hooks:
    """What the attempt's supervisor calls back: the record, the live view, the console, the control
    socket (open for the attempt), the node's sentinel, the job's hang exchange, the file timer."""
    sentinel = node_sentinel()
    return Hooks(
        listener=run.record,
        tick=live.refresh if live else None,
        console=run.console,
        control=stack.enter_context(open_control(run.record)),
        guard=sentinel.watch if sentinel is not None else None,
        job_hang=StoreHangs(job) if job is not None else None,
        timer=timer,
    )


def _fate_monitor(
    supervisor: Supervisor, job: JobStore | None, stack: ExitStack, config: RunConfig
) -> FateMonitor | None:
    """A job of several nodes: the thread that shares this attempt's fate with theirs, and its
    timing (``node_lateness``: slow nodes and links named), until ``stack`` closes."""
    if job is None:
        return None
    monitor = FateMonitor(job, _on_remote(supervisor, job))
    monitor.progress = timing = JobTiming(supervisor.progress, job, node_address(config.rdzv))
    monitor.start()
    stack.callback(monitor.stop)
    stack.callback(timing.stop)  # first: no more of its calls while the monitor stops
    return monitor
