"""Script and module mode: turn a RunConfig into attempts of supervised workers, and an exit code."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

from .config import RunConfig, new_run_id
from .console import PrefixedConsole
from .devices import cuda_visible_devices_for, visible_gpus
from .endpoint import Endpoint
from .environment import JobContext, RankPlacement, build_worker_env, usable_cpu_count
from .errors import signal_name
from .record import RunRecord
from .rendezvous import bind_store_socket
from .report import format_report, plain_summary
from .signals import capture_signals, set_child_subreaper
from .supervisor import RunResult, RunStatus, Supervisor, WorkerSpec

LOOPBACK = Endpoint("127.0.0.1", 0)


def worker_argv(config: RunConfig, python: str = sys.executable) -> list[str]:
    mode = "module" if config.module else "script"
    return [python, "-m", "multigpu.worker", mode, config.target, *config.target_args]


def build_specs(config: RunConfig, *, run_id: str, output_dir: Path, attempt: int, master_addr: str,
                master_port: int, store_fd: int | None, base_env: Mapping[str, str],
                cuda_visible_devices: str | None, launcher_pid: int) -> list[WorkerSpec]:
    """One spec per local rank; pure apart from reading nothing but its arguments."""
    job = JobContext(
        master_addr=master_addr, master_port=master_port, run_id=run_id, device=config.device,
        restart_count=attempt, max_restarts=config.max_restarts, output_dir=str(output_dir),
        cuda_visible_devices=cuda_visible_devices, cpu_count=usable_cpu_count(),
        launcher_pid=launcher_pid,
    )
    logs = output_dir / "logs" / f"attempt_{attempt}"
    argv = worker_argv(config)
    specs = []
    for local_rank in range(config.nproc):
        rank = config.base_rank + local_rank
        placement = RankPlacement(rank=rank, local_rank=local_rank, world_size=config.resolved_world_size,
                                  local_world_size=config.nproc, group_rank=config.group_rank,
                                  group_world_size=config.group_world_size)
        hosts_store = rank == 0 and store_fd is not None
        error_file = logs / f"error_rank_{rank}.json"
        env = build_worker_env({**base_env, **config.extra_env}, placement, job,
                               error_file=str(error_file), store_fd=store_fd if hosts_store else None)
        device = f"cuda:{config.gpus[local_rank]}" if config.device == "cuda" else "cpu"
        specs.append(WorkerSpec(rank=rank, local_rank=local_rank, argv=argv, env=env, device=device,
                                node=config.group_rank, log_path=logs / f"rank_{rank}.log",
                                error_file=error_file,
                                pass_fds=(store_fd,) if hosts_store and store_fd is not None else ()))
    return specs


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


def launch(config: RunConfig, base_env: Mapping[str, str] | None = None) -> int:
    """Run the job to its end and return the launcher's exit code."""
    base_env = dict(os.environ if base_env is None else base_env)
    run_id = config.run_id or new_run_id()
    output_dir = (config.output_dir or Path("multigpu_runs") / run_id).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    cvd = None
    devices = ["cpu"] * config.nproc
    if config.device == "cuda":
        visible = visible_gpus(base_env)
        cvd = cuda_visible_devices_for(list(config.gpus), visible)
        devices = [f"cuda:{i}" for i in config.gpus]
    endpoint = config.rdzv_endpoint or LOOPBACK
    sock = bind_store_socket(endpoint) if config.base_rank == 0 else None
    master_addr = endpoint.bind_host if sock is not None else endpoint.host
    master_port = sock.getsockname()[1] if sock is not None else endpoint.port
    record = RunRecord(output_dir / "run.json", config, run_id, devices)
    what = f"{config.nproc} GPU worker(s) {list(config.gpus)}" if config.device == "cuda" \
        else f"{config.nproc} CPU worker(s)"
    _say(f"run {run_id}: {what}, rendezvous {master_addr}:{master_port}; output in {output_dir}")
    reaper = set_child_subreaper()
    code = 1
    try:
        for attempt in range(config.max_restarts + 1):
            specs = build_specs(config, run_id=run_id, output_dir=output_dir, attempt=attempt,
                                master_addr=master_addr, master_port=master_port,
                                store_fd=sock.fileno() if sock is not None else None, base_env=base_env,
                                cuda_visible_devices=cvd, launcher_pid=os.getpid())
            record.begin_attempt(attempt, master_addr, master_port)
            result, workers = run_attempt(config, specs, record, reaper, attempt)
            record.end_attempt(result)
            code = _exit_code(result)
            if result.status is RunStatus.SUCCEEDED:
                break
            _say(format_report(result, workers, attempt=attempt))
            if result.status is RunStatus.INTERRUPTED or attempt == config.max_restarts:
                break
            _say(f"restarting: attempt {attempt + 1} of {config.max_restarts} restart(s)")
        record.finish("succeeded" if code == 0 else "failed", code)
    finally:
        if sock is not None:
            sock.close()
    return code


def run_attempt(config: RunConfig, specs: list[WorkerSpec], record: RunRecord, reaper: bool,
                attempt: int) -> tuple[RunResult, list]:  # type: ignore[type-arg]
    console = PrefixedConsole(config.log_ranks, qualify_node=config.multi_node)
    with ExitStack() as stack:
        supervisor = Supervisor(specs, sink=console, listener=record, grace_period=config.grace_period,
                                hang_timeout=config.hang_timeout, reap_orphans=reaper)
        stack.callback(supervisor.close)
        live = None
        if _use_live_view(config):
            from .status import LiveStatus

            live = LiveStatus(supervisor.workers, f"multigpu attempt {attempt}")
            supervisor._tick = live.refresh
            supervisor._sink = _LiveSink(live, console)
            stack.enter_context(live)
        stack.enter_context(capture_signals(supervisor.request_signal))
        supervisor.start()
        result = supervisor.wait()
        assert result is not None
        if result.status is RunStatus.INTERRUPTED:
            sig = result.signal or signal.SIGTERM
            _say(f"{signal_name(sig)} received: stopping every rank "
                 f"(grace {config.grace_period:g}s; Ctrl-C again to kill now)")
            supervisor.close(sig=sig)
        else:
            supervisor.close(dump_stacks=result.status is RunStatus.FAILED)
        result = _final(result, supervisor)
    if live is not None:
        from .status import print_summary_table

        print_summary_table(supervisor.workers)
    else:
        _say(plain_summary(supervisor.workers).removeprefix("multigpu: "))
    return result, supervisor.workers


def _final(result: RunResult, supervisor: Supervisor) -> RunResult:
    """A success whose late stragglers failed in teardown is still a success; nothing else changes."""
    return result


class _LiveSink:
    def __init__(self, live: object, console: PrefixedConsole) -> None:
        self.live = live
        self.console = console

    def write_lines(self, worker, stream, lines):  # type: ignore[no-untyped-def]
        if self.console.shows(worker.rank):
            self.live.write_lines(worker, stream, lines, self.console.prefix(worker))  # type: ignore[attr-defined]
