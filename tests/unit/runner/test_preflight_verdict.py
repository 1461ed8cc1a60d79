"""The preflight's verdict (``runner/preflight_verdict.py``): which node is slow, the lines every node
says from the same figures, which slow nodes leave an elastic round, and run.json's entry."""

from __future__ import annotations

from multigpu.contract.preflight_wire import Figures
from multigpu.runner.preflight_verdict import SLOW_BELOW, leavers, record_entry, slow_nodes, verdict_lines

HEALTHY = [Figures(14.2, 2.1), Figures(13.0, 2.0), Figures(15.1, 2.2)]


def test_a_node_whose_matmul_is_under_half_the_others_median_is_slow() -> None:
    assert SLOW_BELOW == 0.5
    assert slow_nodes(HEALTHY) == []
    assert slow_nodes([*HEALTHY, Figures(0.9, 2.1)]) == [3]
    # all_reduce names no node: the healthy node waits longest for a throttled one, so it sees the
    # lowest figure (as measured here: 0.139 GB/s on the healthy node, 1.16 on the throttled one)
    assert slow_nodes([Figures(145.0, 0.139), Figures(14.4, 1.16)]) == [1]
    assert slow_nodes([Figures(14.0, 0.3), *HEALTHY]) == []
    assert slow_nodes([Figures(14.0, 2.0), Figures(7.1, 2.0)]) == []  # just above half: noise, not slow
    assert slow_nodes([Figures(14.0, 2.0)]) == []  # one node: nobody to compare with


def test_the_slow_node_is_named_with_its_figures_beside_the_others() -> None:
    figures = [Figures(14.2, 2.1), Figures(0.9, 0.3), Figures(14.2, 2.1)]
    lines, refusal = verdict_lines(figures, 1.2, "on")
    assert lines == [
        "preflight: node 1 is slow: matmul 0.9 GFLOP/s (others 14.2); all_reduce 0.3 GB/s between the nodes; "
        "running anyway (--preflight=strict refuses)"
    ]
    assert refusal is None
    lines, refusal = verdict_lines(figures, 1.2, "strict")
    assert lines == [] and refusal is not None
    assert refusal.startswith("node 1 is slow: matmul 0.9") and refusal.endswith("(--preflight=strict)")


def test_a_healthy_check_is_one_line_with_its_figures_and_time() -> None:
    lines, refusal = verdict_lines(HEALTHY, 1.23, "strict")
    assert refusal is None
    assert lines == [
        "preflight: every node healthy (3 nodes, 1.2s): matmul 14.2 GFLOP/s, all_reduce 2.1 GB/s (medians)"
    ]


def test_the_record_holds_every_node_and_the_verdict() -> None:
    entry = record_entry([Figures(14.0, 2.0), Figures(1.0, 2.0)], 0.8, "strict")
    assert entry["verdict"] == "refused" and entry["slow_nodes"] == [1]
    assert entry["nodes"]["1"] == {"matmul_gflops": 1.0, "all_reduce_gbps": 2.0}
    assert record_entry(HEALTHY, 0.8, "on")["verdict"] == "healthy"
    assert record_entry([Figures(14.0, 2.0), Figures(1.0, 2.0)], 0.8, "on")["verdict"] == "slow"
    withdrawn = record_entry([Figures(14.0, 2.0), Figures(1.0, 2.0)], 0.8, "strict", withdrawn=[1])
    assert withdrawn["verdict"] == "withdrawn"


def test_the_slow_leave_where_enough_nodes_are_left_and_none_of_them_serves_the_store() -> None:
    assert leavers([2], nodes=3, min_nodes=2, store_host=0) == [2]
    assert leavers([2], nodes=3, min_nodes=3, store_host=0) == []  # too few without it
    assert leavers([2], nodes=3, min_nodes=1, store_host=2) == []  # it serves the store
    assert leavers([1, 2], nodes=3, min_nodes=1, store_host=None) == [1, 2]  # `multigpu store` serves it
    assert leavers([], nodes=3, min_nodes=1, store_host=0) == []
