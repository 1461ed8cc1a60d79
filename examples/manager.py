"""OTX-style function mode: this process becomes rank 0 and MultiGPUManager spawns the other ranks.

python examples/manager.py --cpu 2            # two CPU worker slots, gloo
python examples/manager.py --cpu 2 --fail     # rank 1 raises: the parent gets WorkerFailedError
python examples/manager.py --gpus 0,1         # two GPUs, NCCL
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from multigpu import MultiGPUManager, WorkerFailedError


def train() -> None:
    """Runs in every rank with the default process group already initialised."""
    args = parse_args()  # each spawned rank re-reads its argv (the manager rewrote --output in it)
    rank = dist.get_rank()
    if args.fail and rank == 1:
        raise RuntimeError("rank 1 ran out of data")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"rank {rank}/{dist.get_world_size()}: all_reduce -> {value.item():g}, output {args.output}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", help="GPU ids, e.g. 0,1")
    parser.add_argument("--cpu", type=int, help="N CPU worker slots instead of GPUs")
    parser.add_argument("--output", "-o", default=None)
    parser.add_argument("--fail", action="store_true", help="make rank 1 raise")
    parser.add_argument("--rdzv-endpoint", default="localhost:0")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.cpu:
        manager = MultiGPUManager(train, ",".join(map(str, range(args.cpu))), device="cpu", grace_period=1)
    else:
        manager = MultiGPUManager(train, args.gpus or "0", device="cuda")
    try:
        try:
            if manager.is_available():
                out = manager.setup_multi_gpu_train(args.output)  # starts ranks 1..n-1; we are rank 0
                print(f"rank 0: output in {out}, LOCAL_RANK={os.environ['LOCAL_RANK']}")
            train()  # a child that fails during setup already raises from setup_multi_gpu_train
        finally:
            manager.finalize()  # waits for the others; raises WorkerFailedError if one failed
    except WorkerFailedError as err:  # the root cause, even when rank 0 itself saw a collective error
        print(f"training failed: rank {err.rank}, exit code {err.exit_code}, signal {err.signal}")
        print(err.traceback)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
