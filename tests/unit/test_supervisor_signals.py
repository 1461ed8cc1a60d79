"""capture_signals: handlers only record, previous handlers come back, an ignored SIGHUP stays ignored."""

from __future__ import annotations

import os
import signal
import time
from types import FrameType

from multigpu.contract.signals import CAUGHT
from multigpu.supervisor.signals import capture_signals


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
