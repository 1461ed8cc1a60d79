"""A DDP training loop that survives preemption: it checkpoints and stops on SLURM's warning, and resumes.

    multigpu run --cpu 2 --preempt-signal USR1 examples/preemptible.py --steps 200 --warn-at 5

Two lines make a loop preemptible: ``multigpu.should_stop(step)`` at every step (every rank gets True
at the same step, so none is left in a collective), then a checkpoint. When the job comes back
(``scontrol requeue`` on SLURM), ``MULTIGPU_PREVIOUS_OUTPUT`` names the folder of the allocation before.
``--warn-at STEP`` makes rank 0 send the warning to its own launcher at that step, as SLURM would
(``#SBATCH --signal=USR1@90``), to try it anywhere.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import multigpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warn-at", type=int, default=None, help="simulate SLURM's warning at this step")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Linear(8, 1).to(device), device_ids=[local_rank] if use_cuda else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    previous = os.environ.get("MULTIGPU_PREVIOUS_OUTPUT")
    if previous and (Path(previous) / "checkpoint.pt").exists():
        state = torch.load(Path(previous) / "checkpoint.pt", map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        if rank == 0:
            print(f"resumed from step {step} (MULTIGPU_RESUMED={os.environ['MULTIGPU_RESUMED']})", flush=True)

    while step < args.steps:
        if multigpu.should_stop(step):  # True on every rank at the same step, after a warning
            break
        if step == args.warn_at and rank == 0:
            os.kill(int(os.environ["MULTIGPU_LAUNCHER_PID"]), signal.SIGUSR1)
        x = torch.randn(16, 8, device=device)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients: a collective in every step
        optimizer.step()
        step += 1

    if rank == 0:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save(state, Path(os.environ["MULTIGPU_OUTPUT_DIR"]) / "checkpoint.pt")
        how = "stopped for preemption" if multigpu.preempted() else "finished"
        print(f"{how} at step {step}; checkpoint saved", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
