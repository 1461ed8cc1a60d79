"""What torchrun's options change in each worker's spec: its log files, console streams and environment.

The launcher's spec builder asks here, so the per-option rules live in one place: ``--log-dir``,
``-r``/``-t`` and ``--logs-specs`` (torchrun's file layout), ``--role``, ``--virtual-local-rank`` and
``--numa-binding``. Imports torch only for a ``--logs-specs`` plugin, which is torch's own API.
"""

from __future__ import annotations

import functools
import os
import string
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from multigpu.cluster import numa
from multigpu.cluster.devices import visible_gpus
from multigpu.config.run import RunConfig
from multigpu.contract.environment import error_file_env
from multigpu.contract.errors import UsageError
from multigpu.contract.files import open_folder
from multigpu.contract.names import AFFINITY_ENV, format_cpulist
from multigpu.record.folder import open_checked, resolve_output
from multigpu.supervisor.states import LineCopy

BOTH = frozenset({"stdout", "stderr"})


@dataclass(frozen=True)
class RankLogs:
    """One local rank's torchrun files, and which of its streams the console shows."""

    stream_files: dict[str, Path] = field(default_factory=dict)
    console_streams: frozenset[str] = BOTH
    error_file: Path | None = None


def torchrun_attempt_dir(
    config: RunConfig, run_id: str, output_dir: Path, attempt: int, launcher_pid: int
) -> Path | None:
    """torchrun's ``<log_dir>/<run id>_<suffix>/attempt_<k>`` (DefaultLogsSpecs), or None without
    ``--log-dir``/``-r``/``-t``. ``-r``/``-t`` without ``--log-dir`` write under the run's output
    directory (torchrun picks a temporary one). ``--log-dir /dev/null`` is torchrun's "no files": no
    folder, nothing redirected, every stream on the console (the run's own logs stay)."""
    if config.output.log_dir == Path(os.devnull):
        return None
    if config.output.log_dir is None and not config.output.redirects.given and not config.output.tee.given:
        return None
    base = config.output.log_dir if config.output.log_dir is not None else output_dir / "torchrun_logs"
    return _run_log_dir(base, run_id, launcher_pid) / f"attempt_{attempt}"


@functools.lru_cache(maxsize=8)
def _run_log_dir(base: Path, run_id: str, launcher_pid: int) -> Path:
    """``<base>/<run id>_<random>``, made once per launcher and run (``launcher_pid`` and ``run_id``
    are the cache's key), so every attempt of one launcher finds the same directory. The suffix is
    mkdtemp's, as torchrun's ``DefaultLogsSpecs._make_log_dir``: nobody can guess the name and plant a
    link there beforehand. ``base`` is resolved and checked as an output folder is (this user's, no
    link of another user's on the way: ``record/folder.py``)."""
    real = resolve_output(base, "--log-dir")
    os.close(open_checked(real, "--log-dir"))
    try:
        return Path(tempfile.mkdtemp(prefix=f"{run_id}_", dir=real))
    except OSError as exc:
        raise UsageError(f"--log-dir {base}: {exc.strerror or exc}") from None


def default_rank_logs(config: RunConfig, local_rank: int, attempt_dir: Path | None) -> RankLogs:
    """DefaultLogsSpecs' layout: ``attempt_<k>/<local rank>/{stdout,stderr}.log`` and ``error.json``."""
    if attempt_dir is None:
        return RankLogs()
    rank_dir = attempt_dir / str(local_rank)
    os.close(open_folder(rank_dir, create=True))  # torchrun makes it even with nothing redirected
    redirected = config.output.redirects.streams(local_rank)
    teed = config.output.tee.streams(local_rank)
    files = {name: rank_dir / f"{name}.log" for name in sorted(redirected | teed)}
    return RankLogs(files, BOTH - (redirected - teed), rank_dir / "error.json")


