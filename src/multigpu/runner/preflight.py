"""``--preflight``: every node checked once the nodes met, before any rank starts; a node far slower
than the others is named on every node, with its figures beside theirs.

Runs in the launcher. The check itself runs in a process of its own (``preflight/check.py``), forked
from the node's template where one serves (torch is imported there: the fork costs milliseconds, where
a fresh interpreter importing torch costs seconds) and never inside the template, which must stay free
of threads to fork. Each node's check prints every node's figures (they gathered them), so every
launcher reaches the same verdict here, from the same numbers: a warning (``on``), or a refusal with
``EXIT_PREFLIGHT`` (``strict``). A check that fails (a node died during it) ends the run as a failed
rendezvous does, with one line; its process is ended and reaped whatever happens.

Here: when a meeting is checked, and what follows from the check. Its parts: the task and result on
the wire (``contract/preflight_wire.py``), the verdict (``preflight_verdict``), the check's process
(``preflight_child``) and the other nodes' launchers watched meanwhile (``preflight_peers``). Its lines
go to this module's logger (the run's console).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from multigpu.contract.errors import PreflightRefused, PreflightWithdrew, RendezvousError
from multigpu.contract.failure import PEER_LOST_MARKERS
from multigpu.contract.preflight_wire import Figures, PreflightResult, PreflightTask
from multigpu.record.run_json import RunRecord
from multigpu.rendezvous.job import JobStore
from multigpu.runner import preflight_child
from multigpu.runner.membership import Meeting
from multigpu.runner.preflight_peers import BEAT_S, LOST_AFTER_S, START_S, NodeLost, PeerBeats
from multigpu.runner.preflight_verdict import leavers, record_entry, slow_line, slow_nodes, verdict_lines
from multigpu.supervisor.spawning import PopenSpawner, Spawner
from multigpu.supervisor.states import ProcessHandle

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 60.0
"""The check's own bound on every wait (its store, its peers, each collective); the launcher's bound
adds ``START_S`` (``preflight_peers``): a plain check process imports torch first."""


def one_machine(job: JobStore) -> bool:
    """Every node that joined published the same machine in its fingerprint (``fingerprint.machine_id``)."""
    machines = {p.get("machine") for p in job.fingerprints().values()}
    return len(machines) == 1 and None not in machines


def task_for(meeting: Meeting) -> PreflightTask:
    """What this node's check is asked: the meeting's store and layout, its keys under the round's."""
    config, job = meeting.config, meeting.job
    assert job is not None
    return PreflightTask(
        host=meeting.master_addr,
        port=meeting.master_port,
        prefix=job.key("preflight", meeting.attempt),
        node=config.group_rank,
        nodes=config.group_world_size,
        device="cuda:0" if config.device == "cuda" else "cpu",
        timeout_s=CHECK_TIMEOUT_S,
        launcher=os.getpid(),
    )


def parse_result(out: bytes) -> PreflightResult:
    """The check's result: its last line on stdout (anything it printed before is not ours)."""
    return PreflightResult.decode(out.decode().strip().splitlines()[-1])


