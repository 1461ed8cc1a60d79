"""The one spec builder: what every worker process is started with, for ``multigpu run`` and function mode.

Script and module mode start every local rank; function mode (``MultiGPUManager``) starts local ranks
1..n-1 with ``python -m multigpu.worker function PAYLOAD``, the caller itself being local rank 0.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from . import torchrun_specs as extras
from .config import RunConfig
from .environment import JobContext, RankPlacement, build_worker_env, usable_cpu_count
from .supervisor import WorkerSpec
from .worker import ANNOUNCE_ENV


def worker_argv(config: RunConfig, python: str = sys.executable) -> list[str]:
    mode = ("function" if config.function else "exec" if config.run_mode == "exec"
            else "module" if config.module else "script")
    return [python, "-m", "multigpu.worker", mode, config.target, *config.target_args]


def build_specs(config: RunConfig, *, run_id: str, output_dir: Path, attempt: int, master_addr: str,
                master_port: int, store_fd: int | None, base_env: Mapping[str, str],
                cuda_visible_devices: str | None, launcher_pid: int) -> list[WorkerSpec]:
    """One spec per local rank, from the arguments alone (function mode: ranks 1..n-1; 0 is the caller)."""
    job = JobContext(
        master_addr=master_addr, master_port=master_port, run_id=run_id, device=config.device,
        restart_count=attempt, max_restarts=config.max_restarts, output_dir=str(output_dir),
        cuda_visible_devices=cuda_visible_devices, cpu_count=usable_cpu_count(),
        launcher_pid=launcher_pid,
    )
    logs = output_dir / "logs" / f"attempt_{attempt}"
    envs = {}
    for local_rank in range(config.first_local_rank, config.nproc):
        rank = config.base_rank + local_rank
        placement = RankPlacement(rank=rank, local_rank=local_rank, world_size=config.resolved_world_size,
                                  local_world_size=config.nproc, group_rank=config.group_rank,
                                  group_world_size=config.group_world_size)
        envs[local_rank] = build_worker_env({**base_env, **config.extra_env}, placement, job,
                                            error_file=str(logs / f"error_rank_{rank}.json"),
                                            store_fd=store_fd if rank == 0 else None,
                                            fr_dump_prefix=None if config.run_mode == "exec"
                                            else str(logs / "fr_trace_rank_"))
    attempt_dir = None
    if config.logs_specs is not None:
        rank_logs = extras.plugin_rank_logs(config, run_id, launcher_pid, envs)
    else:
        attempt_dir = extras.torchrun_attempt_dir(config, run_id, output_dir, attempt, launcher_pid)
        rank_logs = [extras.default_rank_logs(config, r, attempt_dir) for r in range(config.nproc)]
    affinity = extras.rank_affinity(config, base_env)
    argv = worker_argv(config)
    specs = []
    for local_rank, env in envs.items():
        rank = config.base_rank + local_rank
        hosts_store = rank == 0 and store_fd is not None
        files = rank_logs[local_rank]
        error_file = files.error_file or logs / f"error_rank_{rank}.json"
        env = extras.apply_to_env(env, config, local_rank, affinity[local_rank], cuda_visible_devices,
                                  error_file)
        if config.function:
            env[ANNOUNCE_ENV] = "1"  # a failing rank tells the caller (rank 0) before it exits
        device = f"cuda:{config.gpus[local_rank]}" if config.device == "cuda" else "cpu"
        specs.append(WorkerSpec(rank=rank, local_rank=local_rank, argv=argv, env=env, device=device,
                                node=config.group_rank, log_path=logs / f"rank_{rank}.log",
                                error_file=error_file,
                                pass_fds=(store_fd,) if hosts_store and store_fd is not None else (),
                                stream_files=files.stream_files, console_streams=files.console_streams,
                                line_copies=extras.line_copies(config, local_rank, rank, files, attempt_dir,
                                                               env)))
    return specs
