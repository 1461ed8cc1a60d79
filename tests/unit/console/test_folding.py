"""Issue 31: after the user's Ctrl-C a rank's ``KeyboardInterrupt`` traceback goes to its log only
(``console/folding.InterruptTracebacks``), and the report names where each rank was in one line
(``record/failure_report.innermost_user_frame``). Pure: lines in, lines out."""

from __future__ import annotations

from multigpu.console.folding import CppStacks, InterruptTracebacks
from tracebacks import FAILED, INTERRUPTED


def feed(lines: list[str], chunk: int = 3) -> list[str]:
    """Through the filter a few lines at a time, as pipe reads arrive; then the pipe ends."""
    filt, shown = InterruptTracebacks(), []
    data = [line.encode() for line in lines]
    for i in range(0, len(data), chunk):
        shown += filt.feed(data[i : i + chunk])
    return [line.decode() for line in shown + filt.flush()]


def test_an_interrupt_traceback_is_dropped_and_what_surrounds_it_shown() -> None:
    assert feed(["saving checkpoint", *INTERRUPTED, "", "bye"]) == ["saving checkpoint", "bye"]


def test_torch_excepthooks_rank_prefix_is_seen_through() -> None:
    prefixed = [f"[rank1]: {line}" for line in INTERRUPTED]
    assert feed(["before", *prefixed, "after"]) == ["before", "after"]


def test_a_chain_that_ends_in_an_interrupt_is_dropped_whole() -> None:
    chain = [
        *FAILED,
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        *INTERRUPTED,
    ]
    assert feed([*chain, "next"]) == ["next"]


def test_any_other_traceback_is_shown_whole_and_in_order() -> None:
    assert feed(["a", *FAILED, "b"]) == ["a", *FAILED, "b"]
    chain = [
        *INTERRUPTED,
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        *FAILED,
    ]
    assert feed(chain, chunk=1) == chain  # ends in ValueError: every line shows


def test_a_traceback_cut_short_shows_when_the_pipe_ends() -> None:
    assert feed(INTERRUPTED[:4]) == INTERRUPTED[:4]


CPP_WARNING = """[W1206 05:11:34.016 TCPStore.cpp:115] [c10d] recvVector failed: Connection reset by peer
Exception raised from recvBytes at /__w/torch/csrc/distributed/c10d/Utils.hpp:784 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7fbe75379b8d in libc10.so)
frame #1: c10d::TCPStore::doGet(std::string const&) + 0x76 (0x7fbe66f43956 in libtorch_cpu.so)
<omitting python frames>
frame #43: _start + 0x21 (0x5557554e4081 in python)
""".splitlines()


def fold(lines: list[str], chunk: int = 2) -> list[str]:
    filt, shown = CppStacks(), []
    data = [line.encode() for line in lines]
    for i in range(0, len(data), chunk):
        shown += filt.feed(data[i : i + chunk])
    return [line.decode() for line in shown]


def test_a_cpp_stack_is_one_line_on_the_console_and_its_message_stays() -> None:
    assert fold(["step 3", *CPP_WARNING, "", "step 4"]) == [
        "step 3",
        CPP_WARNING[0],
        "(torch's C++ stack from recvBytes: in this rank's log)",
        "step 4",
    ]


def test_a_cpp_stack_behind_torchs_rank_prefix_or_ended_by_text_is_folded_too() -> None:
    prefixed = [f"[rank1]: {line}" for line in CPP_WARNING]
    shown = fold([*prefixed, "[rank1]: RuntimeError: done"], chunk=1)
    assert shown == [
        prefixed[0],
        "(torch's C++ stack from recvBytes: in this rank's log)",
        "[rank1]: RuntimeError: done",
    ]
    assert fold(["frame #0: a user's own line", "no stack here"]) == [
        "frame #0: a user's own line",
        "no stack here",
    ]
