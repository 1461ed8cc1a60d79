"""The nodes' fingerprints: what each reads without importing torch, and the verdict on differences.

The two-node refusals themselves run for real in ``tests/integration/multinode/test_multinode.py``."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from multigpu.rendezvous.fingerprint import differences, fingerprint, installed, torch_cuda


def fake_dist(root: Path, name: str, version: str) -> None:
    """An installed package as importlib.metadata finds it: a dist-info folder on sys.path."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_the_cuda_build_and_nccl_are_read_without_importing_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (tmp_path / "torch" / "version.py").write_text(
        "from typing import Optional\n__version__ = '2.13.0+cu128'\ncuda: Optional[str] = '12.8'\n"
    )
    fake_dist(tmp_path, "nvidia-nccl-cu12", "2.27.3")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    importlib.invalidate_caches()
    assert torch_cuda() == "12.8"
    assert installed("nvidia-nccl-cu13", "nvidia-nccl-cu12") == "2.27.3"
    assert installed("no-such-package-here") == "none"
    assert "torch" not in sys.modules  # found, never imported


def test_a_cpu_build_has_no_cuda_and_no_nccl_here() -> None:
    mine = fingerprint(__file__, ("--epochs", "1"), "cpu")
    assert mine["cuda"] == "none" and mine["nccl"] == "none"  # this machine's torch==2.13.0 CPU wheel
    assert mine["args"] == '["--epochs", "1"]' and len(mine["sha256"]) == 64


def test_a_different_nccl_breaks_a_different_python_patch_only_warns() -> None:
    base = fingerprint(__file__, (), "cuda")
    other = {**base, "nccl": "2.21.5", "python_patch": base["python"] + ".99"}
    breaking, soft = differences({0: base, 1: other})
    assert breaking == [f"NCCL differs: node 0 {base['nccl']}, node 1 2.21.5"]
    assert soft == [f"Python release differs: node 0 {base['python_patch']}, node 1 {base['python']}.99"]
    assert differences({0: base, 1: dict(base)}) == ([], [])


def test_a_script_edited_on_one_node_is_named_as_the_file_that_differs(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('a')\n")
    base = fingerprint(str(script), (), "cpu")
    script.write_text("print('b')\n")
    edited = fingerprint(str(script), (), "cpu")
    breaking, _ = differences({0: base, 1: edited})
    assert breaking == [
        f"train.py differs between nodes: node 0 SHA-256 {base['sha256'][:12]}, "
        f"node 1 SHA-256 {edited['sha256'][:12]}"
    ]
    unreadable = differences({0: base, 1: {**edited, "target": "job.py", "sha256": ""}})[0]
    assert unreadable[-1] == (
        f"the targets (job.py, train.py) differ between nodes: node 0 SHA-256 {base['sha256'][:12]}, "
        "node 1 (unreadable)"
    )
