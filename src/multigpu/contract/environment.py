"""Each worker's environment: torchrun's contract, built by a pure function and passed as ``env=``.

Nothing here reads or writes the launcher's own ``os.environ``; callers pass the base mapping in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from multigpu.contract.names import (
    ANNOUNCE_ENV,
    ATTEMPT_ENV,
    DEVICE_ENV,
    ERROR_FILE_ENV,
    FR_DUMP_ENV,
    HEARTBEAT_FD_ENV,
    LAUNCHER_PID_ENV,
    NODE_RANK_ENV,
    OUTPUT_DIR_ENV,
    PREVIOUS_OUTPUT_ENV,
    RESUMED_ENV,
    RUN_ID_ENV,
    WARNING_SIGNALS_ENV,
)

Device = Literal["cpu", "cuda"]
"""What a job's workers run on: CPU workers (gloo), or one GPU each (``MULTIGPU_DEVICE``'s value)."""


def device_named(text: str) -> Device:
    """``MULTIGPU_DEVICE``'s text as a ``Device`` (the launcher writes one of the two; anything else is
    no GPU)."""
    return "cuda" if text == "cuda" else "cpu"


RankMode = Literal["script", "module", "function", "exec"]
"""What ``python -m multigpu.rank MODE TARGET`` runs: a script, a module, function mode's payload, or a
program (``--no-python``). The rank's bootstrap (``rank/bootstrap.run_target``) reads it from its argv,
and refuses any other."""


# Variables that describe one launched group. A launcher clears stale ones inherited from its own
# environment so a worker never sees a mix of two jobs.
CONTRACT_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    RUN_ID_ENV,
    OUTPUT_DIR_ENV,
    LAUNCHER_PID_ENV,
    ERROR_FILE_ENV,
    HEARTBEAT_FD_ENV,
    DEVICE_ENV,
    NODE_RANK_ENV,
    ATTEMPT_ENV,
    ANNOUNCE_ENV,
    FR_DUMP_ENV,
)
FR_BUFFER_DEFAULT = "2000"
"""Collectives the flight recorder keeps per process group, unless the user chose (CPU and GPU ranks:
its cost on gloo is in the training benchmark, section 6)."""

PREEMPTION_KEYS = (WARNING_SIGNALS_ENV, RESUMED_ENV, PREVIOUS_OUTPUT_ENV)
"""Set for every rank of a run by ``cluster.requeue.preemption_env`` (always replaced, never inherited):
the signals the bootstrap records as a preemption warning, how many allocations of this job came
before (SLURM's requeues), and the output folder of the latest of them."""


@dataclass(frozen=True)
class RankPlacement:
    """Where one worker sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int = 0
    group_world_size: int = 1

    @classmethod
    def on_node(cls, rank: int, local_rank: int, world_size: int, local_world_size: int) -> RankPlacement:
        """A rank whose node holds ``local_world_size`` consecutive ranks, as every node does here."""
        local = max(1, local_world_size)
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            group_rank=(rank - local_rank) // local,
            group_world_size=node_count(world_size, local),
        )


def node_count(world_size: int, local_world_size: int) -> int:
    return max(1, -(-world_size // max(1, local_world_size)))


@dataclass(frozen=True)
class JobContext:
    """What every worker of one attempt shares."""

    master_addr: str
    master_port: int
    run_id: str
    device: Device = "cpu"
    restart_count: int = 0
    max_restarts: int = 0
    output_dir: str | None = None
    use_agent_store: bool = True
    cuda_visible_devices: str | None = None
    cpu_count: int | None = None
    launcher_pid: int | None = None


def omp_threads(cpu_count: int | None, local_world_size: int) -> int:
    return max(1, (cpu_count or 1) // max(1, local_world_size))


def usable_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def build_worker_env(
    base: Mapping[str, str],
    placement: RankPlacement,
    job: JobContext,
    *,
    error_file: str | None = None,
    fr_dump_prefix: str | None = None,
) -> dict[str, str]:
    """The full environment of one worker: ``base`` plus the torchrun contract and multigpu's own keys."""
    env = {k: v for k, v in base.items() if k not in CONTRACT_KEYS}
    env.update(rank_env(placement, job), PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.setdefault("OMP_NUM_THREADS", str(omp_threads(job.cpu_count, placement.local_world_size)))
    if job.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = job.cuda_visible_devices
    if error_file is not None:
        env.update(error_file_env(error_file))
    if fr_dump_prefix is not None:
        env.update(flight_recorder_env(env, fr_dump_prefix))
    return env


def error_file_env(error_file: str) -> dict[str, str]:
    """Where a failing rank writes its error record: ours, and torch's ``@record`` (one path)."""
    return {ERROR_FILE_ENV: error_file, "TORCHELASTIC_ERROR_FILE": error_file}


def flight_recorder_env(env: Mapping[str, str], dump_prefix: str) -> dict[str, str]:
    """torch's collective flight recorder for a hang report that names the missing rank.

    On by default for every device kind (``TORCH_FR_BUFFER_SIZE``, the name torch 2.13 reads first;
    the older ``TORCH_NCCL_TRACE_BUFFER_SIZE`` still counts as the user's choice, as does 0 for
    "off"): gloo records too, and a record per collective costs no throughput the training benchmark
    can see, while it turns "rank 1 stopped first" into "rank 1 is missing from collective #31".
    Its dumps (torch's own on a NCCL timeout, and the one the launcher asks for on a hang) go to
    ``dump_prefix<rank>`` unless the user named a file; ``FR_DUMP_ENV`` tells the bootstrap
    where (empty: recorder off), and that the launcher may ask it for stacks and a record.
    """
    size = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    extra: dict[str, str] = {}
    if size is None:
        size = extra["TORCH_FR_BUFFER_SIZE"] = FR_BUFFER_DEFAULT
    if size is None or not size.strip().isdigit() or int(size) <= 0:
        return {**extra, FR_DUMP_ENV: ""}  # no record; the launcher may still ask for the stacks
    target = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if target is None:
        target = extra["TORCH_FR_DUMP_TEMP_FILE"] = dump_prefix
    extra[FR_DUMP_ENV] = target
    return extra


def rank_env(placement: RankPlacement, job: JobContext) -> dict[str, str]:
    """Only the keys that make a process this rank: torchrun's contract and multigpu's job keys.

    Function mode applies exactly these to the calling process, which becomes a rank itself.
    """
    p = placement
    env = dict(
        RANK=str(p.rank),
        LOCAL_RANK=str(p.local_rank),
        WORLD_SIZE=str(p.world_size),
        LOCAL_WORLD_SIZE=str(p.local_world_size),
        GROUP_RANK=str(p.group_rank),
        GROUP_WORLD_SIZE=str(p.group_world_size),
        ROLE_NAME="default",
        ROLE_RANK=str(p.rank),
        ROLE_WORLD_SIZE=str(p.world_size),
        MASTER_ADDR=job.master_addr,
        MASTER_PORT=str(job.master_port),
        TORCHELASTIC_RUN_ID=job.run_id,
        TORCHELASTIC_RESTART_COUNT=str(job.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(job.max_restarts),
    )
    env.update(
        {
            RUN_ID_ENV: job.run_id,
            DEVICE_ENV: job.device,
            NODE_RANK_ENV: str(p.group_rank),
            ATTEMPT_ENV: str(job.restart_count),
        }
    )
    if job.use_agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    if job.output_dir is not None:
        env[OUTPUT_DIR_ENV] = job.output_dir
    if job.launcher_pid is not None:
        env[LAUNCHER_PID_ENV] = str(job.launcher_pid)
    return env


def is_multigpu_child_process(env: Mapping[str, str] | None = None) -> bool:
    """True in every launched worker whose local rank is not 0 (multigpu or torchrun). Never raises."""
    env = os.environ if env is None else env
    try:
        return int(env.get("LOCAL_RANK", "0")) != 0
    except (TypeError, ValueError):
        return False


def inside_launched_worker(env: Mapping[str, str] | None = None) -> bool:
    """True inside a worker started by multigpu or torchrun, whatever its rank."""
    env = os.environ if env is None else env
    # Not MULTIGPU_RUN_ID: that is also where a user may set ``--run-id`` for the launcher itself.
    return "TORCHELASTIC_RUN_ID" in env or LAUNCHER_PID_ENV in env
