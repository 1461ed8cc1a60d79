"""``multigpu.launch``'s checks before anything starts. No processes."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest

import multigpu
from multigpu.contract.errors import MultiGPUError
from multigpu.function import rank_call
from multigpu.function.launch_call import launch, read_values


def test_the_facade_names_it() -> None:
    assert multigpu.launch is launch


def test_what_cannot_be_pickled_is_refused_before_any_process(tmp_path: object) -> None:
    lock = threading.Lock()
    with pytest.raises(MultiGPUError, match="cannot be sent to the ranks"):
        launch(lambda: lock, nprocs=2, device="cpu")


def test_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        launch(42, nprocs=2, device="cpu")  # type: ignore[arg-type]


def test_an_unknown_option_starts_nothing() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        launch(print, nprocs=2, device="cpu", bogus=1)


def _refuse_here() -> None:
    raise ValueError("unsupported pickle protocol: 99")


class _OnlyInTheRank:
    def __reduce__(self) -> tuple[object, tuple[()]]:
        return _refuse_here, ()


def test_a_value_that_cannot_be_read_here_names_its_rank(tmp_path: Path) -> None:
    """Issue 43: not a bare ``ValueError``; one line naming the rank and why."""
    for rank, value in enumerate(["fine", _OnlyInTheRank()]):
        rank_call.result_path(tmp_path, rank).write_bytes(pickle.dumps(value))
    with pytest.raises(MultiGPUError) as raised:
        read_values(tmp_path, 2)
    assert str(raised.value) == (
        "multigpu.launch: rank 1's return value cannot be read here: "
        "ValueError: unsupported pickle protocol: 99"
    )


def test_values_come_back_in_rank_order(tmp_path: Path) -> None:
    for rank in (1, 0):
        rank_call.result_path(tmp_path, rank).write_bytes(pickle.dumps(rank * 10))
    assert read_values(tmp_path, 2) == [0, 10]
    with pytest.raises(MultiGPUError, match="rank 2 succeeded but left no return value"):
        read_values(tmp_path, 3)
