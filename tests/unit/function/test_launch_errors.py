"""A failed launch's error, from its run record and the root-cause rank's kept exception. No processes."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from multigpu.config.run import RunConfig
from multigpu.contract.errors import MultiGPUError, WorkerFailedError
from multigpu.contract.failure import WorkerFailure
from multigpu.function.launch_errors import failure_of
from multigpu.function.rank_call import error_path
from multigpu.record.run_json import RunRecord
from multigpu.supervisor.states import RunResult, RunStatus


def record(out: Path, root: WorkerFailure) -> None:
    """A real run record (``RunRecord``, as the launcher writes it) whose one attempt failed with ``root``."""
    run = RunRecord(
        out / "run.json",
        RunConfig(target="payload.pkl", function=True, nproc=2),
        "r1",
        ["cpu", "cpu"],
    )
    run.begin_attempt(0, "127.0.0.1", 1)
    run.end_attempt(RunResult(RunStatus.FAILED, [root]))
    run.finish("failed", 1)


def test_no_record_is_a_multigpu_error_naming_the_folder(tmp_path: Path) -> None:
    error = failure_of(tmp_path, "r1", tmp_path / "results", 2)
    assert isinstance(error, MultiGPUError) and str(tmp_path) in str(error)


def test_a_rank_that_died_without_an_exception_is_a_worker_failed_error(tmp_path: Path) -> None:
    record(tmp_path, WorkerFailure(rank=1, local_rank=1, pid=99, exit_code=-9, signal="SIGKILL"))
    error = failure_of(tmp_path, "r1", tmp_path / "results", 1)
    assert isinstance(error, WorkerFailedError) and error.rank == 1 and error.signal == "SIGKILL"


def test_the_root_cause_ranks_own_exception_is_raised(tmp_path: Path) -> None:
    record(tmp_path, WorkerFailure(rank=1, local_rank=1, pid=99, exit_code=1, error_type="ValueError"))
    (tmp_path / "results").mkdir()
    kept = {
        "pid": 99,
        "traceback": "Traceback ...\nValueError: bad",
        "exception": pickle.dumps(ValueError("bad")),
    }
    error_path(tmp_path / "results", 1).write_bytes(pickle.dumps(kept))
    error = failure_of(tmp_path, "r1", tmp_path / "results", 1)
    assert type(error) is ValueError and error.__notes__ == ["multigpu: raised by rank 1 (pid 99)"]
    with pytest.raises(ValueError, match="bad"):
        raise error


def test_another_runs_record_in_the_folder_is_not_this_launchs_failure(tmp_path: Path) -> None:
    """An HPO loop reusing ``output=``: trial 1's record (run r1) is still there when trial 2 (run r2)
    fails before any rank reported; trial 1's exception must not be raised for trial 2."""
    record(tmp_path, WorkerFailure(rank=1, local_rank=1, pid=99, exit_code=1, error_type="ValueError"))
    (tmp_path / "results").mkdir()
    kept = {"pid": 99, "traceback": "ValueError: trial 1", "exception": pickle.dumps(ValueError("trial 1"))}
    error_path(tmp_path / "results", 1).write_bytes(pickle.dumps(kept))
    error = failure_of(tmp_path, "r2", tmp_path / "results", 2)
    assert type(error) is MultiGPUError and "before any rank reported" in str(error)
