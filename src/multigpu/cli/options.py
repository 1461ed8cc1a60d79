"""The options of ``multigpu run``: torchrun's (torch 2.13 ``torch/distributed/run.py``) and ours.

One table, the fields of ``RunOptions`` (their rows written in ``option_table``), drives the argument
splitter, the parser, ``--help``, the environment look-up and the typed object the rest of ``cli``
reads, so an option is written down once.
Values are looked up in this order: the command line, ``MULTIGPU_<DEST>``, then ``PET_<DEST>`` for
torchrun's options (as torchrun's ``argparse_util.env`` reads them), then the default. Imports no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from multigpu.cli.option_table import OPTION, Option, OurOptions, TorchrunOptions
from multigpu.contract.errors import UsageError


@dataclass(frozen=True)
class RunOptions(TorchrunOptions, OurOptions):
    """Every ``multigpu run`` option, resolved (``resolve``): the table itself, one field per option.

    The fields are ``option_table``'s rows, ours first, then torchrun's. A field's name is the option's
    dest (``MULTIGPU_<NAME>``); its metadata holds the ``Option`` (flags, help). Values stay text, checked
    where they are used: None when no source gives the option; a flag is True, or False when a variable
    sets it to 0.
    """


ALL = tuple(dataclasses.replace(f.metadata[OPTION], dest=f.name) for f in dataclasses.fields(RunOptions))
OURS = tuple(opt for opt in ALL if not opt.torchrun)
TORCHRUN = tuple(opt for opt in ALL if opt.torchrun)
BY_FLAG = {flag: opt for opt in ALL for flag in opt.flags}
SYNONYMS = (("grace_period", "shutdown_timeout"), ("run_id", "rdzv_id"))
"""Ours and torchrun's names for one setting: both work; two different values are a usage error."""


def expand_abbreviation(token: str) -> str:
    """torchrun (argparse) takes a unique prefix of its long options, e.g. ``--nnode=2``; so do we.

    Only torchrun's options: ours stay whole words, so a script's ``--out`` is never taken for ours.
    """
    name, sep, value = token.partition("=")
    if not name.startswith("--") or name in BY_FLAG:
        return token
    matches = {BY_FLAG[f] for opt in TORCHRUN for f in opt.flags if f.startswith(name) and len(name) > 2}
    return (matches.pop().flags[0] + sep + value) if len(matches) == 1 else token


def suggest(word: str) -> str | None:
    """The known option closest to a mistyped one (``--nproc-per-nod`` -> ``--nproc-per-node``), or None.

    Runs in the launcher, on a usage error. Underscores count as dashes, as in torchrun's spelling."""
    import difflib

    name = word.partition("=")[0]
    if not name.startswith("-"):
        return None
    known = sorted({flag.replace("_", "-") for flag in BY_FLAG if flag.startswith("--")})
    close = difflib.get_close_matches(name.replace("_", "-"), known, n=1, cutoff=0.75)
    return close[0] if close else None


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Launcher options, then the target and its arguments (passed on untouched).

    The first word that is not an option (or follows ``--``) is the target, as in torchrun. Our old
    ``-m MODULE`` and ``-mMODULE`` forms still work: ``-m`` is a flag, and the word after it is the target.
    """
    ours: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return ours, list(argv[i + 1 :])
        if token.startswith("-m") and len(token) > 2 and not token.startswith("--"):
            return [*ours, "-m"], [token[2:], *argv[i + 1 :]]
        if not token.startswith("-") or token == "-":
            return ours, list(argv[i:])
        token = expand_abbreviation(token)
        ours.append(token)
        option = BY_FLAG.get(token)
        if option is not None and option.takes_value:
            word = argv[i + 1] if i + 1 < len(argv) else None
            if option.value_in(word):
                ours.append(str(word))
                i += 1
            elif option.bare is not None:
                ours.append(option.bare)  # ``--preflight train.py``: the flag alone
        i += 1
    return ours, []


def flag_value(raw: str, name: str) -> bool:
    """A ``PET_``/``MULTIGPU_`` value of a flag: an integer, true when not 0, as torchrun's check_env."""
    try:
        return int(raw) != 0
    except ValueError:
        raise UsageError(f"{name} must be 0 or 1, got {raw!r}") from None


