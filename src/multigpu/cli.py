"""``multigpu`` command line: ``run``, ``demo`` and ``devices``. Parses into RunConfig; imports no torch.

Every ``run`` option may also come from ``MULTIGPU_<OPTION>`` (``--grace-period`` from
``MULTIGPU_GRACE_PERIOD``); the command line wins. Usage mistakes exit 2 with one line, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

from ._version import __version__
from .config import RunConfig
from .devices import dedupe, parse_index_list, visible_gpus
from .endpoint import parse_endpoint
from .environment import inside_launched_worker
from .errors import MultiGPUError, UsageError
from .layout import apply_layout, parse_int, parse_rdzv_conf

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line plus a pointer to --help."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


@dataclass(frozen=True)
class Option:
    flag: str
    metavar: str
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env_name(self) -> str:
        return "MULTIGPU_" + self.dest.upper()


RUN_OPTIONS = (
    Option("--gpus", "SPEC", "visible GPU indices, e.g. 0,1, or 'all' (default: every visible GPU)"),
    Option("--cpu", "N", "run N CPU workers (gloo) instead of GPUs"),
    Option("--output", "DIR", "run directory (default: ./multigpu_runs/<run id>)"),
    Option("--run-id", "ID", "job id shared by every node (default: generated, or SLURM_JOB_ID)"),
    Option("--log-ranks", "LIST", "ranks shown on the console, e.g. 0,2 (log files keep every rank)"),
    Option("--rdzv-endpoint", "HOST:PORT", "c10d store address (default: 127.0.0.1, a free port)"),
    Option("--rdzv-timeout", "S", "seconds to wait for peer nodes (default 600)"),
    Option("--base-rank", "R", "global rank of this node's first worker (multi-node)"),
    Option("--world-size", "W", "total workers over all nodes (multi-node)"),
    Option("--nnodes", "N|MIN:MAX", "node count, when every node runs the same number of workers; MIN:MAX "
                                    "(with --rdzv-backend c10d) for an elastic job"),
    Option("--node-rank", "I", "this node's index, with --nnodes"),
    Option("--grace-period", "S", "seconds between SIGTERM and SIGKILL at teardown (default 5)"),
    Option("--hang-timeout", "S", "stop the run, with stack dumps, after S seconds without progress"),
    Option("--max-restarts", "K", "restart the whole group up to K times after a failure (default 0)"),
    Option("--status", "MODE", "live status view: auto (on a terminal), on, off", ("auto", "on", "off")),
    # -- elastic (B): the minimal torchrun rendezvous options; helper A's parser supersedes these at merge
    Option("--rdzv-backend", "NAME", "static (default) or c10d: torch's elastic rendezvous on the endpoint"),
    Option("--rdzv-conf", "K=V,...", "rendezvous settings, e.g. join_timeout=600,last_call_timeout=30"),
    Option("--rdzv-id", "ID", "torchrun's name for --run-id"),
)
_VALUE_FLAGS = {o.flag for o in RUN_OPTIONS}


def _run_parser() -> _Parser:
    parser = _Parser(
        prog="multigpu run",
        usage="multigpu run [options] SCRIPT [ARGS...]\n       multigpu run [options] -m MODULE [ARGS...]",
        description="Launch SCRIPT (or -m MODULE) once per device with torchrun's environment.",
        epilog="Every option may also be set as MULTIGPU_<OPTION>, e.g. MULTIGPU_GRACE_PERIOD=2.",
        allow_abbrev=False,  # split_run_argv knows only the full flags: '--out DIR' must not eat DIR
    )
    for opt in RUN_OPTIONS:
        parser.add_argument(opt.flag, metavar=opt.metavar, help=opt.help, choices=opt.choices)
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    return parser


def split_run_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Our options, then the target and its arguments, passed on untouched."""
    ours: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return ours, list(argv[i + 1:])
        if token == "-m":
            return ours + list(argv[i:i + 2]), list(argv[i + 2:])
        if token.startswith("-m") and len(token) > 2 and not token.startswith("--"):
            return [*ours, "-m", token[2:]], list(argv[i + 1:])
        if not token.startswith("-") or token == "-":
            return ours, list(argv[i:])
        ours.append(token)
        if token in _VALUE_FLAGS and i + 1 < len(argv):
            ours.append(argv[i + 1])
            i += 1
        i += 1
    return ours, []


