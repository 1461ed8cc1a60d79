"""What makes a process join the job as a rank in function mode: its environment, its device, its
process group.

Runs in the caller (which becomes local rank 0 in place) and in every child the manager starts (the
payload calls ``child_entry``, then the manager's ``run_child_process``, then ``run_child``). This is
the one place that writes ``os.environ``: the caller itself becomes a rank, and ``restore_environ``
undoes it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from multigpu.config.endpoint import parse_endpoint
from multigpu.contract.environment import (
    CONTRACT_KEYS,
    Device,
    JobContext,
    RankPlacement,
    device_named,
    rank_env,
)
from multigpu.contract.names import DEVICE_ENV, OUTPUT_DIR_ENV, RUN_ID_ENV
from multigpu.otx.argv import remove_option, set_arguments_to_argv
from multigpu.otx.prepare import GROUP_SOCKETS, TIMEOUT_ENV
from multigpu.rendezvous.store import DEFAULT_TIMEOUT_S, connect_store

CONNECT_TIMEOUT_S = 2.0
"""The caller's gloo connect phase, once every rank has counted itself in (``wait_for_every_rank``).

gloo waits for a peer that published its address and then died for 5x the group's timeout, in C++,
where no signal or socket cut can reach it (its listener has no per-peer socket yet). So the caller
creates its group with this timeout, bounding that wait to about 10 s, then restores the full one.
Legitimately, the phase takes milliseconds: every peer is past the count and creating its group."""
POLL_S = 0.02


def wait_for_every_rank(
    store: Any, key: str, world_size: int, timeout: float, failed: Callable[[], BaseException | None]
) -> None:
    """Count this rank in under ``key`` and wait, in Python, until all ``world_size`` ranks are.

    The wait ends with ``failed()``'s error as soon as it returns one (a child died before joining),
    and with ``TimeoutError`` after ``timeout`` seconds, as ``init_process_group`` would have.
    """
    deadline = time.monotonic() + timeout
    count = int(store.add(key, 1))
    while count < world_size:
        error = failed()
        if error is not None:
            raise error
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {count} of {world_size} ranks joined within {timeout:g}s")
        time.sleep(POLL_S)
        count = int(store.add(key, 0))


def become_rank_environ(run_id: str, out: Path, device: Device, timeout: float) -> dict[str, str | None]:
    """The job's keys in this process's environment; returns what to restore."""
    saved = {key: os.environ.get(key) for key in (*CONTRACT_KEYS, TIMEOUT_ENV)}
    os.environ.setdefault(TIMEOUT_ENV, str(timeout))
    os.environ.update(
        {RUN_ID_ENV: run_id, "TORCHELASTIC_RUN_ID": run_id, OUTPUT_DIR_ENV: str(out), DEVICE_ENV: device}
    )
    return saved


def restore_environ(saved: dict[str, str | None]) -> None:
    """Undo what made this process a rank, so a later manager in it (HPO, say) starts afresh."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@dataclass(frozen=True)
class Member:
    """Where a process sits in the job: OTX's ``rank``, ``local_rank``, ``gpu_ids`` and ``world_size``."""

    rank: int
    local_rank: int
    gpu_ids: list[int]
    """The node's GPUs (or CPU slots); local rank i uses ``gpu_ids[i]``."""
    world_size: int


def join_group(
    rdzv_endpoint: str, member: Member, failed: Callable[[], BaseException | None] | None = None
) -> bool:
    """Set this process's rank environment, pick its device, and init the default process group.

    Returns True when it created the group (False when one already existed); ``failed`` is the
    caller's, naming a child's failure (see ``_init_group``).
    """
    endpoint = parse_endpoint(rdzv_endpoint)
    import torch
    import torch.distributed as dist

    device = device_named(os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu"))
    placement = RankPlacement.on_node(member.rank, member.local_rank, member.world_size, len(member.gpu_ids))
    job = JobContext(
        master_addr=endpoint.bind_host,
        master_port=endpoint.port,
        device=device,
        run_id=os.environ.get("TORCHELASTIC_RUN_ID", "multigpu"),
        output_dir=os.environ.get(OUTPUT_DIR_ENV),
    )
    os.environ.update(rank_env(placement, job))  # the one place: this process becomes the rank
    if device == "cuda":
        torch.cuda.set_device(member.gpu_ids[member.local_rank])
    if dist.is_initialized():
        return False
    _init_group(job, member.world_size, failed)
    return True


def _init_group(job: JobContext, world_size: int, failed: Callable[[], BaseException | None] | None) -> None:
    """The default process group, through the job's store at ``job.master_addr:master_port``.

    Every rank first counts itself in through the store (``wait_for_every_rank``). The caller (it
    passes ``failed``) then creates a gloo group with a short connect timeout (``CONNECT_TIMEOUT_S``),
    so a child that dies inside its own ``init_process_group`` cannot keep the caller there for the
    whole process-group timeout.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    bounded = failed is not None and job.device != "cuda"
    try:
        with GROUP_SOCKETS.recording(store_port=job.master_port):
            store = connect_store(job.master_addr, job.master_port, timeout.total_seconds())
            wait_for_every_rank(
                store,
                f"multigpu/joined/{job.run_id}",
                world_size,
                timeout.total_seconds(),
                failed or (lambda: None),
            )
            dist.init_process_group(
                "nccl" if job.device == "cuda" else "gloo",
                timeout=timedelta(seconds=CONNECT_TIMEOUT_S) if bounded else timeout,
            )
        if bounded:  # the connect phase is over: collectives and the store get the full timeout again
            dist.distributed_c10d._set_pg_timeout(timeout)
            dist.distributed_c10d._get_default_store().set_timeout(timeout)
    except BaseException:
        if not dist.is_initialized():
            # A failed init leaves torch's group counter advanced, so a later group in this process
            # would be named differently from its fresh peers' and never meet them. Destroying the
            # world resets it; with no world to destroy, reset it the same way.
            dist.distributed_c10d._world.group_count = 0
        raise


def run_child(train_func: Callable[..., Any], output_path: str, rdzv_endpoint: str, member: Member) -> None:
    """What each spawned rank runs: fix its argv the OTX way, join the group, call ``train_func``."""
    sys.argv = remove_option(sys.argv, "--gpus")
    sys.argv = remove_option(sys.argv, "--enable-hpo", takes_value=False)
    set_arguments_to_argv(["--output", "-o"], output_path)
    set_arguments_to_argv("--rdzv-endpoint", rdzv_endpoint)
    join_group(rdzv_endpoint, member)
    train_func()
    import torch.distributed as dist

    if dist.is_initialized():  # only after success: a failing rank's bootstrap announces first
        dist.destroy_process_group()


def child_entry(
    run_child_process: Callable[..., None],
    train_func: Callable[..., Any],
    output_path: str,
    rdzv_endpoint: str,
    gpu_ids: list[int],
    world_size: int,
) -> None:
    """The payload's call: one payload for every child, each reading its own rank from its environment."""
    run_child_process(
        train_func,
        output_path,
        rdzv_endpoint,
        int(os.environ["RANK"]),
        int(os.environ["LOCAL_RANK"]),
        gpu_ids,
        world_size,
    )
