"""A slow link named while the job runs (issue 41, case 3): the namespace cluster of ``test_network.py``
(a store host S and training hosts A, B, C on one bridge) with every frame B sends held 100 ms. Every
launcher says, in one line and the same line, that B's link is slow, before its job ends; the job
completes on every node and nothing is left. Bounded: the case ends within a minute or two.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.multinode.test_network import Job, _build, stop_store

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.matrix, pytest.mark.timeout(240)]


@pytest.fixture
def slow_b(tmp_path: Path) -> Iterator[Job]:
    """The cluster with B's link 100 ms slow (a TAP relay holds each frame B sends)."""
    yield from _build(tmp_path, {"B": 0.1})


def said(job: Job, name: str, text: str) -> list[str]:
    path = job.folder / f"{name}.err"
    err = path.read_text() if path.exists() else ""
    return [line for line in err.splitlines() if text in line]


def test_a_slow_link_is_named_on_every_node_while_the_job_runs(slow_b: Job) -> None:
    slow_b.train("ABC", steps=100)
    began = time.monotonic()
    deadline = began + 150
    while time.monotonic() < deadline:
        lines = {name: said(slow_b, name, "slow link") for name in "ABC"}
        if all(lines.values()) or any(slow_b.launchers[n].poll() is not None for n in "ABC"):
            break
        time.sleep(0.2)
    named_after, named_at = time.monotonic() - began, time.time()
    running = {name: slow_b.launchers[name].poll() is None for name in "ABC"}
    codes = {name: slow_b.ended(name, timeout=150) for name in "ABC"}
    errs = {name: slow_b.err(name)[-2500:] for name in "ABC"}
    b_steps = [t for t, _ in slow_b.steps("B")]
    print(
        f"named on every node {named_after:.1f}s after the launchers started, "
        f"{named_at - b_steps[0]:.1f}s after B's first step, {b_steps[-1] - named_at:.1f}s before its last"
    )
    assert all(lines.values()) and running == {"A": True, "B": True, "C": True}, errs
    assert codes == {"A": 0, "B": 0, "C": 0}, errs
    assert named_at < b_steps[-1], "named while B trains"
    lines = {name: said(slow_b, name, "slow link") for name in "ABC"}
    assert all(len(found) == 1 for found in lines.values()) and len(set(map(tuple, lines.values()))) == 1, (
        lines
    )
    b = slow_b.net.hosts["B"].addr
    found = re.search(
        rf"\({re.escape(b)}\) has a slow link: its round trips to the job's store take (\d+) ms ",
        lines["A"][0],
    )
    assert found and int(found.group(1)) >= 90, lines["A"][0]  # 100-400 ms: TCP's delayed acks add to it
    assert all(not said(slow_b, name, " is slow:") for name in "ABC"), errs
    stop_store(slow_b)
    assert slow_b.net.running() == {}
