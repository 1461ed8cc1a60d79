"""A failure's kind (``FailureKind``) and subject (``Subject``) through the record's JSON: what a rank's
error file, run.json and the job's abort record in the store hold is what it was when kinds were plain
strings and a negative rank said "not a rank", and it reads back to the same kind and subject."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import jsonschema
import pytest

from multigpu.contract.failure import NO_NODE, NO_RANK, FailureKind, Subject, WorkerFailure
from multigpu.rendezvous.failure_sharing import (
    failure_from_record,
    failure_record,
    node_interrupted,
    node_lost,
    store_lost,
)

SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "schemas" / "run.schema.json").read_text())
FAILURE_SCHEMA = {**SCHEMA["$defs"]["failure"], "$defs": SCHEMA["$defs"]}

RAISED = WorkerFailure(
    rank=2,
    local_rank=0,
    pid=7,
    exit_code=1,
    node=1,
    error_type="ValueError",
    message="boom",
    traceback="Traceback...\nValueError: boom\n",
    time=3.0,
)
RANK_HUNG = WorkerFailure(
    rank=1,
    local_rank=1,
    pid=8,
    node=0,
    error_type=FailureKind.HANG,
    message="no progress for 5.0s",
    traceback="Thread 0x1 ...",
    time=4.0,
)
NOT_A_RANK = [
    (node_lost(3, "its launcher stopped beating for 1.2s", at=5.0), Subject.NODE, FailureKind.NODE_LOST),
    (store_lost(host=0), Subject.STORE, FailureKind.STORE_LOST),
    (store_lost("stopped answering", host=None), Subject.STORE, FailureKind.STORE_LOST),
    (node_interrupted(1, signal.SIGTERM), Subject.NODE, FailureKind.INTERRUPTED),
    (failure_from_record({"node": 2, "reason": "its layout differs"}), Subject.NODE, FailureKind.REFUSED),
    (
        WorkerFailure.launcher_named(
            Subject.JOB, FailureKind.MEMBERSHIP_CHANGE, "1 node(s) asked to join", node=NO_NODE
        ),
        Subject.JOB,
        FailureKind.MEMBERSHIP_CHANGE,
    ),
    (
        WorkerFailure.launcher_named(Subject.NODE, FailureKind.HANG, "no progress", node=1),
        Subject.NODE,
        FailureKind.HANG,
    ),
]


def _through_json(failure: WorkerFailure) -> tuple[dict[str, object], WorkerFailure]:
    wire = json.loads(json.dumps(failure_record(failure)))
    return wire, failure_from_record(wire)


@pytest.mark.parametrize(("failure", "subject", "kind"), NOT_A_RANK)
def test_a_failure_of_a_node_the_store_or_the_job_reads_back_with_its_subject_and_kind(
    failure: WorkerFailure, subject: Subject, kind: FailureKind
) -> None:
    assert (failure.subject, failure.kind) == (subject, kind)
    wire, back = _through_json(failure)
    assert (wire["rank"], wire["local_rank"], wire["error_type"]) == (NO_RANK, NO_RANK, kind.value)
    assert type(wire["error_type"]) is str  # a plain string on the wire, as before the enum
    jsonschema.validate(wire, FAILURE_SCHEMA)
    assert back == failure and (back.subject, back.kind) == (subject, kind)
    assert back.describe() == failure.describe()


@pytest.mark.parametrize("failure", [RAISED, RANK_HUNG])
def test_a_rank_s_failure_reads_back_as_a_rank_with_its_exception_or_its_kind(failure: WorkerFailure) -> None:
    wire, back = _through_json(failure)
    jsonschema.validate(wire, FAILURE_SCHEMA)
    assert back == failure and back.subject is Subject.RANK and back.rank == failure.rank
    assert back.kind == failure.kind and back.error_type == failure.error_type


def test_an_exception_s_type_name_stays_a_plain_string_and_names_no_kind() -> None:
    assert RAISED.kind is None and type(RAISED.error_type) is str
    assert RANK_HUNG.describe() == "rank 1 (node 0, pid 8) exited with code None: Hang: no progress for 5.0s"
    assert f"{FailureKind.NODE_LOST}" == str(FailureKind.NODE_LOST) == "NodeLost" == FailureKind.NODE_LOST


def test_the_record_is_byte_for_byte_what_the_string_constants_wrote(tmp_path: Path) -> None:
    """The same keys, in the same order, with the same values: old and new launchers share a store."""
    lost = node_lost(3, "its launcher stopped beating", at=5.0)
    expected = {
        "rank": -1,
        "local_rank": -1,
        "pid": None,
        "exit_code": None,
        "signal": None,
        "node": 3,
        "error_type": "NodeLost",
        "message": "its launcher stopped beating",
        "traceback": None,
        "time": 5.0,
        "log_tail": [],
        "log_path": None,
        "killed_by": None,
    }
    assert json.dumps(lost.to_dict()) == json.dumps(expected)
    lost.write(tmp_path / "lost.json")
    assert (tmp_path / "lost.json").read_text() == json.dumps(expected)


def test_an_older_launcher_s_records_read_to_the_same_subjects_and_kinds() -> None:
    """What a launcher of the string-constant version published reads back as this one's own."""

    def old(rank: int, node: int, error_type: str | None, **extra: object) -> WorkerFailure:
        return WorkerFailure.from_dict(
            {
                "rank": rank,
                "local_rank": rank,
                "pid": None,
                "exit_code": None,
                "signal": None,
                "node": node,
                "error_type": error_type,
                "message": "m",
                "traceback": None,
                "time": 1.0,
                "log_tail": [],
                "log_path": None,
                **extra,
            }
        )

    assert (old(-1, 0, "StoreLost").subject, old(-1, 0, "StoreLost").kind) == (
        Subject.STORE,
        FailureKind.STORE_LOST,
    )
    assert old(-1, -1, "StoreLost").describe() == "the rendezvous store m"
    assert old(-1, 2, "NodeLost").describe() == "node 2 was lost: m"
    assert old(-1, -1, "MembershipChange").subject is Subject.JOB
    assert old(-1, 1, "Hang").subject is Subject.NODE
    assert old(-1, 0, None).subject is Subject.JOB  # a record that names no rank (torch's @record)
    # a rank's record names the launcher's kind in its "kind" key; without it, "Hang" is what it raised
    assert old(0, 0, "Hang", kind="Hang").subject is Subject.RANK
    assert old(0, 0, "Hang", kind="Hang").kind is FailureKind.HANG
    assert old(0, 0, "Hang").kind is None and old(0, 0, "Hang").error_type == "Hang"
    assert old(4, 1, "OSError").kind is None and old(4, 1, "OSError").subject is Subject.RANK
    assert old(-1, 1, "Interrupted", signal="SIGINT").describe() == (
        "node 1 was stopped: its launcher received SIGINT"
    )


