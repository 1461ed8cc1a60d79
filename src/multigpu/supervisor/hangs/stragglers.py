"""Stragglers: a rank whose steps or sections take markedly longer than the other ranks' (its median
over a window against theirs), named once on the console and in run.json (``book.ProgressBook``).

Runs in the launcher (and OTX's caller); pure arithmetic on the ranks' recorded times.
"""

from __future__ import annotations

import math
import statistics

from multigpu.supervisor.states import RankProgress

STRAGGLER_MIN_GAP_S = 0.005
"""A straggler must also be this much slower in absolute terms: microsecond jitter is not a story."""


def find_stragglers(ranks: dict[int, RankProgress], window: int, ratio: float) -> dict[int, str]:
    """Ranks whose median section time (or step interval) over the last ``window`` is more than
    ``ratio`` times the median of the other ranks' medians, with the numbers
    (``HangPolicy.straggler_window``, ``straggler_ratio``)."""
    series: dict[str, dict[int, list[float]]] = {}
    for r, p in ranks.items():
        for name, times in p.section_times.items():
            if len(times) >= window:
                series.setdefault(f"section {name!r}", {})[r] = list(times)[-window:]
        if len(p.intervals) >= window:
            series.setdefault("step interval", {})[r] = list(p.intervals)[-window:]
    found: dict[int, str] = {}
    for what, per_rank in series.items():
        if len(per_rank) < 2:
            continue
        medians = {r: statistics.median(v) for r, v in per_rank.items()}
        for r, mine in medians.items():
            others = statistics.median([m for q, m in medians.items() if q != r])
            if mine > ratio * others and mine - others >= STRAGGLER_MIN_GAP_S and r not in found:
                factor = mine / others if others > 0 else math.inf
                found[r] = (
                    f"rank {r} is a straggler: its {what} takes {mine:.3g}s (median of the last "
                    f"{window}) against {others:.3g}s on the other ranks ({factor:.1f}x)"
                )
    return found
