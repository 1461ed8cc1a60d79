"""The preflight check's wire format, both ways: the task the launcher hands its node's check (one JSON
argument) and the result the check prints back (one JSON line on stdout).

Shared by the launcher (``runner/preflight.py`` builds the task and reads the result) and the check
process (``preflight/check.py`` reads the task and writes the result), so it is standard library only
and each side's JSON is written in one place.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PreflightTask:
    """What the launcher asks of its node's check."""

    host: str
    port: int
    """The job's c10d store."""
    prefix: str
    """The check's keys in it (``multigpu/<run id>/preflight/<round>``)."""
    node: int
    nodes: int
    device: str
    """``cpu`` or ``cuda:<i>``."""
    timeout_s: float
    """The check's own bound on every wait (its store, its peers, each collective)."""
    launcher: int
    """The launcher's pid: the check ends with it."""

    def encode(self) -> str:
        """The task as the check's one argument (the launcher's side)."""
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> PreflightTask:
        """The task from the check's argument (the check's side); TypeError for a wrong set of fields."""
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Figures:
    """One node's results."""

    matmul_gflops: float
    all_reduce_gbps: float


@dataclass(frozen=True)
class PreflightResult:
    """What a node's check found: every node's figures, by node rank (they gathered them), and how long
    the check took on this node."""

    figures: tuple[Figures, ...]
    seconds: float

    def encode(self) -> str:
        """The check's one line on stdout (the check's side)."""
        rows = [[f.matmul_gflops, f.all_reduce_gbps] for f in self.figures]
        return json.dumps({"figures": rows, "seconds": self.seconds})

    @classmethod
    def decode(cls, line: str) -> PreflightResult:
        """The check's line (the launcher's side); ValueError, KeyError, IndexError or TypeError for a
        line that is not one."""
        data = json.loads(line)
        figures = tuple(Figures(float(row[0]), float(row[1])) for row in data["figures"])
        return cls(figures, float(data["seconds"]))
