"""Script and module mode: turn a RunConfig into attempts of supervised workers, and an exit code."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import requeue
from .config import RunConfig, new_run_id
from .console import ConsoleWriter, PrefixedConsole, active_writer, say
from .devices import cuda_visible_devices_for, visible_gpus
from .elastic import is_elastic
from .endpoint import Endpoint
from .errors import signal_name
from .exitcodes import EXIT_CRASH_LOOP, EXIT_FAILED, EXIT_PREEMPTED
from .fate import FateMonitor, mark_done, serve_until_all_done, settle_root, share_failure
from .hang import progress_book
from .preempt_watch import PreemptWatch
from .record import RunRecord
from .rendezvous import JobStore, bind_store_socket, connect_store, serve_store
from .report import format_report, plain_summary
from .requeue import allocation_dir
from .restarts import CrashLoopPolicy
from .rundir import check_run_id, claim_output, raise_open_file_limit
from .signals import capture_signals, end_with_signal, set_child_subreaper
from .spawning import Spawner
from .specs import build_specs
from .supervisor import RunResult, RunStatus, Supervisor, Worker, WorkerSpec
from .template_client import NodeSpawner, StoreSocket, spawner_for

LOOPBACK = Endpoint("127.0.0.1", 0)


def _say(msg: str) -> None:
    say(msg)


def _exit_code(result: RunResult) -> int:
    if result.status is RunStatus.SUCCEEDED:
        return 0
    if result.status is RunStatus.INTERRUPTED:
        return 128 + (result.signal or signal.SIGTERM)
    root = result.root_cause
    return root.launcher_exit_code if root is not None else 1


def _use_live_view(config: RunConfig) -> bool:
    if config.status == "on":
        return True
    writer = active_writer()
    ttys = writer.ttys if writer is not None else {1: sys.stdout.isatty(), 2: sys.stderr.isatty()}
    return config.status == "auto" and ttys.get(1, False) and ttys.get(2, False)


@dataclass
class Rendezvous:
    """Where this attempt's workers meet, and who serves the store."""

    master_addr: str
    master_port: int
    run_id: str
    worker_store_fd: int | None
    """The launcher's listening socket on one machine, until ``node_spawner`` hands it to the node's
    template (or store process), which serves the store; function mode's caller serves it itself."""
    job: JobStore | None = None
    """Set for several nodes: the launchers share membership, heartbeats and the abort record."""
    spawner: NodeSpawner | None = None
    """Starts this node's ranks: forked from the node's template, or plain processes (H4)."""


def rendezvous(config: RunConfig, sock: socket.socket | None) -> Rendezvous:
    endpoint = config.rdzv_endpoint or LOOPBACK
    if not config.multi_node:
        assert sock is not None
        return Rendezvous(endpoint.bind_host, sock.getsockname()[1], config.run_id or new_run_id(),
                          sock.fileno())
    if sock is not None:  # base rank 0: this launcher serves the store for the whole job
        port = sock.getsockname()[1]
        store = serve_store(sock.fileno(), endpoint.bind_host, port, timeout_s=config.rdzv_timeout)
        sock.detach()  # the store owns the descriptor now
    else:
        port = endpoint.port
        store = connect_store(endpoint.host, port, config.rdzv_timeout)
    job = JobStore(store, node=config.group_rank, base_rank=config.base_rank, nproc=config.nproc,
                   world_size=config.resolved_world_size)
    run_id = job.settle_run_id(config.run_id or (new_run_id() if sock is not None else None))
    _say(f"node {config.group_rank}: joined run {run_id} at {endpoint}; waiting for "
         f"{config.resolved_world_size} rank(s)")
    job.join(config.rdzv_timeout)
    return Rendezvous(endpoint.host, port, run_id, None, job)


def node_spawner(config: RunConfig, sock: socket.socket | None, notify: Callable[[str], None],
                 base_env: Mapping[str, str]) -> NodeSpawner:
    """This node's spawner, started before the rendezvous so the template imports torch meanwhile; on
    one node it also serves the job's store (not rank 0's bootstrap), so the store outlives rank 0."""
    store = None
    if sock is not None and not config.multi_node:
        host = (config.rdzv_endpoint or LOOPBACK).bind_host
        store = StoreSocket(sock.fileno(), host, sock.getsockname()[1])
    spawner = spawner_for(config, store, notify, base_env)
    if config.multi_node:
        spawner.wait_ready()  # ready before meeting the peers, which start beating at once
    return spawner


