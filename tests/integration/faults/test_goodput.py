"""The goodput ledger on a real run: rank 1 fails once (a restart), then stops stepping inside a
collective (a hang, ``--hang-timeout 3``), and the third attempt trains to the end. Every second of the
run's wall time is attributed to one cause, the causes sum to the wall time within 1%, and
``run.json``, ``multigpu report``, ``report.html`` and the run's last line say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import assert_gone, run_cli, write_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HANG_TIMEOUT = 3.0

JOB = """
    import os, time, torch, torch.distributed as dist, multigpu
    dist.init_process_group("gloo")
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_rank()
    t = torch.ones(1)
    for step in range(1, 21):
        if rank == 1 and step == 5 and attempt == 0:
            raise ValueError("loss is NaN")
        if rank == 1 and step == 5 and attempt == 1:
            time.sleep(600)  # stops stepping; rank 0 waits in its all_reduce: the job hangs
        dist.all_reduce(t)
        time.sleep(0.05)
        multigpu.heartbeat(step=step)
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("goodput")
    job = write_script(tmp, "job.py", JOB)
    args = ["run", "--cpu", "2", "--status", "off", "--max-restarts", "2", "--steps", "20"]
    res = run_cli(
        [*args, "--hang-timeout", str(HANG_TIMEOUT), "--output", str(tmp / "out"), str(job)], cwd=tmp
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((tmp / "out" / "run.json").read_text())
    assert_gone([r["pid"] for a in data["attempts"] for r in a["ranks"].values() if r["pid"]])
    return tmp / "out", res.stderr


def test_every_second_of_a_run_with_a_restart_and_a_hang_has_one_cause(run_dir: tuple[Path, str]) -> None:
    out, _ = run_dir
    data = json.loads((out / "run.json").read_text())
    assert [i["kind"] for i in data["incidents"]] == ["failed", "hung"]
    ledger, wall = data["ledger"], data["end_time"] - data["start_time"]
    seconds = ledger["seconds"]
    assert sum(seconds.values()) == pytest.approx(wall, rel=0.01), (seconds, wall)
    assert ledger["wall_seconds"] == pytest.approx(wall, rel=0.01)
    # the hang: from the last progress to the verdict, the timeout (plus the stacks' collection)
    assert HANG_TIMEOUT - 0.5 <= seconds["hang_undetected"] <= HANG_TIMEOUT + 3, seconds
    assert seconds["hang_handling"] > 0 and seconds["restarting"] > 0 and seconds["starting"] > 0
    assert seconds["training"] > 0.5, seconds  # 4 + 4 + 20 steps of at least 50 ms
    assert seconds["waiting_for_nodes"] < 0.5 and seconds["preflight"] == seconds["preemption"] == 0
    assert seconds["stopping"] == 0  # every failure was followed by a restart
    assert ledger["effective_training_percent"] == pytest.approx(100 * seconds["training"] / wall, abs=0.2)


def test_the_report_and_the_last_line_say_where_the_time_went(run_dir: tuple[Path, str]) -> None:
    out, stderr = run_dir
    percent = json.loads((out / "run.json").read_text())["ledger"]["effective_training_percent"]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"multigpu: effective training {percent:.1f}% of "), last
    assert "hang_undetected" in last and "restarting" in last
    res = run_cli(["report", str(out)], cwd=out)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[-2] == last.removeprefix("multigpu: ") and lines[-1].startswith("timeline: ")
    page = (out / "report.html").read_text()
    assert f"effective training time: {percent}% of " in page and "<td>hang_undetected</td>" in page
