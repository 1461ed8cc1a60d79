"""Where one node's ranks meet the job's: the store's socket, the node's spawner, the other nodes.

Runs in the launcher (and in OTX's caller, which meets its peers the same way). On one node
the node's template (or store process) serves the store on the socket bound here; on several, node 0's
launcher serves it and every launcher joins the job's membership (``rendezvous/job.py``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from multigpu.config.endpoint import Endpoint
from multigpu.config.run import RunConfig, new_run_id
from multigpu.contract.errors import Interrupted, RendezvousError
from multigpu.contract.values import WAIT_LINE_EVERY_S, duration_text
from multigpu.rendezvous.failure_sharing import finish_job
from multigpu.rendezvous.fingerprint import differences, fingerprint
from multigpu.rendezvous.job import JobStore
from multigpu.rendezvous.store import bind_store_socket, connect_store, serve_store_on
from multigpu.template.client import NodeSpawner, spawner_for
from multigpu.template.process import StoreSocket

logger = logging.getLogger(__name__)

LOOPBACK = Endpoint("127.0.0.1", 0)


@dataclass
class Rendezvous:
    """Where this attempt's workers meet, and who serves the store."""

    master_addr: str
    master_port: int
    run_id: str
    one_node: bool
    """The job is this node alone: the store is served here, on the socket the launcher bound (by the
    node's template or store process, or by OTX's caller itself)."""
    job: JobStore | None = None
    """Set for several nodes: the launchers share membership, heartbeats and the abort record."""
    spawner: NodeSpawner | None = None
    """Starts this node's ranks: forked from the node's template, or plain processes."""


def rendezvous(config: RunConfig, sock: socket.socket | None) -> Rendezvous:
    """Meet the other nodes (a job of several); this node's lines are logged (the run's console, or
    stderr in OTX's caller)."""
    endpoint = config.rdzv.endpoint or LOOPBACK
    if not config.multi_node:
        assert sock is not None
        return Rendezvous(
            endpoint.bind_host, sock.getsockname()[1], config.output.run_id or new_run_id(), one_node=True
        )
    if sock is not None:  # base rank 0: this launcher serves the store for the whole job
        port = sock.getsockname()[1]
        store = serve_store_on(sock, endpoint.bind_host, timeout_s=config.rdzv.timeout)
    else:
        port = endpoint.port
        left = wait_for_store_host(config, endpoint.host, port)
        store = connect_store(endpoint.host, port, left)
    job = JobStore(
        store,
        node=config.group_rank,
        base_rank=config.base_rank,
        nproc=config.nproc,
        world_size=config.resolved_world_size,
    )
    try:
        run_id = job.settle_run_id(config.output.run_id or (new_run_id() if sock is not None else None))
        logger.info(f"node {config.group_rank}: joined run {run_id} at {endpoint}")
        job.publish_fingerprint(fingerprint(config.target, config.target_args, config.device))
        JoinWait(config, job).join()
        check_fingerprints(job, config.rdzv.allow_mismatch)
    except RendezvousError:  # a refusal every node reads: the store's host outlives their reads
        finish_job(job, hosts_store=sock is not None)
        raise
    return Rendezvous(endpoint.host, port, run_id, one_node=False, job=job)


def check_fingerprints(job: JobStore, allow: bool) -> None:
    """Every node reads every node's fingerprint and reaches the same verdict (``fingerprint.py``)."""
    breaking, soft = differences(job.fingerprints())
    for line in soft:
        logger.warning(f"warning: the nodes differ: {line}")
    if not breaking:
        return
    text = "; ".join(breaking)
    if not allow:
        raise RendezvousError(
            f"the nodes would run different things: {text}; every node refuses the "
            f"job (--allow-mismatch runs it anyway)"
        )
    logger.warning(
        f"warning: the nodes would run different things: {text}; running anyway (--allow-mismatch)"
    )


def node_spawner(config: RunConfig, sock: socket.socket | None, base_env: Mapping[str, str]) -> NodeSpawner:
    """This node's spawner, started before the rendezvous so the template imports torch meanwhile; on
    one node it also serves the job's store (not rank 0's bootstrap), so the store outlives rank 0."""
    store = None
    if sock is not None and not config.multi_node:
        host = (config.rdzv.endpoint or LOOPBACK).bind_host
        store = StoreSocket(sock.fileno(), host, sock.getsockname()[1])
    spawner = spawner_for(config, store, base_env)
    if config.multi_node:
        spawner.wait_ready()  # ready before meeting the peers, which start beating at once
    return spawner


