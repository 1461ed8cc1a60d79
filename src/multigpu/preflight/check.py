"""One node's preflight check: a timed matmul on its device, then all_reduce between the nodes, then
every node's figures gathered to every node, printed as one JSON line for the launcher.

Runs in the check process (see the package docstring), once per node: the nodes form a process group
of their own (gloo; NCCL on GPUs) of one process per node, rank = node rank, over the job's c10d store
through a ``PrefixStore`` (its keys under the run's), so no other channel is opened. Every wait is
bounded by the task's ``timeout_s``: a node that dies or never comes ends the check with one line on
stderr and exit 1, and the launcher handles it as any failure before the ranks start.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

from multigpu.contract.prctl import set_pdeathsig
from multigpu.contract.preflight_wire import Figures, PreflightResult, PreflightTask
from multigpu.rendezvous.store import connect_store

COMPUTE_S = 0.5
"""The matmuls run this long at least: a CPU quota shows over several of its periods (100 ms)."""
MATMUL_N = {"cpu": 256, "cuda": 4096}
"""The square matrices' side: a few ms per product on one CPU thread; enough to fill a GPU."""
ALL_REDUCE_BYTES = 4 << 20
ALL_REDUCE_ROUNDS = 3
"""Timed all_reduce calls of ``ALL_REDUCE_BYTES``, after one untimed (the connections' set-up)."""


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def matmul_gflops(device: str, seconds: float = COMPUTE_S) -> float:
    """Products of two random square matrices for ``seconds`` (wall clock), in GFLOP/s."""
    import torch

    n = MATMUL_N["cuda" if device.startswith("cuda") else "cpu"]
    a, b = torch.rand(n, n, device=device), torch.rand(n, n, device=device)
    torch.mm(a, b)  # untimed: the first call sets up the kernels
    synchronize(device)
    products, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        products += 1
        if products % 4 == 0:
            synchronize(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2 * n**3 * products / elapsed / 1e9


def all_reduce_gbps(device: str, rounds: int = ALL_REDUCE_ROUNDS) -> float:
    """``rounds`` all_reduce of ``ALL_REDUCE_BYTES`` over the group, in GB/s of the buffer."""
    import torch
    import torch.distributed as dist

    buffer = torch.ones(ALL_REDUCE_BYTES // 4, device=device)
    dist.all_reduce(buffer)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(rounds):
        dist.all_reduce(buffer)
    synchronize(device)
    return ALL_REDUCE_BYTES * rounds / (time.perf_counter() - start) / 1e9


def join_group(task: PreflightTask) -> None:
    """The nodes' own process group, on the job's store under the check's prefix."""
    import torch
    import torch.distributed as dist

    store = dist.PrefixStore(  # type: ignore[attr-defined]
        task.prefix, connect_store(task.host, task.port, task.timeout_s)
    )
    cuda = task.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(task.device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=task.node,
        world_size=task.nodes,
        timeout=timedelta(seconds=task.timeout_s),
    )


def gather(task: PreflightTask, figures: list[float]) -> list[list[float]]:
    """Every node's figures, by node rank (an all_gather of a small tensor)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(figures, dtype=torch.float64, device=task.device)
    every = [torch.zeros_like(mine) for _ in range(task.nodes)]
    dist.all_gather(every, mine)
    return [[float(x) for x in row.tolist()] for row in every]


def run(task: PreflightTask) -> PreflightResult:
    """The check itself: this node's matmul, then the group's all_reduce, then everyone's figures."""
    import torch.distributed as dist

    started = time.perf_counter()
    gflops = matmul_gflops(task.device)
    join_group(task)
    try:
        gbps = all_reduce_gbps(task.device)
        rows = gather(task, [gflops, gbps])
    finally:
        dist.destroy_process_group()
    return PreflightResult(tuple(Figures(*row) for row in rows), time.perf_counter() - started)


def main(argv: list[str]) -> int:
    """Run the check of ``argv[0]`` (a ``PreflightTask``); its result on stdout, or one line on stderr."""
    try:
        task = PreflightTask.decode(argv[0])
        set_pdeathsig(signal.SIGKILL)
        if os.getppid() != task.launcher:  # the launcher is gone already (or this is not its child)
            return 1
        print(run(task).encode(), flush=True)
        return 0
    except Exception as exc:  # one line for the launcher: it names the node and the cause
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"{type(exc).__name__}: {first[:300]}", file=sys.stderr, flush=True)
        return 1
