"""Issue 44: in a job of several nodes, a rank whose collective only saw a peer's connection close
(gloo's "Connection closed by peer") prints a traceback that says nothing new once the attempt's root
cause is another node's: it waits aside (``console/folding.PeerLostTracebacks``) until the launcher
knows, then stays in the rank's log, or shows when the root cause is this node's. Pure: lines in,
lines out."""

from __future__ import annotations

from multigpu.console.folding import PeerLostTracebacks
from tracebacks import FAILED

PEER_LOST = """[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/worker.py", line 10, in <module>
[rank1]:     dist.all_reduce(t)
[rank1]:   File "/venv/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
[rank1]:     work.wait()
[rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:42722. \
This is typically caused by a remote worker crashing.""".splitlines()


def feed(filt: PeerLostTracebacks, lines: list[str], chunk: int = 3) -> list[str]:
    """Through the filter a few lines at a time, as pipe reads arrive."""
    data, shown = [line.encode() for line in lines], []
    for i in range(0, len(data), chunk):
        shown += filt.feed(data[i : i + chunk])
    return [line.decode() for line in shown]


def test_a_peer_lost_traceback_waits_aside_and_is_folded_when_another_node_is_the_cause() -> None:
    filt = PeerLostTracebacks()
    assert feed(filt, ["step 5", *PEER_LOST]) == ["step 5"]
    assert filt.flush() == []  # the pipe ended: still aside, no root cause yet
    assert filt.settle(fold=True) == []
    assert feed(filt, [*PEER_LOST, "bye"]) == ["bye"]  # a later one, folded the same way
    assert filt.flush() == []


def test_a_peer_lost_traceback_shows_late_and_whole_when_the_cause_is_this_nodes() -> None:
    filt = PeerLostTracebacks()
    assert feed(filt, [*PEER_LOST, "after"]) == ["after"]
    assert [line.decode() for line in filt.settle(fold=False)] == PEER_LOST
    assert filt.settle(fold=True) == []  # the first decision stands
    assert feed(filt, [*PEER_LOST, "next"]) == [*PEER_LOST, "next"]


def test_any_other_traceback_shows_at_once_without_waiting_for_the_next_line() -> None:
    filt = PeerLostTracebacks()
    assert feed(filt, ["before", *FAILED], chunk=len(FAILED) + 1) == ["before", *FAILED]
    assert filt.settle(fold=True) == []
