"""The typed run configuration: the single source of truth the CLI parses into and the launcher reads."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from .endpoint import Endpoint
from .environment import node_count


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class RunConfig:
    target: str
    """A script path, or a module name when ``module`` is true."""
    target_args: tuple[str, ...] = ()
    module: bool = False
    device: str = "cpu"
    """``cpu`` (gloo workers) or ``cuda`` (one GPU per worker)."""
    nproc: int = 1
    gpus: tuple[int, ...] = ()
    """Visible GPU indices, one per local worker, when ``device == "cuda"``."""
    output_dir: Path | None = None
    run_id: str | None = None
    log_ranks: frozenset[int] | None = None
    rdzv_endpoint: Endpoint | None = None
    """None: a store on 127.0.0.1, port chosen by the kernel."""
    rdzv_timeout: float = 600.0
    base_rank: int = 0
    world_size: int | None = None
    """None: the local worker count (one node)."""
    node_rank: int | None = None
    nnodes: int | None = None
    grace_period: float = 5.0
    hang_timeout: float | None = None
    max_restarts: int = 0
    status: str = "auto"
    """``auto`` (a live view on a terminal), ``on`` or ``off``."""
    extra_env: dict[str, str] = field(default_factory=dict)
    # -- torchrun options (A)
    rdzv_backend: str = "static"
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    min_nodes: int | None = None
    max_nodes: int | None = None
    run_mode: str = "python"
    """``python`` (a script or module), or ``exec`` (``--no-python``: SCRIPT is a program)."""
    role: str = "default"
    local_addr: str | None = None
    log_dir: Path | None = None
    """torchrun's ``--log-dir``: its per-local-rank files are written there too."""
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset[int] | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    virtual_local_rank: bool = False
    numa_binding: str | None = None
    logs_specs: str | None = None
    # -- function mode (D)
    function: bool = False
    """``target`` is a pickled payload for ``multigpu.worker function`` (``MultiGPUManager``)."""
    first_local_rank: int = 0
    """The first local rank to start: 1 in function mode, where the caller is local rank 0."""
    # -- preemption, requeue and crash loops (H1)
    preempt_signals: tuple[str, ...] = ()
    """Signal names that warn of a preemption (``SIGUSR1``...); under SLURM USR1 and USR2 by default."""
    requeue: bool = False
    """``scontrol requeue`` the job once the ranks have stopped after a warning (SLURM)."""
    preempt_grace: float | None = None
    """Stop the ranks this many seconds after the warning if they are still running."""
    # -- hangs found from progress (H2)
    hang_factor: float = 5.0
    """A rank that reports steps hangs after ``hang_factor`` x its slowest step interval..."""
    hang_floor: float = 60.0
    """...but never sooner than this, and never later than ``hang_timeout`` (the ceiling)."""
    # -- warm worker template (H4)
    template: bool = True
    """Fork the ranks from a per-node template that imported torch once (``--no-template``: don't)."""
    preload: tuple[str, ...] = ()
    """Modules the template imports besides torch (``--preload``)."""

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
    def group_rank(self) -> int:
        if self.node_rank is not None:
            return self.node_rank
        return self.base_rank // self.nproc
