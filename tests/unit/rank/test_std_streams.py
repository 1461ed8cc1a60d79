"""A rank's own stdout and stderr made progress (``rank/std_streams.py``): every write passes through
whole, and the writes send a beat at most every 50 ms. On a stand-in stream and clock; no processes."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from multigpu.rank import std_streams


def test_writes_pass_through_and_beat_at_most_every_50_ms(monkeypatch: pytest.MonkeyPatch) -> None:
    beats: list[float] = []
    clock = [100.0]
    monkeypatch.setattr(std_streams, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(std_streams, "output_beat", lambda: beats.append(clock[0]))
    stream = io.StringIO()
    out = std_streams._BeatingStream(stream)
    assert out.write("a") == 1
    out.writelines(["b", "c"])
    clock[0] += 0.049
    out.write("d")
    clock[0] += 0.001
    out.write("e")
    assert beats == pytest.approx([100.0, 100.05])
    assert stream.getvalue() == "abcde" and out.getvalue() == "abcde"  # anything else is the stream's


def test_an_attribute_set_on_it_is_set_on_the_stream() -> None:
    stream = io.StringIO()
    out = std_streams._BeatingStream(stream)
    out.mine = 1  # type: ignore[attr-defined]
    assert stream.mine == 1  # type: ignore[attr-defined]
