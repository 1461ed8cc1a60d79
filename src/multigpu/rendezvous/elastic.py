"""Elastic membership (``--nnodes MIN:MAX --rdzv-backend c10d``) on torch's own dynamic rendezvous.

Membership, node ranks and rounds are torch's: ``DynamicRendezvousHandler`` over a
``C10dRendezvousBackend`` on the job's c10d TCPStore, so a torchrun node and its rules (MIN nodes and
a closed join window start a round, a waiting node triggers the next one) are the same here. What we
add sits on that store: run-id protection, fate sharing per round (heartbeats and one abort record,
``failure_sharing.py``) and a job-wide restart count. Two defects of torch 2.13's handler are worked around on
the store, not by a new protocol (``elastic_fixes.py``).

Nothing here imports torch at module level: the CLI checks ``--rdzv-conf`` without it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from multigpu.config.endpoint import Endpoint
from multigpu.config.run import RendezvousConfig, RunConfig
from multigpu.contract.errors import Interrupted, RendezvousError, UsageError
from multigpu.contract.values import integer, seconds
from multigpu.rendezvous.elastic_fixes import Liveness, close_rendezvous, handler_class
from multigpu.rendezvous.etcd import describe, rendezvous_backend
from multigpu.rendezvous.fingerprint import fingerprint
from multigpu.rendezvous.job import JobStore
from multigpu.rendezvous.round_hold import RoundHold
from multigpu.rendezvous.round_wait import RoundWait
from multigpu.rendezvous.store import bind_store_socket, connect_store, import_torch_quietly, serve_store_on

logger = logging.getLogger(__name__)

WAITING_POLL_S = 0.5
WATCHER_KEY = "multigpu/watcher"


def is_elastic(config: RunConfig) -> bool:
    return config.rdzv.backend in ("c10d", "etcd-v2") and (config.rdzv.max_nodes or 0) > 1


@dataclass(frozen=True)
class ElasticSettings:
    """torchrun's ``--rdzv-conf`` keys for the c10d backend, with torch's defaults (seconds)."""

    join_timeout: float = RendezvousConfig.timeout
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    heartbeat_timeout: float = 5.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    read_timeout: float = 60.0
    is_host: bool | None = None


_SECONDS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "read_timeout",
)
OTHER_SECONDS = ("timeout", "heartbeat")
"""Keys torchrun's other rendezvous backends read as seconds: checked, not used by c10d."""
TRUTHY, FALSY = ("1", "true", "yes", "y", "on"), ("0", "false", "no", "n", "off")


def settings_from(conf: Mapping[str, str]) -> ElasticSettings:
    """The one reader of ``--rdzv-conf`` values: the settings, or a UsageError naming the key. Unknown
    keys are kept by torchrun too: ignored."""
    values: dict[str, Any] = {}
    for key in (*_SECONDS, *OTHER_SECONDS):
        if key in conf:
            number = seconds(conf[key], f"--rdzv-conf {key}", positive=True)
            if key in _SECONDS:
                values[key] = number
    if "keep_alive_max_attempt" in conf:
        values["keep_alive_max_attempt"] = integer(
            conf["keep_alive_max_attempt"], "--rdzv-conf keep_alive_max_attempt", 1
        )
    if "is_host" in conf:
        flag = conf["is_host"].strip().lower()
        if flag not in TRUTHY + FALSY:
            raise UsageError(f"--rdzv-conf is_host must be true or false, got {conf['is_host']!r}")
        values["is_host"] = flag in TRUTHY
    return ElasticSettings(**values)


def local_address(endpoint: Endpoint) -> str:
    """The address peers reach this node at: the one it uses towards the rendezvous host (a UDP
    connect sends nothing). A loopback endpoint means every node is on this machine."""
    if endpoint.is_loopback:
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((endpoint.host, endpoint.port))
            return str(probe.getsockname()[0])
        except OSError:
            return socket.getfqdn()


def open_store(endpoint: Endpoint, settings: ElasticSettings) -> tuple[Any, bool]:
    """The job's c10d store and whether this launcher serves it. torchrun's rule: a launcher on the
    endpoint's machine (or ``is_host=true``) tries to serve it; if the port is taken, it is a client."""
    import_torch_quietly()  # the launcher's first torch import: c10's C++ store logs off its console
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    is_host = settings.is_host if settings.is_host is not None else _matches_machine_hostname(endpoint.host)
    if is_host:
        try:
            sock = bind_store_socket(endpoint)
        except RendezvousError:
            if settings.is_host:
                raise
        else:
            return serve_store_on(sock, endpoint.bind_host, timeout_s=settings.read_timeout), True
    return connect_store(endpoint.host, endpoint.port, settings.join_timeout), False