@pytest.mark.parametrize("name", [kind.value for kind in FailureKind])
def test_a_ranks_exception_named_like_a_kind_stays_the_ranks_own(name: str) -> None:
    """A user's ``class Hang(Exception)`` (or ``Interrupted``, ``NodeLost`` ...) raised in a rank is that
    rank's exception, in memory and read back from its record: never the launcher's kind, which would
    stop restarts and keep the failure from the other nodes (found by review)."""
    own = type(name, (Exception,), {})
    try:
        raise own("the user's")
    except Exception as exc:
        failure = WorkerFailure.from_exception(exc, {"RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0"})
    back = WorkerFailure.from_dict(json.loads(json.dumps(failure.to_dict())))
    for record in (failure, back):
        assert record.kind is None and record.error_type == name and record.subject is Subject.RANK
    assert "kind" not in failure.to_dict()


def test_the_launchers_kind_on_a_rank_reads_back_as_the_kind() -> None:
    hung = WorkerFailure(rank=1, local_rank=1, pid=7, error_type=FailureKind.HANG, message="no progress")
    back = WorkerFailure.from_dict(json.loads(json.dumps(hung.to_dict())))
    assert back.kind is FailureKind.HANG and back.subject is Subject.RANK and back.to_dict() == hung.to_dict()
