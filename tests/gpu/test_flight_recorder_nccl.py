"""The flight recorder on NCCL: on by default for GPU ranks, dumped on a hang, read into the report's
first line. One GPU: the dump of a single NCCL rank; two GPUs: the rank missing from a collective."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import assert_gone, run_cli, write_script
from multigpu.cluster.devices import visible_gpus
from multigpu.supervisor.hangs.flight_record import read_dumps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not visible_gpus(), reason="no CUDA GPU is visible (NVML and /proc/driver/nvidia)"),
]

JOB = """
import os, time
import torch
import torch.distributed as dist
import multigpu

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(1024, device="cuda")
for step in range(1, 1000):
    with multigpu.section("forward"):
        time.sleep(0.01)
        if step == 20 and (rank == 1 or world == 1):
            time.sleep(600)  # stuck before its all_reduce
    dist.all_reduce(t)
    torch.cuda.synchronize()  # rank 0 waits here for rank 1 (two GPUs)
    multigpu.heartbeat(step=step)
"""


def hang_run(tmp_path: Path, gpus: str) -> tuple[str, Path]:
    job = write_script(tmp_path, "job.py", JOB)
    out = tmp_path / "out"
    res = run_cli(
        [
            "run",
            "--gpus",
            gpus,
            "--status",
            "off",
            "--grace-period",
            "2",
            "--output",
            str(out),
            "--hang-timeout",
            "120",
            "--hang-floor",
            "3",
            str(job),
        ],
        cwd=tmp_path,
        timeout=240,
    )
    print(res.stderr[-4000:])
    data = json.loads((out / "run.json").read_text())
    assert_gone([r["pid"] for a in data["attempts"] for r in a["ranks"].values() if r["pid"]])
    assert res.returncode == 1, res.stderr
    return res.stderr, out


def test_one_nccl_rank_dumps_its_record(tmp_path: Path) -> None:
    stderr, out = hang_run(tmp_path, "0")
    assert "multigpu: attempt 0 hung: rank 0 stopped progressing first" in stderr
    assert re.search(r"\(timeout [\d.]+s, learned: 5 x slowest step", stderr), stderr
    dumps = read_dumps(out / "logs" / "attempt_0" / "fr_trace_rank_")
    assert sorted(dumps) == [0], "no flight-recorder dump (TORCH_FR_BUFFER_SIZE default, or the trigger)"
    ops = {e["profiling_name"] for e in dumps[0]["entries"]}
    assert "nccl:all_reduce" in ops, ops


@pytest.mark.skipif(len(visible_gpus()) < 2, reason="a rank missing from a NCCL collective needs 2 GPUs")
def test_the_rank_missing_from_a_nccl_collective_is_named(tmp_path: Path) -> None:
    stderr, _ = hang_run(tmp_path, "0,1")
    head = next(line for line in stderr.splitlines() if line.startswith("multigpu: attempt 0 hung"))
    assert head.startswith("multigpu: attempt 0 hung: rank 1 is missing from collective #"), head
    assert "(nccl:all_reduce)" in head and "rank 0 entered it" in head
