"""A hang found from progress, end to end: 2 CPU ranks on gloo report steps; rank 1 stops inside its
forward section while rank 0 waits for it in an all_reduce. The run stops on the learned timeout (the
2 s floor here, far below the 120 s ceiling), the report's first line names rank 1 and the collective
it is missing from (torch's flight recorder), and the restart reuses the learned numbers at once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import assert_gone, run_cli, write_script

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(90)]

JOB = """
import os, time
import torch
import torch.distributed as dist
import multigpu

dist.init_process_group("gloo")
rank = dist.get_rank()
stop_at = 30 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 2
t = torch.ones(4)
step = 0
while True:
    step += 1
    with multigpu.section("forward"):
        time.sleep(0.02)
        if rank == 1 and step == stop_at:
            time.sleep(120)  # stuck (a data loader, a deadlock): no more steps from rank 1
    dist.all_reduce(t)
    multigpu.heartbeat(step=step)
"""


def test_learned_timeout_names_the_rank_that_stopped(tmp_path: Path) -> None:
    job = write_script(tmp_path, "job.py", JOB)
    out = tmp_path / "out"
    res = run_cli(
        [
            "run",
            "--cpu",
            "2",
            "--status",
            "off",
            "--grace-period",
            "0.5",
            "--output",
            str(out),
            "--hang-timeout",
            "120",
            "--hang-floor",
            "2",
            "--max-restarts",
            "1",
            str(job),
        ],
        cwd=tmp_path,
        timeout=80,
    )  # the flight recorder: on by default, gloo too
    print(res.stderr[-3000:])
    data = json.loads((out / "run.json").read_text())
    pids = [r["pid"] for a in data["attempts"] for r in a["ranks"].values() if r["pid"]]
    assert_gone(pids)
    assert res.returncode == 1, res.stderr
    heads = [line for line in res.stderr.splitlines() if re.match(r"multigpu: attempt \d hung", line)]
    assert len(heads) == 2, res.stderr
    for attempt, head in enumerate(heads):
        assert head.startswith(f"multigpu: attempt {attempt} hung: rank 1 is missing from collective #"), head
        assert "(gloo:all_reduce) of process group 0 (default_pg); rank 0 entered it; " in head
        assert "rank 1 never reached the all_reduce that rank 0 waits in: rank 1 is in " in head
        progress = r"job\.py:\d+ \(<module>\); last progress [\d.]+s ago at step \d+ in section 'forward'"
        assert re.search(progress, head), head
        timeout = float(re.findall(r"\(timeout ([\d.]+)s, learned: 5 x slowest step", head)[0])
        assert timeout < 120  # the learned timeout fired, not the ceiling
    assert "at step 1 in section" in heads[1]  # one step in: only the inherited numbers could apply
    for attempt in data["attempts"]:
        assert attempt["status"] == "hung"
        assert [f["rank"] for f in attempt["failures"]] == [1, 0]  # the culprit first
        assert "job.py" in (attempt["failures"][0]["traceback"] or "")
        assert attempt["progress"]["1"]["sections"]["forward"]["count"] >= 1
    first, second = data["attempts"][0]["progress"], data["attempts"][1]["progress"]
    assert first["0"]["step"] == first["1"]["step"] == 29 and 0 < first["0"]["median_step_s"] < 2
    assert second["1"]["step"] == 1 and second["1"]["hang_timeout_s"] < 120
    learned = json.loads((out / "hang_timeouts.json").read_text())
    assert 0 < learned["slowest_step_s"] < 120 and "forward" in learned["sections_s"]


SIMPLEST = """
import time, torch, torch.distributed as dist, multigpu
dist.init_process_group("gloo")
t = torch.ones(1)
for step in range(1000):
    multigpu.heartbeat(step=step)
    if step == 30 and dist.get_rank() == 1:
        time.sleep(120)  # line 8: rank 1 stops in Python; rank 0 waits for it in all_reduce
    dist.all_reduce(t)
    print(f"pid={os.getpid()}" if step == 0 else "", end="", flush=True)
"""


@pytest.mark.parametrize("recorder", ["default", "off"])
def test_the_simplest_hang_names_the_sleeping_rank_from_its_stack(tmp_path: Path, recorder: str) -> None:
    """Both ranks stop on step 30, so progress alone cannot tell them apart. The flight recorder (on by
    default) names the collective rank 1 is missing from; the stacks name where rank 1 is instead,
    and do so alone when the user turned the recorder off."""
    job = write_script(tmp_path, "job.py", "import os\n" + SIMPLEST.lstrip())
    out = tmp_path / "out"
    res = run_cli(
        [
            "run",
            "--cpu",
            "2",
            "--status",
            "off",
            "--grace-period",
            "0.5",
            "--output",
            str(out),
            "--hang-timeout",
            "3",
            str(job),
        ],
        cwd=tmp_path,
        timeout=60,
        env={"TORCH_FR_BUFFER_SIZE": "0"} if recorder == "off" else None,
    )
    data = json.loads((out / "run.json").read_text())
    assert_gone([r["pid"] for a in data["attempts"] for r in a["ranks"].values() if r["pid"]])
    assert res.returncode == 1, res.stderr
    head = next(line for line in res.stderr.splitlines() if line.startswith("multigpu: attempt 0 hung"))
    stacks = "rank 1 never reached the all_reduce that rank 0 waits in: rank 1 is in "
    if recorder == "off":
        assert head.startswith(f"multigpu: attempt 0 hung: {stacks}"), head
    else:  # 30 all-reduces done (steps 0-29): rank 0 is in the 31st
        flight = (
            "rank 1 is missing from collective #31 (gloo:all_reduce) of process group 0 (default_pg); "
            "rank 0 entered it; "
        )
        assert head.startswith(f"multigpu: attempt 0 hung: {flight}{stacks}"), head
    assert f"{job}:8 (<module>)" in head, head
    assert [f["rank"] for f in data["attempts"][0]["failures"]] == [1, 0]
