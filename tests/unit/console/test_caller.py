"""Function mode's caller lines (``console/caller.py``): the caller's own prints and its children's lines
never spliced."""

from __future__ import annotations

import os
import sys

import pytest

from multigpu.console.ranks import PrefixedConsole
from multigpu.supervisor.states import Worker, WorkerSpec


def test_function_mode_console_never_splices_a_child_line_into_the_callers_half_printed_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in CI: rank 0 (the caller) printed "REPORT {...}" while a child's line arrived; print()
    writes the text and the newline separately, and the console's flush put the child's line between."""
    import io

    r, w = os.pipe()
    try:
        stdout = io.TextIOWrapper(io.FileIO(w, "w", closefd=False), write_through=False)
        monkeypatch.setattr("sys.stdout", stdout)
        console = PrefixedConsole()
        child = Worker(WorkerSpec(rank=1, local_rank=1, argv=[], env={}))
        stdout.write("REPORT {rank 0}")  # print()'s first write; its "\n" has not come yet
        console.write_lines(child, "stdout", [b"REPORT {rank 1}"])
        stdout.write("\n")
        stdout.flush()
        lines = os.read(r, 4096).decode().splitlines()
        assert sorted(lines) == ["REPORT {rank 0}", "[rank 1] REPORT {rank 1}"]
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("write_through", [True, False], ids=["unbuffered", "block-buffered"])
def test_caller_lines_keep_the_callers_print_whole_when_its_stdout_is_unbuffered(
    monkeypatch: pytest.MonkeyPatch, write_through: bool
) -> None:
    """Found in CI (PYTHONUNBUFFERED=1): print()'s text and newline were two writes to the descriptor,
    and a child's line from the watcher thread landed between them. A block-buffered stream has the
    same hole at its 8 KiB boundary. Under ``caller_lines`` only whole lines reach the descriptor."""
    import io

    from multigpu.console.caller import caller_lines

    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        raw = io.TextIOWrapper(io.FileIO(w, "w", closefd=False), write_through=write_through)
        monkeypatch.setattr("sys.stdout", raw)
        console = PrefixedConsole()
        child = Worker(WorkerSpec(rank=1, local_rank=1, argv=[], env={}))
        with caller_lines():
            assert sys.stdout is not raw and sys.stdout.fileno() == w
            sys.stdout.write("REPORT {rank 0}")  # print()'s first write
            console.write_lines(child, "stdout", [b"REPORT {rank 1}"])
            sys.stdout.write("\n")
            sys.stdout.write("partial")  # no newline yet: still the caller's at the end
        assert sys.stdout is raw
        text = os.read(r, 4096).decode()
        assert text == "[rank 1] REPORT {rank 1}\nREPORT {rank 0}\npartial"
    finally:
        os.close(r)
        os.close(w)
