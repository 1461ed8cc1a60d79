"""``multigpu run``'s argparse parser and its ``--help``, built from the option table (``options``);
``Parser`` parses ``multigpu devices`` too.

Runs in the launcher; imports no torch. A usage mistake is one line (``UsageError``), never argparse's
own exit, so ``main`` reports every command's mistakes the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, NoReturn

from multigpu.cli import options
from multigpu.cli.option_table import Option
from multigpu.config.run import HangConfig, RendezvousConfig, StartConfig, SupervisionConfig
from multigpu.contract.errors import UsageError


class Parser(argparse.ArgumentParser):
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


class RunParser(Parser):
    """``multigpu run``'s parser: its help starts with ``RUN_EXAMPLES``."""

    def format_help(self) -> str:
        return RUN_EXAMPLES + super().format_help()


HELP_DEFAULTS: dict[str, tuple[type[Any], str]] = {
    "grace_period": (SupervisionConfig, "grace_period"),
    "rdzv_timeout": (RendezvousConfig, "timeout"),
    "max_restarts": (SupervisionConfig, "max_restarts"),
    "role": (StartConfig, "role"),
    "hang_factor": (HangConfig, "factor"),
    "hang_floor": (HangConfig, "floor"),
    "straggler_threshold": (HangConfig, "straggler_threshold"),
}
"""The defaults ``--help`` quotes, by the name its text uses, and where each is written."""


def _default_text(name: str) -> str:
    """A configuration default as --help shows it: the dataclass is where defaults are written."""
    group, field_name = HELP_DEFAULTS[name]
    value = {f.name: f.default for f in dataclasses.fields(group)}[field_name]
    return f"{value:g}" if isinstance(value, float) else str(value)


EVERYDAY = (
    "cpu",
    "gpus",
    "nproc_per_node",
    "module",
    "output",
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "max_restarts",
    "hang_timeout",
)
"""The options ``--help`` lists first, in this order: what a new user reaches for (ours and torchrun's)."""

KNOBS = (
    "run_id",
    "rdzv_timeout",
    "no_preflight",
    "grace_period",
    "hang_factor",
    "hang_floor",
    "straggler_threshold",
)
"""Our options ``--help`` lists after the rest of ours: another name for a setting, or a tuning knob."""

TORCHRUN_TITLE = "torchrun options (torch 2.13; dashes or underscores, --opt=value or --opt value)"


def help_groups() -> tuple[tuple[str, tuple[Option, ...]], ...]:
    """``--help``'s groups, in order: every option in exactly one, each group in the table's order."""
    by_dest = {opt.dest: opt for opt in options.ALL}
    first = (*EVERYDAY, *KNOBS)
    return (
        ("everyday options", tuple(by_dest[dest] for dest in EVERYDAY)),
        ("multigpu options", tuple(opt for opt in options.OURS if opt.dest not in first)),
        ("multigpu aliases and tuning knobs", tuple(by_dest[dest] for dest in KNOBS)),
        (TORCHRUN_TITLE, tuple(opt for opt in options.TORCHRUN if opt.dest not in first)),
    )


def run_parser() -> Parser:
    parser = RunParser(
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
    for title, table in help_groups():
        group = parser.add_argument_group(title)
        for opt in table:
            text = opt.help.format(**defaults).replace("%", "%%")
            if opt.takes_value:
                group.add_argument(
                    *opt.flags, dest=opt.dest, metavar=opt.metavar, help=text, choices=opt.choices
                )
            else:
                group.add_argument(*opt.flags, dest=opt.dest, action="store_true", default=None, help=text)
    return parser


def split_run_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Our options, then the target and its arguments, passed on untouched."""
    return options.split_argv(argv)
