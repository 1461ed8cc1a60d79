"""What the servers read of the run: restarts and the time its incidents lost, by cause."""

from __future__ import annotations

import dataclasses

from multigpu.observe.watched import lost_from_incidents
from multigpu.record.ledger import LOST_CAUSES
from multigpu.supervisor.states import Worker
from unit.observe.fakes import ranks, watched


def test_each_phase_of_an_incident_is_lost_to_its_cause() -> None:
    failed = {
        "kind": "failed",
        "failed_time": 0.0,
        "detected_time": 0.5,
        "stopped_time": 2.0,
        "next_attempt_time": 5.0,
        "next_first_step_time": 9.0,
    }
    hung = {**failed, "kind": "hung", "detected_time": 8.0, "stopped_time": 9.0, "next_attempt_time": None}
    # the ledger's causes (docs/metrics.md): a failure's time to the next first step is restarting
    assert lost_from_incidents([failed, hung]) == {
        "restarting": 0.5 + 1.5 + 3.0 + 4.0,
        "hang_undetected": 8.0,
        "hang_handling": 1.0,
    }
    assert set(lost_from_incidents([failed, hung])) <= set(LOST_CAUSES)


def test_restarts_leave_out_membership_changes() -> None:
    record = {
        "attempts": [{}, {}, {}, {}],
        "incidents": [{"kind": "failed"}, {"kind": "membership change"}, {"kind": "hung"}],
    }
    assert watched(record).restarts() == 2
    assert watched().restarts() == 0


def test_restarts_do_not_fall_when_a_restarted_attempt_ends_by_a_membership_change() -> None:
    """A counter: attempt 1, a restart after a failure, ends when a node joins; that round's incident is
    recorded before the next attempt begins, and must not take the restart back meanwhile."""
    record: dict[str, list[dict[str, object]]] = {"attempts": [{}], "incidents": [{"kind": "failed"}]}
    seen = [watched(record).restarts()]
    record["attempts"].append({})  # attempt 1: a restart
    seen.append(watched(record).restarts())
    record["incidents"].append({"kind": "membership change"})  # a node joined: attempt 1's round ends
    seen.append(watched(record).restarts())
    record["attempts"].append({})  # attempt 2: the same restart's new round, not another restart
    seen.append(watched(record).restarts())
    assert seen == [0, 1, 1, 1]


def test_the_node_label_is_the_ranks_once_they_started() -> None:
    seen = watched()
    assert seen.node_label() == "0"
    workers, book, _ = ranks(2)
    seen.attach([replace_node(w, 3) for w in workers], book)
    assert seen.node_label() == "3"


def replace_node(worker: Worker, node: int) -> Worker:
    return Worker(dataclasses.replace(worker.spec, node=node))
