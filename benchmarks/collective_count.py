"""What counting collectives costs a rank: a tiny gloo all_reduce, with and without the rank's
collective watch (``rank/progress.watch_collectives``), median of many.

    python benchmarks/collective_count.py [--calls 400] [--rounds 10]

Two processes on loopback (gloo), started by this script. Each round runs the same number of
all_reduce calls of one float in every mode, the modes interleaved so that drift on a shared machine
falls on all of them alike:

* ``off``: no watch thread (a rank without multigpu's bootstrap);
* ``on``: the watch thread as every rank runs it (a beat every ``COLLECTIVES_EVERY_S``, and a look
  at the world group every ``ENTRY_POLL_S`` during one second in ``SAMPLE_EVERY_S``: entry times for
  the launcher's straggler detection);
* ``sampling``: the thread in its sampling second all the time (a look every 5 ms, the cost during
  that second);
* ``stress``: the thread looking every millisecond all the time, to make any cost visible;
* ``wrapped``: no thread, ``dist.all_reduce`` wrapped in Python to count calls (the alternative
  design, which would also miss the collectives torch issues from C++, DDP's among them).

It also times one read of the counter (``collectives_entered``). Runs outside the launcher.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import threading
import time


def rank_main(calls: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from multigpu.rank import progress

    dist.init_process_group("gloo")
    original = dist.all_reduce
    count = [0]

    @functools.wraps(original)
    def counted(*args: object, **kwargs: object) -> object:
        count[0] += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    read, write = os.pipe()
    os.set_blocking(write, False)
    t = torch.ones(1)
    per_call: dict[str, list[float]] = {"off": [], "on": [], "sampling": [], "stress": [], "wrapped": []}
    every = progress.SAMPLE_EVERY_S, progress.SAMPLE_FOR_S

    def watch(mode: str) -> threading.Thread | None:
        progress._fd, progress._owner, progress._looked = write, os.getpid(), True
        looks = {
            "on": (progress.COLLECTIVES_EVERY_S, progress.ENTRY_POLL_S),
            "sampling": (progress.COLLECTIVES_EVERY_S, progress.ENTRY_POLL_S),
            "stress": (0.001, 0.001),
        }
        if mode not in looks:
            return None
        progress.SAMPLE_FOR_S = every[0] if mode != "on" else every[1]  # always sampling, or as ranks do
        thread = threading.Thread(target=progress._watch_collectives, args=looks[mode], daemon=True)
        thread.start()
        return thread

    for _ in range(3 * calls):  # warm-up
        dist.all_reduce(t)
    for _ in range(rounds):
        for mode in per_call:
            thread = watch(mode)
            call = counted if mode == "wrapped" else original
            dist.barrier()
            for _ in range(calls):
                start = time.perf_counter()
                call(t)
                per_call[mode].append(time.perf_counter() - start)
            progress._fd = None  # the thread ends at its next look
            if thread is not None:
                thread.join()
    os.close(read)
    reads = []
    for _ in range(2000):
        start = time.perf_counter()
        progress.collectives_entered()
        reads.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        base = statistics.median(per_call["off"])
        print(f"gloo all_reduce of 1 float, 2 ranks on loopback, {rounds} rounds x {calls} calls per mode:")
        for mode, times in per_call.items():
            median = statistics.median(times)
            delta = (median - base) * 1e6
            print(f"  {mode:8s} median {median * 1e6:8.1f} us/call  ({delta:+6.1f} us vs off)")
        print(
            f"  one read of the counter (every group's sequence number): median "
            f"{statistics.median(reads) * 1e6:.2f} us"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.calls, args.rounds)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    argv = [sys.executable, __file__, "--calls", str(args.calls), "--rounds", str(args.rounds)]
    procs = [subprocess.Popen([*argv, "--rank", str(r)], env=dict(env, RANK=str(r))) for r in range(2)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
