"""The CUDA tier: runs only where a GPU is visible, and skips cleanly (with a reason) everywhere else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import assert_gone, pids_in, run_cli, write_script
from multigpu.cluster.devices import visible_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not visible_gpus(), reason="no CUDA GPU is visible (NVML and /proc/driver/nvidia)"),
]

NCCL_ALL_REDUCE = """
    import os
    import torch
    import torch.distributed as dist
    print(f"pid={os.getpid()}", flush=True)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    t = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    world = dist.get_world_size()
    assert t.tolist() == [world * (world + 1) / 2] * 4, t
    print(f"nccl ok rank={dist.get_rank()} world={world} backend={dist.get_backend()} "
          f"cvd={os.environ.get('CUDA_VISIBLE_DEVICES')} device={torch.cuda.get_device_name()}", flush=True)
    dist.destroy_process_group()
"""


def test_devices_lists_the_gpus(tmp_path: Path) -> None:
    result = run_cli(["devices"], cwd=tmp_path, timeout=30)
    assert result.returncode == 0, result.stderr
    gpus = visible_gpus()
    lines = [line for line in result.stdout.splitlines() if re.match(r"^\d+: ", line)]
    assert len(lines) == len(gpus), result.stdout
    for gpu, line in zip(gpus, lines, strict=True):
        assert line.startswith(f"{gpu.index}: {gpu.name}")


def test_one_rank_nccl_group(tmp_path: Path) -> None:
    script = write_script(tmp_path, "nccl.py", NCCL_ALL_REDUCE)
    result = run_cli(
        ["run", "--gpus", "0", "--output", str(tmp_path / "out"), str(script)], cwd=tmp_path, timeout=180
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert_gone(pids_in(result.stdout))
    assert re.search(r"^\[rank 0\] nccl ok rank=0 world=1 backend=nccl ", result.stdout, re.M), result.stdout
    assert (tmp_path / "out" / "logs" / "attempt_0" / "rank_0.log").read_text().count("nccl ok") == 1


def test_demo_on_one_gpu(tmp_path: Path) -> None:
    result = run_cli(
        ["demo", "--gpus", "0", "--steps", "100", "--output", str(tmp_path / "demo")],
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rank(s) on cuda" in result.stdout
    m = re.search(r"done: loss ([\d.]+) -> ([\d.]+), accuracy ([\d.]+)%", result.stdout)
    assert m, result.stdout
    first, final, accuracy = float(m.group(1)), float(m.group(2)), float(m.group(3))
    assert final < first * 0.7
    assert accuracy > 50.0
