"""Every rank waits in a collective that rank 1 never joins: a hung job, for ``--hang-timeout``."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()}: started", flush=True)
if int(os.environ["RANK"]) == 1:
    time.sleep(3600)  # stuck (a dead lock, a slow file system, ...)
dist.all_reduce(torch.ones(1))  # rank 0 waits here forever
