"""Function mode: time from a child's failure to rank 0's WorkerFailedError, by what rank 0 is doing.

    .venv/bin/python benchmarks/delivery_latency.py [--runs 5] [--world 3] [--cases collective,sleep]

Each run starts a fresh rank-0 program (CPU workers, gloo). The last rank raises; the latency is the
time rank 0 catches ``WorkerFailedError`` minus the time in the child's error record (written as the
exception left its code, moments before the process exits). Cases for rank 0:
  collective  blocked in an all_reduce the failing rank never joins
  loop        in a loop of all_reduce calls the failing rank leaves half-way
  recv        blocked in recv() from a peer that is alive (only the abort can end it)
  sleep       in time.sleep(30)
  compute     in a pure-Python busy loop
  killed      blocked in an all_reduce, and the failing rank is SIGKILLed (no record, no announce:
              only its exit tells; latency from the moment before the kill)
  killed_sleep  in time.sleep(30), the failing rank SIGKILLed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

RANK0 = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    from multigpu import MultiGPUManager, WorkerFailedError

    CASE, WORLD = os.environ["CASE"], int(os.environ["WORLD"])

    def train():
        rank = dist.get_rank()
        if rank == WORLD - 1:
            if CASE == "loop":
                for _ in range(20):
                    dist.all_reduce(torch.ones(1 << 16))
            else:
                time.sleep(1.0)
            if CASE.startswith("killed"):  # no record, no announce: only its exit tells
                with open(os.path.join(os.environ["OUT"], "killed_at"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), 9)
            raise ValueError("boom")
        if CASE in ("collective", "killed"):
            dist.all_reduce(torch.ones(1 << 16))
        elif CASE == "loop":
            while True:
                dist.all_reduce(torch.ones(1 << 16))
        elif CASE == "recv":
            if rank == 0:
                dist.recv(torch.zeros(1), src=1)  # rank 1 never sends: it waits in the same way
            else:
                dist.recv(torch.zeros(1), src=0)
        elif CASE in ("sleep", "killed_sleep"):
            time.sleep(30)
        else:
            x = 0
            while True:
                x += 1
        time.sleep(30)

    if __name__ == "__main__":
        manager = MultiGPUManager(train, ",".join(map(str, range(WORLD))), device="cpu")
        manager.setup_multi_gpu_train(os.environ["OUT"])
        try:
            train()
        except WorkerFailedError as exc:
            caught = time.time()
            died = exc.root_cause.time
            if CASE.startswith("killed"):
                died = float(open(os.path.join(os.environ["OUT"], "killed_at")).read())
            print("RESULT " + json.dumps({"latency": caught - died, "rank": exc.rank,
                                          "cause": type(exc.__cause__).__name__}), flush=True)
        try:
            manager.finalize()
        except WorkerFailedError:
            pass
""")


def run_once(case: str, world: int, python: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank0.py"
        script.write_text(RANK0)
        env = {**os.environ, "CASE": case, "WORLD": str(world), "OUT": str(Path(tmp) / "out")}
        proc = subprocess.run([python, str(script)], env=env, capture_output=True, text=True, timeout=120)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(
        f"{case}: no result (exit {proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--cases", default="collective,loop,recv,sleep,compute,killed,killed_sleep")
    args = parser.parse_args()
    for case in args.cases.split(","):
        results = [run_once(case, args.world, sys.executable) for _ in range(args.runs)]
        ms = sorted(1000 * float(r["latency"]) for r in results)  # type: ignore[arg-type]
        causes = sorted({str(r["cause"]) for r in results})
        print(
            f"{case:<11} n={len(ms)} min {ms[0]:7.1f} ms  median {statistics.median(ms):7.1f} ms  "
            f"max {ms[-1]:7.1f} ms  chained from: {', '.join(causes)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
