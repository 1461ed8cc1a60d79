"""The demo's training loop (multigpu.cli.demo.train), identical under every launcher.

usage: train.py STEPS
Rank 0 writes marks/train.json: total samples over all ranks and the slowest rank's loop seconds (and,
where the flight recorder is on, how many collectives its groups enqueued: the recorder's cost per step
is that many times its cost per collective).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import sys

from _bench import bench_dir, init_gloo, rank, record_pid, write_atomic

from multigpu.cli.demo import train

record_pid()
dist = init_gloo()
result = train(argparse.Namespace(steps=int(sys.argv[1]), batch_size=64, lr=0.05), "cpu")
if rank() == 0:
    summaries = result["summaries"]
    out = {
        "samples": sum(s["samples"] for s in summaries),
        "seconds": max(s["seconds"] for s in summaries),
        "accuracy": result["accuracy"],
    }
    with contextlib.suppress(Exception):  # where the flight recorder is on: collectives enqueued so far
        import torch

        record = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False))
        out["collectives"] = sum(int(s["last_enqueued_collective"]) for s in record["pg_status"].values())
    write_atomic(bench_dir() / "marks" / "train.json", json.dumps(out))
dist.destroy_process_group()
