"""``multigpu demo``: a real DDP training run on the default devices, launched as ``multigpu run``.

A small MLP learns a deterministic synthetic task (points in 16-D labelled by which of 4 fixed
centres they are nearest), sharded with DistributedSampler. Every visible GPU is used, or 2 CPU
workers (gloo) when there is none. In the launcher, ``cli.main``'s ``cmd_demo`` turns the demo's
options into a ``multigpu run ... -m multigpu.cli.demo`` line (``run_line``) and runs it through the
very code path of ``multigpu run`` (console, logs and ``run.json`` under ``./multigpu_runs/<run id>/``,
or ``--output``), then says where they are and what to try next (``where_and_next``). ``rank_main``
runs in each rank (this module is the rank's ``__main__``): ``torch.distributed`` from torchrun's
environment, then ``train``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multigpu.contract.errors import UsageError

FEATURES, CLASSES, SAMPLES = 16, 4, 4096


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise UsageError(message)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = _Parser(prog="multigpu demo", description="A real DDP training run on the default devices.")
    p.add_argument("--gpus", help="visible GPU indices, e.g. 0,1 (default: every visible GPU)")
    p.add_argument("--cpu", type=int, metavar="N", help="N CPU workers (default when no GPU: 2)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size (default 64)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("-o", "--output", help="output directory (default: ./multigpu_runs/<run id>, as any run)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d store (default: as multigpu run)")
    args = p.parse_args(argv)
    if args.cpu is not None and args.cpu < 1:
        raise UsageError(f"--cpu must be at least 1, got {args.cpu}")
    if args.steps < 1 or args.batch_size < 1:
        raise UsageError("--steps and --batch-size must be at least 1")
    return args


def make_dataset(seed: int = 0) -> Any:
    """Deterministic: the same tensors on every rank and every run."""
    import torch

    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 2.0
    x = torch.randn(SAMPLES, FEATURES, generator=g) * 1.5
    labels = torch.cdist(x, centres).argmin(dim=1)
    return torch.utils.data.TensorDataset(x, labels)


NEXT = "multigpu run --cpu 2 examples/train_ddp.py"
"""What the demo's last line suggests: the same kind of run with a script of the newcomer's own."""


def _device_options(args: argparse.Namespace) -> list[str]:
    """``multigpu run``'s device options for the demo's: every visible GPU, else 2 CPU workers."""
    from multigpu.cluster.devices import visible_gpus

    if args.cpu is not None:
        return ["--cpu", str(args.cpu)]
    if args.gpus is not None:
        return ["--gpus", args.gpus]  # run's own check names --cpu N when no GPU is visible
    return [] if visible_gpus() else ["--cpu", "2"]


def run_line(args: argparse.Namespace, run_id: str) -> list[str]:
    """The ``multigpu run`` arguments the demo runs: its devices, its output, this module as the target."""
    where = ["--output", args.output] if args.output else []
    rdzv = ["--rdzv-endpoint", args.rdzv_endpoint] if args.rdzv_endpoint else []
    return [
        *_device_options(args),
        "--run-id",
        run_id,
        *where,
        *rdzv,
        "-m",
        "multigpu.cli.demo",
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        str(args.lr),
    ]


def where_and_next(args: argparse.Namespace, run_id: str) -> None:
    """The demo's last lines, in the launcher after the run: where its output is, what to try next."""
    out = Path(args.output or Path("multigpu_runs") / run_id).resolve()
    if (out / "run.json").exists():
        show(
            f"demo: logs in {out / 'logs'}, the run record in {out / 'run.json'}",
            f"next: your own script on 2 CPU workers, the same way: {NEXT}",
        )


def rank_main(argv: Sequence[str] | None = None) -> int:
    """The demo in one rank (``multigpu run -m multigpu.cli.demo``, or plain ``python -m`` for one
    process): the process group from torchrun's environment, then ``train``."""
    import torch
    import torch.distributed as dist

    from multigpu.contract.names import DEVICE_ENV

    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" in os.environ:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        train(args, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _progress(total: int, enabled: bool) -> Any:
    if not enabled or not sys.stdout.isatty():
        return None
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
    )


