"""The other launchers watched while this node's check runs (``runner/preflight_peers.py``): a node whose
launcher stops beating, or that never begins, is named (a fast-forward clock; the store in memory)."""

from __future__ import annotations

import pytest

from multigpu.runner import preflight_peers
from multigpu.runner.preflight_peers import NodeLost, PeerBeats


class MemoryStore:
    """The three store calls the launcher's beats make, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [str(self.values[key]).encode() for key in keys]


class Job:
    """The part of a ``JobStore`` the preflight reads: its store, its keys and the nodes' machines."""

    def __init__(self, machines: tuple[str, ...] = ("a", "b")) -> None:
        self.store = MemoryStore()
        self.machines = machines

    def fingerprints(self) -> dict[int, dict[str, str]]:
        return {node: {"machine": m} for node, m in enumerate(self.machines)}

    def key(self, *parts: object) -> str:
        return "/".join(["multigpu", "r", *map(str, parts)])


def test_a_node_whose_launcher_stops_beating_is_named_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(preflight_peers.time, "monotonic", lambda: now[0])
    job = Job()
    beats = PeerBeats(job, 0, 2, me=0)  # type: ignore[arg-type]
    other = PeerBeats(job, 0, 2, me=1)  # type: ignore[arg-type]
    beats.poll()  # node 1 has not begun: nothing judged
    for _ in range(4):
        now[0] += preflight_peers.BEAT_S
        other.poll()
        beats.poll()
    now[0] += (
        preflight_peers.LOST_AFTER_S - preflight_peers.BEAT_S
    )  # node 1 stops beating: still within bounds
    beats.poll()
    with pytest.raises(NodeLost) as info:
        now[0] += 2 * preflight_peers.BEAT_S
        beats.poll()
    assert str(info.value).startswith("node 1 was lost during the check: its launcher stopped beating for")


def test_a_node_that_never_begins_the_check_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(preflight_peers.time, "monotonic", lambda: now[0])
    beats = PeerBeats(Job(), 0, 3, me=1)  # type: ignore[arg-type]
    beats.poll()
    now[0] += preflight_peers.START_S + 1
    with pytest.raises(NodeLost, match=r"^node 0 never began the check within 30s$"):
        beats.poll()


def test_the_beats_live_under_the_rounds_preflight_keys_not_the_jobs() -> None:
    """The attempt's fate monitor gives a node whose job counter never moved a first-beat grace."""
    job = Job()
    PeerBeats(job, 3, 2, me=1).poll()  # type: ignore[arg-type]
    assert job.store.values == {"multigpu/r/preflight/3/beat/1": 1}
