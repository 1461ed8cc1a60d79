"""The manager's checks and output folder before any child starts. No processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from multigpu.otx.prepare import output_folder


def test_without_an_output_path_the_run_goes_where_multigpu_run_puts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out, run_id = output_folder(None, {})
    assert run_id is not None and out == tmp_path / "multigpu_runs" / run_id
    assert output_folder(None, {"SLURM_RESTART_COUNT": "2"})[0].name == "requeue_2"
    assert output_folder(str(tmp_path / "mine"), {}) == (tmp_path / "mine", None)
    assert not out.exists()  # named only: prepare() creates it
