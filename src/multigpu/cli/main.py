"""``multigpu`` command line: ``run``, ``demo`` and ``devices``. Parses into RunConfig; imports no torch.

Every ``run`` option may also come from ``MULTIGPU_<OPTION>`` (``--grace-period`` from
``MULTIGPU_GRACE_PERIOD``); the command line wins. Usage mistakes exit 2 with one line, never a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import importlib.util
import json
import os
import shutil
import signal
import socket
import sys
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from multigpu._version import __version__
from multigpu.cli import options
from multigpu.cli.layout import apply_layout, rendezvous_values
from multigpu.cli.preemption_flags import apply_preemption_options
from multigpu.cli.torchrun import apply_rank_filters, apply_torchrun_options
from multigpu.cluster.devices import dedupe, parse_index_list, visible_gpus
from multigpu.config.endpoint import format_endpoint, parse_endpoint
from multigpu.config.run import (
    HangConfig,
    LiveView,
    OutputConfig,
    RendezvousConfig,
    RunConfig,
    RunMode,
    StartConfig,
    SupervisionConfig,
)
from multigpu.console.writer import ensure_std_fds
from multigpu.contract.environment import Device, inside_launched_worker, usable_cpu_count
from multigpu.contract.errors import Interrupted, MultiGPUError, UsageError
from multigpu.contract.exitcodes import EXIT_USAGE
from multigpu.contract.names import DEBUG_SERVER_ENV
from multigpu.contract.values import integer, seconds


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line plus a pointer to --help; an unknown option
    close to a known one is answered with the known one ("did you mean ...?")."""

    def error(self, message: str) -> NoReturn:
        unknown = message.removeprefix("unrecognized arguments: ")
        if unknown != message:
            for word in unknown.split():
                hint = options.suggest(word)
                if hint is not None:
                    raise UsageError(f"unknown option {word.partition('=')[0]!r}; did you mean {hint!r}?")
        raise UsageError(message)


RUN_EXAMPLES = """examples:
  multigpu run --nproc-per-node 4 train.py --lr 0.1   # torchrun's line, 'torchrun' replaced
  multigpu run --cpu 2 train.py                       # 2 CPU workers (gloo), no GPU needed
  multigpu run --gpus 0,2 train.py                    # visible GPUs 0 and 2

"""
"""What ``multigpu run --help`` shows first: a newcomer copies a line before reading 150 lines."""


class _RunParser(_Parser):
    """``multigpu run``'s parser: its help starts with ``RUN_EXAMPLES``."""

    def format_help(self) -> str:
        return RUN_EXAMPLES + super().format_help()


HELP_DEFAULTS: dict[str, tuple[type[Any], str]] = {
    "grace_period": (SupervisionConfig, "grace_period"), "rdzv_timeout": (RendezvousConfig, "timeout"),
    "max_restarts": (SupervisionConfig, "max_restarts"), "role": (StartConfig, "role"),
    "hang_factor": (HangConfig, "factor"), "hang_floor": (HangConfig, "floor")}
"""The defaults ``--help`` quotes, by the name its text uses, and where each is written."""


def _default_text(name: str) -> str:
    """A configuration default as --help shows it: the dataclass is where defaults are written."""
    group, field_name = HELP_DEFAULTS[name]
    value = {f.name: f.default for f in dataclasses.fields(group)}[field_name]
    return f"{value:g}" if isinstance(value, float) else str(value)


