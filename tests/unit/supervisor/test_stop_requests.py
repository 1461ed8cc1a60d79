"""capture_signals: handlers only record, previous handlers come back, an ignored SIGHUP stays ignored."""

from __future__ import annotations

import os
import signal
import time
from types import FrameType

from multigpu.contract.signals import CAUGHT
from multigpu.supervisor.stop_requests import capture_signals


def _wait_for(received: list[int], count: int) -> None:
    deadline = time.monotonic() + 2
    while len(received) < count and time.monotonic() < deadline:
        time.sleep(0.001)


def test_handlers_record_and_are_restored() -> None:
    def previous(signum: int, frame: FrameType | None) -> None:
        raise AssertionError("the previous handler must not run while captured")

    old = signal.signal(signal.SIGUSR1, previous)
    try:
        received: list[int] = []
        with capture_signals(received.append):
            assert all(signal.getsignal(s) is not previous for s in CAUGHT if s != signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR2)
            _wait_for(received, 2)
        assert received == [signal.SIGUSR1, signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR1) is previous
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_ignored_sighup_stays_ignored() -> None:
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        received: list[int] = []
        with capture_signals(received.append):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGUSR2)
            _wait_for(received, 1)
        assert received == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


def test_sighup_captured_when_not_ignored() -> None:
    old = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        received: list[int] = []
        with capture_signals(received.append):
            os.kill(os.getpid(), signal.SIGHUP)
            _wait_for(received, 1)
        assert received == [signal.SIGHUP]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, old)


def test_stop_requests_one_interrupt_a_second_press_and_the_signals_for_the_ranks() -> None:
    """The first stop signal stops the run; a SIGINT with it (``timeout -s INT`` signals the launcher
    and then its group) is the same interrupt; a SIGINT after the ranks were told to stop, and
    ``SAME_INTERRUPT_S`` later, is Ctrl-C pressed again. SIGHUP/SIGUSR1 go to the ranks."""
    from multigpu.supervisor.stop_requests import SAME_INTERRUPT_S, StopRequests

    now = [100.0]
    woken: list[bool] = []
    stops = StopRequests(lambda: now[0], lambda: woken.append(True))
    stops.record(signal.SIGHUP)
    stops.record(signal.SIGINT)
    assert stops.seen() and woken == [True, True]  # recorded, not yet handled, already counts
    assert stops.take(closing=False) == [signal.SIGHUP]
    assert stops.signal == signal.SIGINT and not stops.kill_now
    stops.told_at = now[0]
    stops.record(signal.SIGINT)  # the group's copy of the same interrupt
    stops.take(closing=True)
    assert not stops.kill_now
    now[0] += SAME_INTERRUPT_S + 0.01
    stops.record(signal.SIGINT)
    stops.take(closing=True)
    assert stops.kill_now


def test_a_stop_signal_during_teardown_does_not_become_the_runs() -> None:
    from multigpu.supervisor.stop_requests import StopRequests

    stops = StopRequests(lambda: 0.0, lambda: None)
    stops.record(signal.SIGTERM)
    assert stops.take(closing=True) == [] and stops.signal is None
