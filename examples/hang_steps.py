"""A loop that reports its steps and times its forward pass. Rank 1 is a straggler (its forward takes
3x as long), then gets stuck at step 30 while rank 0 waits for it in the all-reduce."""

import time

import torch
import torch.distributed as dist

import multigpu

dist.init_process_group("gloo")
rank = dist.get_rank()
grad = torch.ones(4)
for step in range(1, 1001):
    with multigpu.section("forward"):  # the time a rank spends before the collective: stragglers show
        time.sleep(0.06 if rank == 1 else 0.02)
        if rank == 1 and step == 30:
            time.sleep(3600)  # stuck: a data loader that never returns, a dead lock, ...
    dist.all_reduce(grad)  # every rank waits here for the others
    multigpu.heartbeat(step=step)  # step done: the launcher learns the step time from these
