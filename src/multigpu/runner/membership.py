"""Who takes part in each attempt of a run, and where its ranks meet: the one interface the attempts loop
(``attempts.py``) runs every mode through, as torch elastic's agent runs one ``_invoke_run`` whatever its
rendezvous backend. So the crash-loop stop, preemption and requeue, the output claim, the incidents and
the run record are written once, in the loop, and hold in every mode. Runs in the launcher.

Two memberships:

* static (``StaticMembership``, here): one node, or a fixed set of nodes (``static_join.py`` over
  ``rendezvous/job.py``) that meets once at the start and again, all of them, before each restart;
* elastic (``ElasticMembership``, ``rounds.py``): torch's rendezvous rounds
  (``rendezvous/elastic.py``), where a node waiting to join ends a round without counting a restart.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from multigpu.config.endpoint import is_loopback_host
from multigpu.config.run import RunConfig
from multigpu.contract.failure import LEARNED_FROM_SILENCE
from multigpu.contract.names import debug_server_settings
from multigpu.record.folder import check_run_id
from multigpu.rendezvous.failure_sharing import finish_job
from multigpu.rendezvous.job import JobStore
from multigpu.rendezvous.store import bind_store_socket
from multigpu.runner.crash_loop import FailureMemory, LocalFailures
from multigpu.runner.static_join import LOOPBACK, Rendezvous, meet_again, node_spawner, rendezvous
from multigpu.supervisor.states import RunResult
from multigpu.template.client import NodeSpawner


@dataclass(frozen=True)
class Meeting:
    """One attempt's membership, as this node sees it."""

    attempt: int
    """The job-wide restart count: the attempt's log folder, ``TORCHELASTIC_RESTART_COUNT``, run.json's
    attempt. Elastic rounds ended by a joining node share it."""
    config: RunConfig
    """The run's config with this attempt's layout (node rank, base rank, world size)."""
    master_addr: str
    master_port: int
    job: JobStore | None = None
    """The attempt's fate-sharing keys (several nodes)."""


def debug_server_lines(config: RunConfig, rank0_here: bool | None) -> list[str]:
    """``--debug-server``'s opening lines: the page's address with this node's token where rank 0 is
    here (None: an elastic node, which cannot know yet), and a warning when it listens beyond
    loopback. Only this launcher knows its token; its ranks' servers and the page want it."""
    asked = debug_server_settings(config.extra_env)
    if config.start.debug_server is None or asked is None:
        return []
    host, _, token = asked
    address = f"http://{config.start.debug_server}/?token={token}"
    lines = (
        [f"debug server (torch's, rank 0's node): {address}"]
        if rank0_here
        else [f"debug server (torch's): {address} if rank 0 runs on this node"]
        if rank0_here is None
        else []
    )
    if not is_loopback_host(host):
        lines.append(
            f"warning: the debug server listens on {host}, not loopback: every host that "
            f"reaches it can try, and its token crosses the network unencrypted (HTTP)"
        )
    return lines


class Membership(Protocol):
    """What the attempts loop asks of a mode; see the module docstring."""

    run_id: str
    job: JobStore | None
    """Keys of the whole job, whatever the attempt (the preemption warning); None on one node."""
    serves_store: bool
    """This launcher serves the job's store: it leaves last, and requeues a preempted job."""
    spawner: NodeSpawner | None
    """Starts this node's ranks of every attempt (forked from the node's template)."""
    failures: FailureMemory
    """Where the crash-loop policy keeps each failed attempt's signature."""
    record_name: str
    """This node's run record in the output folder."""
    claim: int | str | None
    """This node's lock in the output folder (``rundir.claim_output``); None: the run's alone."""

    def opening(self, output_dir: Path) -> list[str]:
        """The run's first console lines."""

    def meet(self) -> Meeting:
        """The next attempt's members and layout (blocks until they met); drops the last attempt's
        workers' store."""

    def can_meet_again(self, result: RunResult) -> bool:
        """Whether the members can meet again after this failed attempt (restarts left or not)."""

    def restart(self, meeting: Meeting) -> str:
        """Count ``meeting``'s failure as a restart (once, job-wide); the line that says so."""

    def leave(self, *, over: bool) -> None:
        """The last act with the job's store, unless a Ctrl-C ended the run (then it leaves at once);
        ``over``: the job is over for every node, not only for this one."""
        ...

    def close(self, *, over: bool) -> None:
        """Release what the run held; ``over``: the job is over for every node."""


