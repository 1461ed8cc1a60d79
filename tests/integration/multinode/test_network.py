"""An elastic job on a virtual network (``netns_cluster``): a store host S (``multigpu store``) and
three training hosts A, B, C on one bridge, and the faults a real network has (issue 41): a link cut,
a link that flaps, a slow link, a lossy one. Each case is bounded, and leaves nothing: no process in
any namespace, and the namespaces, links, filters and relays removed by the fixture.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import MULTIGPU, clean_env, tier_cannot_run, write_script
from netns_cluster import TRAIN, NetnsCluster, available

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.matrix]

PORT = 29500


@dataclass
class Job:
    """The cluster, its store and its training launchers, and where each one writes."""

    net: NetnsCluster
    folder: Path
    launchers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def train(self, names: str, steps: int) -> None:
        script = write_script(self.folder, "train.py", TRAIN)
        store = self.net.hosts["S"]
        for name in names:
            host = self.net.hosts[name]
            argv = [
                *MULTIGPU, "run", "--cpu", "1", "--nnodes", "2:3", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{store.addr}:{PORT}", "--rdzv-conf", "is_host=false,last_call_timeout=1",
                "--max-restarts", "3", "--grace-period", "1", "--output", str(self.folder / f"out_{name}"),
                str(script),
            ]  # fmt: skip
            env = clean_env(
                {"GLOO_SOCKET_IFNAME": host.dev, "STEPS_LOG": str(self.steps_log(name)), "STEPS": str(steps)}
            )
            self.launchers[name] = self.net.start(name, argv, self.folder / name, env)

    def steps_log(self, name: str) -> Path:
        return self.folder / f"steps_{name}.txt"

    def steps(self, name: str) -> list[tuple[float, int]]:
        """(time, world size) of every step ``name``'s rank logged."""
        path = self.steps_log(name)
        text = path.read_text() if path.exists() else ""
        return [(float(t), int(w)) for t, w in re.findall(r"^(\S+) world=(\d+) ", text, re.M)]

    def err(self, name: str) -> str:
        return (self.folder / f"{name}.err").read_text()

    def wait_for(self, name: str, world: int, after: float, timeout: float) -> float | None:
        """When ``name``'s rank first logged a step of a round of ``world`` after ``after`` (wall
        clock), waiting at most ``timeout``; None if it did not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [t for t, w in self.steps(name) if w == world and t > after]
            if found:
                return found[0]
            time.sleep(0.1)
        return None

    def ended(self, name: str, timeout: float) -> int | None:
        """``name``'s launcher's exit code, waiting at most ``timeout``; None while it runs."""
        try:
            return self.launchers[name].wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def _build(folder: Path, delays: dict[str, float] | None = None) -> Iterator[Job]:
    """S serving the store, A, B and C ready to train (``delays``: a host's frames held that long);
    everything removed after the test, whatever happened."""
    why = available()
    if why is not None:
        tier_cannot_run(why)
    net = NetnsCluster(["S", "A", "B", "C"], delays)
    try:
        store = net.hosts["S"]
        net.start("S", [*MULTIGPU, "store", f"{store.addr}:{PORT}"], folder / "S", clean_env())
        yield Job(net, folder)
    finally:
        net.close()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    yield from _build(tmp_path)


@pytest.fixture
def slow_b(tmp_path: Path) -> Iterator[Job]:
    """The cluster with B's link 100 ms slow (each frame B sends is held that long: a TAP relay)."""
    yield from _build(tmp_path, {"B": 0.1})


def stop_store(job: Job) -> None:
    """End the store (SIGTERM: it says so and exits) once every launcher has."""
    store = job.net.procs[0]
    store.send_signal(signal.SIGTERM)
    store.wait(10)


def one_line(err: str, text: str) -> str:
    lines = [line for line in err.splitlines() if text in line]
    assert lines, err[-3000:]
    return lines[0]


def test_a_cut_link_is_a_round_of_2_for_the_others_and_the_end_for_the_cut_node(job: Job) -> None:
    """Case 1: B's link goes down (its launcher and rank live on). A and C train on in a round of 2
    within 15 s, naming B's node as lost in one line; B ends non-zero within 30 s saying it lost the
    job; when the link returns nothing hangs, and nothing is left."""
    job.train("ABC", steps=400)
    assert job.wait_for("A", 3, 0, timeout=60) is not None, job.err("A")[-3000:]
    time.sleep(1)  # a few steps in a round of 3
    job.net.link("B", up=False)
    cut, cut_mono = time.time(), time.monotonic()
    again = [job.wait_for(name, 2, cut, timeout=30) for name in "AC"]
    took_b = job.ended("B", timeout=max(0.0, 30 - (time.monotonic() - cut_mono)))
    b_after = time.monotonic() - cut_mono
    job.net.link("B", up=True)
    print(f"round of 2 on A, C after {[round((t or 99) - cut, 1) for t in again]}s; B ended {b_after:.1f}s")
    assert all(t is not None and t - cut < 15 for t in again), job.err("A")[-3000:]
    assert took_b is not None and took_b != 0, job.err("B")[-3000:]
    assert "this node lost the job" in one_line(job.err("B"), "lost the job"), job.err("B")[-3000:]
    b_pid = job.launchers["B"].pid
    for name in "AC":
        err = job.err(name)
        lost = rf"root cause: node \d was lost: its launcher \(host \S+, pid {b_pid}\) stopped"
        assert re.search(lost, err), err[-3000:]
        assert "Traceback" not in err and "C++" not in err and "Exception raised from" not in err
        assert job.ended(name, timeout=60) == 0, err[-3000:]
    stop_store(job)
    assert job.net.running() == {}


def test_a_flapping_link_ends_or_reforms_within_45s(job: Job) -> None:
    """Case 5: B down 2 s, up 2 s, three times: within 45 s of the last flap every launcher has ended
    or finished in a re-formed round, and nothing is left running."""
    job.train("ABC", steps=200)
    assert job.wait_for("A", 3, 0, timeout=60) is not None, job.err("A")[-3000:]
    back = job.net.flap("B", down_s=2, up_s=2, times=3)
    codes = {name: job.ended(name, timeout=max(0.0, 45 - (time.monotonic() - back))) for name in "ABC"}
    print(f"after the last flap: {codes}, {time.monotonic() - back:.1f}s")
    assert None not in codes.values(), {n: job.err(n)[-1500:] for n in "ABC"}
    assert codes["A"] == 0 and codes["C"] == 0, {n: job.err(n)[-1500:] for n in "AC"}
    stop_store(job)
    assert job.net.running() == {}


def test_a_slow_link_is_not_a_lost_node(slow_b: Job) -> None:
    """Case 3: 100 ms delay on B's link for the whole run: the job completes on every node; B is
    never declared lost."""
    slow_b.train("ABC", steps=100)
    codes = {name: slow_b.ended(name, timeout=120) for name in "ABC"}
    assert codes == {"A": 0, "B": 0, "C": 0}, {n: slow_b.err(n)[-2000:] for n in "ABC"}
    assert all("was lost" not in slow_b.err(n) for n in "ABC"), {n: slow_b.err(n)[-2000:] for n in "ABC"}
    stop_store(slow_b)
    assert slow_b.net.running() == {}


def test_a_lossy_link_is_not_a_lost_node(job: Job) -> None:
    """Case 2: 20% of the frames C sends lost for the whole run: the job completes on every node."""
    job.net.lose("C", 0.2)
    job.train("ABC", steps=100)
    codes = {name: job.ended(name, timeout=120) for name in "ABC"}
    assert codes == {"A": 0, "B": 0, "C": 0}, {n: job.err(n)[-2000:] for n in "ABC"}
    assert all("was lost" not in job.err(n) for n in "ABC"), {n: job.err(n)[-2000:] for n in "ABC"}
    stop_store(job)
    assert job.net.running() == {}


def test_a_store_cut_off_for_5s_is_ridden_out(job: Job) -> None:
    """Case 4: the store's link down 5 s, then up: the same ranks go on (their training never goes
    through the store), nobody is named lost, and the job completes on every node."""
    job.train("ABC", steps=300)
    assert job.wait_for("A", 3, 0, timeout=60) is not None, job.err("A")[-3000:]
    time.sleep(1)
    job.net.link("S", up=False)
    time.sleep(5)
    job.net.link("S", up=True)
    back = time.time()
    codes = {name: job.ended(name, timeout=90) for name in "ABC"}
    assert codes == {"A": 0, "B": 0, "C": 0}, {n: job.err(n)[-2000:] for n in "ABC"}
    assert all("was lost" not in job.err(n) for n in "ABC"), {n: job.err(n)[-2000:] for n in "ABC"}
    assert all(w == 3 for n in "ABC" for t, w in job.steps(n) if t > back), "the round of 3 went on"
    stop_store(job)
    assert job.net.running() == {}
