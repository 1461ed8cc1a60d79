"""Elastic membership: each attempt of the one attempts loop (``attempts.py``) is a rendezvous round.

torchrun's agent semantics: a node waiting to join ends the round on every node without counting as a
restart (the loop goes straight back to ``meet``); any other failed round (a rank failed, a node was
lost) counts once, job-wide (``restart``: compare-and-set on the store), and every node of the round
goes to the next round together while ``--max-restarts`` allows, else every node ends with the same
root cause. The crash-loop stop keeps each failed round's signature in the job's store, so a node that
joined since decides as the others do. Imported by the launcher only for an elastic job (it imports
torch).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

from multigpu.config.run import RunConfig, new_run_id
from multigpu.contract.failure import FailureKind
from multigpu.record.folder import check_run_id
from multigpu.rendezvous.elastic import (
    ElasticRendezvous,
    Round,
    node_id,
    open_store,
    settings_from,
    settle_run_id,
)
from multigpu.rendezvous.etcd import describe, open_etcd_store
from multigpu.rendezvous.failure_sharing import finish_job, lost_the_store
from multigpu.rendezvous.job import JobStore
from multigpu.runner.crash_loop import FailureMemory, StoreFailures
from multigpu.runner.membership import Meeting, debug_server_lines
from multigpu.runner.static_join import check_fingerprints
from multigpu.supervisor.states import RunResult
from multigpu.template.client import NodeSpawner, spawner_for

logger = logging.getLogger(__name__)


class ElasticMembership:
    """torch's rendezvous rounds on the job's c10d store (``rendezvous/elastic.py``), for this node."""

    def __init__(self, config: RunConfig, base_env: Mapping[str, str]) -> None:
        """Open (or serve) the job's store, agree on the run id, and start the node's template: ready
        before the first round, since a node still importing torch would look lost."""
        assert config.rdzv.endpoint is not None
        self.config = config
        # --rdzv-timeout (or join_timeout in --rdzv-conf: the CLI resolved both into one) bounds the join.
        settings = dataclasses.replace(settings_from(config.rdzv.conf), join_timeout=config.rdzv.timeout)
        if config.rdzv.members:  # etcd: no launcher serves the job's state, the cluster keeps it
            store, hosted = open_etcd_store(config.rdzv.members, config.rdzv.conf), False
        else:
            store, hosted = open_store(config.rdzv.endpoint, settings)
        self.run_id = settle_run_id(store, config.output.run_id, new_run_id())
        check_run_id(self.run_id, "the run id agreed at rendezvous")
        self.rdzv = ElasticRendezvous(config, store, self.run_id, settings, hosted=hosted)
        self.spawner: NodeSpawner | None = None
        try:
            self.spawner = spawner_for(config, None, base_env)  # every round's ranks fork from it
            self.spawner.wait_ready()
        except BaseException:
            self.close(over=False)
            raise
        self.serves_store = hosted
        self.last_round: JobStore | None = None
        """The job's keys of the latest round this node joined (``leave``)."""
        # Keys of the whole job, whatever the round; no layout (the nodes change from round to round).
        self.job: JobStore | None = JobStore(store, node=-1, base_rank=-1, nproc=config.nproc, world_size=-1)
        self.job.run_id = self.run_id
        self.failures: FailureMemory = StoreFailures(store, self.job.key("failures"))
        self.record_name = f"run_{node_id()}.json"
        self.claim: int | str | None = node_id()

    def opening(self, output_dir: Path) -> list[str]:
        config = self.config
        role = "serves" if self.serves_store else "joins"
        where = describe(config.rdzv.members) if config.rdzv.members else str(config.rdzv.endpoint)
        return [
            f"run {self.run_id}: elastic job of {config.rdzv.min_nodes}:{config.rdzv.max_nodes} node(s), "
            f"{config.nproc} worker(s) here; this launcher {role} the rendezvous at "
            f"{where}; output in {output_dir}",
            *debug_server_lines(config, rank0_here=None),
        ]

    def meet(self) -> Meeting:
        """Join the next round (torch's rules); its layout, as this node's attempt."""
        self.rdzv.handler.worker_store = None  # the last round's workers are gone: so is their store
        rnd = self.rdzv.next_round()
        self.last_round = rnd.job
        check_fingerprints(rnd.job, self.config.rdzv.allow_mismatch)  # every node refuses
        last = rnd.base_rank + self.config.nproc - 1
        logger.info(
            f"node {rnd.group_rank} of {rnd.group_world_size}: ranks {rnd.base_rank}..{last} of "
            f"{rnd.world_size}, restart count {rnd.restart_count}"
        )
        return Meeting(rnd.restart_count, self._round_config(rnd), rnd.master_addr, rnd.master_port, rnd.job)

    def _round_config(self, rnd: Round) -> RunConfig:
        config = self.config
        return dataclasses.replace(
            config,
            base_rank=rnd.base_rank,
            world_size=rnd.world_size,
            node_rank=rnd.group_rank,
            nnodes=rnd.group_world_size,
            output=dataclasses.replace(config.output, run_id=self.run_id),
        )

    def can_meet_again(self, result: RunResult) -> bool:
        """Whenever the store is left: a lost node is what a new round is for."""
        return all(f.kind is not FailureKind.STORE_LOST for f in result.failures)

    def restart(self, meeting: Meeting) -> str:
        count = self.rdzv.count_restart(meeting.attempt)
        return (
            f"restarting every node: restart {count} of {self.config.supervision.max_restarts}, "
            "through a new rendezvous round"
        )

    def leave(self, *, over: bool) -> None:
        """When the job is over for every node (a refusal, its end), the store's host outlives the
        other nodes' last reads of the last round (bounded), and every other node says it has read
        them: a refusal reads as itself on every node, not as a lost store. A node that leaves a job
        going on (SIGTERM, Ctrl-C) does not wait for nodes that go on without it."""
        if lost_the_store(self.last_round):
            members = self.config.rdzv.members
            where = describe(members) if members else f"the rendezvous store at {self.config.rdzv.endpoint}"
            logger.warning(
                f"this node lost the job: {where} stopped answering it (its link, or the store, is "
                "down); the nodes that still reach it go on without this one"
            )
        elif over and self.last_round is not None:
            finish_job(self.last_round, hosts_store=self.serves_store)

    def close(self, *, over: bool) -> None:
        """The spawner, then our beats; with ``over``, the rendezvous closes (safe twice), unless this
        node lost the store: the job is over for this node only, and a close sent once a cut link
        returns would end it for the nodes that go on."""
        if self.spawner is not None:
            self.spawner.close()
            self.spawner = None
        self.rdzv.handler.worker_store = None
        self.rdzv.shutdown(close=over and not lost_the_store(self.last_round))
