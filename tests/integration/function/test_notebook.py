"""``multigpu.launch`` in a real Jupyter kernel (``jupyter_client`` + ipykernel), as a notebook user runs it.

Functions and lambdas defined in cells return their 2 CPU ranks' values; a rank's ``ValueError`` is caught
by ``except ValueError``; the stop button (a kernel interrupt) ends a running launch within seconds,
every rank gone, and the next launch works; when the kernel is shut down mid-launch, nothing it started
is left. ``MultiGPUManager`` (the kernel becomes rank 0) runs a function defined in a cell too.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from helpers import assert_gone, clean_env, pids_in
from notebook_kernel import Kernel

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.matrix,
]  # heavy: the tier after the suite

DEFINE = """
import os, time
import multigpu

def work(x):
    print(f"working pid={os.getpid()}", flush=True)
    return (int(os.environ["RANK"]), x * 2)

values = multigpu.launch(work, 21, nprocs=2, device="cpu")
print("VALUES", values)
"""

STATE = """
import threading

def _descriptors():
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own
            pass
    return sorted(found.items())

print("STATE", threading.active_count(), _descriptors())
"""

LAMBDA = 'print("LAMBDA", multigpu.launch(lambda: int(os.environ["WORLD_SIZE"]) + 1, nprocs=2, device="cpu"))'

FAILING = """
def picky():
    if os.environ["RANK"] == "1":
        raise ValueError("no thanks")
    time.sleep(60)

try:
    multigpu.launch(picky, nprocs=2, device="cpu", grace_period=2)
except ValueError as exc:
    print("CAUGHT", exc, exc.__notes__)
    print("CAUSE", exc.__cause__)
"""

SLEEPING = """
def nap():
    print(f"napping pid={os.getpid()}", flush=True)
    time.sleep(300)

multigpu.launch(nap, nprocs=2, device="cpu")
"""

IN_A_THREAD = """
def hello():
    print(f"hello from rank {os.environ['RANK']} in a thread", flush=True)

thread = threading.Thread(target=lambda: multigpu.launch(hello, nprocs=2, device="cpu"))
thread.start()
"""


def kinds_of(state: str) -> tuple[str, list[str]]:
    """``STATE``'s output: the thread count, and each descriptor's kind, sorted."""
    threads = state.split()[1]
    targets = re.findall(r"'([^']*)'\)", state)
    return threads, sorted(re.sub(r"[#\[]\d+\]?", "", t) for t in targets if "history.sqlite" not in t)


@pytest.fixture
def kernel(tmp_path: Path) -> Kernel:
    k = Kernel(tmp_path, clean_env())
    yield k
    k.shutdown()


def test_cells_launch_return_raise_and_interrupt(kernel: Kernel) -> None:
    text, reply = kernel.run(DEFINE)
    assert reply["status"] == "ok", text
    assert "VALUES [(0, 42), (1, 42)]" in text
    assert "[rank 0] working pid=" in text and "[rank 1] working pid=" in text  # in the cell, prefixed
    before, _ = kernel.run(STATE)  # the warm launcher's pipes are open from here on
    text, reply = kernel.run(LAMBDA)
    assert "LAMBDA [3, 3]" in text, text
    text, reply = kernel.run(FAILING)
    assert re.search(r"CAUGHT no thanks \['multigpu: raised by rank 1 \(pid \d+\)'\]", text), text
    # the rank's traceback names the cell as IPython does, with its line and source, not <dynamic-code>
    cell_frame = (
        r'File "[^"]*ipykernel_\d+/[^"]+[.]py", line \d+, in picky\n +raise ValueError\("no thanks"\)'
    )
    assert re.search(cell_frame, text), text

    cell = kernel.start(SLEEPING)
    seen = kernel.output_until(cell, "napping", timeout=120)
    seen += kernel.output_until(cell, "napping", timeout=30) if seen.count("napping") < 2 else ""
    interrupted = time.monotonic()
    kernel.manager.interrupt_kernel()
    rest, reply = kernel.finish(cell, timeout=60)
    took = time.monotonic() - interrupted
    print(f"interrupt to KeyboardInterrupt in the cell: {took:.2f}s")
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", rest
    assert took < 10, took  # the target is 3 s; generous under a loaded test machine
    # nap() had run (its line is above): each rank was interrupted while running it, not starting
    assert "interrupted while starting" not in rest and "rank 0 interrupted " in rest, rest
    assert_gone(pids_in(seen + rest))

    text, reply = kernel.run(DEFINE)  # the kernel is still usable: the next launch works
    assert "VALUES [(0, 42), (1, 42)]" in text, text
    # A launch from a background thread: its ranks' lines reach the notebook too (ipykernel shows a
    # thread's output in the cell running when it comes, here the one that joins the thread).
    text, reply = kernel.run(IN_A_THREAD)
    joined, reply = kernel.run("thread.join()")
    assert reply["status"] == "ok" and "[rank 1] hello from rank 1 in a thread" in text + joined, (
        text + joined
    )
    # Six launches, a failure, an interrupt (which replaced the launcher) and one from a thread among
    # them: no thread or descriptor left over: as many threads, and descriptors of the same kinds (a
    # pipe's inode and number are new with the new launcher; IPython's history journal comes and goes).
    # ipykernel itself holds a socket per thread that printed, closed within 10 s of the thread's end
    # (IOPubThread._event_pipe_gc): waited for, bounded.
    deadline = time.monotonic() + 30
    after, _ = kernel.run(STATE)
    while kinds_of(after) != kinds_of(before) and time.monotonic() < deadline:
        time.sleep(1)
        after, _ = kernel.run(STATE)
    assert kinds_of(after) == kinds_of(before), (before, after)


BACKGROUND = """
import os, threading, time
import multigpu

def nap():
    with open(f"pid_{os.environ['RANK']}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)

threading.Thread(target=multigpu.launch, args=(nap,), kwargs={"nprocs": 2, "device": "cpu"}).start()
"""


def test_kernel_shutdown_leaves_nothing(kernel: Kernel, tmp_path: Path) -> None:
    text, reply = kernel.run(BACKGROUND)
    assert reply["status"] == "ok", text
    files = [tmp_path / "pid_0", tmp_path / "pid_1"]
    deadline = time.monotonic() + 120
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    import psutil

    started = [p.pid for p in psutil.Process(kernel.pid).children(recursive=True)]
    ranks = [int(f.read_text()) for f in files]
    assert started
    kernel.shutdown()
    assert_gone([*ranks, *started, kernel.pid], timeout=10)


MANAGER = """
import os, multigpu

def train():
    import torch, torch.distributed as dist
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print("SUM", t.item(), "rank", dist.get_rank(), flush=True)

manager = multigpu.MultiGPUManager(train, "0,1", device="cpu")
manager.setup_multi_gpu_train(os.path.abspath("manager_out"))
train()
manager.finalize()
"""


def test_multigpu_manager_ships_a_cell_function_by_value(kernel: Kernel) -> None:
    """OTX's API from a notebook: the child rank gets ``train`` by value, not by a name it cannot find."""
    text, reply = kernel.run(MANAGER)
    assert reply["status"] == "ok", text
    assert "SUM 3.0 rank 0" in text, text  # 1 + 2: rank 1, the child, took part in the all_reduce
    assert "Can't get attribute" not in text
