"""The failure report's reading of a rank's last lines (``record/failure_report.py``): the user's innermost
frame, the last interrupt traceback."""

from __future__ import annotations

from multigpu.record.failure_report import innermost_user_frame, last_interrupt_traceback
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
