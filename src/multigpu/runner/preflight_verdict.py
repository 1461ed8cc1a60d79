"""The preflight's verdict: which node is slow, its figures beside the others', the lines that say so and
run.json's entry. Pure: every node's launcher reaches the same verdict here from the same numbers (each
node's check gathered every node's figures), so no node has to tell another what it decided.

Runs in the launcher (``runner/preflight.py`` calls it once the check's result is read).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from multigpu.contract.preflight_wire import Figures

SLOW_BELOW = 0.5
"""A node whose figure is under this share of the median of the other nodes' is slow (one threshold,
for both figures): far outside the noise of a healthy node, well inside a throttled or shared one."""

METRICS = (("matmul", "matmul_gflops", "GFLOP/s"), ("all_reduce", "all_reduce_gbps", "GB/s"))
"""(what the line calls it, the field, its unit), in the line's order."""


def others_median(figures: Sequence[Figures], node: int, field: str) -> float:
    return statistics.median(float(getattr(f, field)) for n, f in enumerate(figures) if n != node)


def slow_nodes(figures: Sequence[Figures]) -> list[int]:
    """The nodes whose matmul is under ``SLOW_BELOW`` x the median of the others' (none alone).

    The all_reduce figure names no node: each node times the same collective, and the time it sees
    includes its wait for the others, so a slow node, arriving last, sees the shortest time and the
    healthy ones the longest (two nodes here, one throttled: 1.16 GB/s on the slow node, 0.139 on the
    healthy one). It is the job's figure (``job_all_reduce``)."""
    if len(figures) < 2:
        return []
    field = "matmul_gflops"
    return [
        n
        for n, mine in enumerate(figures)
        if mine.matmul_gflops < SLOW_BELOW * others_median(figures, n, field)
    ]


def job_all_reduce(figures: Sequence[Figures]) -> float:
    """The nodes' all_reduce as the job sees it: the longest any node waited for it (lowest GB/s)."""
    return min(f.all_reduce_gbps for f in figures)


def slow_line(figures: Sequence[Figures], node: int) -> str:
    """``node 1 is slow: matmul 0.9 GFLOP/s (others 14.2); all_reduce 0.3 GB/s between the nodes``."""
    mine, others = figures[node].matmul_gflops, others_median(figures, node, "matmul_gflops")
    return (
        f"node {node} is slow: matmul {mine:.3g} GFLOP/s (others {others:.3g}); "
        f"all_reduce {job_all_reduce(figures):.3g} GB/s between the nodes"
    )


def healthy_line(figures: Sequence[Figures], seconds: float) -> str:
    """The one line of a healthy check: the median figures and how long it took."""
    parts = [
        f"{name} {statistics.median(getattr(x, f) for x in figures):.3g} {unit}" for name, f, unit in METRICS
    ]
    return f"every node healthy ({len(figures)} nodes, {seconds:.1f}s): {', '.join(parts)} (medians)"


def verdict_lines(figures: Sequence[Figures], seconds: float, mode: str) -> tuple[list[str], str | None]:
    """(the console's lines, the refusal's text or None): every node comes to the same. The lines are
    warnings where a node is slow, else the one healthy line."""
    slow = slow_nodes(figures)
    if not slow:
        return [f"preflight: {healthy_line(figures, seconds)}"], None
    named = [slow_line(figures, node) for node in slow]
    if mode == "strict":
        return [], f"{'; '.join(named)}; every node refuses the job (--preflight=strict)"
    return [f"preflight: {line}; running anyway (--preflight=strict refuses)" for line in named], None


def leavers(slow: Sequence[int], nodes: int, min_nodes: int, store_host: int | None) -> list[int]:
    """The slow nodes that leave an elastic round themselves (torch's rendezvous cannot exclude another
    node): all of them, where the ``nodes - len(slow)`` left are at least ``min_nodes`` and none of the
    slow serves the job's store (``store_host``); else none."""
    enough = nodes - len(slow) >= min_nodes
    return list(slow) if slow and enough and store_host not in slow else []


def record_entry(
    figures: Sequence[Figures], seconds: float, mode: str, withdrawn: Sequence[int] = ()
) -> dict[str, Any]:
    """run.json's ``preflight`` (``withdrawn``: the slow nodes that left an elastic round)."""
    slow = slow_nodes(figures)
    verdict = "withdrawn" if withdrawn else "refused" if mode == "strict" else "slow"
    return {
        "mode": mode,
        "verdict": verdict if slow else "healthy",
        "slow_nodes": slow,
        "seconds": round(seconds, 3),
        "nodes": {
            str(n): {"matmul_gflops": f.matmul_gflops, "all_reduce_gbps": f.all_reduce_gbps}
            for n, f in enumerate(figures)
        },
        "slow_below": SLOW_BELOW,
    }
