"""``multigpu.launch``'s arguments into the one typed ``RunConfig``, as ``multigpu run``'s options would be.

Runs in the caller. ``options`` are ``multigpu run``'s settings by their Python names; each maps to the
one field of ``RunConfig`` that holds it, so its default and meaning are written once, in
``config/run.py``. The devices are resolved here: ``nprocs=None`` means every visible GPU, and a machine
without one gets a one-line error asking for ``nprocs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from multigpu.cluster.devices import visible_gpus
from multigpu.config.run import OutputConfig, RunConfig, new_run_id
from multigpu.contract.environment import Device
from multigpu.contract.errors import UsageError

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
}
"""Each option's Python name and the (section, field) of ``RunConfig`` that holds it."""

_CONVERT: dict[str, Callable[[Any], Any]] = {
    "output": lambda v: None if v is None else Path(v).resolve(),
    "preload": tuple,
    "log_ranks": lambda v: None if v is None else frozenset(v),
}


def resolve_devices(
    nprocs: int | None, device: str, env: Mapping[str, str]
) -> tuple[Device, int, tuple[int, ...]]:
    """(device, rank count, GPU indices) for ``nprocs`` ranks on ``device`` ("auto", "cuda" or "cpu")."""
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if nprocs is not None and (not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1):
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    gpus = [] if device == "cpu" else [g.index for g in visible_gpus(env)]
    if device == "cpu" or (device == "auto" and not gpus):
        if nprocs is None:
            raise UsageError("multigpu.launch: no GPU is visible here; pass nprocs=N to run N CPU ranks")
        return "cpu", nprocs, ()
    count = len(gpus) if nprocs is None else nprocs
    if not gpus or count > len(gpus):
        raise UsageError(
            f"multigpu.launch: {count} GPU rank(s) asked for, {len(gpus)} GPU(s) visible; "
            "pass a smaller nprocs, or device='cpu'"
        )
    return "cuda", count, tuple(gpus[:count])


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
        section, field = OPTIONS[name]
        convert = _CONVERT.get(name)
        sections.setdefault(section, {})[field] = convert(value) if convert is not None else value
    for section, fields in sections.items():
        config = dataclasses.replace(
            config, **{section: dataclasses.replace(getattr(config, section), **fields)}
        )
    run_id = config.output.run_id or new_run_id()
    out = config.output.dir or (Path("multigpu_runs") / run_id).resolve()
    return dataclasses.replace(config, output=dataclasses.replace(config.output, dir=out, run_id=run_id))
