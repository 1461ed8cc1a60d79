"""The preflight check's process as the launcher sees it: started through the node's spawner (forked from
its template where one serves), both its pipes read to their ends within one deadline, and ended as a
rank is: SIGTERM to its process group, one deadline, SIGKILL for what is left, reaped
(``supervisor/teardown.py``'s steps, on the check as a one-process worker).

Runs in the launcher's main thread (``runner/preflight.py``).
"""

from __future__ import annotations

import os
import selectors
import signal
import sys
import time
from collections.abc import Callable, Mapping

from multigpu.contract.preflight_wire import PreflightTask
from multigpu.supervisor import teardown
from multigpu.supervisor.settings import SupervisorOptions
from multigpu.supervisor.spawning import Spawner
from multigpu.supervisor.states import ProcessHandle, Worker, WorkerSpec, WorkerState
from multigpu.template.client import PREFLIGHT_MODULE

TICK_S = 0.5
"""The longest a read of the check's pipes waits before ``collect`` calls its ``tick`` again."""
END_GRACE_S = 1.0
"""From the check's SIGTERM to SIGKILL: it holds nothing to save (no file, no rank), and SIGTERM's
default action ends it even inside a collective; only a process stuck in the kernel outlasts it."""
END_POLL_S = 0.005


def start(task: PreflightTask, env: Mapping[str, str], spawner: Spawner) -> ProcessHandle:
    """``python -m multigpu.preflight TASK`` in its own session (the spawner's), its pipes ours."""
    argv = [sys.executable, "-m", PREFLIGHT_MODULE, task.encode()]
    spec = WorkerSpec(rank=-1, local_rank=-1, argv=argv, env=dict(env), cwd=os.getcwd())
    return spawner.spawn(spec, dict(env), ())


def collect(
    handle: ProcessHandle, deadline: float, tick: Callable[[], None] = lambda: None
) -> tuple[bytes, bytes]:
    """The check's stdout and stderr, read to their ends (both: neither pipe may fill and stall it);
    TimeoutError at ``deadline``; ``tick`` called at least every ``TICK_S`` meanwhile."""
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}
    with selectors.DefaultSelector() as selector:
        for name, pipe in (("out", handle.stdout), ("err", handle.stderr)):
            if pipe is not None:
                selector.register(pipe, selectors.EVENT_READ, name)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            tick()
            for key, _ in selector.select(min(left, TICK_S)):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.data].append(data)
                else:
                    selector.unregister(key.fileobj)
    return b"".join(chunks["out"]), b"".join(chunks["err"])


def end(handle: ProcessHandle, grace: float = END_GRACE_S) -> None:
    """The check ended as the ranks are at teardown: SIGTERM to its process group (it leads its own),
    ``grace`` for the group to empty, SIGKILL for what is left (said, if the check itself is), the
    check reaped within ``reaping.KILL_WAIT_S``; its pipes closed. A group already empty (the check
    ended and took its children with it) is never signalled. Safe on a process that ended already."""
    check = Worker(
        WorkerSpec(rank=-1, local_rank=-1, argv=[], env={}, title="the preflight check"), popen=handle
    )
    check.to(WorkerState.RUNNING)
    check.returncode = handle.poll()  # reaped already: its group is signalled only if it still has members
    try:
        teardown.signal_groups([check], signal.SIGTERM)
        deadline = time.monotonic() + grace
        while True:
            check.returncode = handle.poll()
            if teardown.all_gone([check]) or time.monotonic() >= deadline:
                break
            time.sleep(END_POLL_S)
        why = f"{grace:g}s after SIGTERM"
        teardown.kill_rest([check], why, SupervisorOptions(), frozenset)
    finally:
        for pipe in (handle.stdout, handle.stderr):
            if pipe is not None:
                pipe.close()
