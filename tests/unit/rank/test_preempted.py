"""The rank side of a preemption warning: the recording handler, and the agreed stop step.

The agreement is checked against a model of a data-parallel loop: every step ends in a collective
over all ranks, so a rank finishes step s only once every rank has entered it. A random scheduler
runs ranks in any order such a loop allows, with the warning reaching each rank at a different
moment; every run must end with all ranks stopped at the same step, no rank left waiting in a
collective, and no store call after rank 0 (the store's host on one machine) has left.
"""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import pytest

from multigpu.contract.names import WARNING_SIGNALS_ENV as SIGNALS_ENV
from multigpu.contract.values import signal_numbers
from multigpu.rank import preempted as preemption
from multigpu.rank.preempted import _State


class FakeStore:
    """A dict with the store calls ``should_stop`` makes, counting them; it refuses once ``gone``."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.calls = 0
        self.gone = False
        self.after_gone = 0

    def _call(self) -> None:
        if self.gone:
            self.after_gone += 1
            raise ConnectionError("the store's host (rank 0) has left")
        self.calls += 1

    def set(self, key: str, value: str) -> None:
        self._call()
        self.data[key] = value

    def add(self, key: str, amount: int) -> int:
        self._call()
        self.data[key] = str(int(self.data.get(key, "0")) + amount)
        return int(self.data[key])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._call()
        return [self.data[k].encode() for k in keys]


def _states(world: int, store: FakeStore) -> list[_State]:
    env = {"WORLD_SIZE": str(world), "TORCHELASTIC_RUN_ID": "r", "MULTIGPU_ATTEMPT": "0"}
    return [_State(store=store, env={**env, "RANK": str(r)}) for r in range(world)]


def _ask(monkeypatch: pytest.MonkeyPatch, state: _State, step: int) -> bool:
    monkeypatch.setattr(preemption, "_state", state)
    return preemption.should_stop(step)


def simulate(monkeypatch: pytest.MonkeyPatch, seed: int, world: int) -> list[int]:
    """Run the model loop to its end; the step each rank stopped at."""
    rng = random.Random(seed)
    store = FakeStore()
    states = _states(world, store)
    boundary = [0] * world
    in_step = [False] * world
    stopped: list[int | None] = [None] * world
    warn_at = [rng.randint(0, 40) for _ in range(world)]  # in scheduler moves: some ranks hear it late
    for move in range(10_000):
        for r in range(world):
            if move >= warn_at[r] and states[r].signum is None:
                states[r].signum = signal.SIGUSR1
        movable = [
            r
            for r in range(world)
            if stopped[r] is None
            and (
                not in_step[r]
                or all(
                    boundary[o] > boundary[r] or (boundary[o] == boundary[r] and in_step[o])
                    for o in range(world)
                )
            )
        ]  # a stopped rank entered no step after it
        if not movable:
            break
        r = rng.choice(movable)
        if in_step[r]:  # the step's collective completes: every rank has entered it
            in_step[r], boundary[r] = False, boundary[r] + 1
        elif _ask(monkeypatch, states[r], boundary[r]):
            stopped[r] = boundary[r]
            store.gone = store.gone or r == 0
        else:
            in_step[r] = True
    assert not store.after_gone, f"seed {seed}: a store call after rank 0, the store's host, left"
    waiting = [r for r in range(world) if stopped[r] is None]
    assert not waiting, f"seed {seed}: ranks {waiting} wait in a collective their peers left ({stopped})"
    return [s for s in stopped if s is not None]


@pytest.mark.parametrize("world", [2, 3, 5])
def test_every_rank_stops_at_the_same_step(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    for seed in range(150):
        steps = simulate(monkeypatch, seed, world)
        assert len(set(steps)) == 1, f"seed {seed}: stopped at {steps}"


@pytest.mark.parametrize("MARGIN", [0, 1])
def test_a_smaller_margin_fails(monkeypatch: pytest.MonkeyPatch, MARGIN: int) -> None:
    """Stopping at the largest step written strands a peer in that step's collective; one step later,
    a peer may still have to ask the store after rank 0 (its host on one machine) has left."""
    monkeypatch.setattr(preemption, "STOP_MARGIN", MARGIN)
    failures = 0
    for seed in range(150):
        try:
            simulate(monkeypatch, seed, 3)
        except AssertionError:
            failures += 1
    assert failures > 0


def test_no_store_call_before_a_warning_and_one_per_step_after(monkeypatch: pytest.MonkeyPatch) -> None:
    store = FakeStore()
    first, second = _states(2, store)
    for step in range(100):
        assert not _ask(monkeypatch, first, step)
    assert store.calls == 0  # a flag test per step, nothing else
    first.signum = signal.SIGUSR1
    assert not _ask(monkeypatch, first, 100)  # writes its step and counts itself in
    assert store.calls == 2
    for step in range(101, 104):
        assert not _ask(monkeypatch, first, step)
    assert store.calls == 5  # one call per step while waiting for the peer
    second.signum = signal.SIGUSR1
    assert not _ask(monkeypatch, second, 103)
    assert second.stop == 105
    assert not _ask(monkeypatch, first, 104) and first.stop == 105
    calls = store.calls
    assert _ask(monkeypatch, first, 105) and _ask(monkeypatch, second, 105)
    assert store.calls == calls  # known: no more store calls


def test_a_lost_store_stops_the_rank_where_it_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = FakeStore()
    store.gone = True
    (state,) = _states(1, store)
    state.signum = signal.SIGUSR1
    assert _ask(monkeypatch, state, 7)
    assert "stopping at step 7" in capsys.readouterr().err


def test_parse_signals() -> None:
    assert signal_numbers("USR1, sigusr2", "--x") == (signal.SIGUSR1, signal.SIGUSR2)
    with pytest.raises(ValueError, match="'BOGUS'"):
        signal_numbers("bogus", "--x")


def test_installed_handler_only_records(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    monkeypatch.setattr(preemption, "_state", _State())
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # ignored at start (nohup): stays ignored
        assert preemption.install({SIGNALS_ENV: "SIGUSR1,SIGUSR2"}) == (signal.SIGUSR2,)
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        assert not preemption.preempted()
        os.kill(os.getpid(), signal.SIGUSR2)  # the process lives on: it was recorded
        assert preemption.preempted()
        assert preemption.install({}) == ()
        assert preemption.install({SIGNALS_ENV: "nonsense"}) == ()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_outside_a_run_nothing_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _State(env={})  # a clean slate, the real state restored after
    monkeypatch.setattr(preemption, "_state", state)
    assert not preemption.preempted() and not preemption.should_stop(0)
    assert state.store is None


def _unused(*_: Any) -> None:  # keeps the fake's signature honest for mypy's Protocol check
    store: preemption.Store = FakeStore()
    del store
