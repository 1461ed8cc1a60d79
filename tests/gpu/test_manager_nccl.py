"""Function mode on NCCL: a child's failure reaches rank 0 while rank 0 waits on the GPU.

Needs two visible GPUs (NCCL refuses two ranks on one device); skips cleanly otherwise.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from helpers import PYTHON, assert_gone, clean_env, pids_in
from multigpu.cluster.devices import visible_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(
        len(visible_gpus()) < 2, reason="needs two visible CUDA GPUs for a two-rank NCCL group"
    ),
]

SCRIPT = Path(__file__).with_name("manager_nccl_failure.py")


@pytest.mark.parametrize("case", ["collective", "synchronize", "sleep"])
def test_child_failure_reaches_rank_0_waiting_on_nccl(tmp_path: Path, case: str) -> None:
    proc = subprocess.run(
        [PYTHON, str(SCRIPT), case, str(tmp_path / "out")],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = proc.stdout + proc.stderr
    assert_gone(pids_in(text))
    assert re.search(r"^CAUGHT rank=1 latency_ms=\d+ ", proc.stdout, re.M), text[-3000:]
    assert proc.returncode == 0, text[-3000:]
