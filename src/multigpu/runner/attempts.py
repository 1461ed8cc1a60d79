"""Script and module mode: turn a RunConfig into attempts of supervised workers, and an exit code.

One attempts loop for every membership (``membership.py``: one node, a fixed set of nodes, elastic
rounds), so what holds across attempts (the output claim, the allocation folder, the run record and its
incidents, the crash-loop stop, the preemption watch and requeue) is written here once. Runs in the
launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from multigpu.cluster import requeue
from multigpu.cluster.devices import cuda_visible_devices_for, visible_gpus
from multigpu.cluster.requeue import allocation_dir
from multigpu.config.run import RunConfig
from multigpu.console.log import lines_through
from multigpu.console.writer import Console, ConsoleWriter
from multigpu.contract.errors import Interrupted, MultiGPUError, RendezvousError
from multigpu.contract.exitcodes import EXIT_CRASH_LOOP
from multigpu.contract.failure import FailureKind
from multigpu.contract.names import DEBUG_SOCKETS_ENV, PREVIOUS_OUTPUT_ENV, RESUMED_ENV
from multigpu.contract.prctl import set_child_subreaper
from multigpu.observe.serving import observed
from multigpu.record.failure_report import format_report
from multigpu.record.folder import check_run_id, claim_output, raise_open_file_limit, resolve_output
from multigpu.record.ledger import ledger_line
from multigpu.record.run_json import RunRecord
from multigpu.rendezvous.elastic import is_elastic
from multigpu.rendezvous.failure_sharing import serve_until_all_done
from multigpu.rendezvous.store import STORE_NOTES
from multigpu.runner.attempt import Run, exit_code, run_attempt
from multigpu.runner.crash_loop import CrashLoopPolicy
from multigpu.runner.membership import Meeting, Membership, StaticMembership
from multigpu.runner.preempt_watch import PreemptWatch, finish_preempted
from multigpu.runner.preflight import Preflight, check_env
from multigpu.runner.sentinel_handle import close_node_sentinel
from multigpu.runner.specs import AttemptContext, build_specs
from multigpu.supervisor import file_timer
from multigpu.supervisor.states import RunResult, RunStatus, Worker
from multigpu.supervisor.stop_requests import end_with_signal

logger = logging.getLogger(__name__)


def launch(config: RunConfig, base_env: Mapping[str, str] | None = None) -> int:
    """Run the job to its end and return the launcher's exit code.

    The console is a ``ConsoleWriter`` for the whole run, so no console (stalled, closed, full) can
    hold the launcher; its ``Console`` is handed to every part of the run that writes to it, and every
    line the launcher logs goes through it meanwhile (``console.log.lines_through``). After a
    Ctrl-C the launcher ends itself with SIGINT once everything is torn down, as Python does for
    KeyboardInterrupt, so a shell loop around it stops too.
    """
    base_env = dict(os.environ if base_env is None else base_env)
    try:
        writer = ConsoleWriter()  # closed (flushed) before the run's log handler goes
        with lines_through(Console(writer)) as console, writer, _debug_sockets(config, base_env):
            code, record = _launch(config, base_env, console)
    finally:
        close_node_sentinel()  # every rank is reaped: nothing left for it to guard
    if record is not None and record.stop_signal == signal.SIGINT:
        end_with_signal(signal.SIGINT)
    return code


@contextlib.contextmanager
def _debug_sockets(config: RunConfig, base_env: dict[str, str]) -> Iterator[None]:
    """``--debug-server``: a private folder for the ranks' worker sockets, removed as the run ends (a
    rank killed by SIGKILL cannot remove its own)."""
    if config.start.debug_server is None:
        yield
        return
    folder = tempfile.mkdtemp(prefix="multigpu-debug-")
    base_env[DEBUG_SOCKETS_ENV] = folder
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _launch(config: RunConfig, base_env: dict[str, str], console: Console) -> tuple[int, RunRecord | None]:
    raise_open_file_limit(config.nproc)
    if config.output.run_id is not None:
        check_run_id(config.output.run_id)
    cvd = None
    devices = ["cpu"] * config.nproc
    if config.device == "cuda":
        cvd = cuda_visible_devices_for(list(config.gpus), visible_gpus(base_env))
        devices = [f"cuda:{i}" for i in config.gpus]
    members = open_membership(config, base_env)
    run: Run | None = None
    record: RunRecord | None = None
    try:
        output_dir = allocation_dir(
            resolve_output(config.output.dir or Path("multigpu_runs") / members.run_id), base_env
        )
        folder = claim_output(output_dir, members.run_id, members.claim)
        if members.job is not None:  # what torch said of a failed store call: a log, not the console
            notes = members.record_name.replace("run", "store", 1).replace(".json", ".log")
            STORE_NOTES.attach(output_dir / notes)
        try:
            record = RunRecord.create(output_dir / members.record_name, config, members.run_id, devices)
            for line in members.opening(output_dir):
                logger.info(line)
            run = Run(config, members, record, output_dir, base_env, cvd, console=console)
            return run_attempts(run), record  # finishes the record
        finally:
            folder.release()
    finally:
        over = run is not None and run.over
        if record is None or record.stop_signal != signal.SIGINT:  # after a Ctrl-C, leave at once
            members.leave(over=over)  # the store's host outlives the other nodes' last reads
        members.close(over=over)


def open_membership(config: RunConfig, base_env: Mapping[str, str]) -> Membership:
    """This node's membership of the job, met (its run id agreed): elastic rounds or a fixed set."""
    if is_elastic(config):  # torch's dynamic rendezvous; imports torch
        from multigpu.runner.rounds import ElasticMembership

        return ElasticMembership(config, base_env)
    return StaticMembership(config, base_env)


