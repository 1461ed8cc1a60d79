"""torchrun's options, once resolved (``options.RunOptions``), mapped onto RunConfig with torchrun's meaning.

Kept apart from the option table (``options``) so the table stays a plain list, and apart from
``layout`` so rank arithmetic does not learn about rendezvous backends. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import re
from importlib import metadata
from pathlib import Path

from multigpu.cli import options
from multigpu.cli.options import RunOptions
from multigpu.cluster.devices import parse_index_list
from multigpu.config.endpoint import C10D_PORT, TORCHRUN_MASTER_PORT, Endpoint, parse_endpoint
from multigpu.config.run import RendezvousConfig, RunConfig, StartConfig
from multigpu.config.streams import StdStreams
from multigpu.contract.errors import UsageError
from multigpu.contract.values import integer, seconds
from multigpu.rendezvous import etcd
from multigpu.rendezvous.elastic import settings_from


def _rdzv_conf(text: str | None) -> dict[str, str]:
    conf = options.parse_rdzv_conf(text or "")
    settings_from(conf)  # a bad value is a usage error now, whatever the backend
    return conf


def _backend(values: RunOptions) -> str:
    """The backend's name; torchrun's ``etcd`` and ``etcd-v2`` both run torch's etcd-v2 backend."""
    backend = (values.rdzv_backend or RendezvousConfig.backend).strip().lower()
    if backend in etcd.BACKENDS:
        return "etcd-v2"
    if backend not in ("static", "c10d"):
        raise UsageError(f"--rdzv-backend must be static, c10d or etcd-v2, got {backend!r}")
    return backend


def _etcd_members(values: RunOptions, conf: dict[str, str]) -> tuple[Endpoint, ...]:
    """``--rdzv-endpoint H1:P1,H2:P2,...``: the etcd members (torch's parser takes one)."""
    if not values.rdzv_endpoint:
        raise UsageError("--rdzv-backend etcd-v2 needs --rdzv-endpoint with the etcd members, HOST:PORT,...")
    etcd.etcd_settings(conf)  # a bad protocol or certificate pair is a usage error now
    return etcd.parse_members(values.rdzv_endpoint)


def _endpoint(values: RunOptions, backend: str, max_nodes: int) -> Endpoint | None:
    """torchrun's ``get_rdzv_endpoint``: the endpoint, else master addr:port for static."""
    text = values.rdzv_endpoint
    if text:
        if backend == "c10d" and not re.search(r":\d+$", text):
            text = f"{text}:{C10D_PORT}"
        return parse_endpoint(text, option="--rdzv-endpoint")
    port = values.master_port
    if backend != "static" or (port is None and max_nodes == 1):
        return None  # one node: torchrun uses localhost:0, as we do by default
    host = values.master_addr or "127.0.0.1"
    number = integer(port, "--master-port", 0) if port is not None else TORCHRUN_MASTER_PORT
    if number > 65535:
        raise UsageError(f"--master-port must be at most 65535, got {number}")
    return Endpoint(host.strip("[]"), number)


def rendezvous_settings(config: RunConfig, values: RunOptions) -> RunConfig:
    """Backend, endpoint, node range and rendezvous settings, as torchrun's ``run()`` decides them."""
    backend = _backend(values)
    min_nodes, max_nodes = options.parse_nnodes(values.nnodes) if values.nnodes else (None, None)
    conf = _rdzv_conf(values.rdzv_conf)
    members = _etcd_members(values, conf) if backend == "etcd-v2" else ()
    endpoint = members[0] if members else _endpoint(values, backend, max_nodes or 1)
    if values.standalone:
        if (max_nodes or 1) > 1:
            raise UsageError(f"--standalone is one node; drop --nnodes {values.nnodes}")
        backend, endpoint, members, min_nodes, max_nodes = "c10d", None, (), 1, 1
    if min_nodes != max_nodes and backend == "static":
        raise UsageError(f"--nnodes {values.nnodes} is an elastic range: it needs --rdzv-backend c10d")
    # torch's etcd backend names its join timeout ``timeout``
    timeout = values.rdzv_timeout or conf.get("join_timeout") or (conf.get("timeout") if members else None)
    rdzv = dataclasses.replace(
        config.rdzv,
        backend=backend,
        conf=conf,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        endpoint=endpoint,
        members=members,
        timeout=seconds(timeout, "--rdzv-timeout", positive=True) if timeout else RendezvousConfig.timeout,
        allow_mismatch=bool(values.allow_mismatch),
    )
    return dataclasses.replace(config, rdzv=rdzv)


