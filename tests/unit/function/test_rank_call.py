"""What a rank of ``multigpu.launch`` keeps for the caller: its value, or its exception. In-process."""

from __future__ import annotations

import linecache
import os
import pickle
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

from multigpu.function import rank_call
from multigpu.function.launch_errors import RemoteTraceback, original_exception
from multigpu.function.rank_call import (
    call_in_rank,
    dumps_call,
    dumps_value,
    error_path,
    pid_path,
    result_path,
)


@pytest.fixture(autouse=True)
def rank_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")


def test_the_value_is_written_under_the_rank(tmp_path: Path) -> None:
    offset = 3
    call_in_rank(cloudpickle.dumps((lambda a, b: a + b + offset, (1,), {"b": 2})), str(tmp_path))
    assert pickle.loads(result_path(tmp_path, 1).read_bytes()) == 6
    assert not error_path(tmp_path, 1).exists()


def test_an_exception_is_kept_with_its_traceback_and_raised_again(tmp_path: Path) -> None:
    def refuse() -> None:
        raise KeyError("nope")

    with pytest.raises(KeyError):
        call_in_rank(cloudpickle.dumps((refuse, (), {})), str(tmp_path))
    assert not result_path(tmp_path, 1).exists()
    exc = original_exception(error_path(tmp_path, 1), 1)
    assert type(exc) is KeyError and exc.args == ("nope",)
    assert exc.__notes__ == [f"multigpu: raised by rank 1 (pid {os.getpid()})"]
    cause = exc.__cause__
    assert isinstance(cause, RemoteTraceback) and cause.rank == 1 and cause.pid == os.getpid()
    assert "in refuse" in cause.text and "call_in_rank" not in cause.text  # from the user's frame on
    assert str(cause).startswith('\n"""\nTraceback')


class Unpicklable(Exception):
    def __reduce__(self) -> object:
        raise TypeError("cannot pickle this")


def test_an_exception_that_cannot_travel_leaves_its_text_only(tmp_path: Path) -> None:
    def fail() -> None:
        raise Unpicklable("odd")

    with pytest.raises(Unpicklable):
        call_in_rank(cloudpickle.dumps((fail, (), {})), str(tmp_path))
    record = pickle.loads(error_path(tmp_path, 1).read_bytes())
    assert record["exception"] is None and "Unpicklable: odd" in record["traceback"]
    assert original_exception(error_path(tmp_path, 1), 1) is None  # the caller falls back


def test_tensors_travel_and_others_are_moved_to_the_cpu_first(monkeypatch: pytest.MonkeyPatch) -> None:
    value = pickle.loads(dumps_value({"t": torch.ones(2), "n": [1]}))
    assert value["t"].tolist() == [1.0, 1.0] and value["n"] == [1]
    moved: list[str] = []

    def cpu(self: torch.Tensor) -> torch.Tensor:
        moved.append(self.device.type)
        return torch.zeros(2)

    meta = torch.empty(2, device="meta")  # no GPU here: a tensor off the CPU all the same
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    assert pickle.loads(dumps_value([meta]))[0].tolist() == [0.0, 0.0] and moved == ["meta"]


def test_a_value_over_the_limit_is_an_error_naming_the_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rank_call, "RESULT_LIMIT_BYTES", 100)
    with pytest.raises(
        ValueError, match=r"^rank 1's return value is \d+ bytes pickled, over .* limit of 100 bytes"
    ):
        call_in_rank(cloudpickle.dumps((bytes, (500,), {})), str(tmp_path))
    assert not result_path(tmp_path, 1).exists()
    exc = original_exception(error_path(tmp_path, 1), 1)
    assert isinstance(exc, ValueError) and "rank 1's return value" in str(exc)  # the caller raises it


@pytest.mark.parametrize("code", [0, None, False])
def test_sys_exit_0_is_a_rank_that_returned_none(tmp_path: Path, code: object) -> None:
    """As under ``torch.multiprocessing.spawn``: ``sys.exit(0)``, ``sys.exit()`` end the rank well."""
    call_in_rank(cloudpickle.dumps((sys.exit, (code,), {})), str(tmp_path))
    assert pickle.loads(result_path(tmp_path, 1).read_bytes()) is None
    assert not error_path(tmp_path, 1).exists()


def test_another_exit_is_the_ranks_exit_status_not_an_exception_for_the_caller(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        call_in_rank(cloudpickle.dumps((sys.exit, (3,), {})), str(tmp_path))
    assert exited.value.code == 3
    assert not error_path(tmp_path, 1).exists() and not result_path(tmp_path, 1).exists()


def test_the_rank_writes_its_pid_before_it_runs_the_function(tmp_path: Path) -> None:
    call_in_rank(cloudpickle.dumps((lambda: pid_path(tmp_path, 1).read_text(), (), {})), str(tmp_path))
    assert pickle.loads(result_path(tmp_path, 1).read_bytes()) == str(os.getpid())


CELL = """\
import os

def picky(x):
    if x:
        raise ValueError("from the cell")
"""


def test_a_traceback_names_the_cell_or_script_the_function_was_defined_in(tmp_path: Path) -> None:
    """cloudpickle writes ``<dynamic-code>``; the file name, line and a cell's source reach the rank."""
    cell = "/tmp/ipykernel_4242/1234567890.py"  # as IPython names a cell: no such file
    linecache.cache[cell] = (len(CELL), None, CELL.splitlines(keepends=True), cell)
    namespace: dict[str, object] = {"__name__": "__main__"}  # sent by value, as from a notebook
    exec(compile(CELL, cell, "exec"), namespace)
    blob = dumps_call((namespace["picky"], (1,), {}))
    del linecache.cache[cell]  # the rank has only what came with the payload
    with pytest.raises(ValueError):
        call_in_rank(blob, str(tmp_path))
    text = pickle.loads(error_path(tmp_path, 1).read_bytes())["traceback"]
    assert f'File "{cell}", line 5, in picky\n    raise ValueError("from the cell")' in text, text
    assert "<dynamic-code>" not in text


def test_a_script_function_keeps_its_path_and_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(CELL)
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(CELL, str(script), "exec"), namespace)
    with pytest.raises(ValueError):
        call_in_rank(dumps_call((namespace["picky"], (1,), {})), str(tmp_path))
    text = pickle.loads(error_path(tmp_path, 1).read_bytes())["traceback"]
    assert f'File "{script}", line 5, in picky' in text, text
