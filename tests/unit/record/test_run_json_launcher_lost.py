"""Issue 31: whether a run's launcher is still there (``record/run_json.py``), decided from a fake /proc
reading, the record closed as ``launcher lost``. No processes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from multigpu.config.run import RunConfig
from multigpu.record.run_json import (
    LOST,
    RunRecord,
    close_if_lost,
    launcher_fate,
    launcher_identity,
    start_time_of,
)

SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "schemas" / "run.schema.json").read_text())
STARTED = 1796455709.25
LAUNCHER = {"pid": 4242, "start_time": STARTED, "host": "n1", "boot_id": "boot-a", "uid": 1000}


def _data(**launcher: Any) -> dict[str, Any]:
    return {"status": "running", "end_time": None, "launcher": {**LAUNCHER, **launcher}}


def _proc(table: dict[int, float]) -> Any:
    """A fake /proc: pid -> start time; a pid not in it is gone."""
    return table.get


def test_the_same_pid_started_at_the_same_time_is_alive() -> None:
    fate = launcher_fate(_data(), "n1", "boot-a", _proc({4242: STARTED + 0.01}))
    assert fate.state == "alive"


def test_no_such_pid_is_gone_and_named() -> None:
    fate = launcher_fate(_data(), "n1", "boot-a", _proc({}))
    assert fate.state == "gone"
    assert fate.line == "launcher lost: pid 4242 on n1 is gone (its run.json still says running)"


def test_a_reused_pid_is_told_apart_by_its_start_time() -> None:
    fate = launcher_fate(_data(), "n1", "boot-a", _proc({4242: STARTED + 3600}))
    assert fate.state == "gone"


@pytest.mark.parametrize(
    ("host", "boot"), [("n2", "boot-a"), ("n1", "boot-b")], ids=["other host", "rebooted"]
)
def test_another_host_or_boot_cannot_tell(host: str, boot: str) -> None:
    asked: list[int] = []

    def proc(pid: int) -> float | None:
        asked.append(pid)
        return STARTED

    fate = launcher_fate(_data(), host, boot, proc)
    assert fate.state == "unknown" and "cannot tell whether it is still running" in fate.line
    assert "its launcher (pid 4242) runs on n1" in fate.line
    assert asked == []  # this machine's /proc says nothing of that launcher


def test_a_record_without_a_launcher_cannot_tell() -> None:
    fate = launcher_fate({"status": "running", "end_time": None}, "n1", "boot-a", _proc({}))
    assert fate.state == "unknown"


def test_this_process_reads_as_alive_from_the_real_proc() -> None:
    me = launcher_identity()
    assert me["pid"] == os.getpid() and me["uid"] == os.getuid()
    assert start_time_of(os.getpid()) == pytest.approx(me["start_time"], abs=1.0)
    fate = launcher_fate({"status": "running", "launcher": me}, me["host"], me["boot_id"])
    assert fate.state == "alive", fate.line


def test_its_own_user_closes_the_record_as_launcher_lost(tmp_path: Path) -> None:
    config = RunConfig(target="train.py", nproc=1, world_size=1)
    record = RunRecord(tmp_path / "run.json", config, "20261206-000000-abcdef", ["cpu"], command=["multigpu"])
    record.begin_attempt(0, "127.0.0.1", 29500)
    data = json.loads(record.path.read_text())
    assert data["launcher"]["pid"] == os.getpid()
    assert close_if_lost(record.path, data)
    closed = json.loads(record.path.read_text())
    assert closed["status"] == LOST and closed["end_time"] is not None and closed["exit_code"] is None
    assert closed["launcher"]["lost_found_time_utc"].endswith("Z")
    jsonschema.validate(closed, SCHEMA)


def test_another_users_reader_leaves_the_record_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_data()))
    monkeypatch.setattr(os, "getuid", lambda: path.stat().st_uid + 1)
    assert not close_if_lost(path, _data())
    assert json.loads(path.read_text())["status"] == "running"
