"""A small real DDP training script: runs unchanged under ``multigpu run`` and ``torchrun``.

    multigpu run --cpu 2 examples/train_ddp.py --steps 20
    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 20

The backend follows the hardware: NCCL when CUDA is available, gloo otherwise. The process group is
set up with a plain ``init_process_group()``: the launcher's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...) says everything else.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device),
        device_ids=[local_rank] if use_cuda else None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    target = torch.arange(1.0, 9.0, device=device) / 8  # y = x . target, learned from random x
    data = torch.Generator().manual_seed(1 + rank)  # each rank sees its own shard of samples

    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch_size, 8, generator=data).to(device)
        y = (x @ target).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        if step == 1 or step % 5 == 0 or step == args.steps:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step:3d}  loss {mean.item() / world:.4f}", flush=True)

    if rank == 0:
        print(f"done: {world} rank(s), backend {dist.get_backend()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
