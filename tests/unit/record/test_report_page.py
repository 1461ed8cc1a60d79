"""``report.html``'s timeline: each rank's life, and an orange band while it was a straggler."""

from __future__ import annotations

from typing import Any

from multigpu.record.report_page import page, table, timeline_svg


def run(progress: dict[str, Any]) -> dict[str, Any]:
    ranks = {str(r): {"start_time": 100.0, "end_time": 200.0, "state": "succeeded"} for r in (0, 1)}
    return {
        "run_id": "r",
        "status": "succeeded",
        "end_time": 200.0,
        "incidents": [],
        "attempts": [{"attempt": 0, "ranks": ranks, "progress": progress}],
    }


def test_a_straggling_span_is_a_band_on_its_rank_with_the_line() -> None:
    line = "rank 1 (node 0, pid 7) is a straggler: it enters collectives 20 ms (40%) after the others"
    svg = timeline_svg(
        run(
            {
                "1": {
                    "straggler": line,
                    "straggling": [
                        {
                            "start_time": 150.0,
                            "end_time": None,
                            "late_s": 0.02,
                            "late_share": 0.4,
                            "collectives": 300,
                        }
                    ],
                }
            }
        )
    )
    assert svg.count('class="life"') == 2 and svg.count('class="straggler"') == 1
    band = svg.split('class="straggler"')[1]
    assert 'y="38"' in band and "20 ms (40%)" in band  # rank 1's row; its line as the title
    x = float(band.split('x="')[1].split('"')[0])
    assert 80 + (900 - 90) * 0.5 - 1 < x < 80 + (900 - 90) * 0.5 + 1  # halfway: 150 s of 100-200


def test_no_band_without_a_straggler() -> None:
    assert 'class="straggler"' not in timeline_svg(run({"0": {"step": 3}}))
    assert 'class="straggler"' not in timeline_svg(run({}))


def test_the_report_says_where_the_time_went_with_effective_training_first() -> None:
    data = run({})
    data["ledger"] = {
        "seconds": {"starting": 2.0, "training": 6.0, "hang_undetected": 2.0, "preflight": 0.0},
        "wall_seconds": 10.0,
        "effective_training_percent": 60.0,
    }
    assert table(data)[1] == "effective training 60.0% of 10.0s; lost: starting 2.0s, hang_undetected 2.0s"
    html = page(data)
    assert "effective training time: 60.0% of 10.0s" in html
    assert "<td>training</td><td>6.0s</td><td>60.0%</td>" in html and "<td>preflight</td>" not in html
    del data["ledger"]  # a record an older multigpu wrote: no such part
    assert len(table(data)) == 1 and "where the time went" not in page(data)