@dataclass
class Preflight:
    """This node's preflight for the whole run: which meetings are checked, and how."""

    mode: str
    """``on``, ``strict`` or ``off`` (``RunConfig.preflight_mode``)."""
    env: Mapping[str, str]
    """The check's environment (the ranks' base, one thread; the GPUs the ranks see)."""
    record: RunRecord
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
        started = time.monotonic()
        beats = PeerBeats(job, meeting.attempt, config.group_world_size, config.group_rank)
        beats.poll()  # the first beat before the fork: a node killed from here on is silent, not absent
        result = self._run(task_for(meeting), spawner or PopenSpawner(), beats)
        if result is None:  # an elastic round lost a node during the check: a new round forms without it
            return False
        figures, seconds = result.figures, time.monotonic() - started
        slow = slow_nodes(figures)
        leaving = self.withdrawing(meeting, slow)
        self.record.note_preflight(record_entry(figures, seconds, self.mode, withdrawn=leaving))
        if leaving:
            return self._withdraw(figures, leaving, config.group_rank)
        lines, refusal = verdict_lines(figures, seconds, self.mode)
        for line in lines:  # a slow node run with anyway is a warning, a healthy check news
            log.log(logging.WARNING if slow else logging.INFO, line)
        if refusal is not None:
            raise PreflightRefused(f"preflight: {refusal}")
        return True

    def withdrawing(self, meeting: Meeting, slow: list[int]) -> list[int]:
        """The slow nodes that leave an elastic round themselves (``preflight_verdict.leavers``): none
        in a static job. Every node of the round comes to the same list, from the same figures."""
        if not self.every_round or not slow or meeting.job is None:
            return []
        config = meeting.config
        return leavers(slow, config.group_world_size, config.rdzv.min_nodes or 1, meeting.job.store_host)

    def _withdraw(self, figures: Sequence[Figures], leaving: list[int], me: int) -> bool:
        """This node leaves the job (raised), or says who leaves and meets again without them."""
        named = "; ".join(slow_line(figures, node) for node in leaving)
        left = len(figures) - len(leaving)
        if me in leaving:
            raise PreflightWithdrew(
                f"preflight: {named}; node {me} (this one) leaves the job, which goes on with {left} node(s)"
            )
        log.warning(f"preflight: {named}; it leaves the job: a new round with {left} node(s)")
        return False

    def _run(self, task: PreflightTask, spawner: Spawner, beats: PeerBeats) -> PreflightResult | None:
        """The check's result; else (it failed, timed out, or a node was lost) one line, raised. None:
        an elastic round lost a node (said here), which a new round leaves out, as after a lost node
        during an attempt."""
        outcome, lost = self._outcome(preflight_child.start(task, self.env, spawner), beats)
        if isinstance(outcome, PreflightResult):
            return outcome
        why = outcome
        self.record.note_preflight({"mode": self.mode, "verdict": "failed", "error": why})
        if lost is not None and self.every_round:
            log.warning(f"preflight: {lost}; meeting again without it")
            return None
        raise RendezvousError(f"preflight: {why}; no rank was started (--no-preflight skips the check)")

    def _outcome(self, handle: ProcessHandle, beats: PeerBeats) -> tuple[PreflightResult | str, str | None]:
        """(the check's result, or why it gave none; the lost node's line, if a node was lost), the
        check's process ended and reaped whatever happened."""
        lost = None
        try:
            deadline = time.monotonic() + CHECK_TIMEOUT_S + START_S
            out, err = preflight_child.collect(handle, deadline, beats.poll)
            code = handle.wait(timeout=5.0)
        except (TimeoutError, subprocess.TimeoutExpired):
            return f"the check gave no result within {CHECK_TIMEOUT_S + START_S:g}s", None
        except NodeLost as exc:
            return str(exc), str(exc)
        finally:
            preflight_child.end(handle)
        if code == 0:
            with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
                return parse_result(out), None
        line = (err.decode(errors="replace").strip().splitlines() or [f"it exited with code {code}"])[-1]
        if any(marker in line for marker in PEER_LOST_MARKERS):  # a peer's end: which node was lost?
            lost = beats.name_lost(LOST_AFTER_S + 2 * BEAT_S)
        return lost or f"the check failed on node {beats.me}: {line}", lost


def check_env(base_env: Mapping[str, str], extra: Mapping[str, str], cvd: str | None) -> dict[str, str]:
    """The check's environment: the ranks' (so a GPU check sees their GPUs), with one CPU thread (a
    node's figure is one core's, comparable across nodes whatever their core counts)."""
    env = {**base_env, **extra, "OMP_NUM_THREADS": "1"}
    if cvd is not None:
        env["CUDA_VISIBLE_DEVICES"] = cvd
    return env