def train(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """The demo's DDP training run in this rank (every rank runs it); rank 0 reports."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    setup = _setup(args, device, distributed, rank, world)
    dev, dataset, model = setup.dev, setup.dataset, setup.model
    if rank == 0:
        show(
            f"demo: {world} rank(s) on {device}, {len(dataset)} samples, {args.steps} steps, "
            f"batch {args.batch_size} per rank"
        )
    step, samples, elapsed, first_loss, loss_value = _loop(args, setup, rank, world)
    accuracy = evaluate(model, dataset, dev, rank, world)
    device_index = dev.index if dev.type == "cuda" else -1
    summaries = gather_summaries(
        [rank, os.getpid(), device_index, step, samples, elapsed, first_loss, loss_value], dev, world
    )
    if rank == 0:
        total = sum(s["samples"] for s in summaries)
        show(
            f"done: loss {first_loss:.4f} -> {loss_value:.4f}, accuracy {accuracy:.1%}, "
            f"{total / elapsed:,.0f} samples/s over {world} rank(s) in {elapsed:.1f}s",
            "rank  pid      device  steps  samples  seconds  first loss  final loss",
            *(
                f"{s['rank']:>4}  {s['pid']:<7}  {s['device']:<6}  {s['steps']:>5}  {s['samples']:>7}  "
                f"{s['seconds']:>7}  {s['first_loss']:>10.4f}  {s['final_loss']:>10.4f}"
                for s in summaries
            ),
        )
    return {"accuracy": accuracy, "summaries": summaries}


@dataclass(frozen=True)
class _Setup:
    """What a rank trains with: the same on every rank, sharded by the sampler."""

    dev: Any
    dataset: Any
    sampler: Any
    loader: Any
    model: Any


def _setup(args: argparse.Namespace, device: str, distributed: bool, rank: int, world: int) -> _Setup:
    """The rank's device, dataset, sampler, loader and model (DDP-wrapped when ``distributed``)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    dev = torch.device(f"cuda:{torch.cuda.current_device()}") if device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    dataset = make_dataset()
    sampler: Any = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model: Any = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES)
    ).to(dev)
    if distributed:
        model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    return _Setup(dev, dataset, sampler, loader, model)


def _loop(
    args: argparse.Namespace, setup: _Setup, rank: int, world: int
) -> tuple[int, int, float, float, float]:
    """``args.steps`` SGD steps; (steps, samples, seconds, first loss, last loss)."""
    import torch

    model, sampler, loader, dev = setup.model, setup.sampler, setup.loader, setup.dev

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    progress = _progress(args.steps, rank == 0)
    task = progress.add_task("train", total=args.steps, info="") if progress else None
    if progress:
        progress.start()
    step, epoch, first_loss, loss_value, samples = 0, 0, None, float("nan"), 0
    start = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(dev), y.to(dev)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            step += 1
            samples += len(x)
            loss_value = loss.item()
            first_loss = loss_value if first_loss is None else first_loss
            if rank == 0:
                rate = samples * world / (time.perf_counter() - start)
                info = f"loss {loss_value:.4f}  {rate:,.0f} samples/s"
                if progress and task is not None:
                    progress.update(task, completed=step, info=info)
                elif step == 1 or step % 50 == 0 or step == args.steps:
                    show(f"step {step:4d}/{args.steps}  {info}")
            if step >= args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - start
    if progress:
        progress.stop()
    return step, samples, elapsed, float("nan") if first_loss is None else first_loss, loss_value


def show(*lines: str) -> None:
    """Rank 0's lines. A reader that left (``multigpu demo | head``) ends the output, not the training:
    the run goes on and ends well, as ``multigpu run``'s does, instead of rank 0 dying of the pipe."""
    try:
        print(*lines, sep="\n", flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ else 1)
        os.close(devnull)


SUMMARY_FIELDS = ("rank", "pid", "device", "steps", "samples", "seconds", "first_loss", "final_loss")


def gather_summaries(values: list[Any], dev: Any, world: int) -> list[dict[str, Any]]:
    """Every rank's numbers, gathered as one tensor (``all_gather_object`` would need numpy)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([float(v) for v in values], dtype=torch.float64, device=dev)
    rows = [mine]
    if world > 1:
        rows = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
    out = []
    for row in rows:
        record: dict[str, Any] = dict(zip(SUMMARY_FIELDS, row.tolist(), strict=True))
        for key in ("rank", "pid", "steps", "samples"):
            record[key] = int(record[key])
        record["seconds"] = round(record["seconds"], 2)
        index = int(record["device"])
        record["device"] = "cpu" if index < 0 else f"cuda:{index}"
        out.append(record)
    return out


def evaluate(model: Any, dataset: Any, dev: Any, rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    x, y = dataset.tensors
    shard = slice(rank, None, world)
    with torch.no_grad():
        correct = (model(x[shard].to(dev)).argmax(dim=1) == y[shard].to(dev)).sum().float()
        count = torch.tensor(float(len(y[shard])), device=dev)
    stats = torch.stack([correct, count])
    if world > 1:
        dist.all_reduce(stats)
    return float(stats[0] / stats[1])


if __name__ == "__main__":
    sys.exit(rank_main())
