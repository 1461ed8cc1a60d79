"""``multigpu run ARGV`` into a ``RunConfig``: the options resolved (``options.RunOptions``), then the
devices, the target and each group of options checked and applied. Runs in the launcher; imports no torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import sys
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from multigpu.cli import options
from multigpu.cli.layout import apply_layout, layout_options
from multigpu.cli.options import DeviceChoice, RunOptions
from multigpu.cli.preemption_flags import apply_preemption_options
from multigpu.cli.run_parser import run_parser, split_run_argv
from multigpu.cli.torchrun import apply_rank_filters, apply_torchrun_options
from multigpu.cluster.devices import (
    Devices,
    NotVisibleError,
    choose_devices,
    dedupe,
    parse_index_list,
    visible_gpus,
)
from multigpu.config.endpoint import format_endpoint, parse_endpoint
from multigpu.config.run import (
    HangConfig,
    LiveView,
    OutputConfig,
    Preflight,
    RunConfig,
    RunMode,
    StartConfig,
    SupervisionConfig,
)
from multigpu.contract.environment import Device, usable_cpu_count
from multigpu.contract.errors import UsageError
from multigpu.contract.names import DEBUG_SERVER_ENV, DEBUG_TOKEN_ENV
from multigpu.contract.values import integer, module_names, number, seconds
from multigpu.observe.serving import metrics_endpoint


def _choose_devices(
    choice: DeviceChoice, env: Mapping[str, str], torchrun_line: bool = False
) -> tuple[Device, int, tuple[int, ...], str | None]:
    """(device, local worker count, GPU indices, a note for the user).

    Without a device option, a torchrun line gets torchrun's default of one worker per node (its world
    size must not change with the launcher); any other line, one worker per visible GPU.
    """
    gpus, cpu, nproc = choice.gpus, choice.cpu, choice.nproc_per_node
    if gpus is None and cpu is None and nproc is None and torchrun_line:
        nproc = "1"
    if cpu is not None:
        found = choose_devices(0, device="cpu", count=integer(cpu, "--cpu", 1))
    elif nproc is not None:
        found = _nproc_per_node(nproc.strip().lower(), len(visible_gpus(env)))
    elif gpus is not None:
        found = _gpus_option(gpus, len(visible_gpus(env)))
    else:
        found = choose_devices(len(visible_gpus(env)), cpu_fallback=1)
        if found.device == "cpu":
            note = "no GPU is visible: running 1 CPU worker (use --cpu N for more)"
            return found.device, found.count, found.gpus, note
    return found.device, found.count, found.gpus, None


def _gpus_option(text: str, visible: int) -> Devices:
    """``--gpus all`` or ``--gpus 0,2``: a GPU that is not visible is refused, naming it."""
    indices = None
    if text.strip().lower() != "all":
        try:
            indices = dedupe(parse_index_list(text, what="--gpus"), what="--gpus")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:
        return choose_devices(visible, gpus=indices)
    except NotVisibleError as exc:
        if not visible:
            raise UsageError(
                "--gpus: no GPU is visible on this machine; use --cpu N for N CPU workers"
            ) from None
        raise UsageError(
            f"--gpus: GPU {exc.missing[0]} is not visible; {visible} visible "
            f"(indices 0-{visible - 1}, see 'multigpu devices')"
        ) from None


def _nproc_per_node(value: str, visible: int) -> Devices:
    """torchrun's ``--nproc-per-node``: local rank i uses visible GPU i, as ``set_device(LOCAL_RANK)``."""
    if value == "cpu" or (value == "auto" and not visible):
        return choose_devices(visible, device="cpu", count=usable_cpu_count())
    if value in ("gpu", "auto"):
        try:
            return choose_devices(visible)
        except NotVisibleError:
            raise UsageError("--nproc-per-node gpu: no GPU is visible; use a number or cpu") from None
    if value == "xpu":
        raise UsageError("--nproc-per-node xpu: XPU devices are not supported; use a number, gpu or cpu")
    if not value.isdigit():
        raise UsageError(f"--nproc-per-node must be a number, auto, gpu or cpu, got {value!r}")
    count = integer(value, "--nproc-per-node", 1)
    try:
        return choose_devices(visible, count=count, cpu_fallback=count)
    except NotVisibleError:
        raise UsageError(
            f"--nproc-per-node {count}: only {visible} GPU(s) visible, and rank i uses GPU i; "
            f"use --cpu {count} for CPU workers"
        ) from None


