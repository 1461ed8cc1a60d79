"""The preemption watch's thread, as the launcher ends an attempt (``runner/preempt_watch.py``)."""

from __future__ import annotations

import signal
import threading
import time
from contextlib import ExitStack

import pytest

from multigpu.runner import preempt_watch
from multigpu.runner.preempt_watch import PreemptWatch


class _Target:
    def request_signal(self, signum: int) -> None:
        pass

    def request_stop(self) -> None:
        pass


def test_a_watch_stuck_in_a_store_call_does_not_hold_the_attempt_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over a cut link a store call has no time-out: the end of the attempt waits a bounded time for
    the thread (a daemon), never for ever (found by review)."""
    stuck, release = threading.Event(), threading.Event()

    def run(self: PreemptWatch, target: _Target) -> None:
        stuck.set()
        release.wait(60)  # a store call that does not return

    monkeypatch.setattr(PreemptWatch, "_run", run)
    monkeypatch.setattr(preempt_watch, "JOIN_S", 0.2)
    watch = PreemptWatch([signal.SIGUSR1])
    try:
        with ExitStack() as stack:
            watch.attach(stack, _Target())
            assert stuck.wait(10)
            started = time.monotonic()
        assert time.monotonic() - started < 10
    finally:
        release.set()
        watch.close()
