"""The tiny job: init_process_group (gloo, env://), one all_reduce, exit."""

from __future__ import annotations

import torch
from _bench import init_gloo, record_pid

record_pid()
dist = init_gloo()
t = torch.ones(1)
dist.all_reduce(t)
assert int(t.item()) == dist.get_world_size()
dist.destroy_process_group()