def _module_exists(name: str) -> bool:
    """Found the way a worker will look (current directory first, as ``python -m`` does), import
    hooks of editable installs included; the module itself is not imported."""
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path[:] = saved


def _runnable_by_python(path: Path) -> bool:
    """A file, or a directory or zip archive with a ``__main__.py``: what ``python PATH`` runs."""
    if path.is_dir():
        return (path / "__main__.py").is_file()
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            return "__main__.py" in archive.namelist()
    return path.is_file()


def _check_target(script: str | None, module: str | None, run_mode: RunMode) -> None:
    if module is not None:
        top = module.split(".")[0]
        if not module or not _module_exists(top):
            raise UsageError(f"module {module!r} not found (no package {top!r} on sys.path)")
        return
    if script is None:
        raise UsageError("no script given: multigpu run [options] SCRIPT [ARGS...] (or -m MODULE)")
    if run_mode == "exec":
        found = (
            shutil.which(script)
            if os.sep not in script
            else (script if os.access(script, os.X_OK) and Path(script).is_file() else None)
        )
        if found is None:
            raise UsageError(f"--no-python: program {script!r} not found or not executable")
        return
    if not Path(script).exists():
        raise UsageError(f"script {script!r} not found")
    if not _runnable_by_python(Path(script)):
        raise UsageError(f"{script!r} is a directory or archive without a __main__.py")


def _run_mode(values: RunOptions) -> tuple[RunMode, bool]:
    """(run mode, module mode), as torchrun: --run-path beats --no-python; -m with --no-python is refused."""
    module = bool(values.module)
    if values.run_path:
        return "python", module
    if values.no_python:
        if module:
            raise UsageError("--no-python and --module (-m) cannot be used together")
        return "exec", False
    return "python", module


_VIEWS: dict[str | None, LiveView] = {None: "auto", "auto": "auto", "on": "on", "off": "off"}


def _status(value: str | None) -> LiveView:
    view = _VIEWS.get(value)
    if view is None:
        raise UsageError(f"MULTIGPU_STATUS must be auto, on or off, got {value!r}")
    return view


def parse_run_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[RunConfig, str | None]:
    """The RunConfig for ``multigpu run ARGV``, and a note to print (or None)."""
    env = os.environ if env is None else env
    ours, rest = split_run_argv(argv)
    given = vars(run_parser().parse_args(ours))
    values = options.resolve(given, env)
    run_mode, module_mode = _run_mode(values)
    module = rest[0] if module_mode and rest else None
    script = None if module_mode else (rest[0] if rest else None)
    if module_mode and module is None:
        raise UsageError("-m/--module needs a module name: multigpu run [options] -m MODULE [ARGS...]")
    device, nproc, gpus, note = _choose_devices(
        options.device_choice(given, env), env, options.is_torchrun_line(values)
    )
    grace, hang_timeout, max_restarts, status, factor, floor = _our_values(values)
    config = RunConfig(
        target=module if module is not None else str(script),
        target_args=tuple(rest[1:]),
        module=module is not None,
        device=device,
        nproc=nproc,
        gpus=gpus,
        supervision=SupervisionConfig(grace_period=grace, max_restarts=max_restarts),
        hang=HangConfig(
            timeout=hang_timeout,
            factor=factor,
            floor=floor,
            straggler_threshold=HangConfig.straggler_threshold
            if values.straggler_threshold is None
            else number(
                values.straggler_threshold, "--straggler-threshold", 0, " (a share of the step, 0: off)"
            ),
        ),
        output=_output(values, status),
        start=StartConfig(run_mode=run_mode),
    )
    config = apply_torchrun_options(config, values)
    config = apply_layout(config, layout_options(config, values), env)
    config = apply_rank_filters(config, values)
    config = apply_preemption_options(config, values, env)
    config = _apply_template(config, values)
    config = _apply_preflight(config, values)
    config = _apply_debug_server(config, values.debug_server, env)
    if values.metrics_port is not None:
        where = metrics_endpoint(values.metrics_port)
        config = dataclasses.replace(config, output=dataclasses.replace(config.output, metrics=where))
    _check_target(script, module, run_mode)  # last: a wrong option is named before a missing file
    return config, note


