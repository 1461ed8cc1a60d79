"""The failure report's reading of a rank's last lines (``record/failure_report.py``): the user's innermost
frame, the last interrupt traceback."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import multigpu.function.rank_call as rank_call
import multigpu.rank.bootstrap as bootstrap
from multigpu.record.failure_report import (
    innermost_user_frame,
    interrupted_line,
    last_interrupt_traceback,
    running_in,
)
from multigpu.supervisor.states import WorkerState
from tracebacks import FAILED, INTERRUPTED


def test_the_innermost_frame_of_the_users_own_code_with_its_source() -> None:
    assert innermost_user_frame("\n".join(INTERRUPTED)) == "train.py:42 (model = DDP(model))"
    assert innermost_user_frame("\n".join(INTERRUPTED[:1] + INTERRUPTED[4:])) is None  # torch's frames only


def test_the_last_interrupt_traceback_in_a_ranks_last_lines() -> None:
    tail = ["step 3", *FAILED, "step 4", *[f"[rank0]: {line}" for line in INTERRUPTED]]
    found = last_interrupt_traceback(tail)
    assert found is not None and innermost_user_frame(found) == "train.py:42 (model = DDP(model))"
    assert last_interrupt_traceback(["step 3", *FAILED]) is None
    assert last_interrupt_traceback(["step 3"]) is None


def _rank(tail: list[str]) -> Any:
    """A rank still running when the Ctrl-C's report is written, its last lines ``tail``."""
    return SimpleNamespace(rank=1, state=WorkerState.RUNNING, lines=SimpleNamespace(tail=tail))


def test_a_rank_interrupted_in_a_function_sent_from_a_notebook_was_running_not_starting() -> None:
    """``hang()`` defined in a cell has no file of the user's (``<dynamic-code>``): the rank had run
    it for seconds, so it was not "starting, before its script ran"."""
    cell = f"""Traceback (most recent call last):
  File "{bootstrap.__file__}", line 116, in run_function
    func(*args)
  File "{rank_call.__file__}", line 71, in call_in_rank
    value = fn(*args, **kwargs)
  File "<dynamic-code>", line 3, in hang
KeyboardInterrupt""".splitlines()
    assert interrupted_line(_rank(["started", *cell])) == "rank 1 interrupted while running, in hang"
    assert running_in("\n".join(INTERRUPTED[:1] + INTERRUPTED[4:])) == "__init__"  # torch's, past ours


def test_a_rank_interrupted_in_our_start_up_or_the_import_system_was_starting() -> None:
    start = f"""Traceback (most recent call last):
  File "{bootstrap.__file__}", line 150, in main
    run_target(mode, target, args)
  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load
KeyboardInterrupt""".splitlines()
    assert interrupted_line(_rank(start)) == "rank 1 interrupted while starting, before its script ran"
    assert interrupted_line(_rank(INTERRUPTED)) == "rank 1 interrupted in train.py:42 (model = DDP(model))"
