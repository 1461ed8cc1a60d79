"""The one spec builder: what every worker process is started with, for ``multigpu run`` and function mode.

Script and module mode start every local rank; function mode (``MultiGPUManager``) starts local ranks
1..n-1 with ``python -m multigpu.rank function PAYLOAD``, the caller itself being local rank 0.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from multigpu.config.run import RunConfig
from multigpu.contract.environment import (
    JobContext,
    RankMode,
    RankPlacement,
    build_worker_env,
    usable_cpu_count,
)
from multigpu.contract.names import ANNOUNCE_ENV
from multigpu.runner import torchrun_rules as extras
from multigpu.supervisor.states import WorkerSpec


def worker_argv(config: RunConfig, python: str = sys.executable) -> list[str]:
    mode: RankMode = (
        "function"
        if config.function
        else "exec"
        if config.start.run_mode == "exec"
        else "module"
        if config.module
        else "script"
    )
    return [python, "-m", "multigpu.rank", mode, config.target, *config.target_args]


@dataclass(frozen=True)
class AttemptContext:
    """Where and as what one attempt's ranks meet: what the spec builder needs beyond the config."""

    run_id: str
    output_dir: Path
    attempt: int
    master_addr: str
    master_port: int
    cuda_visible_devices: str | None = None
    launcher_pid: int = field(default_factory=os.getpid)


def error_record(logs: Path, rank: int) -> Path:
    """Where a rank writes its error record, unless torchrun's file layout (``--log-dir``, a
    ``--logs-specs`` plugin) names another."""
    return logs / f"error_rank_{rank}.json"


def _rank_envs(
    config: RunConfig, job: JobContext, base: Mapping[str, str], logs: Path
) -> dict[int, dict[str, str]]:
    """Each local rank's environment by the torchrun contract, before torchrun's options apply."""
    envs = {}
    for local_rank in range(config.first_local_rank, config.nproc):
        rank = config.base_rank + local_rank
        placement = RankPlacement(
            rank=rank,
            local_rank=local_rank,
            world_size=config.resolved_world_size,
            local_world_size=config.nproc,
            group_rank=config.group_rank,
            group_world_size=config.group_world_size,
        )
        envs[local_rank] = build_worker_env(
            base,
            placement,
            job,
            error_file=str(error_record(logs, rank)),
            fr_dump_prefix=None if config.start.run_mode == "exec" else str(logs / "fr_trace_rank_"),
        )
    return envs


def _job_context(config: RunConfig, context: AttemptContext) -> JobContext:
    """What every rank of this attempt shares in its environment: the job, not the rank."""
    return JobContext(
        master_addr=context.master_addr,
        master_port=context.master_port,
        run_id=context.run_id,
        device=config.device,
        restart_count=context.attempt,
        max_restarts=config.supervision.max_restarts,
        output_dir=str(context.output_dir),
        cuda_visible_devices=context.cuda_visible_devices,
        cpu_count=usable_cpu_count(),
        launcher_pid=context.launcher_pid,
    )


def build_specs(config: RunConfig, context: AttemptContext, base_env: Mapping[str, str]) -> list[WorkerSpec]:
    """One spec per local rank, from the arguments alone (function mode: ranks 1..n-1; 0 is the caller)."""
    run_id, output_dir, attempt = context.run_id, context.output_dir, context.attempt
    cuda_visible_devices, launcher_pid = context.cuda_visible_devices, context.launcher_pid
    logs = output_dir / "logs" / f"attempt_{attempt}"
    envs = _rank_envs(config, _job_context(config, context), {**base_env, **config.extra_env}, logs)
    attempt_dir = None
    if config.output.logs_specs is not None:
        rank_logs = extras.plugin_rank_logs(config, run_id, launcher_pid, envs)
    else:
        attempt_dir = extras.torchrun_attempt_dir(config, run_id, output_dir, attempt, launcher_pid)
        rank_logs = [extras.default_rank_logs(config, r, attempt_dir) for r in range(config.nproc)]
    affinity = extras.rank_affinity(config, base_env)
    argv = worker_argv(config)
    specs = []
    for local_rank, env in envs.items():
        rank = config.base_rank + local_rank
        files = rank_logs[local_rank]
        error_file = files.error_file or error_record(logs, rank)
        env = extras.apply_to_env(
            env, config, local_rank, affinity[local_rank], cuda_visible_devices, error_file
        )
        # A failing rank says so before it exits: function mode's caller raises at once, and the
        # launcher keeps the consequences (the peers' "Connection closed") off the console.
        env[ANNOUNCE_ENV] = "1"
        device = f"cuda:{config.gpus[local_rank]}" if config.device == "cuda" else "cpu"
        specs.append(
            WorkerSpec(
                rank=rank,
                local_rank=local_rank,
                argv=argv,
                env=env,
                device=device,
                node=config.group_rank,
                log_path=logs / f"rank_{rank}.log",
                error_file=error_file,
                stream_files=files.stream_files,
                console_streams=files.console_streams,
                line_copies=extras.line_copies(config, local_rank, rank, files, attempt_dir, env),
            )
        )
    return specs