def _run_parser() -> _Parser:
    parser = _RunParser(
        prog="multigpu run",
        usage="multigpu run [options] SCRIPT [ARGS...]\n       multigpu run [options] -m MODULE [ARGS...]",
        description="Launch SCRIPT (or -m MODULE) once per device with torchrun's environment. Every "
        "torchrun command line works with 'torchrun' replaced by 'multigpu run'.",
        epilog="Every option may also be set as MULTIGPU_<OPTION> (e.g. MULTIGPU_GRACE_PERIOD=2), and "
        "torchrun's as PET_<OPTION> (e.g. PET_NPROC_PER_NODE=2); the command line wins, then MULTIGPU_, "
        "then PET_.",
        allow_abbrev=False,  # split_argv knows only full flags: '--out DIR' must not eat DIR
    )
    defaults = {k: _default_text(k) for k in HELP_DEFAULTS}
    groups = (("multigpu options", options.OURS),
              ("torchrun options (torch 2.13; dashes or underscores, --opt=value or --opt value)",
               options.TORCHRUN))
    for title, table in groups:
        group = parser.add_argument_group(title)
        for opt in table:
            text = opt.help.format(**defaults).replace("%", "%%")
            if opt.takes_value:
                group.add_argument(*opt.flags, dest=opt.dest, metavar=opt.metavar, help=text,
                                   choices=opt.choices)
            else:
                group.add_argument(*opt.flags, dest=opt.dest, action="store_true", default=None, help=text)
    return parser


def split_run_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Our options, then the target and its arguments, passed on untouched."""
    return options.split_argv(argv)


def _factor(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not number >= 1:
        raise UsageError(f"--hang-factor must be a number of at least 1, got {value!r}")
    return number


def _choose_devices(choice: Mapping[str, str | None], env: Mapping[str, str],
                    torchrun_line: bool = False) -> tuple[Device, int, tuple[int, ...], str | None]:
    """(device, local worker count, GPU indices, a note for the user).

    Without a device option, a torchrun line gets torchrun's default of one worker per node (its world
    size must not change with the launcher); any other line, one worker per visible GPU.
    """
    gpus, cpu, nproc = choice["gpus"], choice["cpu"], choice["nproc_per_node"]
    if gpus is None and cpu is None and nproc is None and torchrun_line:
        nproc = "1"
    if cpu is not None:
        return "cpu", integer(cpu, "--cpu", 1), (), None
    visible = visible_gpus(env)
    if nproc is not None:
        return _nproc_per_node(nproc.strip().lower(), len(visible))
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


def _nproc_per_node(value: str, visible: int) -> tuple[Device, int, tuple[int, ...], str | None]:
    """torchrun's ``--nproc-per-node``: local rank i uses visible GPU i, as ``set_device(LOCAL_RANK)``."""
    if value == "cpu" or (value == "auto" and not visible):
        return "cpu", usable_cpu_count(), (), None
    if value in ("gpu", "auto"):
        if not visible:
            raise UsageError("--nproc-per-node gpu: no GPU is visible; use a number or cpu")
        return "cuda", visible, tuple(range(visible)), None
    if value == "xpu":
        raise UsageError("--nproc-per-node xpu: XPU devices are not supported; use a number, gpu or cpu")
    if not value.isdigit():
        raise UsageError(f"--nproc-per-node must be a number, auto, gpu or cpu, got {value!r}")
    count = integer(value, "--nproc-per-node", 1)
    if not visible:
        return "cpu", count, (), None
    if count > visible:
        raise UsageError(f"--nproc-per-node {count}: only {visible} GPU(s) visible, and rank i uses GPU i; "
                         f"use --cpu {count} for CPU workers")
    return "cuda", count, tuple(range(count)), None


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
        found = shutil.which(script) if os.sep not in script else (script if os.access(script, os.X_OK)
                                                                    and Path(script).is_file() else None)
        if found is None:
            raise UsageError(f"--no-python: program {script!r} not found or not executable")
        return
    if not Path(script).exists():
        raise UsageError(f"script {script!r} not found")
    if not _runnable_by_python(Path(script)):
        raise UsageError(f"{script!r} is a directory or archive without a __main__.py")