def settle_run_id(store: Any, wanted: str | None, fresh: str) -> str:
    """The job's run id: its ``--rdzv-id``; without one, the first launcher's fresh id, which every
    launcher without one then shares (as torchrun's nodes share its default id, ``none``).

    Each id has its own key, as every other key of the job lives under its run id: one store serves
    job after job (``multigpu store``), and a job never reads another's state."""
    key = f"{JobStore.RUN_ID_KEY}/{wanted or RDZV_ID_UNSET}"
    return str(store.compare_set(key, "", wanted or fresh).decode())


RDZV_ID_UNSET = "none"
"""torchrun's default ``--rdzv-id``: the namespace of launchers that name none."""


@dataclass(frozen=True)
class Round:
    """One completed rendezvous round, as this node sees it."""

    group_rank: int
    group_world_size: int
    base_rank: int
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    job: ElasticJobStore


class ElasticJobStore(JobStore):
    """The round's fate-sharing keys (in torch's per-round prefix store), plus: a node waiting to join
    is a membership change that ends the round on every node (the watcher asks, and publishes it). A
    node told to stop leaves the job: the others go on to a new round where ``--max-restarts`` allows."""

    interrupt_stops_job = False

    def __init__(self, store: Any, rdzv: ElasticRendezvous, **layout: int) -> None:
        super().__init__(store, **layout)
        self._rdzv = rdzv
        self._next_poll = 0.0

    def membership_change(self) -> str | None:
        now = time.monotonic()
        if now < self._next_poll:
            return None
        self._next_poll = now + WAITING_POLL_S
        waiting = self._rdzv.num_nodes_waiting()
        if waiting:
            return f"{waiting} node(s) asked to join: a new rendezvous round"
        return None


