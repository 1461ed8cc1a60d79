"""Rank 1 raises after a first all-reduce; the other ranks are stopped. For the failure report."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
print(f"rank {dist.get_rank()}: step 1 done", flush=True)
if int(os.environ["RANK"]) == 1:
    raise ValueError("loss is NaN at step 2")
dist.all_reduce(torch.ones(1))  # the other ranks wait here for rank 1, which never comes
dist.destroy_process_group()
