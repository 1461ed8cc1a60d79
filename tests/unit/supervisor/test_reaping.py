"""Which of the launcher's descendants its sweep ends (``reaping.started_by_ranks``): what its ranks
started, found by session, ancestry or the launcher's mark, and never a process it was only given.

The test process plays the launcher: its children are a "rank" (a shell leading its own session,
with a child in its session and one that left it), a process carrying the launcher's mark in its
environment (a rank's daemon, re-parented here), and a foreign child (a ``tee`` a shell handed over).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import psutil
import pytest

from helpers import alive, assert_gone
from multigpu.contract.names import LAUNCHER_PID_ENV
from multigpu.supervisor import reaping


def sleeper(env: dict[str, str] | None = None, new_session: bool = True) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "30"], env=env, start_new_session=new_session)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The processes a test started; each, and what the "rank" started, killed by PID at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for pid in GRANDCHILDREN:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    GRANDCHILDREN.clear()
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def rank_with_children(procs: list[subprocess.Popen[bytes]]) -> tuple[int, list[int]]:
    """A "rank" leading its own session, with one child in its session and one that left it."""
    rank = subprocess.Popen(
        ["bash", "-c", "sleep 30 & setsid sleep 30 & wait"],
        env={"PATH": os.environ["PATH"]},
        start_new_session=True,
    )
    procs.append(rank)
    deadline = time.monotonic() + 10
    while len(children := psutil.Process(rank.pid).children()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    GRANDCHILDREN.extend(c.pid for c in children)
    return rank.pid, [c.pid for c in children]


GRANDCHILDREN: list[int] = []


def test_the_ranks_descendants_and_marked_processes_only(started: list[subprocess.Popen[bytes]]) -> None:
    foreign = sleeper({"PATH": os.environ["PATH"]}, new_session=False)  # the tee: our group, no mark
    marked = sleeper({"PATH": os.environ["PATH"], LAUNCHER_PID_ENV: str(os.getpid())})
    other_launcher = sleeper({"PATH": os.environ["PATH"], LAUNCHER_PID_ENV: "1"})
    started += [foreign, marked, other_launcher]
    rank, descendants = rank_with_children(started)
    taken = {p.pid for p in reaping.started_by_ranks({rank})}
    ours = {foreign.pid, marked.pid, other_launcher.pid, rank, *descendants}
    assert taken & ours == {marked.pid, *descendants}
    assert not {p.pid for p in reaping.started_by_ranks({rank}, frozenset({marked.pid}))} & {marked.pid}


def test_the_sweep_kills_what_the_ranks_started_and_nothing_else(
    started: list[subprocess.Popen[bytes]],
) -> None:
    foreign = sleeper({"PATH": os.environ["PATH"]}, new_session=False)
    marked = sleeper({"PATH": os.environ["PATH"], LAUNCHER_PID_ENV: str(os.getpid())})
    started += [foreign, marked]
    rank, descendants = rank_with_children(started)
    reaping.kill_escaped([_Worker(rank)])  # type: ignore[list-item]
    assert marked.wait(timeout=5) == -signal.SIGKILL
    assert_gone(descendants, timeout=5.0)
    assert alive(foreign.pid)  # the foreign one lives; the bash "rank" ended as its children did


class _Worker:
    def __init__(self, pid: int) -> None:
        self.pid = pid
