"""The beat protocol: what ``multigpu.heartbeat(step=)`` and ``multigpu.section()`` write, and how
the launcher's decoder reads it, whatever the reads cut."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from multigpu.contract.beats import Beat, BeatDecoder
from multigpu.contract.names import HEARTBEAT_FD_ENV
from multigpu.rank import progress


@pytest.fixture
def pipe() -> Iterator[int]:
    """A heartbeat pipe attached in this process, as the bootstrap does; the read end is yielded."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    saved = (progress._fd, progress._owner, progress._looked)
    progress.attach(w)
    try:
        yield r
    finally:
        progress._fd, progress._owner, progress._looked = saved
        os.close(r)
        os.close(w)


def test_steps_sections_and_beats_round_trip(pipe: int) -> None:
    import multigpu

    multigpu.heartbeat()
    multigpu.heartbeat(step=41)
    with multigpu.section("forward;=\nx"):
        pass
    progress.output_beat()
    data = os.read(pipe, 4096)
    beats = BeatDecoder().feed(data)
    assert [b.kind for b in beats] == ["beat", "step", "begin", "end", "output"]
    assert beats[1].value == 41
    assert beats[2].name == beats[3].name == "forward___x"
    assert 0 <= beats[3].value < 1


def test_decoder_joins_records_cut_by_reads() -> None:
    stream = b".S12;Bforward;Eforward=0.250000;DS13;!F"
    expected = BeatDecoder().feed(stream)
    assert [b.kind for b in expected] == ["beat", "step", "begin", "end", "done", "step", "failing", "dumped"]
    for cut in range(len(stream)):
        decoder = BeatDecoder()
        assert decoder.feed(stream[:cut]) + decoder.feed(stream[cut:]) == expected, cut


def test_decoder_skips_garbage() -> None:
    decoder = BeatDecoder()
    beats = decoder.feed(b"xyzSnot-a-number;E=;" + b"B" + b"a" * 200 + b".S7;")
    assert Beat("step", value=7.0) in beats
    assert all(b.kind in ("beat", "step") for b in beats), beats


def test_a_full_pipe_drops_a_report_instead_of_blocking(pipe: int) -> None:
    sent = 0
    while progress.send(b"S1;"):
        sent += 1
    assert sent > 1000  # the pipe is full now
    progress.heartbeat(step=2)  # returns at once
    assert BeatDecoder().feed(os.read(pipe, 3 * 64))[0] == Beat("step", value=1.0)


def test_outside_a_worker_nothing_is_sent(pipe: int) -> None:
    """A process the rank forked inherits the descriptor but is not the rank: it sends nothing. A process
    without the variable has no descriptor at all."""
    progress._owner = os.getpid() + 1  # as the rank's forked child sees it
    progress.heartbeat(step=1)
    progress.heartbeat()
    with progress.section("x"):
        pass
    assert progress.heartbeat_fd() is None
    os.set_blocking(pipe, False)
    with pytest.raises(BlockingIOError):  # the pipe is empty: nothing was written
        os.read(pipe, 64)
    progress._owner = os.getpid()
    assert progress.send(b"S2;")  # the same pipe carries a rank's report: the check above can fail
    assert BeatDecoder().feed(os.read(pipe, 64)) == [Beat("step", value=2.0)]


def test_without_the_variable_there_is_no_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HEARTBEAT_FD_ENV, raising=False)
    monkeypatch.setattr(progress, "_looked", False)
    monkeypatch.setattr(progress, "_fd", 99)
    monkeypatch.setattr(progress, "_owner", None)
    assert progress.heartbeat_fd() is None
    assert not progress.send(b"S1;")
    progress.heartbeat(step=1)  # and does not raise
