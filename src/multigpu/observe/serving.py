"""The run's servers for monitoring, opened once for the whole run and closed with it: ``/metrics``
(``--metrics-port``, ``MULTIGPU_METRICS_PORT``) and torchrun's ``/healthz``
(``TORCHELASTIC_HEALTH_CHECK_PORT``). Runs in the launcher (``runner/attempts.py`` opens them before
the first attempt); the option's value is checked where it is given (``metrics_endpoint``), so a wrong
one or a missing library is one line before anything starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from multigpu.config.endpoint import Endpoint, format_endpoint, parse_endpoint
from multigpu.config.run import RunConfig
from multigpu.contract.errors import UsageError
from multigpu.observe import health, metrics
from multigpu.observe.watched import LostSeconds, Watched

logger = logging.getLogger(__name__)


def metrics_endpoint(value: str, option: str = "--metrics-port") -> Endpoint:
    """``[HOST:]PORT``: loopback unless a host is given (0 picks a free port); prometheus_client must be
    importable."""
    text = value.strip()
    if ":" not in text and not (text.isdigit() and int(text) <= 65535):
        raise UsageError(f"{option} {text!r}: write a port number from 0 to 65535, or HOST:PORT")
    where = parse_endpoint(text if ":" in text else f"127.0.0.1:{text}", option=option)
    if importlib.util.find_spec("prometheus_client") is None:
        raise UsageError(f"{option} needs prometheus_client: pip install 'multigpu[metrics]'")
    return where


def health_port(env: Mapping[str, str]) -> int | None:
    """torchrun's ``TORCHELASTIC_HEALTH_CHECK_PORT``; None when unset or empty."""
    text = env.get(health.HEALTH_PORT_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) > 65535:
        raise UsageError(f"{health.HEALTH_PORT_ENV} must be a port number from 0 to 65535, got {text!r}")
    return int(text)


@contextlib.contextmanager
def observed(
    config: RunConfig,
    env: Mapping[str, str],
    record: Mapping[str, Any],
    run_id: str,
    lost_seconds: LostSeconds | None = None,
) -> Iterator[Watched | None]:
    """The servers the run asked for, for the ``with`` block; None when it asked for neither. A port
    that cannot be bound is one line (exit 2) before any rank starts. ``lost_seconds``: the run's
    lost time by cause (None: what its incidents tell, ``watched.lost_from_incidents``)."""
    where, port = config.output.metrics, health_port(env)
    if where is None and port is None:
        yield None
        return
    slurm = env.get("SLURM_JOB_ID") or None
    watched = Watched(run_id, config.group_rank, record, slurm_job_id=slurm, lost_seconds=lost_seconds)
    with contextlib.ExitStack() as stack:
        if where is not None:
            bound = _open(
                stack, metrics.serving(watched, where.bind_host, where.port), "--metrics-port", where
            )
            logger.info(f"metrics: http://{format_endpoint(where.bind_host, bound)}/metrics")
        if port is not None:
            loopback = Endpoint("127.0.0.1", port)
            bound = _open(stack, health.serving(watched, "127.0.0.1", port), health.HEALTH_PORT_ENV, loopback)
            logger.info(f"health check: http://127.0.0.1:{bound}/healthz ({health.HEALTH_PORT_ENV})")
        yield watched


def _open(
    stack: contextlib.ExitStack, server: contextlib.AbstractContextManager[int], what: str, where: Endpoint
) -> int:
    try:
        return stack.enter_context(server)
    except OSError as exc:
        raise UsageError(f"{what}: cannot serve on {where}: {exc.strerror or exc}") from None
