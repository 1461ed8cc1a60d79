"""Rank 1 is SIGKILLed, as the kernel's OOM killer would do, while rank 0 trains on."""

import os
import signal
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()}: allocating", flush=True)
if int(os.environ["RANK"]) == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer sends; no Python code runs after it
dist.all_reduce(torch.ones(1))
