"""``--preflight``: every node checked once the nodes met, before any rank starts; a node far slower
than the others is named on every node, with its figures beside theirs.

Runs in the launcher. The check itself runs in a process of its own (``preflight/check.py``), forked
from the node's template where one serves (torch is imported there: the fork costs milliseconds, where
a fresh interpreter importing torch costs seconds) and never inside the template, which must stay free
of threads to fork. Each node's check prints every node's figures (they gathered them), so every
launcher reaches the same verdict here, from the same numbers: a warning (``on``), or a refusal with
``EXIT_PREFLIGHT`` (``strict``). A check that fails (a node died during it) ends the run as a failed
rendezvous does, with one line; its process is ended and reaped whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from multigpu.contract.errors import PreflightRefused, PreflightWithdrew, RendezvousError
from multigpu.contract.failure import PEER_LOST_MARKERS
from multigpu.record.run_json import RunRecord
from multigpu.rendezvous.job import JobStore
from multigpu.rendezvous.latency import BeatWatch
from multigpu.runner.membership import Meeting
from multigpu.supervisor.spawning import PopenSpawner, Spawner
from multigpu.supervisor.states import ProcessHandle, WorkerSpec
from multigpu.template.client import PREFLIGHT_MODULE

SLOW_BELOW = 0.5
"""A node whose figure is under this share of the median of the other nodes' is slow (one threshold,
for both figures): far outside the noise of a healthy node, well inside a throttled or shared one."""

CHECK_TIMEOUT_S = 60.0
"""The check's own bound on every wait (its store, its peers, each collective)."""
START_S = 30.0
"""Added to ``CHECK_TIMEOUT_S`` for the launcher's bound: a plain check process imports torch first.
Also how long a node may take to begin its check."""
BEAT_S = 0.5
LOST_AFTER_S = 10.0
"""A node whose launcher's beats stop this long during the check is lost (``PeerBeats``)."""


def one_machine(job: JobStore) -> bool:
    """Every node that joined published the same machine in its fingerprint (``fingerprint.machine_id``)."""
    machines = {p.get("machine") for p in job.fingerprints().values()}
    return len(machines) == 1 and None not in machines


@dataclass(frozen=True)
class Figures:
    """One node's results."""

    matmul_gflops: float
    all_reduce_gbps: float


METRICS = (("matmul", "matmul_gflops", "GFLOP/s"), ("all_reduce", "all_reduce_gbps", "GB/s"))
"""(what the line calls it, the field, its unit), in the line's order."""


def others_median(figures: Sequence[Figures], node: int, field: str) -> float:
    return statistics.median(float(getattr(f, field)) for n, f in enumerate(figures) if n != node)


def slow_nodes(figures: Sequence[Figures]) -> list[int]:
    """The nodes whose matmul is under ``SLOW_BELOW`` x the median of the others' (none alone).

    The all_reduce figure names no node: each node times the same collective, and the time it sees
    includes its wait for the others, so a slow node, arriving last, sees the shortest time and the
    healthy ones the longest (two nodes here, one throttled: 1.16 GB/s on the slow node, 0.139 on the
    healthy one). It is the job's figure (``job_all_reduce``)."""
    if len(figures) < 2:
        return []
    field = "matmul_gflops"
    return [
        n
        for n, mine in enumerate(figures)
        if mine.matmul_gflops < SLOW_BELOW * others_median(figures, n, field)
    ]


def job_all_reduce(figures: Sequence[Figures]) -> float:
    """The nodes' all_reduce as the job sees it: the longest any node waited for it (lowest GB/s)."""
    return min(f.all_reduce_gbps for f in figures)


def slow_line(figures: Sequence[Figures], node: int) -> str:
    """``node 1 is slow: matmul 0.9 GFLOP/s (others 14.2); all_reduce 0.3 GB/s between the nodes``."""
    mine, others = figures[node].matmul_gflops, others_median(figures, node, "matmul_gflops")
    return (
        f"node {node} is slow: matmul {mine:.3g} GFLOP/s (others {others:.3g}); "
        f"all_reduce {job_all_reduce(figures):.3g} GB/s between the nodes"
    )


def healthy_line(figures: Sequence[Figures], seconds: float) -> str:
    """The one line of a healthy check: the median figures and how long it took."""
    parts = [
        f"{name} {statistics.median(getattr(x, f) for x in figures):.3g} {unit}" for name, f, unit in METRICS
    ]
    return f"every node healthy ({len(figures)} nodes, {seconds:.1f}s): {', '.join(parts)} (medians)"


def verdict_lines(figures: Sequence[Figures], seconds: float, mode: str) -> tuple[list[str], str | None]:
    """(the console's lines, the refusal's text or None): every node comes to the same."""
    slow = slow_nodes(figures)
    if not slow:
        return [f"preflight: {healthy_line(figures, seconds)}"], None
    named = [slow_line(figures, node) for node in slow]
    if mode == "strict":
        return [], f"{'; '.join(named)}; every node refuses the job (--preflight=strict)"
    return [f"preflight: {line}; running anyway (--preflight=strict refuses)" for line in named], None