def _run_mode(values: Mapping[str, str | None]) -> tuple[RunMode, bool]:
    """(run mode, module mode), as torchrun: --run-path beats --no-python; -m with --no-python is refused."""
    module = values["module"] == "1"
    if values["run_path"] == "1":
        return "python", module
    if values["no_python"] == "1":
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
    given = vars(_run_parser().parse_args(ours))
    values = options.resolve(given, env)
    run_mode, module_mode = _run_mode(values)
    module = rest[0] if module_mode and rest else None
    script = None if module_mode else (rest[0] if rest else None)
    if module_mode and module is None:
        raise UsageError("-m/--module needs a module name: multigpu run [options] -m MODULE [ARGS...]")
    device, nproc, gpus, note = _choose_devices(options.device_choice(given, env), env,
                                                options.is_torchrun_line(values))
    grace, hang_timeout, max_restarts, status, factor, floor = _our_values(values)
    config = RunConfig(
        target=module if module is not None else str(script),
        target_args=tuple(rest[1:]),
        module=module is not None,
        device=device,
        nproc=nproc,
        gpus=gpus,
        supervision=SupervisionConfig(grace_period=grace, max_restarts=max_restarts),
        hang=HangConfig(timeout=hang_timeout, factor=factor, floor=floor),
        output=OutputConfig(dir=Path(values["output"]) if values["output"] else None, run_id=values["run_id"],
                            status=status),
        start=StartConfig(run_mode=run_mode),
    )
    config = apply_torchrun_options(config, values)
    config = apply_layout(config, rendezvous_values(config, values), env)
    config = apply_rank_filters(config, values)
    config = apply_preemption_options(config, values, env)
    config = _apply_template(config, values)
    config = _apply_debug_server(config, values["debug_server"])
    _check_target(script, module, run_mode)  # last: a wrong option is named before a missing file
    return config, note


def _our_values(values: Mapping[str, str | None]) -> tuple[float, float | None, int, LiveView, float, float]:
    """(grace period, hang timeout, max restarts, status, hang factor, hang floor), checked in this order."""
    grace, timeout, restarts = values["grace_period"], values["hang_timeout"], values["max_restarts"]
    return (seconds(grace, "--grace-period") if grace else SupervisionConfig.grace_period,
            seconds(timeout, "--hang-timeout", positive=True) if timeout else None,
            integer(restarts, "--max-restarts", 0) if restarts else SupervisionConfig.max_restarts,
            _status(values["status"]),
            _factor(values["hang_factor"]) if values["hang_factor"] else HangConfig.factor,
            seconds(values["hang_floor"], "--hang-floor") if values["hang_floor"] else HangConfig.floor)


def _apply_template(config: RunConfig, values: Mapping[str, str | None]) -> RunConfig:
    """--no-template and --preload: checked last, as before any rank starts."""
    preload = tuple(m.strip() for m in (values["preload"] or "").split(",") if m.strip())
    bad = [m for m in preload if not all(part.isidentifier() for part in m.split("."))]
    if bad:
        raise UsageError(f"--preload takes module names, comma separated; got {bad[0]!r}")
    supervision = dataclasses.replace(config.supervision, template=values["no_template"] != "1",
                                      preload=preload)
    return dataclasses.replace(config, supervision=supervision)


DEBUG_MODULES = ("jinja2", "aiohttp", "tabulate")
"""What torch's debug server imports beyond torch (the ``debug`` extra)."""


def _apply_debug_server(config: RunConfig, value: str | None) -> RunConfig:
    """``--debug-server [HOST:]PORT``: loopback unless a host is given; its packages checked here, so a
    missing one is one line now, not a traceback in every rank."""
    if value is None:
        return config
    text = value.strip()
    where = parse_endpoint(f"127.0.0.1:{text}" if text.isdigit() else text, option="--debug-server")
    missing = [name for name in DEBUG_MODULES if not _importable(name)]
    if missing:
        raise UsageError(f"--debug-server needs {', '.join(missing)} (torch's debug server imports "
                         f"{'it' if len(missing) == 1 else 'them'}): pip install 'multigpu[debug]'")
    if where.port == 0:
        raise UsageError("--debug-server needs a port to open in a browser (0 would pick one no one is told)")
    if config.base_rank == 0:  # the page is served on rank 0's node: its port must be free there
        _check_free(where.bind_host, where.port)
    env = {**config.extra_env, DEBUG_SERVER_ENV: json.dumps([where.bind_host, where.port])}
    return dataclasses.replace(config, extra_env=env,
                               start=dataclasses.replace(config.start, debug_server=where))


