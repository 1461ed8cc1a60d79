"""Where one node's ranks meet the job's: the store's socket, the node's spawner, the other nodes.

Runs in the launcher (and in function mode's caller, which meets its peers the same way). On one node
the node's template (or store process) serves the store on the socket bound here; on several, node 0's
launcher serves it and every launcher joins the job's membership (``rendezvous/job.py``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from multigpu.config.endpoint import Endpoint
from multigpu.config.run import RunConfig, new_run_id
from multigpu.contract.errors import RendezvousError
from multigpu.rendezvous.fate import finish_job
from multigpu.rendezvous.fingerprint import differences, fingerprint
from multigpu.rendezvous.job import JobStore
from multigpu.rendezvous.store import bind_store_socket, connect_store, serve_store_on
from multigpu.supervisor.console import say
from multigpu.template.client import NodeSpawner, spawner_for
from multigpu.template.process import StoreSocket

LOOPBACK = Endpoint("127.0.0.1", 0)


@dataclass
class Rendezvous:
    """Where this attempt's workers meet, and who serves the store."""

    master_addr: str
    master_port: int
    run_id: str
    one_node: bool
    """The job is this node alone: the store is served here, on the socket the launcher bound (by the
    node's template or store process, or by function mode's caller itself)."""
    job: JobStore | None = None
    """Set for several nodes: the launchers share membership, heartbeats and the abort record."""
    spawner: NodeSpawner | None = None
    """Starts this node's ranks: forked from the node's template, or plain processes."""


def rendezvous(config: RunConfig, sock: socket.socket | None) -> Rendezvous:
    endpoint = config.rdzv.endpoint or LOOPBACK
    if not config.multi_node:
        assert sock is not None
        return Rendezvous(endpoint.bind_host, sock.getsockname()[1], config.output.run_id or new_run_id(),
                          one_node=True)
    if sock is not None:  # base rank 0: this launcher serves the store for the whole job
        port = sock.getsockname()[1]
        store = serve_store_on(sock, endpoint.bind_host, timeout_s=config.rdzv.timeout)
    else:
        port = endpoint.port
        store = connect_store(endpoint.host, port, config.rdzv.timeout)
    job = JobStore(store, node=config.group_rank, base_rank=config.base_rank, nproc=config.nproc,
                   world_size=config.resolved_world_size)
    try:
        run_id = job.settle_run_id(config.output.run_id or (new_run_id() if sock is not None else None))
        say(f"node {config.group_rank}: joined run {run_id} at {endpoint}; waiting for "
            f"{config.resolved_world_size} rank(s)")
        job.publish_fingerprint(fingerprint(config.target, config.target_args, config.device))
        job.join(config.rdzv.timeout)
        check_fingerprints(job, config.rdzv.allow_mismatch)
    except RendezvousError:  # a refusal every node reads: the store's host outlives their reads
        finish_job(job, hosts_store=sock is not None)
        raise
    return Rendezvous(endpoint.host, port, run_id, one_node=False, job=job)


def check_fingerprints(job: JobStore, allow: bool) -> None:
    """Every node reads every node's fingerprint and reaches the same verdict (``fingerprint.py``)."""
    breaking, soft = differences(job.fingerprints())
    for line in soft:
        say(f"warning: the nodes differ: {line}")
    if not breaking:
        return
    text = "; ".join(breaking)
    if not allow:
        raise RendezvousError(f"the nodes would run different things: {text}; every node refuses the "
                              f"job (--allow-mismatch runs it anyway)")
    say(f"warning: the nodes would run different things: {text}; running anyway (--allow-mismatch)")


def node_spawner(config: RunConfig, sock: socket.socket | None, notify: Callable[[str], None],
                 base_env: Mapping[str, str]) -> NodeSpawner:
    """This node's spawner, started before the rendezvous so the template imports torch meanwhile; on
    one node it also serves the job's store (not rank 0's bootstrap), so the store outlives rank 0."""
    store = None
    if sock is not None and not config.multi_node:
        host = (config.rdzv.endpoint or LOOPBACK).bind_host
        store = StoreSocket(sock.fileno(), host, sock.getsockname()[1])
    spawner = spawner_for(config, store, notify, base_env)
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
    job.join(config.rdzv.timeout)  # every rank claimed again: the port is published
    return job, int(job.store.get(key)), store