def record_entry(
    figures: Sequence[Figures], seconds: float, mode: str, withdrawn: Sequence[int] = ()
) -> dict[str, Any]:
    """run.json's ``preflight`` (``withdrawn``: the slow nodes that left an elastic round)."""
    slow = slow_nodes(figures)
    verdict = "withdrawn" if withdrawn else "refused" if mode == "strict" else "slow"
    return {
        "mode": mode,
        "verdict": verdict if slow else "healthy",
        "slow_nodes": slow,
        "seconds": round(seconds, 3),
        "nodes": {
            str(n): {"matmul_gflops": f.matmul_gflops, "all_reduce_gbps": f.all_reduce_gbps}
            for n, f in enumerate(figures)
        },
        "slow_below": SLOW_BELOW,
    }


def parse_result(out: bytes) -> tuple[list[Figures], float]:
    """The check's JSON line: every node's figures, by node rank, and the check's own seconds."""
    data = json.loads(out.decode().strip().splitlines()[-1])
    return [Figures(*row[:2]) for row in data["figures"]], float(data["seconds"])


class NodeLost(Exception):
    """A node's launcher stopped beating during the check (its text says which, and for how long)."""


class PeerBeats:
    """Every launcher beats while its check runs and watches the other nodes' counters, so a node whose
    launcher died is named within ``LOST_AFTER_S``, not at the check's own time-out. Runs in the
    launcher's main thread, between reads of the check's pipes: one ``add`` and one ``check`` (then one
    ``multi_get``) per ``BEAT_S``, under the round's keys."""

    def __init__(self, job: JobStore, scope: object, nodes: int, me: int) -> None:
        self._store, self.me = job.store, me
        self._keys = [job.key("preflight", scope, "beat", n) for n in range(nodes)]
        self._watch = BeatWatch(time.monotonic)
        self._started = self._next = time.monotonic()

    def poll(self) -> None:
        """Beat when due, and raise ``NodeLost`` for a node silent too long (or never started)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + BEAT_S
        self._store.add(self._keys[self.me], 1)
        if not self._store.check(self._keys):  # a node has not begun its check yet
            if now - self._started > START_S:
                missing = next(n for n, key in enumerate(self._keys) if not self._store.check([key]))
                raise NodeLost(f"node {missing} never began the check within {START_S:g}s")
            return
        counts = dict(enumerate(int(value) for value in self._store.multi_get(self._keys)))
        del counts[self.me]
        silent = self._watch.silent(counts, LOST_AFTER_S)
        if silent is not None:
            raise NodeLost(
                f"node {silent[0]} was lost during the check: its launcher stopped beating for "
                f"{silent[1]:.1f}s (killed, or its network is down)"
            )

    def name_lost(self, within: float) -> str | None:
        """Keep beating for up to ``within`` seconds: the lost node's line, or None if none shows."""
        deadline = time.monotonic() + within
        try:
            while time.monotonic() < deadline:
                self.poll()
                time.sleep(BEAT_S / 5)
        except NodeLost as lost:
            return str(lost)
        return None


def collect(
    handle: ProcessHandle, deadline: float, tick: Callable[[], None] = lambda: None
) -> tuple[bytes, bytes]:
    """The check's stdout and stderr, read to their ends (both: neither pipe may fill and stall it);
    TimeoutError at ``deadline``; ``tick`` called at least every ``BEAT_S`` meanwhile."""
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
            for key, _ in selector.select(min(left, BEAT_S)):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.data].append(data)
                else:
                    selector.unregister(key.fileobj)
    return b"".join(chunks["out"]), b"".join(chunks["err"])


def end(handle: ProcessHandle) -> None:
    """The check's process group killed (it started its own session) and the process reaped; its pipes
    closed. Safe on a process that ended already."""
    if handle.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(handle.pid, signal.SIGKILL)
    handle.wait()
    for pipe in (handle.stdout, handle.stderr):
        if pipe is not None:
            pipe.close()