def launch(config: RunConfig, base_env: Mapping[str, str] | None = None) -> int:
    """Run the job to its end and return the launcher's exit code.

    The console is a ``ConsoleWriter`` for the whole run, so no console (stalled, closed, full) can
    hold the launcher. After a Ctrl-C the launcher ends itself with SIGINT once everything is torn
    down, as Python does for KeyboardInterrupt, so a shell loop around it stops too.
    """
    with ConsoleWriter():
        code, record = _launch(config, base_env)
    if record is not None and record.stop_signal == signal.SIGINT:
        end_with_signal(signal.SIGINT)
    return code


def _launch(config: RunConfig, base_env: Mapping[str, str] | None) -> tuple[int, RunRecord | None]:
    base_env = dict(os.environ if base_env is None else base_env)
    raise_open_file_limit(config.nproc)
    if config.run_id is not None:
        check_run_id(config.run_id)
    cvd = None
    devices = ["cpu"] * config.nproc
    if config.device == "cuda":
        cvd = cuda_visible_devices_for(list(config.gpus), visible_gpus(base_env))
        devices = [f"cuda:{i}" for i in config.gpus]
    if is_elastic(config):  # torch's dynamic rendezvous; imports torch
        from .elastic_loop import launch_elastic

        return launch_elastic(config, base_env, cvd, devices)
    endpoint = config.rdzv_endpoint or LOOPBACK
    sock = bind_store_socket(endpoint) if config.base_rank == 0 else None
    folder = None
    spawner = None
    try:
        spawner = node_spawner(config, sock, _say, base_env)
        rdzv = replace(rendezvous(config, sock), worker_store_fd=None, spawner=spawner)
        check_run_id(rdzv.run_id, "the run id agreed at rendezvous")
        output_dir = allocation_dir((config.output_dir or Path("multigpu_runs") / rdzv.run_id).resolve(),
                                    base_env)
        folder = claim_output(output_dir, rdzv.run_id, config.group_rank if config.multi_node else None)
        name = f"run_node{config.group_rank}.json" if config.multi_node else "run.json"
        record = RunRecord.create(output_dir / name, config, rdzv.run_id, devices)
        what = f"{config.nproc} GPU worker(s) {list(config.gpus)}" if config.device == "cuda" \
            else f"{config.nproc} CPU worker(s)"
        _say(f"run {rdzv.run_id}: {what}, rendezvous {rdzv.master_addr}:{rdzv.master_port}; "
             f"output in {output_dir}")
        try:
            code = run_attempts(config, rdzv, record, output_dir, base_env, cvd)  # it finishes the record
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


def run_attempts(config: RunConfig, rdzv: Rendezvous, record: RunRecord, output_dir: Path,
                 base_env: Mapping[str, str], cvd: str | None) -> int:
    """Attempts until one succeeds, restarts run out, a crash loop shows, or a preemption warning came;
    the record is finished here, and a preempted SLURM job is requeued as the very last act."""
    reaper = set_child_subreaper()
    base_env = requeue.rank_env(config, output_dir, base_env)
    resumed, previous = int(base_env[requeue.RESUMED_ENV]), base_env.get(requeue.PREVIOUS_OUTPUT_ENV)
    record.data.update(resumed=resumed, previous_output=previous)
    if resumed:
        _say(f"resuming: {resumed} earlier allocation(s) of this job (MULTIGPU_RESUMED={resumed}); the "
             f"latest one's output is in {previous} (MULTIGPU_PREVIOUS_OUTPUT)")
    watch = PreemptWatch(requeue.warning_names(config), grace=config.preempt_grace, job=rdzv.job) \
        if config.preempt_signals else None
    policy, code = CrashLoopPolicy(), 1
    try:
        for attempt in range(config.max_restarts + 1):
            result, workers, job, worker_store = _attempt(config, rdzv, record, output_dir, base_env, cvd,
                                                          reaper, attempt, watch)
            code = _exit_code(result)
            if result.status is RunStatus.SUCCEEDED and not (watch is not None and watch.warned):
                if job is not None and config.base_rank == 0:
                    serve_until_all_done(job)
                break
            if result.status is not RunStatus.SUCCEEDED:
                _say(format_report(result, workers, attempt=attempt))
            if watch is not None and watch.warned and not _interrupted_by_user(result):
                return _preempted(config, job, record, watch, result, base_env)
            if result.status is RunStatus.INTERRUPTED or attempt == config.max_restarts or _node_gone(result):
                break
            loop = policy.check(result.root_cause if result.status is RunStatus.FAILED else None)
            if loop is not None:
                _say(loop)
                record.data["crash_loop"] = loop
                code = EXIT_CRASH_LOOP
                break
            every = " on every node" if rdzv.job is not None else ""
            _say(f"restarting{every}: attempt {attempt + 1} of {config.max_restarts} restart(s)")
            del worker_store  # the failed attempt's workers are gone: so is their store
    finally:
        if watch is not None:
            watch.close()
    record.finish("succeeded" if code == 0 else "failed", code)
    return code


