"""Script and module mode: turn a RunConfig into attempts of supervised workers, and an exit code."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from multigpu.cluster import requeue
from multigpu.cluster.devices import cuda_visible_devices_for, visible_gpus
from multigpu.cluster.requeue import allocation_dir
from multigpu.config.run import RunConfig
from multigpu.contract.errors import LEARNED_FROM_SILENCE
from multigpu.contract.exitcodes import EXIT_CRASH_LOOP
from multigpu.contract.names import PREVIOUS_OUTPUT_ENV, RESUMED_ENV
from multigpu.contract.prctl import set_child_subreaper
from multigpu.launch.attempt import exit_code, run_attempt
from multigpu.launch.meeting import LOOPBACK, Rendezvous, meet_again, node_spawner, rendezvous
from multigpu.launch.preemption import PreemptWatch, finish_preempted
from multigpu.launch.record import RunRecord
from multigpu.launch.report import format_report
from multigpu.launch.restarts import CrashLoopPolicy
from multigpu.launch.rundir import check_run_id, claim_output, raise_open_file_limit
from multigpu.launch.specs import AttemptContext, build_specs
from multigpu.rendezvous.elastic import is_elastic
from multigpu.rendezvous.fate import finish_job, serve_until_all_done
from multigpu.rendezvous.job import JobStore
from multigpu.rendezvous.store import STORE_NOTES, bind_store_socket
from multigpu.supervisor.console import ConsoleWriter, say
from multigpu.supervisor.sentinel import close_node_sentinel
from multigpu.supervisor.signals import end_with_signal
from multigpu.supervisor.states import RunResult, RunStatus, Worker


def launch(config: RunConfig, base_env: Mapping[str, str] | None = None) -> int:
    """Run the job to its end and return the launcher's exit code.

    The console is a ``ConsoleWriter`` for the whole run, so no console (stalled, closed, full) can
    hold the launcher. After a Ctrl-C the launcher ends itself with SIGINT once everything is torn
    down, as Python does for KeyboardInterrupt, so a shell loop around it stops too.
    """
    try:
        with ConsoleWriter():
            code, record = _launch(config, base_env)
    finally:
        close_node_sentinel()  # every rank is reaped: nothing left for it to guard
    if record is not None and record.stop_signal == signal.SIGINT:
        end_with_signal(signal.SIGINT)
    return code


def _launch(config: RunConfig, base_env: Mapping[str, str] | None) -> tuple[int, RunRecord | None]:
    base_env = dict(os.environ if base_env is None else base_env)
    raise_open_file_limit(config.nproc)
    if config.output.run_id is not None:
        check_run_id(config.output.run_id)
    cvd = None
    devices = ["cpu"] * config.nproc
    if config.device == "cuda":
        cvd = cuda_visible_devices_for(list(config.gpus), visible_gpus(base_env))
        devices = [f"cuda:{i}" for i in config.gpus]
    if is_elastic(config):  # torch's dynamic rendezvous; imports torch
        from multigpu.launch.elastic import launch_elastic

        return launch_elastic(config, base_env, cvd, devices)
    endpoint = config.rdzv.endpoint or LOOPBACK
    sock = bind_store_socket(endpoint) if config.base_rank == 0 else None
    folder = None
    spawner = None
    rdzv: Rendezvous | None = None
    record: RunRecord | None = None
    try:
        spawner = node_spawner(config, sock, say, base_env)
        rdzv = replace(rendezvous(config, sock), spawner=spawner)
        check_run_id(rdzv.run_id, "the run id agreed at rendezvous")
        output_dir = allocation_dir((config.output.dir or Path("multigpu_runs") / rdzv.run_id).resolve(),
                                    base_env)
        folder = claim_output(output_dir, rdzv.run_id, config.group_rank if config.multi_node else None)
        name = f"run_node{config.group_rank}.json" if config.multi_node else "run.json"
        if config.multi_node:  # what torch said when a store call failed, out of the console
            STORE_NOTES.attach(output_dir / f"store_node{config.group_rank}.log")
        record = RunRecord.create(output_dir / name, config, rdzv.run_id, devices)
        what = f"{config.nproc} GPU worker(s) {list(config.gpus)}" if config.device == "cuda" \
            else f"{config.nproc} CPU worker(s)"
        say(f"run {rdzv.run_id}: {what}, rendezvous {rdzv.master_addr}:{rdzv.master_port}; "
            f"output in {output_dir}")
        if config.start.debug_server is not None and config.base_rank == 0:
            say(f"debug server (torch's, rank 0's node): http://{config.start.debug_server}/")
        try:
            code = run_attempts(Run(config, rdzv, record, output_dir, base_env, cvd))  # finishes the record
        except BaseException:
            record.finish("failed", 1)  # whatever ended it, run.json does not stay "running"
            raise
        return code, record
    finally:
        if folder is not None:
            folder.release()
        if spawner is not None:
            spawner.close()
        if sock is not None and sock.fileno() >= 0:
            sock.close()
        if rdzv is not None and (record is None or record.stop_signal != signal.SIGINT):  # Ctrl-C: now
            finish_job(rdzv.job, hosts_store=config.base_rank == 0)  # the store's host goes last


@dataclass
class Run:
    """One run on this node, for all its attempts: what each attempt starts from."""

    config: RunConfig
    rdzv: Rendezvous
    record: RunRecord
    output_dir: Path
    base_env: Mapping[str, str]
    cvd: str | None
    """``CUDA_VISIBLE_DEVICES`` for the ranks (GPU jobs)."""
    reaper: bool = False
    """This launcher is a child subreaper: it ends and reaps what left the ranks' groups."""
    watch: PreemptWatch | None = None


