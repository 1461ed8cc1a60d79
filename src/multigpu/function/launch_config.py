"""``multigpu.launch``'s arguments into the one typed ``RunConfig``, as ``multigpu run``'s options would be.

Runs in the caller. ``options`` are ``multigpu run``'s settings by their Python names; each maps to the
one field of ``RunConfig`` that holds it, so its default and meaning are written once, in
``config/run.py``. The devices are chosen by ``cluster/devices.choose_devices`` and worded here:
``nprocs=None`` means every visible GPU, and a machine without one gets a one-line error asking for
``nprocs``. Without ``output``, the run's record goes under the user's cache folder, whose history is
bounded (``run_history``), never into the working folder.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from multigpu.cluster.devices import (
    NotVisibleError,
    choose_devices,
    device_wish,
    parse_index_list,
    visible_gpus,
)
from multigpu.config.run import OutputConfig, RunConfig, new_run_id
from multigpu.contract.environment import Device
from multigpu.contract.errors import UsageError
from multigpu.contract.values import integer, module_names, number, seconds
from multigpu.function.run_history import default_output
from multigpu.observe.serving import metrics_endpoint
from multigpu.record.folder import check_run_id, resolve_output

OPTIONS: dict[str, tuple[str, str]] = {
    "hang_timeout": ("hang", "timeout"),
    "hang_factor": ("hang", "factor"),
    "hang_floor": ("hang", "floor"),
    "max_restarts": ("supervision", "max_restarts"),
    "grace_period": ("supervision", "grace_period"),
    "template": ("supervision", "template"),
    "preload": ("supervision", "preload"),
    "output": ("output", "dir"),
    "run_id": ("output", "run_id"),
    "log_ranks": ("output", "log_ranks"),
    "metrics_port": ("output", "metrics"),
    "steps": ("output", "steps"),
}
"""Each option's Python name and the (section, field) of ``RunConfig`` that holds it."""


def _text(value: Any, name: str) -> str:
    """What the command line would have been given: a string as is, a number as its digits, a list of
    them comma separated (``log_ranks=[0, 1]`` is ``--log-ranks 0,1``); anything else is refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (list, tuple, set, frozenset)) and name in _LISTS:
        return ",".join(_text(item, name) for item in value)
    raise UsageError(f"{name} must be {_WANTS.get(name, 'a number')}, got {value!r}")


def _output(value: Any, name: str) -> Path:
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise UsageError(f"{name} must be a folder path, got {value!r}")
    return resolve_output(Path(value))  # never through a link another user planted


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{name} must be True or False, got {value!r}")
    return value


def _ranks(value: Any, name: str) -> frozenset[int]:
    try:
        return frozenset(parse_index_list(_text(value, name), what=name))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


_LISTS = ("preload", "log_ranks")
_WANTS = {
    "preload": "module names (a list, or a comma-separated string)",
    "log_ranks": "ranks (a list, or a comma-separated string)",
    "run_id": "a name",
}

_PARSE: dict[str, Callable[[Any, str], Any]] = {
    "hang_timeout": lambda v, name: seconds(_text(v, name), name, positive=True),
    "hang_factor": lambda v, name: number(_text(v, name), name, 1, ""),
    "hang_floor": lambda v, name: seconds(_text(v, name), name),
    "max_restarts": lambda v, name: integer(_text(v, name), name, 0),
    "grace_period": lambda v, name: seconds(_text(v, name), name),
    "template": _flag,
    "preload": lambda v, name: module_names(_text(v, name), name),
    "output": _output,
    "run_id": lambda v, name: check_run_id(_text(v, name), name),
    "log_ranks": _ranks,
    "metrics_port": lambda v, name: metrics_endpoint(_text(v, name), name),
    "steps": lambda v, name: integer(_text(v, name), name, 1),
}
"""Each option checked by the parser ``multigpu run`` checks its flag with (``contract/values``, the run
id's ``record/folder.check_run_id``), so a wrong value is one ``UsageError`` in the caller before
anything starts; None is the option's default."""


def resolve_devices(
    nprocs: int | None, device: str, env: Mapping[str, str]
) -> tuple[Device, int, tuple[int, ...]]:
    """(device, rank count, GPU indices) for ``nprocs`` ranks on ``device`` ("auto", "cuda" or "cpu")."""
    wished = device_wish(device)
    if nprocs is not None and (not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1):
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    visible = 0 if wished == "cpu" else len(visible_gpus(env))
    if nprocs is None and (wished == "cpu" or (wished == "auto" and not visible)):
        raise UsageError("multigpu.launch: no GPU is visible here; pass nprocs=N to run N CPU ranks")
    try:
        found = choose_devices(visible, device=wished, count=nprocs, cpu_fallback=nprocs)
    except NotVisibleError:
        raise UsageError(
            f"multigpu.launch: {visible if nprocs is None else nprocs} GPU rank(s) asked for, "
            f"{visible} GPU(s) visible; pass a smaller nprocs, or device='cpu'"
        ) from None
    return found.device, found.count, found.gpus


def launch_config(
    nprocs: int | None, device: str, options: Mapping[str, Any], env: Mapping[str, str]
) -> RunConfig:
    """The run ``multigpu run`` would make of the same settings, in function mode, every rank started
    (its ``target``, the payload in the run folder, is the caller's to set)."""
    kind, count, gpus = resolve_devices(nprocs, device, env)
    config = RunConfig(
        target="", function=True, device=kind, nproc=count, gpus=gpus, output=OutputConfig(status="off")
    )
    sections: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        if name not in OPTIONS:
            known = ", ".join(sorted(OPTIONS))
            raise TypeError(
                f"multigpu.launch() got an unexpected keyword argument {name!r} (options: {known})"
            )
        if value is None:
            continue
        section, field = OPTIONS[name]
        try:
            sections.setdefault(section, {})[field] = _PARSE[name](value, name)
        except UsageError as exc:
            raise UsageError(f"multigpu.launch: {exc}") from None
    for section, fields in sections.items():
        config = dataclasses.replace(
            config, **{section: dataclasses.replace(getattr(config, section), **fields)}
        )
    run_id = config.output.run_id or new_run_id()
    # not ./multigpu_runs: a loop of launches would flood it; never through another user's link
    out = config.output.dir or resolve_output(default_output(run_id, env))
    return dataclasses.replace(config, output=dataclasses.replace(config.output, dir=out, run_id=run_id))
