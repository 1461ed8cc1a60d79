"""The run record (``record/run_json.py``) and its schema: one reading of each rank's end, UTC twins of
epoch times, the resolved configuration. No processes: a record fed by hand-made workers."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from multigpu.config.run import RunConfig
from multigpu.contract.failure import WorkerFailure
from multigpu.record.run_json import RunRecord, complete_error_files, with_utc_times
from multigpu.supervisor.states import RunResult, RunStatus, Worker, WorkerSpec, WorkerState

SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "schemas" / "run.schema.json").read_text())


class _Popen:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def _worker(rank: int, tmp_path: Path, state: WorkerState, returncode: int) -> Worker:
    spec = WorkerSpec(
        rank=rank,
        local_rank=rank,
        argv=[],
        env={},
        log_path=tmp_path / f"rank_{rank}.log",
        error_file=tmp_path / f"error_rank_{rank}.json",
    )
    w = Worker(spec, state=state, start_time=1796455709.5, end_time=1796455710.25, returncode=returncode)
    w.popen = _Popen(1000 + rank)  # type: ignore[assignment]
    return w


def _record(tmp_path: Path) -> RunRecord:
    config = RunConfig(target="train.py", nproc=2, world_size=2)
    return RunRecord(
        tmp_path / "run.json",
        config,
        "20261205-000000-abcdef",
        ["cpu", "cpu"],
        command=["multigpu", "run", "--cpu", "2", "train.py"],
    )


def test_a_rank_that_raised_then_was_cut_short_reads_the_same_everywhere(tmp_path: Path) -> None:
    """Issue 22: the rank's record said SIGTERM while its failure said exit 1. One reading now."""
    record = _record(tmp_path)
    record.begin_attempt(0, "127.0.0.1", 29400)
    failed = _worker(1, tmp_path, WorkerState.FAILED, -15)  # raised, then the teardown's SIGTERM
    WorkerFailure(
        rank=1, local_rank=1, pid=1001, error_type="ValueError", message="boom", time=1796455710.0
    ).write(failed.spec.error_file)  # what the rank wrote before exiting
    failed.ending.failure = failed.ended_with(1, failed.own_record())
    stopped = _worker(0, tmp_path, WorkerState.STOPPED, -15)
    for w in (stopped, failed):
        record.on_workers_change([w])
    record.end_attempt(RunResult(RunStatus.FAILED, [failed.ending.failure]))
    record.finish("failed", 1)
    data = json.loads(record.path.read_text())
    jsonschema.validate(data, SCHEMA)
    attempt = data["attempts"][0]
    rank1, root = attempt["ranks"]["1"], attempt["root_cause"]
    assert (rank1["exit_code"], rank1["signal"]) == (root["exit_code"], root["signal"]) == (1, None)
    assert rank1["reason"] == "exited with code 1: ValueError: boom"
    assert attempt["ranks"]["0"]["reason"] == "stopped by the launcher (SIGTERM)"
    assert attempt["ranks"]["0"]["start_time_utc"] == "2026-12-05T07:28:29.500Z"
    assert data["config"]["output"]["dir"] == str(tmp_path) and data["config"]["output"]["run_id"]
    assert data["config"]["rdzv"]["endpoint"] == "127.0.0.1:29400"
    complete_error_files([stopped, failed])
    error = json.loads(failed.spec.error_file.read_text())  # type: ignore[union-attr]
    assert (error["exit_code"], error["log_path"]) == (1, str(failed.spec.log_path))


def test_the_schema_refuses_a_record_that_contradicts_itself(tmp_path: Path) -> None:
    record = _record(tmp_path)
    record.begin_attempt(0, "127.0.0.1", 29400)
    record.on_workers_change([_worker(0, tmp_path, WorkerState.STOPPED, -15)])
    data = json.loads(record.path.read_text())
    jsonschema.validate(data, SCHEMA)
    data["attempts"][0]["ranks"]["0"]["exit_code"] = 1  # beside "signal": "SIGTERM"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA)


def test_utc_twins_beside_every_epoch_time() -> None:
    out = with_utc_times({"time": 0.0, "a": [{"end_time": 1.5, "end_time_x": 2}], "start_time": None})
    assert out["time_utc"] == "1970-01-01T00:00:00.000Z"
    assert out["a"][0]["end_time_utc"] == "1970-01-01T00:00:01.500Z" and "start_time_utc" not in out


def test_the_preflight_record_holds_every_nodes_figures_and_a_failure_its_error(tmp_path: Path) -> None:
    record = _record(tmp_path)
    figures = {"matmul_gflops": 14.2, "all_reduce_gbps": 2.1}
    entry = {"mode": "on", "verdict": "slow", "slow_nodes": [1], "seconds": 1.2, "nodes": {"0": figures}}
    record.note_preflight(entry)
    jsonschema.validate(json.loads(record.path.read_text()), SCHEMA)
    record.note_preflight({"mode": "strict", "verdict": "failed", "error": "node 1 died"})
    jsonschema.validate(json.loads(record.path.read_text()), SCHEMA)
    data = json.loads(record.path.read_text())
    del data["preflight"]["error"]  # a failure says why
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA)