class StaticMembership:
    """One node, or a fixed set: met once by ``meeting.rendezvous``, and again by ``meet_again``."""

    def __init__(self, config: RunConfig, base_env: Mapping[str, str]) -> None:
        """Bind the store's socket (node 0), start the node's spawner, and meet the other nodes."""
        self.config = config
        endpoint = config.rdzv.endpoint or LOOPBACK
        self._sock: socket.socket | None = bind_store_socket(endpoint) if config.base_rank == 0 else None
        self.spawner: NodeSpawner | None = None
        try:
            spawner = node_spawner(config, self._sock, base_env)
            self.spawner = spawner
            self.rdzv: Rendezvous = replace(rendezvous(config, self._sock), spawner=spawner)
            check_run_id(self.rdzv.run_id, "the run id agreed at rendezvous")
        except BaseException:
            self.close(over=True)
            raise
        self.run_id, self.job = self.rdzv.run_id, self.rdzv.job
        self.serves_store = self.job is not None and config.base_rank == 0
        self.failures: FailureMemory = LocalFailures()  # a fixed set: every node saw every attempt
        self.record_name = f"run_node{config.group_rank}.json" if config.multi_node else "run.json"
        self.claim: int | str | None = config.group_rank if config.multi_node else None
        self._next = 0
        self._worker_store: Any = None
        """Node 0's store for a restart's workers: it lives while any node's workers may."""

    def opening(self, output_dir: Path) -> list[str]:
        config, rdzv = self.config, self.rdzv
        what = (
            f"{config.nproc} GPU worker(s) {list(config.gpus)}"
            if config.device == "cuda"
            else f"{config.nproc} CPU worker(s)"
        )
        lines = [
            f"run {rdzv.run_id}: {what}, rendezvous {rdzv.master_addr}:{rdzv.master_port}; "
            f"output in {output_dir}"
        ]
        return lines + debug_server_lines(config, rank0_here=config.base_rank == 0)

    def meet(self) -> Meeting:
        """Attempt 0 is the rendezvous of the start; every later one meets again, on fresh keys and a
        fresh store for the workers (node 0 serves it; it lives until the next meeting)."""
        attempt, self._worker_store = self._next, None
        job, port = self.rdzv.job, self.rdzv.master_port
        if job is not None and attempt > 0:
            job, port, self._worker_store = meet_again(self.config, job, self.rdzv.master_addr, attempt)
        return Meeting(attempt, self.config, self.rdzv.master_addr, port, job)

    def can_meet_again(self, result: RunResult) -> bool:
        """Not without the store's host or one of the fixed nodes."""
        return not any(f.kind in LEARNED_FROM_SILENCE for f in result.failures)

    def restart(self, meeting: Meeting) -> str:
        self._next = meeting.attempt + 1
        every = " on every node" if self.job is not None else ""
        return f"restarting{every}: attempt {self._next} of {self.config.supervision.max_restarts} restart(s)"

    def leave(self, *, over: bool) -> None:
        """This node's last act with the job's store: node 0, its host, outlives the other nodes'
        reads of the job's end (bounded); every other node says it has read it. A static job is
        over for every node whenever one node leaves it: ``over`` changes nothing."""
        finish_job(self.job, hosts_store=self.serves_store)

    def close(self, *, over: bool) -> None:
        """The spawner, then the store's socket (safe twice)."""
        self._worker_store = None
        if self.spawner is not None:
            self.spawner.close()
        if self._sock is not None and self._sock.fileno() >= 0:
            self._sock.close()