def resolve(given: Mapping[str, object], env: Mapping[str, str]) -> RunOptions:
    """Each option's value (a flag as True/False); synonyms resolved and checked."""
    levels: list[dict[str, str]] = [{}, {}, {}]
    for opt in ALL:
        value = given.get(opt.dest)
        if value is not None and value is not False:
            levels[0][opt.dest] = "1" if value is True else str(value)
        for index, name in zip((1, 2), opt.env_names(), strict=False):
            raw = env.get(name)
            if raw:  # an empty variable counts as unset
                levels[index][opt.dest] = (
                    ("1" if flag_value(raw, name) else "0") if not opt.takes_value else raw
                )
    texts: dict[str, str | None] = {}
    for opt in ALL:
        texts[opt.dest] = next((lv[opt.dest] for lv in levels if opt.dest in lv), None)
    for ours, theirs in SYNONYMS:
        level = next((lv for lv in levels if ours in lv or theirs in lv), {})
        a, b = level.get(ours), level.get(theirs)
        if a is not None and b is not None and a != b:
            raise UsageError(
                f"--{ours.replace('_', '-')} {a} and --{theirs.replace('_', '-')} {b} "
                "disagree; they are the same setting, give one"
            )
        texts[ours] = texts[theirs] = a if a is not None else b
    return RunOptions(**{opt.dest: _typed(opt, texts[opt.dest]) for opt in ALL})


def _typed(opt: Option, text: str | None) -> Any:
    """A resolved value as its ``RunOptions`` field holds it: text, or a flag's "1"/"0" as True/False."""
    return text if opt.takes_value or text is None else text == "1"


SHARED = frozenset({"nnodes", "node_rank", "rdzv_endpoint", "max_restarts"})
"""Options both launchers have always had: using them says nothing about whose line this is."""


def is_torchrun_line(values: RunOptions) -> bool:
    """Whether the options (command line or ``PET_``/``MULTIGPU_`` variables) use one only torchrun has;
    such a line gets torchrun's defaults where ours differ (one worker per node). A flag set to 0, or a
    value of "0", does not count."""
    return any(
        getattr(values, opt.dest) not in (None, False, "0") for opt in TORCHRUN if opt.dest not in SHARED
    )


@dataclass(frozen=True)
class DeviceChoice:
    """The option that chooses the workers, as text; at most one is set (``device_choice``)."""

    gpus: str | None = None
    cpu: str | None = None
    nproc_per_node: str | None = None


def device_choice(given: Mapping[str, object], env: Mapping[str, str]) -> DeviceChoice:
    """``--gpus``, ``--cpu`` and ``--nproc-per-node`` all choose the workers: the first source that names
    any of them decides, and it may name only one."""
    keys = tuple(f.name for f in dataclasses.fields(DeviceChoice))
    sources: list[tuple[str, dict[str, str]]] = [
        ("", {k: str(given[k]) for k in keys if given.get(k) is not None}),
        ("MULTIGPU_", {k: env[f"MULTIGPU_{k.upper()}"] for k in keys if env.get(f"MULTIGPU_{k.upper()}")}),
        ("PET_", {"nproc_per_node": env["PET_NPROC_PER_NODE"]} if env.get("PET_NPROC_PER_NODE") else {}),
    ]
    for prefix, found in sources:
        if len(found) > 1:
            names = " and ".join(
                f"{prefix}{k.upper()}" if prefix else "--" + k.replace("_", "-") for k in found
            )
            raise UsageError(f"give one of --gpus, --cpu, --nproc-per-node, not {names}")
        if found:
            return DeviceChoice(**found)
    return DeviceChoice()


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` as torchrun reads it, with a one-line error naming the option."""
    parts = text.split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise UsageError(f"--nnodes must be N or MIN:MAX, got {text!r}") from None
    if not 0 < low <= high:
        raise UsageError(f"--nnodes {text}: need 0 < MIN <= MAX")
    return low, high


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``key=value,...`` as torch's ``_parse_rendezvous_config``: every key needs a non-empty value."""
    config: dict[str, str] = {}
    if not text.strip():
        return config
    for item in text.strip().split(","):
        key, sep, value = item.partition("=")
        if not key.strip() or not sep or not value.strip():
            raise UsageError(f"--rdzv-conf {text!r}: write KEY=VALUE,KEY=VALUE (item {item!r})")
        config[key.strip()] = value.strip()
    return config


def comma_list(text: str) -> tuple[str, ...]:
    """torchrun's ``comma_separated_list``: split on ',', with ',,' for a literal comma."""
    placeholder = "\0"
    return tuple(item.replace(placeholder, ",") for item in text.replace(",,", placeholder).split(","))