def _output(values: RunOptions, status: LiveView) -> OutputConfig:
    """--output, --run-id, --status and --steps (the job's step count, for its ETA)."""
    return OutputConfig(
        dir=Path(values.output) if values.output else None,
        run_id=values.run_id,
        status=status,
        steps=integer(values.steps, "--steps", 1) if values.steps else None,
    )


def _our_values(values: RunOptions) -> tuple[float, float | None, int, LiveView, float, float]:
    """(grace period, hang timeout, max restarts, status, hang factor, hang floor), checked in this order."""
    grace, timeout, restarts = values.grace_period, values.hang_timeout, values.max_restarts
    return (
        seconds(grace, "--grace-period") if grace else SupervisionConfig.grace_period,
        seconds(timeout, "--hang-timeout", positive=True) if timeout else None,
        integer(restarts, "--max-restarts", 0) if restarts else SupervisionConfig.max_restarts,
        _status(values.status),
        number(values.hang_factor, "--hang-factor", 1, "") if values.hang_factor else HangConfig.factor,
        seconds(values.hang_floor, "--hang-floor") if values.hang_floor else HangConfig.floor,
    )


def _apply_template(config: RunConfig, values: RunOptions) -> RunConfig:
    """--no-template and --preload: checked last, as before any rank starts."""
    preload = module_names(values.preload or "", "--preload")
    supervision = dataclasses.replace(config.supervision, template=not values.no_template, preload=preload)
    return dataclasses.replace(config, supervision=supervision)


_PREFLIGHTS: dict[str | None, Preflight] = {None: "auto", "on": "on", "off": "off", "strict": "strict"}


def _apply_preflight(config: RunConfig, values: RunOptions) -> RunConfig:
    """--preflight MODE and --no-preflight (which must not contradict each other)."""
    mode = _PREFLIGHTS.get(values.preflight)
    if mode is None:
        raise UsageError(f"--preflight must be on, off or strict, got {values.preflight!r}")
    if values.no_preflight:
        if mode not in ("auto", "off"):
            raise UsageError(f"--no-preflight and --preflight {mode} cannot be used together")
        mode = "off"
    return dataclasses.replace(config, rdzv=dataclasses.replace(config.rdzv, preflight=mode))


DEBUG_MODULES = ("jinja2", "aiohttp", "tabulate")
"""What torch's debug server imports beyond torch (the ``debug`` extra)."""


def _apply_debug_server(config: RunConfig, value: str | None, env: Mapping[str, str]) -> RunConfig:
    """``--debug-server [HOST:]PORT``: loopback unless a host is given; its packages checked here, so a
    missing one is one line now, not a traceback in every rank."""
    if value is None:
        return config
    text = value.strip()
    where = parse_endpoint(f"127.0.0.1:{text}" if text.isdigit() else text, option="--debug-server")
    missing = [name for name in DEBUG_MODULES if not _importable(name)]
    if missing:
        raise UsageError(
            f"--debug-server needs {', '.join(missing)} (torch's debug server imports "
            f"{'it' if len(missing) == 1 else 'them'}): pip install 'multigpu[debug]'"
        )
    if where.port == 0:
        raise UsageError("--debug-server needs a port to open in a browser (0 would pick one no one is told)")
    if config.base_rank == 0:  # the page is served on rank 0's node: its port must be free there
        _check_free(where.bind_host, where.port)
    token = _debug_token(env)  # the page and every rank's server want it (rank/debug_server.py)
    env = {**config.extra_env, DEBUG_SERVER_ENV: json.dumps([where.bind_host, where.port, token])}
    return dataclasses.replace(
        config, extra_env=env, start=dataclasses.replace(config.start, debug_server=where)
    )


def _debug_token(env: Mapping[str, str]) -> str:
    """The run's token: the user's, the same on every node, or a new one (one node's launcher alone)."""
    given = env.get(DEBUG_TOKEN_ENV)
    if not given:  # an empty variable counts as unset
        return secrets.token_urlsafe(18)
    if not re.fullmatch(r"[A-Za-z0-9_-]{16,}", given):
        raise UsageError(
            f"{DEBUG_TOKEN_ENV} must be at least 16 letters, digits, '-' or '_' (it goes in the "
            f"debug page's address), e.g. python -c 'import secrets; print(secrets.token_urlsafe(18))'"
        )
    return given


def _check_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the page's server binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UsageError(
                f"--debug-server {format_endpoint(host, port)}: cannot listen there "
                f"({exc.strerror}); name another port"
            ) from None


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # absent, or broken: either way the debug server could not start
        return False
    return True