def _attempt(config: RunConfig, rdzv: Rendezvous, record: RunRecord, output_dir: Path,
             base_env: Mapping[str, str], cvd: str | None, reaper: bool, attempt: int,
             watch: PreemptWatch | None) -> tuple[RunResult, list[Worker], JobStore | None, Any]:
    """One attempt, from meeting again (several nodes) to its recorded result; with its job scope and
    the store its workers use on node 0 of a restart, which must live while any node's workers may."""
    job, master_port, worker_store = rdzv.job, rdzv.master_port, None
    if job is not None and attempt > 0:
        job, master_port, worker_store = meet_again(config, job, rdzv.master_addr, attempt)
    specs = build_specs(config, run_id=rdzv.run_id, output_dir=output_dir, attempt=attempt,
                        master_addr=rdzv.master_addr, master_port=master_port,
                        store_fd=rdzv.worker_store_fd, base_env=base_env, cuda_visible_devices=cvd,
                        launcher_pid=os.getpid())
    record.begin_attempt(attempt, rdzv.master_addr, master_port)
    result, workers = run_attempt(config, specs, record, reaper, attempt, job, watch, rdzv.spawner)
    record.end_attempt(result)
    return result, workers, job, worker_store


def _interrupted_by_user(result: RunResult) -> bool:
    """Ctrl-C ends the run, warned or not; SIGTERM after a warning is SLURM ending the allocation."""
    return result.status is RunStatus.INTERRUPTED and result.signal == signal.SIGINT


def _preempted(config: RunConfig, job: JobStore | None, record: RunRecord, watch: PreemptWatch,
               result: RunResult, env: Mapping[str, str]) -> int:
    """After a warning: wait for the other nodes (node 0), finish the record, then requeue the job."""
    if result.status is RunStatus.SUCCEEDED and job is not None and config.base_rank == 0:
        serve_until_all_done(job)
    info: dict[str, Any] = {"signal": signal_name(watch.signum or 0), "time": watch.time,
                            "source": watch.source, "ranks": result.status.value, "requeue": config.requeue}
    record.data["preemption"] = info
    ok = result.status is RunStatus.SUCCEEDED
    stopped = "the ranks stopped" if ok else f"the run {result.status.value}"
    if not config.requeue or config.base_rank != 0:
        reason = ("node 0 requeues the job" if config.requeue else "not requeued (--no-requeue)"
                  if requeue.under_slurm(env) else "not requeued (not a SLURM job)")
        _say(f"preempted: {stopped} after {info['signal']}; {reason}: exit {EXIT_PREEMPTED}")
        _finish_preempted(record)
        return EXIT_PREEMPTED
    _say(f"preempted: {stopped} after {info['signal']}; requeueing SLURM job {requeue.slurm_job_id(env)}")
    _finish_preempted(record)  # first: SLURM ends this allocation once it takes the request
    job_id, why = requeue.requeue_job(env)
    info["requeued"] = why is None
    if why is not None:
        _say(f"requeue of job {job_id} failed: {why}; resubmit the job to resume it")
        record.finish("failed", EXIT_FAILED)
        return EXIT_FAILED
    _say(f"requeued job {job_id} (scontrol requeue); its next allocation resumes with "
         f"MULTIGPU_RESUMED={requeue.resume_count(env) + 1}: exit {EXIT_PREEMPTED}")
    record.write()
    return EXIT_PREEMPTED


