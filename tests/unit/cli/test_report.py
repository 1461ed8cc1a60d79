"""``multigpu report`` / ``status`` / ``stacks`` on records as users meet them: a folder of a job over
several nodes, a record that is not one, a mistyped option, a report that cannot be written. Each is
one line, never a traceback (``cli/report.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from multigpu.cli.main import main


def record(run_id: str = "r", status: str = "succeeded") -> dict[str, Any]:
    ranks = {"0": {"start_time": 100.0, "end_time": 200.0, "state": "succeeded"}}
    return {
        "run_id": run_id,
        "status": status,
        "end_time": 200.0,
        "incidents": [],
        "attempts": [{"attempt": 0, "ranks": ranks}],
    }


@pytest.fixture
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hand-written stand-ins for records (not ``tmp_path``: its records must be a launcher's, whole)."""
    return tmp_path_factory.mktemp("records")


def test_a_folder_of_a_job_over_two_nodes_reports_each_nodes_record(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp_path = folder
    for node in (0, 1):
        (tmp_path / f"run_node{node}.json").write_text(json.dumps(record(f"job-node{node}")))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "run_node0.json:" in out and "run_node1.json:" in out
    assert "run job-node0: succeeded" in out and "run job-node1: succeeded" in out
    assert (tmp_path / "run_node0.html").is_file() and (tmp_path / "run_node1.html").is_file()


@pytest.mark.parametrize("command", ["report", "status", "stacks"])
def test_a_record_that_is_not_one_is_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run.json").write_text("{not json")
    assert main([command, str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a run record multigpu can read" in err, err
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r"}))
    assert main([command, str(tmp_path)]) == 1
    assert "(no status, attempts)" in capsys.readouterr().err


def test_a_mistyped_option_is_a_usage_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--jsno", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "multigpu report: error: unrecognized arguments: --jsno", err
    assert len(err) == 2 and "--help" in err[1]


def test_a_report_that_cannot_be_written_still_prints_its_table(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp_path = folder
    (tmp_path / "run.json").write_text(json.dumps(record()))
    (tmp_path / "report.html").mkdir()  # in the way (root writes through a read-only mode)
    assert main(["report", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "run r: succeeded" in captured.out
    assert captured.err.startswith("multigpu: cannot write ") and captured.err.count("\n") == 1


def test_with_no_folder_the_newest_run_is_found_among_function_launches_too(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A notebook user who ran ``multigpu.launch`` types ``multigpu report``: its record is under the
    cache folder, not ./multigpu_runs; the newest of both is the one reported."""
    monkeypatch.chdir(folder)
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / "cache"))
    older = folder / "multigpu_runs" / "by-hand"
    newer = folder / "cache" / "multigpu" / "runs" / "from-a-notebook"
    for path, run_id in ((older, "by-hand"), (newer, "launched")):
        path.mkdir(parents=True)
        (path / "run.json").write_text(json.dumps(record(run_id)))
    os.utime(older / "run.json", (1_000, 1_000))
    assert main(["report"]) == 0
    assert "run launched: succeeded" in capsys.readouterr().out
    assert (newer / "report.html").is_file()


def test_with_no_run_anywhere_the_line_names_both_places(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(folder)
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / "nothing"))
    assert main(["report"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        f"multigpu report: error: no run under ./multigpu_runs or {folder}/nothing/multigpu/runs; "
        "give a run's output folder"
    ), err