def line_copies(
    config: RunConfig,
    local_rank: int,
    rank: int,
    files: RankLogs,
    attempt_dir: Path | None,
    env: Mapping[str, str],
) -> tuple[LineCopy, ...]:
    """``--duplicate-std{out,err}-filters``: torchrun copies matching lines of the *teed* streams (those
    both in a file and on the console, of the ranks ``--local-ranks-filter`` keeps) to
    ``attempt_<k>/filtered_std{out,err}.log``, each after the rank's log-line header."""
    if attempt_dir is None:
        return ()
    keep = config.output.local_ranks_filter
    shown = keep is None or local_rank in keep
    template = env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    header = (
        string.Template(template).safe_substitute(
            role_name=config.start.role, rank=str(rank), local_rank=str(local_rank)
        )
        if template
        else f"[{config.start.role}{local_rank}]:"
    )
    copies = []
    for name, needles in (
        ("stdout", config.output.duplicate_stdout_filters),
        ("stderr", config.output.duplicate_stderr_filters),
    ):
        if needles:  # the file exists even when no rank's stream is teed, as under torchrun
            teed = shown and name in files.stream_files and name in files.console_streams
            copies.append(
                LineCopy(
                    name,
                    attempt_dir / f"filtered_{name}.log",
                    tuple(n.encode() for n in needles) if teed else (),
                    header.encode(),
                )
            )
    return tuple(copies)


@dataclass(frozen=True)
class _LogsSpecs:
    """What a ``torchrun.logs_specs`` plugin is made with: ``--logs-specs NAME``, ``--log-dir``,
    ``-r``, ``-t`` and ``--local-ranks-filter``."""

    name: str
    log_dir: str | None
    redirects: str
    tee: str
    ranks: frozenset[int] | None


@functools.lru_cache(maxsize=4)
def _plugin(specs: _LogsSpecs, run_id: str, launcher_pid: int) -> Any:
    """One ``torchrun.logs_specs`` instance per launcher and run (``run_id`` and ``launcher_pid`` are
    the cache's key), as torchrun keeps one for the job (its run directory is made once, on the first
    attempt)."""
    from torch.distributed.elastic.multiprocessing.api import Std

    (entry,) = metadata.entry_points(group="torchrun.logs_specs", name=specs.name)
    return entry.load()(
        log_dir=specs.log_dir,
        redirects=Std.from_str(specs.redirects),
        tee=Std.from_str(specs.tee),
        local_ranks_filter=set(specs.ranks) if specs.ranks is not None else None,
    )


def plugin_rank_logs(
    config: RunConfig, run_id: str, launcher_pid: int, envs: dict[int, dict[str, str]]
) -> list[RankLogs]:
    """``--logs-specs NAME``: the plugin's ``reify`` decides every path, as under torchrun."""
    output = config.output
    assert output.logs_specs is not None
    log_dir = str(output.log_dir) if output.log_dir is not None else None
    specs = _LogsSpecs(
        output.logs_specs, log_dir, output.redirects.text, output.tee.text, output.local_ranks_filter
    )
    spec = _plugin(specs, run_id, launcher_pid)
    dest = spec.reify(envs)
    answer = []
    for rank in sorted(envs):
        files = {
            name: Path(path)
            for name, path in (("stdout", dest.stdouts.get(rank)), ("stderr", dest.stderrs.get(rank)))
            if path
        }
        hidden = {
            name
            for name, teed in (("stdout", dest.tee_stdouts), ("stderr", dest.tee_stderrs))
            if name in files and rank not in teed
        }
        error = dest.error_files.get(rank)
        answer.append(RankLogs(files, BOTH - hidden, Path(error) if error and error != os.devnull else None))
    return answer


def rank_affinity(config: RunConfig, base_env: Mapping[str, str]) -> list[list[int] | None]:
    """``--numa-binding``: the CPUs of each local rank, or None where sysfs does not say."""
    if config.start.numa_binding is None:
        return [None] * config.nproc
    allowed = set(os.sched_getaffinity(0))
    if config.device != "cuda":
        return numa.cpu_rank_cpus(config.nproc, allowed)
    visible = {g.index: g.ordinal for g in visible_gpus(base_env)}
    bus = numa.gpu_bus_ids()
    ids = [
        bus[int(o)] if o.isdigit() and int(o) < len(bus) else ""
        for o in (visible.get(i, "") for i in config.gpus)
    ]
    return numa.gpu_rank_cpus(config.start.numa_binding, ids, allowed)


def apply_to_env(
    env: dict[str, str],
    config: RunConfig,
    local_rank: int,
    cpus: list[int] | None,
    cuda_visible_devices: str | None,
    error_file: Path,
) -> dict[str, str]:
    """torchrun's per-option changes to one worker's environment."""
    env["ROLE_NAME"] = config.start.role
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.start.signals_to_handle  # torchrun: its launcher's
    env.update(error_file_env(str(error_file)))
    if config.start.virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        if cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices.split(",")[local_rank]
    env.pop(AFFINITY_ENV, None)
    if cpus:
        env[AFFINITY_ENV] = format_cpulist(cpus)
    return env
