"""Reading torch's flight-recorder dumps: recorded ones (a real 2-rank gloo run, torch 2.13, where rank 1
never entered the 7th collective) and fabricated ones in the NCCL format; the environment defaults."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest

from multigpu.contract.environment import flight_recorder_env
from multigpu.supervisor.hangs.flight_record import load_dump, missing_ranks, read_dumps

RECORDED = Path(__file__).parent / "data" / "flight_recorder" / "gloo_rank1_missing"


def test_recorded_gloo_dumps_name_the_missing_rank() -> None:
    dumps = read_dumps(RECORDED / "fr_trace_rank_")
    assert sorted(dumps) == [0, 1]
    assert dumps[0]["pg_status"]["0"]["last_enqueued_collective"] == 7
    assert [f.line for f in missing_ranks(dumps, {0, 1})] == [
        "rank 1 is missing from collective #7 (gloo:all_reduce) of process group 0 (default_pg); "
        "rank 0 entered it"
    ]


def entry(
    rank_seq: int,
    op: str,
    state: str,
    pg: tuple[str, str] = ("0", "default_pg"),
    pg_id: int = 0,
    p2p: bool = False,
) -> dict[str, Any]:
    return {
        "record_id": rank_seq,
        "pg_id": pg_id,
        "process_group": pg,
        "collective_seq_id": rank_seq,
        "p2p_seq_id": 0,
        "op_id": rank_seq,
        "profiling_name": op,
        "state": state,
        "is_p2p": p2p,
        "input_sizes": [[4]],
        "output_sizes": [[4]],
        "retired": state == "completed",
        "timeout_ms": 600000,
        "time_created_ns": 1,
        "frames": [],
    }


def nccl_dump(last: int, *, stuck: bool, side_group_last: int = 0) -> dict[str, Any]:
    entries = [entry(i, "nccl:all_reduce", "completed") for i in range(1, last)]
    entries.append(entry(last, "nccl:all_reduce", "started" if stuck else "completed"))
    entries.append(entry(1, "nccl:send 0->1", "completed", p2p=True))
    entries += [
        entry(i, "nccl:all_gather", "completed", pg=("1", "tp"), pg_id=1)
        for i in range(1, side_group_last + 1)
    ]
    return {
        "version": "2.10",
        "entries": entries,
        "pg_config": {
            "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
            "1": {"name": "1", "desc": "tp", "ranks": "[0, 1]"},
        },
        "pg_status": {
            "0": {
                "last_enqueued_collective": last,
                "last_started_collective": last,
                "last_completed_collective": last - 1 if stuck else last,
            }
        },
    }


def write(folder: Path, dumps: dict[int, dict[str, Any]]) -> Path:
    for rank, dump in dumps.items():
        (folder / f"fr_trace_rank_{rank}").write_bytes(pickle.dumps(dump))
    return folder / "fr_trace_rank_"


def test_nccl_format_two_ranks_behind(tmp_path: Path) -> None:
    prefix = write(
        tmp_path,
        {
            0: nccl_dump(12, stuck=True, side_group_last=3),
            1: nccl_dump(12, stuck=True, side_group_last=3),
            2: nccl_dump(11, stuck=False),
            3: nccl_dump(11, stuck=False),
        },
    )
    assert [f.line for f in missing_ranks(read_dumps(prefix), {0, 1, 2, 3})] == [
        "ranks 2, 3 are missing from collective #12 (nccl:all_reduce) of process group 0 (default_pg); "
        "ranks 0, 1 entered it"
    ]


def test_every_rank_inside_one_collective(tmp_path: Path) -> None:
    prefix = write(tmp_path, {r: nccl_dump(5, stuck=True) for r in range(4)})
    assert [f.line for f in missing_ranks(read_dumps(prefix), {0, 1, 2, 3})] == [
        "every rank entered collective #5 (nccl:all_reduce) of process group 0 (default_pg), and none "
        "completed it"
    ]


def test_ranks_of_other_nodes_are_not_blamed(tmp_path: Path) -> None:
    """This launcher reads only its own node's dumps (ranks 0, 1 of the 4 in the group)."""
    prefix = write(tmp_path, {0: nccl_dump(5, stuck=True), 1: nccl_dump(5, stuck=True)})
    assert [f.line for f in missing_ranks(read_dumps(prefix), {0, 1})] == [
        "every rank that wrote a dump entered collective #5 (nccl:all_reduce) of process group 0 "
        "(default_pg), and none completed it"
    ]


def test_a_rank_without_a_dump_is_named(tmp_path: Path) -> None:
    prefix = write(tmp_path, {0: nccl_dump(5, stuck=False), 1: nccl_dump(5, stuck=False)})
    findings = missing_ranks(read_dumps(prefix), {0, 1, 2})
    assert [(f.ranks, f.line) for f in findings] == [([2], "rank 2 wrote no flight-recorder dump")]


def test_stale_and_hostile_files_are_not_read(tmp_path: Path) -> None:
    prefix = write(tmp_path, {0: nccl_dump(5, stuck=True), 1: nccl_dump(4, stuck=False)})
    old = time.time() - 3600
    os.utime(tmp_path / "fr_trace_rank_1", (old, old))
    assert sorted(read_dumps(prefix, newer_than=time.time() - 60)) == [0]
    (tmp_path / "fr_trace_rank_2").write_bytes(pickle.dumps(Path("x")))  # a class: refused
    (tmp_path / "fr_trace_rank_3").write_bytes(b"not a pickle")
    (tmp_path / "fr_trace_rank_x").write_bytes(pickle.dumps({}))
    assert sorted(read_dumps(prefix)) == [0, 1]
    with pytest.raises(pickle.UnpicklingError):
        load_dump(pickle.dumps(Path("x")))


def test_recorder_on_by_default_for_every_rank_unless_the_user_chose_a_size() -> None:
    """On for gloo too: the hang report can then name the collective a CPU rank is missing from."""
    prefix = "/out/logs/attempt_0/fr_trace_rank_"
    assert flight_recorder_env({}, prefix) == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "MULTIGPU_FR_DUMP": prefix,
    }
    assert flight_recorder_env({"TORCH_FR_BUFFER_SIZE": "50"}, "/p") == {
        "TORCH_FR_DUMP_TEMP_FILE": "/p",
        "MULTIGPU_FR_DUMP": "/p",
    }


def test_the_users_choices_stand() -> None:
    off = {"MULTIGPU_FR_DUMP": ""}  # no record; the launcher can still ask for the stacks
    assert flight_recorder_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, "/p") == off
    assert flight_recorder_env({"TORCH_FR_BUFFER_SIZE": "0"}, "/p") == off
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/mine/trace_"}
    assert flight_recorder_env(mine, "/p") == {"MULTIGPU_FR_DUMP": "/mine/trace_"}
