"""A hang, once called: the line that names who stopped progressing first, the notice that names no
rank, and the ``Hang`` failures the report gets. Runs in the launcher (and an OTX caller), in the
supervisor's loop, from what the ``ProgressBook`` (``book.py``) knows of each rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from multigpu.contract.failure import FailureKind, WorkerFailure
from multigpu.supervisor.hangs.culprit import find_culprits
from multigpu.supervisor.states import RankProgress

if TYPE_CHECKING:
    from multigpu.supervisor.hangs.flight_record import Finding
    from multigpu.supervisor.states import Worker

TIE_S = 0.01
"""Ranks whose last progress at the same step is this close are named together: no one is first."""


@dataclass(frozen=True)
class Timeout:
    seconds: float
    why: str


@dataclass(frozen=True)
class Hang:
    """A hang decision: the ranks that stopped first, in order, and the line that says so."""

    culprits: list[int]
    line: str
    quiet: dict[int, float]
    """Seconds since each running rank's last progress, when the hang was called."""
    notice: str = ""
    """What is known before any stack is read, naming no rank: the first line on the console."""


def hang_line(
    ranks: Mapping[int, RankProgress],
    ordered: list[int],
    quiet: dict[int, float],
    limit: Timeout,
    late: set[int],
) -> tuple[list[int], str]:
    """The culprits, the ranks tied first at the front, and the line that names them: ``ordered`` is
    who stopped first (``ProgressBook.order``), ``late`` the ranks past their timeout."""
    first = ordered[0]
    p = ranks[first]
    window = min(TIE_S, 0.05 * quiet[first])
    tied = [
        r
        for r in ordered
        if r in late and ranks[r].step == p.step and ranks[r].last_progress - p.last_progress <= window
    ]
    where = f"at step {p.step}" if p.step is not None else "before any step"
    if p.section is not None:
        where += f" in section {p.section!r}"
    names = ", ".join(str(r) for r in tied)
    who = f"rank {names}" if len(tied) == 1 else f"ranks {names}"
    others = [r for r in ordered if r not in tied]
    rest = "; ".join(f"rank {r} {_at(ranks[r])}, {quiet[r]:.1f}s ago" for r in others[:4])
    why = limit.why if limit.why.startswith("no rank") else f"timeout {limit.seconds:.3g}s, {limit.why}"
    line = f"{who} stopped progressing first: last progress {quiet[first]:.1f}s ago {where} ({why})" + (
        f"; {rest}" if rest else ""
    )
    return tied + others, line


def hang_notice(ranks: Mapping[int, RankProgress], running: list[int], silent: float, limit: Timeout) -> str:
    """``no progress for 5.0s since step 29 (--hang-timeout 5s)``: the silence and the last step any
    rank here reached, before the stacks say who holds the job up."""
    steps = [s for r in running if (s := ranks[r].step) is not None]
    since = f" since step {max(steps)}" if steps else ""
    why = (
        f"--hang-timeout {limit.seconds:g}s"
        if limit.why.startswith(("no rank", "--hang"))
        else f"timeout {limit.seconds:.3g}s, {limit.why}"
    )
    return f"no progress for {silent:.1f}s{since} ({why})"


def _at(p: RankProgress) -> str:
    return "before any step" if p.step is None else f"at step {p.step}"


def hang_failures(
    hang: Hang, running: list[Worker], flight: list[Finding], wall_now: float
) -> list[WorkerFailure]:
    """One ``Hang`` failure per running rank, the first culprit first in time (the report's root
    cause); its message is the report's first line: the flight recorder's findings when there are
    any (which rank is missing from which collective; those ranks go first), then the ranks whose
    stacks are outside torch.distributed while the others wait in it (``culprit.py``), then who
    stopped progressing first."""
    blamed = [r for f in flight for r in f.ranks]
    stacks = find_culprits({w.rank: w.dumps.stacks for w in running})
    outside = stacks.ranks if stacks is not None else []
    culprits = [*dict.fromkeys([r for r in blamed if r in hang.culprits] + outside + hang.culprits)]
    order = {r: i for i, r in enumerate(culprits)}
    progress = hang.line.split(" stopped progressing first: ", 1)[-1] if stacks else hang.line
    first = "; ".join([*(f.line for f in flight), *([stacks.line] if stacks else []), progress])
    failures = []
    base = wall_now - max(hang.quiet.values(), default=0.0)  # the earliest last progress, roughly
    for w in sorted(running, key=lambda w: order.get(w.rank, len(order))):
        quiet = hang.quiet.get(w.rank, 0.0)
        message = first if w.rank == culprits[0] else f"no progress for {quiet:.1f}s"
        failures.append(
            dataclasses.replace(
                w.ended_with(None),
                error_type=FailureKind.HANG,
                message=message,
                traceback="\n".join(w.dumps.stacks) or None,
                time=base + order.get(w.rank, len(order)) * 1e-3,
            )
        )  # sorted later: keeps the culprits' order
    return failures
