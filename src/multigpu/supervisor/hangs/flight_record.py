"""torch's collective flight recorder: the rank side writes a dump on request, the launcher reads them
all and says which rank is missing from which collective.

torch keeps, per process, a ring buffer of the last collectives of every process group
(``TORCH_FR_BUFFER_SIZE`` entries; ``environment.flight_recorder_env`` turns it on for GPU ranks). On a
hang the launcher sends ``FR_SIGNAL`` to each rank; a thread of the rank's bootstrap (``rank/dump_signal.py``)
calls ``torch._C._distributed_c10d._dump_nccl_trace`` (NCCL) or ``_dump_fr_trace`` (gloo and the
others) and writes the pickled dump to ``<prefix><rank>``, the file name torch's own dump on a NCCL
timeout uses (``TORCH_FR_DUMP_TEMP_FILE``). A dump is a dict: ``version``, ``pg_config`` (group name ->
ranks), ``pg_status`` (pg id -> last enqueued/started/completed sequence number) and ``entries``, one
per collective: ``pg_id``, ``process_group`` (name, description), ``collective_seq_id``,
``profiling_name`` (``nccl:all_reduce``), ``state``, ``is_p2p``.

The reading side never imports torch, and unpickles with a loader that refuses every class: a dump
holds only dicts, lists, strings and numbers.
"""

from __future__ import annotations

import ast
import os
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multigpu.contract.flight_dump import load_dump


def read_dumps(prefix: str | Path, newer_than: float = 0.0) -> dict[int, dict[str, Any]]:
    """Every ``<prefix><rank>`` file written since ``newer_than`` (wall clock) that holds a readable
    dump, by rank: a file an earlier run left at a path the user chose is not this hang's."""
    prefix = Path(prefix)
    dumps: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(prefix.parent)
    except OSError:
        return dumps
    for name in names:
        rank = name[len(prefix.name) :]
        if not name.startswith(prefix.name) or not rank.isdigit():
            continue
        path = prefix.parent / name
        try:
            if path.stat().st_mtime < newer_than:
                continue
            dumps[int(rank)] = load_dump(path.read_bytes())
        except (OSError, ValueError, pickle.UnpicklingError, EOFError):
            continue
    return dumps


@dataclass
class _Group:
    name: str
    desc: str = ""
    members: set[int] = field(default_factory=set)
    last: dict[int, int] = field(default_factory=dict)
    """rank -> the highest collective sequence number it entered."""
    completed: dict[int, int] = field(default_factory=dict)
    ops: dict[int, str] = field(default_factory=dict)


def _groups(dumps: dict[int, dict[str, Any]], expected: set[int]) -> dict[str, _Group]:
    groups: dict[str, _Group] = {}
    for rank, dump in dumps.items():
        pg_names: dict[str, str] = {}
        for e in dump.get("entries") or []:
            if e.get("is_p2p"):
                continue
            name, desc = [*(e.get("process_group") or ("?", "")), "", ""][:2]
            g = groups.setdefault(str(name), _Group(str(name), str(desc)))
            seq = int(e.get("collective_seq_id") or 0)
            g.last[rank] = max(g.last.get(rank, 0), seq)
            g.ops.setdefault(seq, str(e.get("profiling_name") or "?"))
            pg_names[str(e.get("pg_id"))] = str(name)
        for pg_id, status in (dump.get("pg_status") or {}).items():
            group = groups.get(pg_names.get(str(pg_id), ""))
            if group is not None and isinstance(status, dict):
                enqueued = int(status.get("last_enqueued_collective", 0))
                group.last[rank] = max(group.last.get(rank, 0), enqueued)
                group.completed[rank] = int(status.get("last_completed_collective", -1))
        for name, config in (dump.get("pg_config") or {}).items():
            group = groups.get(str(name))
            if group is not None and isinstance(config, dict):
                group.members |= _ranks(config.get("ranks"))
    for g in groups.values():
        if not g.members:
            g.members = set(expected) if g.desc == "default_pg" else set(g.last)
    return groups


def _ranks(text: Any) -> set[int]:
    try:
        value = ast.literal_eval(text) if isinstance(text, str) else text
        return {int(r) for r in value}
    except (ValueError, SyntaxError, TypeError):
        return set()


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


@dataclass(frozen=True)
class Finding:
    ranks: list[int]
    """The ranks it blames (missing from a collective, or without a dump); none when all are stuck."""
    line: str


def missing_ranks(dumps: dict[int, dict[str, Any]], expected: set[int] | None = None) -> list[Finding]:
    """The findings, the most telling first: "rank 1 is missing from collective #6 (gloo:all_reduce)
    of process group 0 (default_pg); rank 0 entered it"."""
    expected = set(dumps) if expected is None else set(expected)
    findings: list[tuple[int, Finding]] = []
    for g in _groups(dumps, expected).values():
        if not g.last:
            continue
        top = max(g.last.values())
        behind: dict[int, list[int]] = defaultdict(list)
        for rank in sorted(g.members & set(dumps)):
            if g.last.get(rank, 0) < top:
                behind[g.last.get(rank, 0) + 1].append(rank)
        where = f"of process group {g.name}" + (f" ({g.desc})" if g.desc else "")
        for seq, ranks in sorted(behind.items()):
            entered = sorted(r for r, last in g.last.items() if last >= seq)
            verb = "is" if len(ranks) == 1 else "are"
            findings.append(
                (
                    seq,
                    Finding(
                        ranks,
                        f"{_ranks_text(ranks)} {verb} missing from collective "
                        f"#{seq} ({g.ops.get(seq, '?')}) {where}; "
                        f"{_ranks_text(entered)} entered it",
                    ),
                )
            )
        here = g.members & set(dumps)
        stuck = [r for r in here if g.completed.get(r, top) < top == g.last.get(r)]
        if not behind and stuck and len(stuck) == len(here):
            who = "every rank" if g.members <= here else "every rank that wrote a dump"  # other nodes
            findings.append(
                (
                    top,
                    Finding(
                        [],
                        f"{who} entered collective #{top} "
                        f"({g.ops.get(top, '?')}) {where}, and none completed it",
                    ),
                )
            )
    silent = sorted(expected - set(dumps))
    result = [f for _, f in sorted(findings, key=lambda item: item[0])]
    if silent and dumps:
        result.append(Finding(silent, f"{_ranks_text(silent)} wrote no flight-recorder dump"))
    return result
