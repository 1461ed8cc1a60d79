"""The preflight check's wire format (``contract/preflight_wire.py``): the task the launcher encodes is
the task the check decodes, and the check's result line is the one the launcher reads."""

from __future__ import annotations

import json

import pytest

from multigpu.contract.preflight_wire import Figures, PreflightResult, PreflightTask

TASK = PreflightTask("10.0.0.1", 29400, "multigpu/r/preflight/0", 1, 3, "cuda:0", 60.0, 4242)


def test_a_task_goes_through_one_argument_unchanged() -> None:
    assert PreflightTask.decode(TASK.encode()) == TASK
    assert json.loads(TASK.encode())["launcher"] == 4242  # plain JSON: one argv entry, no quoting rules


def test_a_task_with_a_field_missing_or_unknown_is_refused() -> None:
    fields = json.loads(TASK.encode())
    with pytest.raises(TypeError):
        PreflightTask.decode(json.dumps({k: v for k, v in fields.items() if k != "launcher"}))
    with pytest.raises(TypeError):
        PreflightTask.decode(json.dumps({**fields, "extra": 1}))


def test_a_result_is_one_json_line_of_rows_by_node_rank() -> None:
    result = PreflightResult((Figures(14.2, 2.1), Figures(0.9, 0.3)), 1.25)
    line = result.encode()
    assert "\n" not in line
    assert json.loads(line) == {"figures": [[14.2, 2.1], [0.9, 0.3]], "seconds": 1.25}
    assert PreflightResult.decode(line) == result


def test_a_line_that_is_no_result_raises_what_the_launcher_catches() -> None:
    for line, error in (
        ("{", ValueError),
        ("{}", KeyError),
        ('{"figures": [[1.0]], "seconds": 1}', IndexError),
    ):
        with pytest.raises(error):
            PreflightResult.decode(line)
