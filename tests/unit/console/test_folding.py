"""Issue 31: after the user's Ctrl-C a rank's ``KeyboardInterrupt`` traceback goes to its log only
(``console/folding.InterruptTracebacks``), and the report names where each rank was in one line
(``record/failure_report.innermost_user_frame``). Issue 44: in a job of several nodes, a rank whose
collective only saw a peer's connection close (gloo's "Connection closed by peer") prints a traceback
that says nothing new once the attempt's root cause is another node's: it waits aside
(``PeerLostTracebacks``) until the launcher knows, then stays in the rank's log, or shows when the
root cause is this node's. Pure: lines in, lines out."""

from __future__ import annotations

from multigpu.console.folding import CppStacks, InterruptTracebacks, PeerLostTracebacks
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


PEER_LOST = """[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/worker.py", line 10, in <module>
[rank1]:     dist.all_reduce(t)
[rank1]:   File "/venv/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
[rank1]:     work.wait()
[rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:42722. \
This is typically caused by a remote worker crashing.""".splitlines()


def peer_feed(filt: PeerLostTracebacks, lines: list[str], chunk: int = 3) -> list[str]:
    """Through the filter a few lines at a time, as pipe reads arrive."""
    data, shown = [line.encode() for line in lines], []
    for i in range(0, len(data), chunk):
        shown += filt.feed(data[i : i + chunk])
    return [line.decode() for line in shown]


def test_a_peer_lost_traceback_waits_aside_and_is_folded_when_another_node_is_the_cause() -> None:
    filt = PeerLostTracebacks()
    assert peer_feed(filt, ["step 5", *PEER_LOST]) == ["step 5"]
    assert filt.flush() == []  # the pipe ended: still aside, no root cause yet
    assert filt.settle(fold=True) == []
    assert peer_feed(filt, [*PEER_LOST, "bye"]) == ["bye"]  # a later one, folded the same way
    assert filt.flush() == []


def test_a_peer_lost_traceback_shows_late_and_whole_when_the_cause_is_this_nodes() -> None:
    filt = PeerLostTracebacks()
    assert peer_feed(filt, [*PEER_LOST, "after"]) == ["after"]
    assert [line.decode() for line in filt.settle(fold=False)] == PEER_LOST
    assert filt.settle(fold=True) == []  # the first decision stands
    assert peer_feed(filt, [*PEER_LOST, "next"]) == [*PEER_LOST, "next"]


def test_any_other_traceback_shows_at_once_without_waiting_for_the_next_line() -> None:
    filt = PeerLostTracebacks()
    assert peer_feed(filt, ["before", *FAILED], chunk=len(FAILED) + 1) == ["before", *FAILED]
    assert filt.settle(fold=True) == []


def test_a_ranks_own_connection_reset_is_not_taken_for_a_lost_peer() -> None:
    """A data loader's HTTP or S3 call says "Connection reset by peer" too: that error is the user's
    own, shown at once, never folded as another node's consequence."""
    own = [*PEER_LOST[:-1], "[rank1]: ConnectionResetError: [Errno 104] Connection reset by peer"]
    filt = PeerLostTracebacks()
    assert peer_feed(filt, ["before", *own], chunk=len(own) + 1) == ["before", *own]
    assert filt.settle(fold=True) == []
