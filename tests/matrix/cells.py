"""The fault matrix's cells: what each fault does, and what every node must say about it.

A cell is two launchers on loopback, one rank each (``--nproc-per-node 1``), static (``--nnodes 2
--node-rank I --master-addr/--master-port``) or elastic (``--nnodes 2:2 --rdzv-backend c10d``), with
NumPy on the path or not, on a quiet machine or beside two busy CPU processes. The fault happens on
node 1 unless its name says node 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

JOB = """
import os, sys, time, torch, torch.distributed as dist
fault, steps, step_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"pid={os.getpid()}", flush=True)
for step in range(steps):
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 0:
        print(f"step {step}", flush=True)  # most scripts print from rank 0 only
    if rank == 1 and step == 2:
        if fault == "raise":
            raise ValueError("cell fault at step 2")
        if fault == "exit":
            os._exit(1)
        if fault == "sigkill":
            os.kill(os.getpid(), 9)
        if fault == "hang":
            time.sleep(600)  # outside any collective: rank 0 waits in the next all_reduce
        if fault == "oom":
            hog = b"x" * (1200 << 20)  # twice the memory cgroup's limit
            time.sleep(30)
    time.sleep(step_s)
dist.destroy_process_group()
"""


@dataclass(frozen=True)
class Fault:
    """One fault and the verdict every node that lives to tell it must print."""

    name: str
    codes: tuple[int | None, int | None]
    """Each node's documented exit code; None: the node is killed by the test (no code to check)."""
    cause: str = ""
    """Text every surviving node's ``root cause:`` line (or its one refusal line) contains."""
    elastic_cause: str | None = None
    """The same for an elastic job where it differs (node ranks are the rendezvous's there: the
    launcher started second is not always node 1)."""
    steps: int = 40
    step_s: float = 0.2
    launcher_args: tuple[str, ...] = ()
    survivor_stacks: bool = False
    """Rank 0 was alive at the verdict: its stacks must be in its log."""
    nodes: tuple[int, ...] = (0, 1)
    tags: frozenset[str] = field(default_factory=frozenset)


FAULTS = {
    f.name: f
    for f in (
        Fault("raise", (1, 1), "ValueError: cell fault at step 2", survivor_stacks=True),
        Fault("exit", (1, 1), "exited with code 1", survivor_stacks=True),
        Fault("sigkill", (137, 137), "SIGKILL", survivor_stacks=True),
        Fault("hang", (1, 1), "cell.py:", launcher_args=("--hang-timeout", "4"), survivor_stacks=True),
        Fault("healthy", (0, 0), steps=6, step_s=1.0, launcher_args=("--hang-timeout", "3")),
        Fault("term1", (143, 143), "SIGTERM"),
        Fault("kill0", (None, 1), "node 0", elastic_cause="root cause: node "),
        Fault("kill1", (1, None), "node 1", survivor_stacks=True, elastic_cause="root cause: node "),
        Fault("mismatch", (1, 1), "the nodes would run different things"),
        Fault("nevercomes", (1, None), "joined", nodes=(0,), launcher_args=("--rdzv-timeout", "4")),
        Fault("oom", (137, 137), "OOM killer", survivor_stacks=True),
    )
}

FORBIDDEN = (
    "Exception raised from",
    "TCPStore.cpp",
    ".cpp:",
    "signal 47",
    "plain processes",
    "could not fork",
)
"""Never on a launcher's console: a C++ frame or torch store message, a rank ended by our own dump
signal, a node that fell back from the template."""


def our_frames(console: str) -> list[str]:
    """What a launcher's console must never show: a frame of multigpu's own code or of torch's store
    and elastic machinery, and a traceback of rank 0, which only saw rank 1's fault (its record and
    its log keep it). The user's frames are the point of a root cause, and a hang report shows where
    each rank waits (torch's collective included): those may appear."""
    bad = ("/multigpu/", "/torch/distributed/elastic/", "rendezvous", "TCPStore")
    return [
        line
        for line in console.splitlines()
        if (line.strip().startswith('File "') and any(b in line for b in bad))
        or ("rank 0]" in line and "Traceback" in line)
    ]
