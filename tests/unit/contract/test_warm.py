"""The warm slot: started once, replaced when unusable, taken whole, ended once, from any thread."""

from __future__ import annotations

import threading

import pytest

from multigpu.contract.warm import Warm


class Thing:
    def __init__(self) -> None:
        self.ended = 0
        self.usable = True


def test_started_on_first_use_then_the_same_one() -> None:
    slot: Warm[Thing] = Warm(lambda t: None)
    first = slot.get_or_start(Thing)
    assert slot.get_or_start(Thing) is first and slot.held() is first


def test_one_no_longer_usable_is_ended_and_replaced() -> None:
    ended: list[Thing] = []
    slot: Warm[Thing] = Warm(ended.append)
    first = slot.get_or_start(Thing)
    first.usable = False
    second = slot.get_or_start(Thing, lambda t: t.usable)
    assert second is not first and ended == [first] and slot.held() is second


def test_one_whose_check_raises_is_ended_not_dropped() -> None:
    """A held helper process whose ``usable`` check fails (a broken pipe, say) must still be ended:
    dropped from the slot, it would run on with no one to end it."""

    def check(_: Thing) -> bool:
        raise BrokenPipeError

    ended: list[Thing] = []
    slot: Warm[Thing] = Warm(ended.append)
    first = slot.get_or_start(Thing)
    with pytest.raises(BrokenPipeError):
        slot.get_or_start(Thing, check)
    assert ended == [first] and slot.held() is None


def test_a_start_that_fails_leaves_the_slot_empty() -> None:
    def broken() -> Thing:
        raise OSError("no")

    slot: Warm[Thing] = Warm(lambda t: None)
    with pytest.raises(OSError):
        slot.get_or_start(broken)
    assert slot.held() is None


def test_put_fills_only_an_empty_slot_and_take_empties_it() -> None:
    slot: Warm[Thing] = Warm(lambda t: None)
    kept, other = Thing(), Thing()
    assert slot.put(kept) and not slot.put(other)
    assert slot.take() is kept and slot.take() is None and slot.put(other)


def test_close_ends_the_one_held_once() -> None:
    ended: list[Thing] = []
    slot: Warm[Thing] = Warm(ended.append)
    held = slot.get_or_start(Thing)
    slot.close()
    slot.close()
    assert ended == [held] and slot.held() is None
    assert slot.get_or_start(Thing) is not held  # the next use starts anew


def test_threads_asking_at_once_share_one_start() -> None:
    started: list[Thing] = []
    gate = threading.Barrier(8)

    def start() -> Thing:
        started.append(Thing())
        return started[-1]

    slot: Warm[Thing] = Warm(lambda t: None)
    got: list[Thing] = []

    def ask() -> None:
        gate.wait()
        got.append(slot.get_or_start(start))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(started) == 1 and all(g is started[0] for g in got)
