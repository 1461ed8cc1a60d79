"""Torch's flight-record dump read without trusting the file (``contract/flight_dump.py``): plain data
loads, any class is refused before it can run, and what is not a dict is no dump."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from multigpu.contract.flight_dump import load_dump


class _Runs:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("true",))


def test_plain_data_loads() -> None:
    dump = {"version": "2.4", "pg_config": {"0": {"ranks": "[0, 1]"}}, "entries": [{"seq_id": 1}]}
    assert load_dump(pickle.dumps(dump)) == dump


@pytest.mark.parametrize("hostile", [{"path": Path("x")}, {"run": _Runs()}], ids=["a class", "a call"])
def test_a_class_or_a_call_is_refused(hostile: dict[str, object]) -> None:
    with pytest.raises(pickle.UnpicklingError, match="holds no classes"):
        load_dump(pickle.dumps(hostile))


def test_what_is_not_a_dict_is_no_dump() -> None:
    with pytest.raises(ValueError, match="not a flight-recorder dump"):
        load_dump(pickle.dumps([1, 2]))