def _logs_specs(name: str | None) -> str | None:
    """An installed ``torchrun.logs_specs`` entry point, found without loading it (no torch here)."""
    if name is not None and not metadata.entry_points(group="torchrun.logs_specs", name=name):
        raise UsageError(
            f"--logs-specs {name!r}: no 'torchrun.logs_specs' entry point of that name is installed"
        )
    return name


HANDLED_SIGNALS = (
    "SIGTERM",
    "SIGINT",
    "SIGHUP",
    "SIGQUIT",
    "SIGUSR1",
    "SIGUSR2",
    "SIGABRT",
    "SIGALRM",
    "SIGCONT",
    "SIGPIPE",
    "SIGTSTP",
    "SIGTTIN",
    "SIGTTOU",
    "SIGWINCH",
    "SIGXCPU",
)
"""What torchrun's ``--signals-to-handle`` accepts."""


def _handled_signals(text: str) -> tuple[str, ...]:
    """torchrun's ``--signals-to-handle``: names from its list, written as torchrun writes them."""
    names = tuple(s.strip().upper() for s in text.split(",") if s.strip())
    bad = [s for s in names if s not in HANDLED_SIGNALS]
    if bad or not names:
        what = bad[0] if bad else repr(text)
        raise UsageError(f"--signals-to-handle: {what} is not a signal name like SIGTERM")
    return names


def _check_no_effect_options(values: RunOptions) -> None:
    """Options torchrun needs and we do not still get torchrun's checks, so a typo is caught here too."""
    if values.monitor_interval is not None:
        seconds(values.monitor_interval, "--monitor-interval")
    method = values.start_method
    if method is not None and method not in ("spawn", "fork", "forkserver"):
        raise UsageError(f"--start-method must be spawn, fork or forkserver, got {method!r}")
    if values.signals_to_handle is not None:
        _handled_signals(values.signals_to_handle)


def apply_torchrun_options(config: RunConfig, values: RunOptions) -> RunConfig:
    """Every torchrun option that is not the device choice or the rank layout."""
    config = rendezvous_settings(config, values)
    _check_no_effect_options(values)
    numa = values.numa_binding
    if numa is not None and numa not in ("node", "socket", "exclusive", "core-complex"):
        raise UsageError(f"--numa-binding must be node, socket, exclusive or core-complex, got {numa!r}")
    role = values.role
    if role is not None and not role.strip():
        raise UsageError("--role must not be empty")
    start = dataclasses.replace(
        config.start,
        role=role or StartConfig.role,
        virtual_local_rank=bool(values.virtual_local_rank),
        numa_binding=numa,
        signals_to_handle=values.signals_to_handle or StartConfig.signals_to_handle,
    )
    output = dataclasses.replace(
        config.output,
        log_dir=Path(values.log_dir) if values.log_dir else None,
        redirects=StdStreams()
        if values.redirects is None
        else StdStreams.parse(values.redirects, "--redirects"),
        tee=StdStreams() if values.tee is None else StdStreams.parse(values.tee, "--tee"),
        duplicate_stdout_filters=options.comma_list(values.duplicate_stdout_filters)
        if values.duplicate_stdout_filters
        else (),
        duplicate_stderr_filters=options.comma_list(values.duplicate_stderr_filters)
        if values.duplicate_stderr_filters
        else (),
        logs_specs=_logs_specs(values.logs_specs),
    )
    rdzv = dataclasses.replace(config.rdzv, local_addr=values.local_addr)
    return dataclasses.replace(config, start=start, output=output, rdzv=rdzv)


def _ranks(text: str, flag: str) -> frozenset[int]:
    try:
        return frozenset(parse_index_list(text, what=flag))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def apply_rank_filters(config: RunConfig, values: RunOptions) -> RunConfig:
    """``--log-ranks`` names global ranks, ``--local-ranks-filter`` local ones: both may be given if they
    agree on this node."""
    log_ranks = _ranks(values.log_ranks, "--log-ranks") if values.log_ranks else None
    local = _ranks(values.local_ranks_filter, "--local-ranks-filter") if values.local_ranks_filter else None
    if local is not None:
        as_global = frozenset(config.base_rank + r for r in local)
        if log_ranks is not None and log_ranks != as_global:
            raise UsageError(
                f"--log-ranks {values.log_ranks} and --local-ranks-filter "
                f"{values.local_ranks_filter} disagree on this node (base rank "
                f"{config.base_rank})"
            )
        log_ranks = as_global
    output = dataclasses.replace(config.output, log_ranks=log_ranks, local_ranks_filter=local)
    return dataclasses.replace(config, output=output)