def _seconds(value: str, flag: str, *, positive: bool = False) -> float:
    try:
        number = float(value)
    except ValueError:
        raise UsageError(f"{flag} must be a number of seconds, got {value!r}") from None
    if number < 0 or (positive and number == 0) or number != number:
        raise UsageError(f"{flag} must be {'more than' if positive else 'at least'} 0, got {value}")
    return number


def _choose_devices(gpus: str | None, cpu: str | None,
                    env: Mapping[str, str]) -> tuple[str, int, tuple[int, ...], str | None]:
    """(device, local worker count, GPU indices, a note for the user)."""
    if gpus is not None and cpu is not None:
        raise UsageError("give either --gpus or --cpu, not both")
    if cpu is not None:
        return "cpu", parse_int(cpu, "--cpu", 1), (), None
    visible = visible_gpus(env)
    if gpus is None:
        if not visible:
            return "cpu", 1, (), "no GPU is visible: running 1 CPU worker (use --cpu N for more)"
        return "cuda", len(visible), tuple(g.index for g in visible), None
    if gpus.strip().lower() == "all":
        indices = [g.index for g in visible]
    else:
        try:
            indices = dedupe(parse_index_list(gpus, what="--gpus"), what="--gpus")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if not visible:
        raise UsageError("--gpus: no GPU is visible on this machine; use --cpu N for N CPU workers")
    missing = [i for i in indices if i >= len(visible)]
    if missing:
        raise UsageError(f"--gpus: GPU {missing[0]} is not visible; {len(visible)} visible "
                         f"(indices 0-{len(visible) - 1}, see 'multigpu devices')")
    return "cuda", len(indices), tuple(indices), None


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


def _check_target(script: str | None, module: str | None) -> None:
    if module is not None:
        top = module.split(".")[0]
        if not module or not _module_exists(top):
            raise UsageError(f"module {module!r} not found (no package {top!r} on sys.path)")
        return
    if script is None:
        raise UsageError("no script given: multigpu run [options] SCRIPT [ARGS...] (or -m MODULE)")
    if not Path(script).is_file():
        raise UsageError(f"script {script!r} not found")


def _option_value(ns: argparse.Namespace, option: Option, env: Mapping[str, str]) -> str | None:
    """The command line's value, else ``MULTIGPU_<OPTION>`` (an empty variable counts as unset)."""
    given = getattr(ns, option.dest)
    return given if given is not None else (env.get(option.env_name) or None)


def parse_run_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[RunConfig, str | None]:
    """The RunConfig for ``multigpu run ARGV``, and a note to print (or None)."""
    env = os.environ if env is None else env
    ours, rest = split_run_argv(argv)
    ns = _run_parser().parse_args(ours)
    values = {o.dest: _option_value(ns, o, env) for o in RUN_OPTIONS}
    if ns.gpus is not None or ns.cpu is not None:  # a device choice on the command line beats the env's
        values["gpus"], values["cpu"] = ns.gpus, ns.cpu
    if values["status"] not in (None, "auto", "on", "off"):
        raise UsageError(f"MULTIGPU_STATUS must be auto, on or off, got {values['status']!r}")
    module = ns.module
    script = None if module is not None else (rest[0] if rest else None)
    target_args = rest if module is not None else rest[1:]
    device, nproc, gpus, note = _choose_devices(values["gpus"], values["cpu"], env)
    _check_target(script, module)
    endpoint = parse_endpoint(values["rdzv_endpoint"], option="--rdzv-endpoint") \
        if values["rdzv_endpoint"] else None
    log_ranks = None
    if values["log_ranks"]:
        try:
            log_ranks = frozenset(parse_index_list(values["log_ranks"], what="--log-ranks"))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    config = RunConfig(
        target=module if module is not None else str(script),
        target_args=tuple(target_args),
        module=module is not None,
        device=device,
        nproc=nproc,
        gpus=gpus,
        output_dir=Path(values["output"]) if values["output"] else None,
        run_id=values["run_id"],
        log_ranks=log_ranks,
        rdzv_endpoint=endpoint,
        rdzv_timeout=_seconds(values["rdzv_timeout"], "--rdzv-timeout", positive=True)
        if values["rdzv_timeout"] else 600.0,
        grace_period=_seconds(values["grace_period"], "--grace-period")
        if values["grace_period"] else 5.0,
        hang_timeout=_seconds(values["hang_timeout"], "--hang-timeout", positive=True)
        if values["hang_timeout"] else None,
        max_restarts=parse_int(values["max_restarts"], "--max-restarts", 0) if values["max_restarts"] else 0,
        status=values["status"] or "auto",
    )
    config = _with_rendezvous(config, values)
    config = apply_layout(config, values, env)
    return config, note