def _check_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the page's server binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UsageError(f"--debug-server {format_endpoint(host, port)}: cannot listen there "
                             f"({exc.strerror}); name another port") from None


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # absent, or broken: either way the debug server could not start
        return False
    return True


def cmd_run(argv: Sequence[str]) -> int:
    if inside_launched_worker():
        raise UsageError("already inside a multigpu or torchrun worker (TORCHELASTIC_RUN_ID is set); "
                         "run the script directly instead of launching a nested group")
    config, note = parse_run_args(argv)
    if note:
        print(f"multigpu: {note}", file=sys.stderr, flush=True)
    from multigpu.runner.attempts import launch

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
    """``multigpu demo``: a ``multigpu run`` of the demo module, by the same code path; then where its
    output went and what to try next."""
    from multigpu.cli import demo
    from multigpu.config.run import new_run_id

    args, run_id = demo.parse_args(argv), new_run_id()
    code = cmd_run(demo.run_line(args, run_id))
    demo.where_and_next(args, run_id)
    return code


def cmd_report(argv: Sequence[str]) -> int:
    from multigpu.cli.report import cmd_report as report

    return report(argv)


def cmd_stacks(argv: Sequence[str]) -> int:
    from multigpu.cli.report import cmd_ask

    return cmd_ask("stacks", argv)


def cmd_status(argv: Sequence[str]) -> int:
    from multigpu.cli.report import cmd_ask

    return cmd_ask("status", argv)


def cmd_store(argv: Sequence[str]) -> int:
    from multigpu.cli.store_server import cmd_store as store

    return store(argv)


COMMANDS = {"run": cmd_run, "demo": cmd_demo, "devices": cmd_devices, "report": cmd_report,
            "stacks": cmd_stacks, "status": cmd_status, "store": cmd_store}

HELP = f"""usage: multigpu [--version] COMMAND [ARGS...]

Launch and supervise PyTorch distributed training on GPUs or CPU workers.

commands:
  run       launch a script or module once per device (a drop-in for torchrun)
  demo      a real DDP training run on the default devices
  devices   list the visible GPUs
  report    where a run's time went: its incidents, and a timeline in report.html
  stacks    every live rank's Python stacks of a running job, without stopping it
  status    one line per rank of a running job
  store     serve elastic jobs' rendezvous store off the training nodes

'multigpu COMMAND --help' describes each command. Version {__version__}.
"""


def main(argv: Sequence[str] | None = None) -> int:
    ensure_std_fds()  # before anything opens a descriptor: closed 0-2 must not be reused
    # The interpreter's last collection walks torch's whole heap (0.5-2 s on a busy machine) after the
    # report is out; a frozen heap is not walked, so a failed job's launcher exits when it is done.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
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
    except KeyboardInterrupt as exc:
        interrupted(exc, argv[0])
        return 130


def interrupted(exc: KeyboardInterrupt, command: str | None) -> None:
    """A Ctrl-C that reached the command line: one line saying what stopped (``Interrupted`` knows;
    anywhere else no rank had started yet, and every ``finally`` on the way out has stopped what the
    command started), then the launcher dies of SIGINT, as Python does, so a shell loop stops too."""
    from multigpu.supervisor.stop_requests import end_with_signal
    from multigpu.template.process import close_early

    text = "interrupted (SIGINT)"
    if isinstance(exc, Interrupted) and str(exc):
        text = str(exc)
    elif command in ("run", "demo"):
        text += " while starting, before any rank started; nothing is left running"
    print(f"multigpu: {text}", file=sys.stderr)
    close_early()
    end_with_signal(signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
