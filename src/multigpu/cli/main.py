"""``multigpu`` command line: the dispatch of ``run``, ``demo``, ``devices``, ``report``, ``stacks``,
``status``, ``store`` and ``etcd``, and how a command's failure ends the launcher. Runs in the launcher;
imports no torch. ``run``'s parsing into RunConfig is ``run_args``'s; its parser and ``--help``,
``run_parser``'s.

Every ``run`` option may also come from ``MULTIGPU_<OPTION>`` (``--grace-period`` from
``MULTIGPU_GRACE_PERIOD``); the command line wins. Usage mistakes exit 2 with one line, never a traceback.
"""

from __future__ import annotations

import atexit
import gc
import signal
import sys
from collections.abc import Sequence

from multigpu._version import __version__
from multigpu.cli.run_args import parse_run_args
from multigpu.cli.run_parser import Parser
from multigpu.cluster.devices import visible_gpus
from multigpu.console.writer import ensure_std_fds
from multigpu.contract.environment import inside_launched_worker
from multigpu.contract.errors import Interrupted, MultiGPUError, UsageError
from multigpu.contract.exitcodes import EXIT_USAGE


def cmd_run(argv: Sequence[str]) -> int:
    if inside_launched_worker():
        raise UsageError(
            "already inside a multigpu or torchrun worker (TORCHELASTIC_RUN_ID is set); "
            "run the script directly instead of launching a nested group"
        )
    config, note = parse_run_args(argv)
    if note:
        print(f"multigpu: {note}", file=sys.stderr, flush=True)
    from multigpu.runner.attempts import launch

    return launch(config)


def cmd_devices(argv: Sequence[str]) -> int:
    parser = Parser(prog="multigpu devices", description="List the visible GPUs (no CUDA context).")
    parser.parse_args(argv)
    gpus = visible_gpus()
    if not gpus:
        print("No GPU is visible. Run CPU workers instead: multigpu run --cpu N SCRIPT")
        return 0
    for g in gpus:
        mem = (
            f"{g.memory_used_mib} / {g.memory_total_mib} MiB"
            if g.memory_total_mib is not None
            else "memory unknown (install nvidia-ml-py)"
        )
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


def cmd_etcd(argv: Sequence[str]) -> int:
    from multigpu.cli.etcd_cluster import cmd_etcd as etcd

    return etcd(argv)


COMMANDS = {
    "run": cmd_run,
    "demo": cmd_demo,
    "devices": cmd_devices,
    "report": cmd_report,
    "stacks": cmd_stacks,
    "status": cmd_status,
    "store": cmd_store,
    "etcd": cmd_etcd,
}

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
  etcd      a local 3-member etcd cluster, for trying --rdzv-backend etcd-v2

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
        return exc.launcher_exit
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