def run_attempts(run: Run) -> int:
    """Attempts until one succeeds, restarts run out, a crash loop shows, or a preemption warning came;
    the record is finished here, and a preempted SLURM job is requeued as the very last act."""
    config, rdzv, record = run.config, run.rdzv, run.record
    run.reaper = set_child_subreaper()
    run.base_env = base_env = requeue.preemption_env(config, run.output_dir, run.base_env)
    resumed, previous = int(base_env[RESUMED_ENV]), base_env.get(PREVIOUS_OUTPUT_ENV)
    record.data.update(resumed=resumed, previous_output=previous)
    if resumed:
        say(f"resuming: {resumed} earlier allocation(s) of this job (MULTIGPU_RESUMED={resumed}); the "
            f"latest one's output is in {previous} (MULTIGPU_PREVIOUS_OUTPUT)")
    run.watch = watch = PreemptWatch(requeue.warning_names(config), grace=config.preemption.grace,
                                     job=rdzv.job) if config.preemption.signals else None
    policy, code = CrashLoopPolicy(), 1
    try:
        for attempt in range(config.supervision.max_restarts + 1):
            result, workers, job, worker_store = _attempt(run, attempt)
            code = exit_code(result)
            if result.status is RunStatus.SUCCEEDED and not (watch is not None and watch.warned):
                if job is not None and config.base_rank == 0:
                    serve_until_all_done(job)
                break
            if result.status is not RunStatus.SUCCEEDED:
                say(format_report(result, workers, attempt=attempt))
            if watch is not None and watch.warned and not _interrupted_by_user(result):
                return finish_preempted(config, job, record, watch, result, base_env)
            last = attempt == config.supervision.max_restarts
            if result.status is RunStatus.INTERRUPTED or last or _node_gone(result):
                break
            loop = policy.check(result.root_cause if result.status is RunStatus.FAILED else None)
            if loop is not None:
                say(loop)
                record.data["crash_loop"] = loop
                code = EXIT_CRASH_LOOP
                break
            every = " on every node" if rdzv.job is not None else ""
            say(f"restarting{every}: attempt {attempt + 1} of {config.supervision.max_restarts} restart(s)")
            del worker_store  # the failed attempt's workers are gone: so is their store
    finally:
        if watch is not None:
            watch.close()
    record.finish("succeeded" if code == 0 else "failed", code)
    return code


def _attempt(run: Run, attempt: int) -> tuple[RunResult, list[Worker], JobStore | None, Any]:
    """One attempt, from meeting again (several nodes) to its recorded result; with its job scope and
    the store its workers use on node 0 of a restart, which must live while any node's workers may."""
    rdzv, record = run.rdzv, run.record
    job, master_port, worker_store = rdzv.job, rdzv.master_port, None
    if job is not None and attempt > 0:
        job, master_port, worker_store = meet_again(run.config, job, rdzv.master_addr, attempt)
    context = AttemptContext(rdzv.run_id, run.output_dir, attempt, rdzv.master_addr, master_port, run.cvd)
    specs = build_specs(run.config, context, run.base_env)
    record.begin_attempt(attempt, rdzv.master_addr, master_port)
    result, workers = run_attempt(run.config, specs, record, run.reaper, attempt, job, run.watch,
                                  rdzv.spawner)
    record.end_attempt(result)
    return result, workers, job, worker_store


def _interrupted_by_user(result: RunResult) -> bool:
    """Ctrl-C ends the run, warned or not; SIGTERM after a warning is SLURM ending the allocation."""
    return result.status is RunStatus.INTERRUPTED and result.signal == signal.SIGINT


def _node_gone(result: RunResult) -> bool:
    """A static job cannot meet again without the store's host or one of its fixed nodes."""
    return any(f.error_type in LEARNED_FROM_SILENCE for f in result.failures)