def run_attempts(run: Run) -> int:
    """Attempts until one succeeds, restarts run out, a crash loop shows, or a preemption warning came;
    the record is finished here, and a preempted SLURM job is requeued as the very last act.

    One loop for every membership (torch elastic's agent runs one ``_invoke_run`` whatever its
    rendezvous): meet, run the attempt, then decide (``_verdict``) whether the run ends or meets again."""
    config, record = run.config, run.record
    run.reaper = set_child_subreaper()
    _resume(run)
    run.watch = (
        PreemptWatch(requeue.warning_names(config), grace=config.preemption.grace, job=run.members.job)
        if config.preemption.signals
        else None
    )
    policy = CrashLoopPolicy(run.members.failures)
    env = check_env(run.base_env, config.extra_env, run.cvd)
    preflight = Preflight(
        config.preflight_mode,
        env,
        record,
        every_round=is_elastic(config),
        auto=config.rdzv.preflight == "auto",
    )
    try:
        lost = record.ledger.lost_seconds
        with observed(config, run.base_env, record.data, run.members.run_id, lost) as run.watched:
            while True:
                meeting = _meet(run, preflight)
                if meeting is None:
                    continue  # a slow node left the elastic round: the others meet again without it
                result, workers = _attempt(run, meeting)
                code = _verdict(run, meeting, result, workers, policy)
                if code is not None:
                    _say_ledger(record)
                    return code
    except BaseException as exc:  # whatever ended it, run.json does not stay "running"
        code = exc.launcher_exit if isinstance(exc, MultiGPUError) else 1
        record.finish(*(("interrupted", 130) if isinstance(exc, KeyboardInterrupt) else ("failed", code)))
        run.over = run.over or isinstance(exc, RendezvousError)  # a refused or failed rendezvous: over
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise Interrupted(
                "interrupted (SIGINT); every rank it started has stopped, nothing is left running"
            ) from None
        raise
    finally:
        if run.watch is not None:
            run.watch.close()


def _meet(run: Run, preflight: Preflight) -> Meeting | None:
    """The next attempt's meeting, its nodes checked where due; None when a slow node left the elastic
    round. The ledger counts both waits (``waiting_for_nodes``, ``preflight``)."""
    ledger = run.record.ledger
    with ledger.phase("waiting_for_nodes"):
        meeting = run.members.meet()
    if preflight.due(meeting):
        with ledger.phase("preflight"):
            if not preflight.check(meeting, run.members.spawner):
                return None
    return meeting


