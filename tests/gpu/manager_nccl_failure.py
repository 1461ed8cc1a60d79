"""Rank 0 of a two-GPU function-mode job (NCCL) whose rank 1 raises while rank 0 waits on the GPU.

    python tests/gpu/manager_nccl_failure.py {collective|synchronize|sleep} OUTPUT_DIR

Prints ``CAUGHT rank=1 latency_ms=N cause=X`` and exits 0 when rank 0's code got WorkerFailedError
within 5 s of rank 1's failure; exits 1 otherwise. Used by tests/gpu/test_manager_nccl.py and by
scripts/check_gpu.sh (needs two visible GPUs: NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

from multigpu import MultiGPUManager, WorkerFailedError

MODE = os.environ.get("NCCL_CASE", "collective")


def train() -> None:
    rank = dist.get_rank()
    print(f"pid={os.getpid()}", flush=True)
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)  # warm-up: the communicators exist before anyone fails
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(1.0)
        raise ValueError("boom from rank 1")
    if MODE == "collective":  # enqueue all_reduce after all_reduce: the stream stalls on the dead peer
        for _ in range(1_000_000):
            dist.all_reduce(t)
        torch.cuda.synchronize()
    elif MODE == "synchronize":  # one collective, then wait for the GPU
        dist.all_reduce(t)
        torch.cuda.synchronize()
    else:
        time.sleep(30)


def main() -> int:
    global MODE
    MODE = sys.argv[1]
    os.environ["NCCL_CASE"] = MODE  # the child re-imports this file and reads it from the environment
    manager = MultiGPUManager(train, "0,1")  # device "auto": CUDA, NCCL
    if not manager.is_available():
        print("SKIP: needs two visible GPUs", flush=True)
        return 1
    manager.setup_multi_gpu_train(sys.argv[2])
    start = time.time()
    try:
        train()
        print(f"NOT CAUGHT: train() returned after {time.time() - start:.1f}s", flush=True)
        manager.finalize()
        return 1
    except WorkerFailedError as exc:
        latency = time.time() - (exc.root_cause.time or start)
        print(
            f"CAUGHT rank={exc.rank} latency_ms={latency * 1000:.0f} cause={type(exc.__cause__).__name__}",
            flush=True,
        )
        ok = exc.rank == 1 and "boom from rank 1" in (exc.traceback or "") and latency < 5
    with contextlib.suppress(WorkerFailedError):  # it was raised already; finalize() raises it again
        manager.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
