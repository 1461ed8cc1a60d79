"""The demo's training loop (multigpu.cli.demo.train), identical under every launcher.

usage: train.py STEPS
Rank 0 writes marks/train.json: total samples over all ranks and the slowest rank's loop seconds.
"""

from __future__ import annotations

import argparse
import json
import sys

from _bench import bench_dir, init_gloo, rank, record_pid, write_atomic

from multigpu.cli.demo import train

record_pid()
dist = init_gloo()
result = train(argparse.Namespace(steps=int(sys.argv[1]), batch_size=64, lr=0.05), "cpu")
if rank() == 0:
    summaries = result["summaries"]
    out = {"samples": sum(s["samples"] for s in summaries),
           "seconds": max(s["seconds"] for s in summaries), "accuracy": result["accuracy"]}
    write_atomic(bench_dir() / "marks" / "train.json", json.dumps(out))
dist.destroy_process_group()
