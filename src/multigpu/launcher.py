"""Script and module mode: turn a RunConfig into attempts of supervised workers, and an exit code."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from .config import RunConfig, new_run_id
from .console import PrefixedConsole
from .devices import cuda_visible_devices_for, visible_gpus
from .endpoint import Endpoint
from .errors import signal_name
from .fate import FateMonitor, mark_done, serve_until_all_done, settle_root, share_failure
from .record import RunRecord
from .rendezvous import JobStore, bind_store_socket, connect_store, serve_store
from .report import format_report, plain_summary
from .signals import capture_signals, set_child_subreaper
from .specs import build_specs
from .supervisor import RunResult, RunStatus, Supervisor, Worker, WorkerSpec

LOOPBACK = Endpoint("127.0.0.1", 0)


def _say(msg: str) -> None:
    print(f"multigpu: {msg}", file=sys.stderr, flush=True)


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
    return config.status == "auto" and sys.stderr.isatty() and sys.stdout.isatty()


@dataclass
class Rendezvous:
    """Where this attempt's workers meet, and who serves the store."""

    master_addr: str
    master_port: int
    run_id: str
    worker_store_fd: int | None
    """Set on one machine: rank 0 serves the store on the launcher's socket (no torch in the launcher)."""
    job: JobStore | None = None
    """Set for several nodes: the launchers share membership, heartbeats and the abort record."""


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


def launch(config: RunConfig, base_env: Mapping[str, str] | None = None) -> int:
    """Run the job to its end and return the launcher's exit code."""
    base_env = dict(os.environ if base_env is None else base_env)
    cvd = None
    devices = ["cpu"] * config.nproc
    if config.device == "cuda":
        cvd = cuda_visible_devices_for(list(config.gpus), visible_gpus(base_env))
        devices = [f"cuda:{i}" for i in config.gpus]
    endpoint = config.rdzv_endpoint or LOOPBACK
    sock = bind_store_socket(endpoint) if config.base_rank == 0 else None
    try:
        rdzv = rendezvous(config, sock)
        output_dir = (config.output_dir or Path("multigpu_runs") / rdzv.run_id).resolve()
        output_dir.mkdir(parents=True, exist_ok=True)
        name = f"run_node{config.group_rank}.json" if config.multi_node else "run.json"
        record = RunRecord(output_dir / name, config, rdzv.run_id, devices)
        what = f"{config.nproc} GPU worker(s) {list(config.gpus)}" if config.device == "cuda" \
            else f"{config.nproc} CPU worker(s)"
        _say(f"run {rdzv.run_id}: {what}, rendezvous {rdzv.master_addr}:{rdzv.master_port}; "
             f"output in {output_dir}")
        return run_attempts(config, rdzv, record, output_dir, base_env, cvd)
    finally:
        if sock is not None and sock.fileno() >= 0:
            sock.close()


def run_attempts(config: RunConfig, rdzv: Rendezvous, record: RunRecord, output_dir: Path,
                 base_env: Mapping[str, str], cvd: str | None) -> int:
    reaper = set_child_subreaper()
    code = 1
    for attempt in range(config.max_restarts + 1):
        specs = build_specs(config, run_id=rdzv.run_id, output_dir=output_dir, attempt=attempt,
                            master_addr=rdzv.master_addr, master_port=rdzv.master_port,
                            store_fd=rdzv.worker_store_fd, base_env=base_env, cuda_visible_devices=cvd,
                            launcher_pid=os.getpid())
        record.begin_attempt(attempt, rdzv.master_addr, rdzv.master_port)
        result, workers = run_attempt(config, specs, record, reaper, attempt, rdzv.job)
        record.end_attempt(result)
        code = _exit_code(result)
        if result.status is RunStatus.SUCCEEDED:
            if rdzv.job is not None and config.base_rank == 0:
                serve_until_all_done(rdzv.job)
            break
        _say(format_report(result, workers, attempt=attempt))
        if result.status is RunStatus.INTERRUPTED or attempt == config.max_restarts:
            break
        _say(f"restarting: attempt {attempt + 1} of {config.max_restarts} restart(s)")
    record.finish("succeeded" if code == 0 else "failed", code)
    return code


def run_attempt(config: RunConfig, specs: list[WorkerSpec], record: RunRecord, reaper: bool,
                attempt: int, job: JobStore | None = None) -> tuple[RunResult, list[Worker]]:
    console = PrefixedConsole(config.log_ranks, qualify_node=config.multi_node)
    live = None
    if _use_live_view(config):
        from .status import LiveStatus

        live = LiveStatus(f"multigpu attempt {attempt}", console)
    with ExitStack() as stack:
        supervisor = Supervisor(specs, sink=live or console, listener=record,
                                grace_period=config.grace_period, hang_timeout=config.hang_timeout,
                                tick=live.refresh if live else None, reap_orphans=reaper)
        stack.callback(supervisor.close)
        if live is not None:
            live.workers = supervisor.workers
            stack.enter_context(live)
        stack.enter_context(capture_signals(supervisor.request_signal))
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
            supervisor.close(dump_stacks=result.status is RunStatus.FAILED)
        result = supervisor.final_result(result)
        if job is not None:
            result = settle_root(job, result)
        if job is not None and result.status is RunStatus.SUCCEEDED:
            mark_done(job)
    if live is not None:
        from .status import print_summary_table

        print_summary_table(supervisor.workers)
    else:
        _say(plain_summary(supervisor.workers).removeprefix("multigpu: "))
    return result, supervisor.workers
