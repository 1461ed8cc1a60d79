"""The flight recorder's cost per collective: one gloo process (world size 1, so no peer's scheduling
adds noise) times a tiny all_reduce, best of 5 rounds of 20,000. Run by hand, not under a launcher,
with ``TORCH_FR_BUFFER_SIZE`` set by the harness (0: off). Writes marks/collective.json."""

from __future__ import annotations

import json
import os
import pickle
import time

import torch
import torch.distributed as dist
from _bench import bench_dir, record_pid, write_atomic

ROUNDS, OPS = 5, 20_000

record_pid()
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=0, world_size=1
)
t = torch.ones(1)
for _ in range(2000):
    dist.all_reduce(t)


def one_round() -> float:
    began = time.perf_counter()
    for _ in range(OPS):
        dist.all_reduce(t)
    return (time.perf_counter() - began) / OPS * 1e6


best = min(one_round() for _ in range(ROUNDS))
recorded = len(pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False)).get("entries", []))
write_atomic(bench_dir() / "marks" / "collective.json", json.dumps({"us": best, "recorded": recorded}))
dist.destroy_process_group()
