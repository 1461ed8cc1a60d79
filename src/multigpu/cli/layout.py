"""The rank layout over nodes: explicit options, ``--nnodes/--node-rank``, or SLURM; checked up front."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from multigpu.cli.options import RunOptions
from multigpu.cluster import slurm
from multigpu.config.endpoint import TORCHRUN_MASTER_PORT, Endpoint
from multigpu.config.run import RunConfig
from multigpu.contract.errors import UsageError
from multigpu.contract.values import integer


@dataclass(frozen=True)
class LayoutOptions:
    """The options that place this node's ranks, as text (None: not given), from ``layout_options``."""

    nnodes: str | None
    """A fixed node count (an elastic range is the rendezvous's business, not the layout's)."""
    node_rank: str | None
    base_rank: str | None
    world_size: str | None


def _opt_int(raw: str | None, flag: str, minimum: int) -> int | None:
    return None if raw is None or raw == "" else integer(raw, flag, minimum)


def layout_options(config: RunConfig, values: RunOptions) -> LayoutOptions:
    """The layout options, with torchrun's defaults filled in where a torchrun line relies on them.

    A fixed ``--nnodes N`` without ``--node-rank`` is node 0 (torchrun's default), ``--node-rank``
    alone is one node, and under c10d the node rank is the rendezvous's to assign, not the user's.
    """
    fixed = config.rdzv.min_nodes is not None and config.rdzv.min_nodes == config.rdzv.max_nodes
    nnodes = str(config.rdzv.min_nodes) if fixed else None
    node_rank = values.node_rank if config.rdzv.backend == "static" else None
    if nnodes is not None and node_rank is None and config.rdzv.min_nodes != 1:
        node_rank = "0"
    if node_rank is not None and nnodes is None and config.rdzv.max_nodes is None:
        nnodes = "1"
    if nnodes == "1" and node_rank is None:
        nnodes = None  # one node: the layout (and SLURM) decide as before
    return LayoutOptions(nnodes, node_rank, values.base_rank, values.world_size)


def check_layout(base_rank: int, local: int, world_size: int) -> None:
    if base_rank < 0:
        raise UsageError(f"--base-rank must be at least 0, got {base_rank}")
    if world_size < local:
        raise UsageError(f"--world-size {world_size} is smaller than this node's {local} worker(s)")
    if base_rank + local > world_size:
        raise UsageError(
            f"ranks {base_rank}..{base_rank + local - 1} do not fit in --world-size "
            f"{world_size}; lower --base-rank or raise --world-size"
        )


def _elastic_layout(config: RunConfig, values: LayoutOptions) -> RunConfig | None:
    """``--rdzv-backend c10d``: node ranks and the world come from the rendezvous, round by round.
    None when at most one node may take part (then it is an ordinary one-machine job)."""
    from multigpu.rendezvous.elastic import settings_from

    min_nodes = config.rdzv.min_nodes or 1
    max_nodes = config.rdzv.max_nodes or min_nodes
    settings_from(config.rdzv.conf)  # bad values are usage errors now, not after the join
    if max_nodes == 1:
        return None
    if values.base_rank or values.world_size:
        raise UsageError(
            "--base-rank/--world-size do not apply with --rdzv-backend c10d: the rendezvous assigns ranks"
        )
    endpoint = config.rdzv.endpoint
    if endpoint is None or endpoint.port == 0:
        raise UsageError(
            "--rdzv-backend c10d with several nodes needs --rdzv-endpoint HOST:PORT with a fixed port"
        )
    return dataclasses.replace(
        config, rdzv=dataclasses.replace(config.rdzv, min_nodes=min_nodes, max_nodes=max_nodes)
    )


def _ranks_from_nodes(
    nproc: int, nnodes: int | None, node_rank: int | None, base_rank: int | None, world_size: int | None
) -> tuple[int | None, int | None]:
    """Base rank and world size, derived from ``--nnodes``/``--node-rank`` when given; an explicit value
    that disagrees with the derived one is a usage error."""
    if (nnodes is None) != (node_rank is None):
        raise UsageError("--nnodes and --node-rank go together")
    if nnodes is None or node_rank is None:
        return base_rank, world_size
    if node_rank >= nnodes:
        raise UsageError(f"--node-rank {node_rank} must be below --nnodes {nnodes}")
    derived_base, derived_world = node_rank * nproc, nnodes * nproc
    if base_rank is not None and base_rank != derived_base:
        raise UsageError(
            f"--base-rank {base_rank} disagrees with --node-rank {node_rank} "
            f"x {nproc} workers = {derived_base}"
        )
    if world_size is not None and world_size != derived_world:
        raise UsageError(
            f"--world-size {world_size} disagrees with --nnodes {nnodes} x {nproc} workers = {derived_world}"
        )
    return derived_base, derived_world


def _check_endpoint(endpoint: Endpoint | None, world_size: int, nproc: int) -> None:
    """A job beyond this machine needs a fixed endpoint; port 0 (pick one) is for loopback only."""
    if world_size > nproc:
        if endpoint is None:
            raise UsageError(
                "a multi-node job needs --rdzv-endpoint HOST:PORT (the base-rank-0 node's address)"
            )
        if endpoint.port == 0:
            raise UsageError("a multi-node --rdzv-endpoint needs a fixed port; port 0 is for one machine")
    elif endpoint is not None and endpoint.port == 0 and not endpoint.is_loopback:
        raise UsageError(f"--rdzv-endpoint {endpoint}: port 0 is only allowed on a loopback host")


def apply_layout(config: RunConfig, values: LayoutOptions, env: Mapping[str, str]) -> RunConfig:
    """Fill base rank, world size, node rank, endpoint and run id; explicit options always win."""
    if config.rdzv.backend in ("c10d", "etcd-v2"):
        elastic = _elastic_layout(config, values)
        if elastic is not None:
            return elastic
        values = dataclasses.replace(values, nnodes=None, node_rank=None)
        if config.rdzv.members:  # one node needs no etcd: it is an ordinary one-machine job
            config = dataclasses.replace(
                config, rdzv=dataclasses.replace(config.rdzv, endpoint=None, members=())
            )
    base_rank = _opt_int(values.base_rank, "--base-rank", 0)
    world_size = _opt_int(values.world_size, "--world-size", 1)
    nnodes = _opt_int(values.nnodes, "--nnodes", 1)
    node_rank = _opt_int(values.node_rank, "--node-rank", 0)
    endpoint, run_id = config.rdzv.endpoint, config.output.run_id
    found = slurm.detect(env) if base_rank is None and nnodes is None else None
    if found is not None:
        run_id = run_id or f"slurm-{found.job_id}"
    if found is not None and found.nnodes > 1:
        nnodes, node_rank = found.nnodes, found.node_rank
        run_id = run_id or f"slurm-{found.job_id}"
        if endpoint is None:
            endpoint = Endpoint(found.master_host, int(env.get("MASTER_PORT", TORCHRUN_MASTER_PORT)))
    base_rank, world_size = _ranks_from_nodes(config.nproc, nnodes, node_rank, base_rank, world_size)
    base_rank = base_rank or 0
    world_size = world_size if world_size is not None else base_rank + config.nproc
    check_layout(base_rank, config.nproc, world_size)
    _check_endpoint(endpoint, world_size, config.nproc)
    return dataclasses.replace(
        config,
        base_rank=base_rank,
        world_size=world_size,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv=dataclasses.replace(config.rdzv, endpoint=endpoint),
        output=dataclasses.replace(config.output, run_id=run_id),
    )
