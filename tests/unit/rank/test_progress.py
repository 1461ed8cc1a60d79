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


def test_the_thread_stamps_when_the_world_group_entered_collectives(
    pipe: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``K<n>@<t>;``: the world group's count seen at n, on this process's monotonic clock."""
    import sys
    import time
    import types

    class Group:
        seq = 0

        def _get_sequence_number_for_group(self) -> int:
            return self.seq

    world = Group()
    c10d = types.SimpleNamespace(_world=types.SimpleNamespace(pg_map={world: None}, default_pg=world))
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", c10d)
    monkeypatch.setattr(progress, "SAMPLE_FOR_S", progress.SAMPLE_EVERY_S)  # always sampling
    assert progress.world_entered() == 0
    progress.watch_collectives(every_s=0.05, poll_s=0.002)
    time.sleep(0.05)
    before = time.monotonic()
    for _ in range(5):
        world.seq += 1
        time.sleep(0.02)
    after = time.monotonic()
    time.sleep(0.15)
    beats = BeatDecoder().feed(os.read(pipe, 65536))
    entered = [b for b in beats if b.kind == "entered"]
    assert {b.index for b in entered} == {1, 2, 3, 4, 5}, beats  # the fixture's own thread may say so too
    assert all(before <= b.value <= after + 0.01 for b in entered)
    assert Beat("collectives", value=5.0) in beats


def test_entry_times_are_taken_in_the_same_second_of_three_on_every_rank() -> None:
    assert progress._pause(3000.5, 0.25, 0.005) == 0.005
    assert progress._pause(3001.5, 0.25, 0.005) == 0.25
    assert progress._pause(3002.9, 0.25, 0.005) == pytest.approx(0.1)


def test_the_sampling_seconds_are_the_wall_clocks_so_every_node_samples_the_same(
    pipe: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nodes are compared too (``rendezvous/node_lateness.py``): their monotonic clocks start at boot,
    so seconds picked on them would be different collectives on every node; the wall clock's are
    the same wherever NTP runs. The entry times themselves stay monotonic."""
    import time

    seen: list[float] = []
    real = progress._pause

    def spy(now: float, every_s: float, poll_s: float) -> float:
        seen.append(now)
        return real(now, every_s, poll_s)

    monkeypatch.setattr(progress, "_pause", spy)
    progress.watch_collectives(every_s=0.05, poll_s=0.002)
    time.sleep(0.1)
    assert seen and all(abs(now - time.time()) < 1.0 for now in seen), seen[:3]