def meet_again(config: RunConfig, job: JobStore, master_addr: str, attempt: int) -> tuple[JobStore, int, Any]:
    """Every node of a multi-node job meets again for a restart, with fresh fate-sharing keys and a
    fresh store for the workers (torch's workers add no per-attempt prefix: the last attempt's keys
    would mislead gloo's rendezvous). Node 0 serves that store; (job, its port, the store)."""
    job = job.for_attempt(attempt)
    key, store = job.key("worker_store_port"), None
    if config.base_rank == 0:
        sock = bind_store_socket(Endpoint(master_addr, 0))
        port = sock.getsockname()[1]
        store = serve_store_on(sock, Endpoint(master_addr, 0).bind_host, timeout_s=config.rdzv.timeout)
        job.store.set(key, str(port))
    JoinWait(config, job).join()  # every rank claimed again: the port is published
    return job, int(job.store.get(key)), store


def node_list(nodes: list[int]) -> str:
    return ", ".join(map(str, nodes)) if nodes else "none"


def wait_line(node: int, joined: list[int], missing: list[int], left_s: float) -> str:
    """``node 1: waiting for node(s) 0 (joined: 1); 9m58s left (--rdzv-timeout)``."""
    return (
        f"node {node}: waiting for node(s) {node_list(missing)} (joined: {node_list(joined)}); "
        f"{duration_text(left_s)} left (--rdzv-timeout)"
    )


FIRST_LINE_S = 1.0
"""A wait says nothing before this: peers started together meet within it (every restart meets again)."""


class JoinWait:
    """A node waiting for the others to join: which nodes came, which did not, and the time left,
    said once the wait lasts ``FIRST_LINE_S``, then every ``WAIT_LINE_EVERY_S``; a time-out or a Ctrl-C
    names the missing nodes in one line. Runs in the launcher, on the thread that joins."""

    def __init__(self, config: RunConfig, job: JobStore, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.job, self._clock = config, job, clock
        self._next = clock() + FIRST_LINE_S

    def join(self) -> None:
        try:
            self.job.join(self.config.rdzv.timeout, on_wait=self)
        except KeyboardInterrupt:
            joined, missing = self.nodes()
            raise Interrupted(
                f"node {self.config.group_rank}: interrupted (SIGINT) while waiting for "
                f"node(s) {node_list(missing)} to join (joined: {node_list(joined)}); "
                "no rank was started"
            ) from None

    def nodes(self) -> tuple[list[int], list[int]]:
        """(joined, missing) node indices, from the job's member list."""
        joined = sorted(set(self.job.members().values()))
        return joined, [n for n in range(self.config.group_world_size) if n not in joined]

    def __call__(self, left_s: float) -> None:
        """Told at each poll of the wait (``JobStore.join``): say where things stand when due."""
        now = self._clock()
        if left_s <= 0:
            _, missing = self.nodes()
            raise RendezvousError(
                f"node(s) {node_list(missing)} never joined within "
                f"{self.config.rdzv.timeout:g}s (--rdzv-timeout); check that every node "
                "started with the same --rdzv-endpoint and --world-size"
            )
        if now < self._next:
            return
        self._next = now + WAIT_LINE_EVERY_S
        joined, missing = self.nodes()
        logger.info(wait_line(self.config.group_rank, joined, missing, left_s))


def wait_for_store_host(
    config: RunConfig,
    host: str,
    port: int,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 0.5,
) -> float:
    """Wait until the store's port answers, saying so every ``WAIT_LINE_EVERY_S``, and return the
    seconds left for the rest of the rendezvous. A plain TCP connect, closed at once: torch's store
    client would retry in C++, where neither a line nor a Ctrl-C gets through until it gives up."""
    deadline, due = clock() + config.rdzv.timeout, clock() + FIRST_LINE_S
    where = f"node 0 (the store's host, {host}:{port})"
    try:
        while True:
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=poll_s):
                return max(deadline - clock(), 1.0)
            if clock() >= deadline:
                raise RendezvousError(
                    f"{where} never answered within {config.rdzv.timeout:g}s "
                    "(--rdzv-timeout); check that it runs multigpu with the same "
                    "--rdzv-endpoint and that the port is reachable"
                )
            if clock() >= due:
                due = clock() + WAIT_LINE_EVERY_S
                logger.info(
                    f"node {config.group_rank}: waiting for {where}; {duration_text(deadline - clock())} "
                    "left (--rdzv-timeout)"
                )
            time.sleep(poll_s)
    except KeyboardInterrupt:
        raise Interrupted(
            f"node {config.group_rank}: interrupted (SIGINT) while waiting for {where}; no rank was started"
        ) from None
