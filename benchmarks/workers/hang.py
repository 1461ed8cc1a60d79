"""Rank 1 stops in Python (a sleep) while rank 0 waits for it in an all_reduce: the simplest hang."""

from __future__ import annotations

import time

import torch
from _bench import init_gloo, rank, record_pid

record_pid()
dist = init_gloo()
dist.barrier()
if rank() == 1:
    time.sleep(600)
t = torch.ones(1)
dist.all_reduce(t)
