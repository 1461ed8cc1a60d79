"""A new round waits for the live nodes of the last round, never for a dead one, and never long
(``rendezvous/round_hold.py``), on fake beat counters and a fake clock."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multigpu.rendezvous.round_hold import ALIVE_WITHIN_S, HOLD_CAP_S, RoundHold


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Beats:
    """Launchers' beat counters: a live one moves each time it is read."""

    me = "A"

    def __init__(self, alive: set[str], known: set[str]) -> None:
        self.alive, self.known = alive, known
        self.values: dict[str, int] = {}

    def counts(self, nodes: list[Any]) -> Mapping[Any, int]:
        for node in nodes:
            if node in self.alive:
                self.values[node] = self.values.get(node, 0) + 1
        return {n: self.values.setdefault(n, 7) for n in nodes if n in self.known}


def test_a_live_node_of_the_last_round_holds_the_round_until_it_joins() -> None:
    clock, beats = Clock(), Beats(alive={"B", "C"}, known={"B", "C"})
    hold = RoundHold(beats, clock)
    hold.begin(["A", "B", "C"])
    clock.now += 1.0  # the last call is over: A and B are in, C is still stopping its ranks
    assert hold.holds({"A": 0, "B": 0}, 4) and hold.held_for == ["C"]
    clock.now += 0.5
    assert not hold.holds({"A": 0, "B": 0, "C": 0}, 4) and hold.held_for == []


def test_a_dead_node_holds_nobody() -> None:
    """Its counter, read when the round began, has not moved when the round would complete."""
    clock, beats = Clock(), Beats(alive={"B"}, known={"B", "C"})
    hold = RoundHold(beats, clock)
    hold.begin(["A", "B", "C"])
    clock.now += ALIVE_WITHIN_S
    assert not hold.holds({"A": 0, "B": 0}, 4)


def test_a_node_that_never_beat_holds_nobody() -> None:
    """A torchrun among us, or a node whose counter the store never had."""
    clock, beats = Clock(), Beats(alive=set(), known=set())
    hold = RoundHold(beats, clock)
    hold.begin(["A", "B"])
    clock.now += 1.0
    assert not hold.holds({"A": 0}, 4)


def test_a_live_node_that_never_joins_holds_the_round_no_longer_than_the_cap() -> None:
    clock, beats = Clock(), Beats(alive={"C"}, known={"C"})
    hold = RoundHold(beats, clock)
    hold.begin(["A", "C"])
    clock.now += 1.0
    assert hold.holds({"A": 0}, 4)
    clock.now += HOLD_CAP_S / 2
    assert hold.holds({"A": 0}, 4)
    clock.now += HOLD_CAP_S
    assert not hold.holds({"A": 0}, 4)


def test_a_store_that_fails_holds_nobody() -> None:
    class Broken(Beats):
        def counts(self, nodes: list[Any]) -> Mapping[Any, int]:
            raise RuntimeError("store gone")

    clock = Clock()
    hold = RoundHold(Broken(alive=set(), known=set()), clock)
    hold.begin(["A", "B"])
    clock.now += 1.0
    assert not hold.holds({"A": 0}, 4)


def test_the_first_round_holds_nobody() -> None:
    hold = RoundHold(Beats(alive={"B"}, known={"B"}), Clock())
    hold.begin([])
    assert not hold.holds({}, 4)


def test_a_full_round_is_never_held() -> None:
    """With the round at its maximum, a late node would make it one too many: torch completes no
    round over ``max_nodes``, and every node would wait until ``join_timeout``."""
    clock, beats = Clock(), Beats(alive={"C"}, known={"C"})
    hold = RoundHold(beats, clock)
    hold.begin(["A", "B", "C"])
    clock.now += 1.0
    assert hold.holds({"A": 0, "B": 0}, 3)  # room for C: held
    assert not hold.holds({"A": 0, "B": 0, "D": 0}, 3)  # a spare node filled the round: not held
