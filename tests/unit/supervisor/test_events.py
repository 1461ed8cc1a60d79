"""The supervisor's one selector (``supervisor/events.py``): what is ready comes with its kind and object,
a wake-up from another thread ends a wait at once and yields nothing, a descriptor forgotten while a
batch is handled is skipped, and ``read_ready`` tells "nothing yet" from the end of a pipe. No processes.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from multigpu.supervisor.events import Events, read_ready


def test_a_ready_pipe_comes_with_its_kind_and_object() -> None:
    events = Events()
    r, w = os.pipe()
    events.watch(r, "pipe", "rank 0")
    assert list(events.ready(0)) == []
    os.write(w, b"x")
    assert list(events.ready(1)) == [("pipe", "rank 0")]
    assert os.read(r, 1) == b"x"
    events.forget(r, close=True)
    os.close(w)
    events.close()


def test_a_wake_from_another_thread_ends_the_wait_and_yields_nothing() -> None:
    events = Events()
    waker = threading.Timer(0.05, events.wake)
    waker.start()
    start = time.monotonic()
    assert list(events.ready(30)) == []
    assert time.monotonic() - start < 10
    waker.join()
    events.close()
    events.wake()  # a late wake after close writes nowhere and raises nothing


def test_a_descriptor_forgotten_while_a_batch_is_handled_is_skipped() -> None:
    events = Events()
    pipes = [os.pipe() for _ in range(2)]
    for n, (r, w) in enumerate(pipes):
        events.watch(r, "pipe", n)
        os.write(w, b"x")
    seen = []
    for _, n in events.ready(1):
        seen.append(n)
        events.forget(pipes[1 - n][0], close=True)  # the first one's handling closes the other
    assert len(seen) == 1
    events.forget(pipes[seen[0]][0], close=True)
    for _, w in pipes:
        os.close(w)
    events.close()


def test_forget_closes_only_when_asked_and_twice_is_harmless() -> None:
    events = Events()
    r, w = os.pipe()
    events.watch(r, "pipe", None)
    events.forget(r)
    events.forget(r)
    os.write(w, b"x")
    assert list(events.ready(0)) == []
    assert os.read(r, 1) == b"x"  # still open
    events.watch(r, "pipe", None)
    events.forget(r, close=True)
    with pytest.raises(OSError):
        os.fstat(r)
    os.close(w)
    events.close()


def test_read_ready_tells_nothing_yet_from_the_end() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    assert read_ready(r) is None
    os.write(w, b"ab")
    assert read_ready(r) == b"ab"
    os.close(w)
    assert read_ready(r) == b""
    os.close(r)
