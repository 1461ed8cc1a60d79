"""The typed run configuration: what the CLI (and function mode) parses into and everything else reads.

Every default is written here once, in the field that holds it; ``--help`` quotes them from here, and
function mode's caller and the supervisor take theirs from here too. The fields are grouped by concern:
where the nodes meet (``RendezvousConfig``), how ranks are watched and restarted
(``SupervisionConfig``), when a rank hangs (``HangConfig``), where output goes (``OutputConfig``),
preemption on SLURM (``PreemptionConfig``) and how each rank's process is started (``StartConfig``).
The top level says what runs, on which devices, and where this node sits in the job.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from multigpu.config.endpoint import Endpoint
from multigpu.config.streams import StdStreams
from multigpu.contract.environment import Device, node_count

LiveView = Literal["auto", "on", "off"]
"""``--status``: a live view on a terminal (``auto``), always (``on``) or never (``off``)."""
Preflight = Literal["auto", "on", "off", "strict"]
"""``--preflight``: check every node after the rendezvous, before the ranks (``runner/preflight.py``):
``on`` warns of a slow node, ``strict`` refuses the job, ``auto`` is ``on`` for several nodes only."""
RunMode = Literal["python", "exec"]
"""How a rank runs its target: ``python`` (a script or module), or ``exec`` (``--no-python``: a program)."""


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class RendezvousConfig:
    """Where and how the nodes of the job meet (torchrun's ``--rdzv-*`` options)."""

    endpoint: Endpoint | None = None
    """None: a store on 127.0.0.1, port chosen by the kernel. With etcd: its first member."""
    members: tuple[Endpoint, ...] = ()
    """The etcd cluster's members (``--rdzv-backend etcd-v2``), as ``--rdzv-endpoint`` lists them."""
    timeout: float = 600.0
    """How long nodes wait for each other (``--rdzv-timeout``; function mode's ``rdzv_timeout``)."""
    backend: str = "static"
    conf: dict[str, str] = field(default_factory=dict)
    min_nodes: int | None = None
    max_nodes: int | None = None
    local_addr: str | None = None
    allow_mismatch: bool = False
    """Run a multi-node job whose nodes would run different things (``--allow-mismatch``): warn only."""
    preflight: Preflight = "auto"
    """``--preflight``/``--no-preflight``; see ``RunConfig.preflight_mode``."""


@dataclass(frozen=True)
class SupervisionConfig:
    """How the ranks are watched, stopped and restarted."""

    grace_period: float = 5.0
    """Seconds between the stop signal and SIGKILL."""
    max_restarts: int = 0
    template: bool = True
    """Fork the ranks from a per-node template that imported torch once (``--no-template``: don't)."""
    preload: tuple[str, ...] = ()
    """Modules the template imports besides torch (``--preload``)."""


@dataclass(frozen=True)
class HangConfig:
    """When a rank hangs: ``clamp(factor x its slowest step interval, floor, timeout)``."""

    timeout: float | None = None
    """``--hang-timeout``: the ceiling, and the timeout before a rank reports its first step."""
    factor: float = 5.0
    floor: float = 60.0
    straggler_threshold: float = 0.2
    """``--straggler-threshold``: a rank that enters collectives this share of the others' step after
    them is named a straggler (the job runs that much slower for it); 0: no straggler detection."""


@dataclass(frozen=True)
class OutputConfig:
    """Where the run's record and logs go, and what the console shows."""

    dir: Path | None = None
    """``--output``; None: ``./multigpu_runs/<run id>``."""
    run_id: str | None = None
    log_ranks: frozenset[int] | None = None
    """Global ranks shown on the console (``--log-ranks``); None: all."""
    status: LiveView = "auto"
    steps: int | None = None
    """``--steps``: the job's step count (as ``multigpu.heartbeat(step=N)`` counts), for its progress
    and ETA in the live view, ``multigpu status`` and the run's ledger; None: the step alone."""
    log_dir: Path | None = None
    """torchrun's ``--log-dir``: its per-local-rank files are written there too."""
    redirects: StdStreams = field(default_factory=StdStreams)
    tee: StdStreams = field(default_factory=StdStreams)
    local_ranks_filter: frozenset[int] | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    logs_specs: str | None = None
    metrics: Endpoint | None = None
    """``--metrics-port``: where this node's launcher serves Prometheus's ``/metrics``; None: off."""


@dataclass(frozen=True)
class PreemptionConfig:
    """A warning signal before the end of an allocation, and SLURM's requeue."""

    signals: tuple[str, ...] = ()
    """Signal names that warn of a preemption (``SIGUSR1``...); under SLURM USR1 and USR2 by default."""
    requeue: bool = False
    """``scontrol requeue`` the job once the ranks have stopped after a warning (SLURM)."""
    grace: float | None = None
    """Stop the ranks this many seconds after the warning if they are still running."""


@dataclass(frozen=True)
class StartConfig:
    """How each rank's process is started (torchrun's per-worker options)."""

    run_mode: RunMode = "python"
    role: str = "default"
    virtual_local_rank: bool = False
    numa_binding: str | None = None
    debug_server: Endpoint | None = None
    """``--debug-server``: where rank 0 serves torch's debug server (every rank's worker server binds
    the same host); None: off."""
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    """``--signals-to-handle``, as written (torchrun's default): the workers'
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``, which torch's own process contexts read."""


@dataclass(frozen=True)
class RunConfig:
    target: str
    """A script path, a module name when ``module`` is true, or function mode's pickled payload."""
    target_args: tuple[str, ...] = ()
    module: bool = False
    function: bool = False
    """``target`` is a pickled payload for ``python -m multigpu.rank function`` (``MultiGPUManager``)."""
    first_local_rank: int = 0
    """The first local rank to start: 1 in function mode, where the caller is local rank 0."""
    device: Device = "cpu"
    """``cpu`` (gloo workers) or ``cuda`` (one GPU per worker)."""
    nproc: int = 1
    gpus: tuple[int, ...] = ()
    """Visible GPU indices, one per local worker, when ``device == "cuda"``."""
    base_rank: int = 0
    world_size: int | None = None
    """None: the local worker count (one node)."""
    node_rank: int | None = None
    nnodes: int | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    rdzv: RendezvousConfig = field(default_factory=RendezvousConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    hang: HangConfig = field(default_factory=HangConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    start: StartConfig = field(default_factory=StartConfig)

    @property
    def resolved_world_size(self) -> int:
        return self.world_size if self.world_size is not None else self.nproc

    @property
    def multi_node(self) -> bool:
        return self.resolved_world_size > self.nproc

    @property
    def group_world_size(self) -> int:
        """Node count: ranks are laid out in equal blocks of ``nproc`` when the layout allows it."""
        if self.nnodes is not None:
            return self.nnodes
        return node_count(self.resolved_world_size, self.nproc)

    @property
    def preflight_mode(self) -> Literal["on", "off", "strict"]:
        """``--preflight`` resolved: ``auto`` checks a job that may span several nodes (a fixed set, or
        an elastic job of up to ``max_nodes`` above 1), never one node alone, which has no peer to
        compare with; nor, once they met, nodes that all run on one machine (``runner/preflight``)."""
        if self.rdzv.preflight != "auto":
            return self.rdzv.preflight
        return "on" if self.multi_node or (self.rdzv.max_nodes or 1) > 1 else "off"

    @property
    def group_rank(self) -> int:
        if self.node_rank is not None:
            return self.node_rank
        return self.base_rank // self.nproc