def _resume(run: Run) -> None:
    """The ranks' environment of this allocation; where earlier ones of the job ran, said and recorded."""
    run.base_env = env = requeue.preemption_env(run.config, run.output_dir, run.base_env)
    resumed, previous = int(env[RESUMED_ENV]), env.get(PREVIOUS_OUTPUT_ENV)
    run.record.data.update(resumed=resumed, previous_output=previous)
    if resumed:
        logger.info(
            f"resuming: {resumed} earlier allocation(s) of this job (MULTIGPU_RESUMED={resumed}); the "
            f"latest one's output is in {previous} (MULTIGPU_PREVIOUS_OUTPUT)"
        )


def _attempt(run: Run, meeting: Meeting) -> tuple[RunResult, list[Worker]]:
    """One attempt, from its meeting to its recorded result."""
    record = run.record
    context = AttemptContext(
        run.members.run_id, run.output_dir, meeting.attempt, meeting.master_addr, meeting.master_port, run.cvd
    )
    with file_timer.hosted(run.base_env, run.members.run_id) as timer:  # torchrun's, per attempt
        base = run.base_env if timer is None else {**run.base_env, file_timer.TIMER_FILE_ENV: timer.path}
        specs = build_specs(meeting.config, context, base)
        for spec in specs:  # elastic rounds of one restart count share a log folder: no stale error record
            if spec.error_file is not None:
                spec.error_file.unlink(missing_ok=True)
        record.begin_attempt(meeting.attempt, meeting.master_addr, meeting.master_port)
        result, workers = run_attempt(run, meeting, specs, timer.kills if timer is not None else None)
    record.end_attempt(result)
    return result, workers


def _verdict(
    run: Run, meeting: Meeting, result: RunResult, workers: list[Worker], policy: CrashLoopPolicy
) -> int | None:
    """After an attempt: None to meet again, else the run's exit code (its record finished).

    torchrun's rules: a node waiting to join ends the round without counting as a restart; a failed
    attempt counts once, job-wide, while ``--max-restarts`` allows; every node reads the same root
    cause, so every node comes to the same answer (the crash-loop stop included)."""
    config, members, watch = run.config, run.members, run.watch
    warned = watch is not None and watch.warned
    if result.status is RunStatus.SUCCEEDED and not warned:
        if meeting.job is not None and members.serves_store:  # it leaves last: every node read the end
            serve_until_all_done(meeting.job)
        return _finish(run, 0)
    root = result.root_cause
    if root is not None and root.kind is FailureKind.MEMBERSHIP_CHANGE:
        logger.info(f"{root.message}; stopping this round on every node")
        return None
    if result.status is not RunStatus.SUCCEEDED:
        logger.warning(format_report(result, workers, attempt=meeting.attempt))
    if watch is not None and warned and not _interrupted_by_user(result):
        run.over = True
        return finish_preempted(
            meeting,
            run.record,
            watch,
            result,
            run.base_env,
            leads=members.serves_store or meeting.job is None,
        )
    if result.status is RunStatus.INTERRUPTED:
        return _finish(run, exit_code(result), over=False)  # this node leaves; an elastic job goes on
    if meeting.attempt >= config.supervision.max_restarts or not members.can_meet_again(result):
        return _finish(run, exit_code(result))
    loop = policy.check(root if result.status is RunStatus.FAILED else None, meeting.attempt)
    if loop is not None:
        logger.warning(loop)
        run.record.data["crash_loop"] = loop
        return _finish(run, EXIT_CRASH_LOOP)
    logger.info(members.restart(meeting))
    return None


def _say_ledger(record: RunRecord) -> None:
    """The run's last line, after a run that lost time to an incident: where its time went."""
    line = ledger_line(record.data.get("ledger") or {})
    if record.data["incidents"] and line is not None:
        logger.info(line)


def _finish(run: Run, code: int, *, over: bool = True) -> int:
    run.over = over
    run.record.finish("succeeded" if code == 0 else "failed", code)
    return code


def _interrupted_by_user(result: RunResult) -> bool:
    """Ctrl-C ends the run, warned or not; SIGTERM after a warning is SLURM ending the allocation."""
    return result.status is RunStatus.INTERRUPTED and result.signal == signal.SIGINT