# -- elastic (B): torchrun's rendezvous options into RunConfig's fields (helper A's parser supersedes this)
def _with_rendezvous(config: RunConfig, values: Mapping[str, str | None]) -> RunConfig:
    backend = (values["rdzv_backend"] or "static").strip().lower()
    if backend in ("etcd", "etcd-v2"):
        raise UsageError(f"--rdzv-backend {backend} is not supported; use --rdzv-backend c10d")
    if backend not in ("static", "c10d"):
        raise UsageError(f"--rdzv-backend must be static or c10d, got {backend!r}")
    run_id = config.run_id
    if values["rdzv_id"]:
        if run_id is not None and run_id != values["rdzv_id"]:
            raise UsageError(f"--rdzv-id {values['rdzv_id']!r} contradicts --run-id {run_id!r}")
        run_id = values["rdzv_id"]
    return replace(config, rdzv_backend=backend, run_id=run_id,
                   rdzv_conf=parse_rdzv_conf(values["rdzv_conf"] or ""))


def cmd_run(argv: Sequence[str]) -> int:
    if inside_launched_worker():
        raise UsageError("already inside a multigpu or torchrun worker (TORCHELASTIC_RUN_ID is set); "
                         "run the script directly instead of launching a nested group")
    config, note = parse_run_args(argv)
    if note:
        print(f"multigpu: {note}", file=sys.stderr, flush=True)
    from .launcher import launch

    return launch(config)


def cmd_devices(argv: Sequence[str]) -> int:
    parser = _Parser(prog="multigpu devices", description="List the visible GPUs (no CUDA context).")
    parser.parse_args(argv)
    gpus = visible_gpus()
    if not gpus:
        print("No GPU is visible. Run CPU workers instead: multigpu run --cpu N SCRIPT")
        return 0
    for g in gpus:
        mem = (f"{g.memory_used_mib} / {g.memory_total_mib} MiB" if g.memory_total_mib is not None
               else "memory unknown (install nvidia-ml-py)")
        print(f"{g.index}: {g.name}  {mem}  ({g.uuid or 'device ' + g.ordinal})")
    return 0


def cmd_demo(argv: Sequence[str]) -> int:
    from .demo import main as demo_main

    return demo_main(list(argv))


COMMANDS = {"run": cmd_run, "demo": cmd_demo, "devices": cmd_devices}

HELP = f"""usage: multigpu [--version] COMMAND [ARGS...]

Launch and supervise PyTorch distributed training on GPUs or CPU workers.

commands:
  run       launch a script or module once per device (a drop-in for torchrun)
  demo      a real DDP training run on the default devices
  devices   list the visible GPUs

'multigpu COMMAND --help' describes each command. Version {__version__}.
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(HELP, end="")
        return 0 if argv else EXIT_USAGE
    if argv[0] in ("-V", "--version"):
        print(f"multigpu {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    try:
        if command is None:
            raise UsageError(f"unknown command {argv[0]!r}; try 'multigpu --help'")
        return command(argv[1:])
    except UsageError as exc:
        name = f"multigpu {argv[0]}" if command else "multigpu"
        print(f"{name}: error: {exc}", file=sys.stderr)
        if command is not None:
            print(f"Run '{name} --help' for usage.", file=sys.stderr)
        return EXIT_USAGE
    except MultiGPUError as exc:
        print(f"multigpu: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