class ElasticRendezvous:
    """torch's dynamic rendezvous for this node, and the rank layout of each round."""

    def __init__(
        self,
        config: RunConfig,
        store: Any,
        run_id: str,
        settings: ElasticSettings,
        *,
        hosted: bool,
    ) -> None:
        """A node waiting for its round says so in a log line (``RoundWait``: the run's console)."""
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

        rdzv = config.rdzv
        assert rdzv.min_nodes is not None and rdzv.max_nodes is not None and rdzv.endpoint
        self.config, self.store, self.run_id, self.settings = config, store, run_id, settings
        self.hosted = hosted  # this launcher serves the job's store: then it leaves last
        self.store_failed = False
        """A rendezvous call failed on the store: this node lost the job, the others may not have."""
        self.addr = local_address(rdzv.endpoint)
        # etcd's store carries its client: torch's etcd-v2 backend keeps the state beside it
        self.backend = (
            rendezvous_backend(store, run_id) if rdzv.members else C10dRendezvousBackend(store, run_id)
        )
        timeout = RendezvousTimeout(
            join=timedelta(seconds=settings.join_timeout),
            last_call=timedelta(seconds=settings.last_call_timeout),
            close=timedelta(seconds=settings.close_timeout),
            heartbeat=timedelta(seconds=settings.heartbeat_timeout),
        )
        self.handler = handler_class().from_backend(
            run_id,
            store,
            self.backend,
            config.rdzv.min_nodes,
            config.rdzv.max_nodes,
            local_addr=self.addr,
            timeout=timeout,
            keep_alive_interval=settings.keep_alive_interval,
            keep_alive_max_attempt=settings.keep_alive_max_attempt,
        )
        self.restarts_key = f"multigpu/{run_id}/restart_count"  # the job's, under its run id
        store.compare_set(self.restarts_key, "", "0")
        # The launcher that serves the store evicts; with the store elsewhere (``multigpu store``,
        # ``is_host=false``) no launcher serves it, and every one evicts (aging a silent node's
        # keep-alive is the same act whoever does it): else a lost node held the next round 15 s.
        evicts = hosted or settings.is_host is False or bool(rdzv.members)  # etcd: nobody serves it
        self.liveness = Liveness(store, self.backend, run_id, self.handler._this_node, evicts=evicts)
        self.liveness.start()
        self.handler.hold = RoundHold(self.liveness)

    def next_round(self) -> Round:
        """Join the next round (torch's rules) and agree on ranks, master and restart count."""
        info = self._next_rendezvous()
        try:
            return self._layout(info)
        except RuntimeError as exc:  # a store call timed out: a node of the round vanished meanwhile
            within = f"read_timeout={self.settings.read_timeout:g}s"
            raise RendezvousError(
                f"the nodes of the new round did not all report within {within} ({type(exc).__name__})"
            ) from None

    def _next_rendezvous(self) -> Any:
        from torch.distributed.elastic.rendezvous import api

        where = describe(self.config.rdzv.members) if self.config.rdzv.members else self.config.rdzv.endpoint
        lost_s = self.settings.keep_alive_interval * self.settings.keep_alive_max_attempt  # torch's rule
        wait = RoundWait(self.backend, self.config, self.settings.join_timeout, (self.liveness, lost_s))
        try:
            with wait:
                return self.handler.next_rendezvous()
        except KeyboardInterrupt:
            raise Interrupted(
                f"interrupted (SIGINT) while waiting for a rendezvous round at {where} "
                f"({wait.last or 'no node joined yet'}); no rank of it was started"
            ) from None
        except api.RendezvousTimeoutError:
            raise RendezvousError(
                f"fewer than {self.config.rdzv.min_nodes} node(s) joined the rendezvous at "
                f"{where} within join_timeout={self.settings.join_timeout:g}s"
            ) from None
        except (api.RendezvousClosedError, api.RendezvousGracefulExitError):
            raise RendezvousError(
                f"the job at {where} has already ended (its rendezvous is closed); "
                "start a new one with another --rdzv-id"
            ) from None
        except (api.RendezvousError, RuntimeError, ValueError) as exc:
            self.store_failed = True  # the store, or the way to it, failed: not ours to close
            raise RendezvousError(
                f"the rendezvous at {where} failed ({type(exc).__name__}); the launcher "
                "that serves it may be gone"
            ) from None

    def _layout(self, info: Any) -> Round:
        """Consecutive ranks by node rank, as torchrun lays them out; every rank claimed (the round's
        barrier) in the round's own keys."""
        group_rank, group_world, rstore = info.rank, info.world_size, info.store
        if group_rank == 0:
            rstore.set("multigpu/restart_count", self.store.get(self.restarts_key))
        if self.hosted:  # before our nproc key: whoever has read every nproc key sees it
            rstore.set(WATCHER_KEY, str(group_rank))
        rstore.set(f"multigpu/nproc/{group_rank}", str(self.config.nproc))
        keys = ["multigpu/restart_count", *(f"multigpu/nproc/{g}" for g in range(group_world))]
        rstore.wait(keys, timedelta(seconds=self.settings.read_timeout))
        nprocs = [int(rstore.get(f"multigpu/nproc/{g}")) for g in range(group_world)]
        base_rank, world_size = sum(nprocs[:group_rank]), sum(nprocs)
        job = ElasticJobStore(
            rstore, self, node=group_rank, base_rank=base_rank, nproc=self.config.nproc, world_size=world_size
        )
        job.run_id = self.run_id
        # The launcher that serves the store watches the round; if it is not in it, group rank 0 does,
        # and every other node watches that one's counter (its death is not the store's).
        hosted = int(rstore.get(WATCHER_KEY)) if rstore.check([WATCHER_KEY]) else None
        job.watcher_base = sum(nprocs[:hosted]) if hosted is not None else 0
        job.watcher_hosts_store = hosted is not None
        job.store_host = hosted  # the group rank of the launcher that serves the store, if in the round
        # What this node would run, for every node of the round to compare once all joined (the
        # launcher checks: ``runner/static_join.check_fingerprints``), as a static job's nodes do.
        job.publish_fingerprint(fingerprint(self.config.target, self.config.target_args, self.config.device))
        job.join(self.settings.read_timeout)
        store_info = info.bootstrap_store_info
        return Round(
            group_rank,
            group_world,
            base_rank,
            world_size,
            store_info.master_addr,
            store_info.master_port,
            int(rstore.get("multigpu/restart_count")),
            job,
        )

    def num_nodes_waiting(self) -> int:
        return int(self.handler.num_nodes_waiting())

    def count_restart(self, seen: int) -> int:
        """The job-wide restart count after a failed round: every node of the round moves it from
        ``seen`` to ``seen + 1`` (compare-and-set, so it moves once)."""
        self.store.compare_set(self.restarts_key, str(seen), str(seen + 1))
        return seen + 1

    def shutdown(self, *, close: bool) -> None:
        """Stop beating; with ``close``, the job is over: a node that comes now is told so, in
        ``CLOSE_WAIT_S`` at most (``close_rendezvous``); a node whose rendezvous call failed on the
        store leaves it open for the nodes that still reach it."""
        self.liveness.stop()
        if close and not self.store_failed:
            close_rendezvous(self.handler)


def node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"
