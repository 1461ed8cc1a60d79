"""SLURM: under ``srun`` with one launcher task per node, the layout comes from SLURM's variables."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

_GROUP = re.compile(r"\[([^\]]*)\]")


def _split_top_level(text: str) -> list[str]:
    """Split ``a[1-2],b,c[3,5]`` on the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (part.strip() for part in parts) if p]


def _expand_range(spec: str) -> list[str]:
    out = []
    for item in spec.split(","):
        lo, sep, hi = item.partition("-")
        if not sep:
            out.append(lo)
            continue
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """``node[01-04,07],gpu[1-2]`` -> ``node01 … node04 node07 gpu1 gpu2`` (SLURM's compressed form)."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        pieces = _GROUP.split(part)  # literal, range, literal, range, ...
        choices = [[p] if i % 2 == 0 else _expand_range(p) for i, p in enumerate(pieces)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


@dataclass(frozen=True)
class SlurmLayout:
    master_host: str
    node_rank: int
    nnodes: int
    job_id: str


def detect(env: Mapping[str, str]) -> SlurmLayout | None:
    """The layout of an ``srun`` step with one task per node, or None when not in one."""
    if "SLURM_JOB_ID" not in env or "SLURM_NODEID" not in env or "SLURM_STEP_ID" not in env:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    try:
        nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "1")
        node_rank = int(env["SLURM_NODEID"])
        ntasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or str(nnodes))
    except ValueError:
        return None
    if ntasks != nnodes:
        return None  # not one launcher per node: leave the layout to the user
    hosts = expand_nodelist(nodelist)
    if not hosts:
        return None
    return SlurmLayout(master_host=hosts[0], node_rank=node_rank, nnodes=nnodes, job_id=env["SLURM_JOB_ID"])