def _finish_preempted(record: RunRecord) -> None:
    record.finish("preempted", EXIT_PREEMPTED)
    if record.data["status"] != "preempted":  # an attempt ended by SLURM's SIGTERM is still a preemption
        record.data["status"] = "preempted"
        record.write()


def _membership_change(result: RunResult) -> bool:
    """An elastic round ended for a joining node: nothing failed, so there are no stacks to dump."""
    return result.root_cause is not None and result.root_cause.error_type == "MembershipChange"


def meet_again(config: RunConfig, job: JobStore, master_addr: str, attempt: int) -> tuple[JobStore, int, Any]:
    """Every node of a multi-node job meets again for a restart, with fresh fate-sharing keys and a
    fresh store for the workers (torch's workers add no per-attempt prefix: the last attempt's keys
    would mislead gloo's rendezvous). Node 0 serves that store; (job, its port, the store)."""
    job = job.for_attempt(attempt)
    key, store = job.key("worker_store_port"), None
    if config.base_rank == 0:
        sock = bind_store_socket(Endpoint(master_addr, 0))
        port = sock.getsockname()[1]
        store = serve_store(sock.fileno(), Endpoint(master_addr, 0).bind_host, port,
                            timeout_s=config.rdzv_timeout)
        sock.detach()
        job.store.set(key, str(port))
    job.join(config.rdzv_timeout)  # every rank claimed again: the port is published
    return job, int(job.store.get(key)), store


def _node_gone(result: RunResult) -> bool:
    """A static job cannot meet again without the store's host or one of its fixed nodes."""
    return any(f.error_type in ("StoreLost", "NodeLost") for f in result.failures)


def run_attempt(config: RunConfig, specs: list[WorkerSpec], record: RunRecord, reaper: bool,
                attempt: int, job: JobStore | None = None, preempt: PreemptWatch | None = None,
                spawner: Spawner | None = None) -> tuple[RunResult, list[Worker]]:
    console = PrefixedConsole(config.log_ranks, qualify_node=config.multi_node, writer=active_writer())
    live = None
    if _use_live_view(config):
        from .status import LiveStatus

        live = LiveStatus(f"multigpu attempt {attempt}", console, active_writer())
    with ExitStack() as stack:
        supervisor = Supervisor(specs, sink=live or console, listener=record,
                                grace_period=config.grace_period, hang_timeout=config.hang_timeout,
                                tick=live.refresh if live else None, reap_orphans=reaper,
                                progress=progress_book(config, record.path.parent, specs), spawner=spawner)
        stack.callback(supervisor.close)
        if live is not None:
            live.workers = supervisor.workers
            stack.enter_context(live)
        stack.enter_context(capture_signals(preempt.attach(stack, supervisor) if preempt is not None
                                            else supervisor.request_signal))
        supervisor.start()
        if job is not None:
            monitor = FateMonitor(job, supervisor.abort)
            monitor.start()
            stack.callback(monitor.stop)
        result = supervisor.wait()
        assert result is not None
        if job is not None and result.status in (RunStatus.FAILED, RunStatus.HUNG):
            result = share_failure(job, result)
        if result.status is RunStatus.INTERRUPTED:
            sig = result.signal or signal.SIGTERM
            _say(f"{signal_name(sig)} received: stopping every rank "
                 f"(grace {config.grace_period:g}s; Ctrl-C again to kill now)")
            supervisor.close(sig=sig)
        else:
            supervisor.close(dump_stacks=result.status is RunStatus.FAILED and not _membership_change(result))
        result = supervisor.final_result(result)
        for loss in supervisor.output_losses():
            _say(f"output lost: {loss}")
        record.note_losses(supervisor.output_losses())
        if job is not None:
            result = settle_root(job, result)
        if job is not None and result.status is RunStatus.SUCCEEDED:
            mark_done(job)
    if live is not None:
        from .status import print_summary_table

        print_summary_table(supervisor.workers, active_writer())
    else:
        _say(plain_summary(supervisor.workers).removeprefix("multigpu: "))
    return result, supervisor.workers
