"""What the command line's unit tests share: a machine that shows no GPU unless a test gives it four,
and a script to name on a line."""

from __future__ import annotations

from pathlib import Path

import pytest

from multigpu.cluster import devices
from multigpu.cluster.devices import GPUInfo


@pytest.fixture(autouse=True)
def gpu_less(no_gpu: None) -> None:
    """Deterministic discovery: this machine, or any other, looks GPU-less unless a test says otherwise."""


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        devices, "_nvml_gpus", lambda: [GPUInfo(index=i, ordinal=str(i), name="Fake") for i in range(4)]
    )


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)