@dataclass
class Preflight:
    """This node's preflight for the whole run: which meetings are checked, and how."""

    mode: str
    """``on``, ``strict`` or ``off`` (``RunConfig.preflight_mode``)."""
    env: Mapping[str, str]
    """The check's environment (the ranks' base, one thread; the GPUs the ranks see)."""
    record: RunRecord
    say: Callable[[str], None]
    every_round: bool = False
    """An elastic job: every round is checked (a node may have joined it), else only the first meeting.
    Every node of a round must come to the same answer, or a check would wait for a peer that skips it."""
    auto: bool = False
    """``--preflight`` not given: nodes that all run on one machine are not checked (``due``)."""
    done: bool = False

    def due(self, meeting: Meeting) -> bool:
        """A job of several nodes: its first meeting, or each round of an elastic job (of several). By
        default not nodes that all run on one machine (tests, a trial on a workstation): they share its
        processors, so their figures compare nothing, and on a busy machine could name a healthy node
        slow. Every node reads the same fingerprints (published at the join), so all decide alike."""
        if self.mode == "off" or meeting.job is None or meeting.config.group_world_size < 2:
            return False
        if self.auto and one_machine(meeting.job):
            return False
        return self.every_round or not self.done

    def check(self, meeting: Meeting, spawner: Spawner | None) -> bool:
        """Run this node's check, record it, say the verdict; raise on a refusal or a failed check, or
        where this node withdraws. False: a slow node withdrew from the round, meet again without it."""
        self.done = True
        config, job = meeting.config, meeting.job
        assert job is not None
        task = {
            "host": meeting.master_addr,
            "port": meeting.master_port,
            "prefix": job.key("preflight", meeting.attempt),
            "node": config.group_rank,
            "nodes": config.group_world_size,
            "device": "cuda:0" if config.device == "cuda" else "cpu",
            "timeout_s": CHECK_TIMEOUT_S,
            "launcher": os.getpid(),
        }
        started = time.monotonic()
        beats = PeerBeats(job, meeting.attempt, config.group_world_size, config.group_rank)
        beats.poll()  # the first beat before the fork: a node killed from here on is silent, not absent
        result = self._run(json.dumps(task), spawner or PopenSpawner(), beats)
        if result is None:  # an elastic round lost a node during the check: a new round forms without it
            return False
        figures, _ = result
        seconds = time.monotonic() - started
        leaving = self.withdrawing(meeting, slow_nodes(figures))
        self.record.note_preflight(record_entry(figures, seconds, self.mode, withdrawn=leaving))
        if leaving:
            return self._withdraw(figures, leaving, config.group_rank)
        lines, refusal = verdict_lines(figures, seconds, self.mode)
        for line in lines:
            self.say(line)
        if refusal is not None:
            raise PreflightRefused(f"preflight: {refusal}")
        return True

    def withdrawing(self, meeting: Meeting, slow: list[int]) -> list[int]:
        """The slow nodes that leave an elastic round themselves (torch's rendezvous cannot exclude
        another node): where the nodes left are enough (``--nnodes MIN:``) and none of the slow serves
        the job's store. Every node of the round comes to the same list, from the same figures."""
        if not self.every_round or not slow or meeting.job is None:
            return []
        config = meeting.config
        enough = config.group_world_size - len(slow) >= (config.rdzv.min_nodes or 1)
        return slow if enough and meeting.job.store_host not in slow else []

    def _withdraw(self, figures: Sequence[Figures], leaving: list[int], me: int) -> bool:
        """This node leaves the job (raised), or says who leaves and meets again without them."""
        named = "; ".join(slow_line(figures, node) for node in leaving)
        left = len(figures) - len(leaving)
        if me in leaving:
            raise PreflightWithdrew(
                f"preflight: {named}; node {me} (this one) leaves the job, which goes on with {left} node(s)"
            )
        self.say(f"preflight: {named}; it leaves the job: a new round with {left} node(s)")
        return False

    def _run(self, task: str, spawner: Spawner, beats: PeerBeats) -> tuple[list[Figures], float] | None:
        """The check's figures; else (it failed, timed out, or a node was lost) one line, raised. None:
        an elastic round lost a node (said here), which a new round leaves out, as after a lost node
        during an attempt."""
        argv = [sys.executable, "-m", PREFLIGHT_MODULE, task]
        spec = WorkerSpec(rank=-1, local_rank=-1, argv=argv, env=dict(self.env), cwd=os.getcwd())
        handle, lost = spawner.spawn(spec, dict(self.env), ()), None
        try:
            out, err = collect(handle, time.monotonic() + CHECK_TIMEOUT_S + START_S, beats.poll)
            code = handle.wait(timeout=5.0)
        except (TimeoutError, subprocess.TimeoutExpired):
            why = f"the check gave no result within {CHECK_TIMEOUT_S + START_S:g}s"
        except NodeLost as exc:
            why = lost = str(exc)
        else:
            if code == 0:
                with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
                    return parse_result(out)
            line = (err.decode(errors="replace").strip().splitlines() or [f"it exited with code {code}"])[-1]
            why = f"the check failed on node {beats.me}: {line}"
            if any(marker in line for marker in PEER_LOST_MARKERS):  # a peer's end: which node was lost?
                lost = beats.name_lost(LOST_AFTER_S + 2 * BEAT_S)
            why = lost or why
        finally:
            end(handle)
        self.record.note_preflight({"mode": self.mode, "verdict": "failed", "error": why})
        if lost is not None and self.every_round:
            self.say(f"preflight: {lost}; meeting again without it")
            return None
        raise RendezvousError(f"preflight: {why}; no rank was started (--no-preflight skips the check)")


def check_env(base_env: Mapping[str, str], extra: Mapping[str, str], cvd: str | None) -> dict[str, str]:
    """The check's environment: the ranks' (so a GPU check sees their GPUs), with one CPU thread (a
    node's figure is one core's, comparable across nodes whatever their core counts)."""
    env = {**base_env, **extra, "OMP_NUM_THREADS": "1"}
    if cvd is not None:
        env["CUDA_VISIBLE_DEVICES"] = cvd
    return env
