"""Issue 31: whether a run's launcher is still there (``record/run_json.py``), decided from a fake /proc
reading, the record closed as ``launcher lost``; and the waiting lines of a node (``runner/static_join.py``).
No processes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from multigpu.config.run import RendezvousConfig, RunConfig
from multigpu.contract.errors import Interrupted, RendezvousError
from multigpu.contract.values import duration_text
from multigpu.record.run_json import (
    LOST,
    RunRecord,
    close_if_lost,
    launcher_fate,
    launcher_identity,
    start_time_of,
)
from multigpu.runner.static_join import JoinWait, wait_line

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "schemas" / "run.schema.json").read_text())
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


@pytest.mark.parametrize(("host", "boot"), [("n2", "boot-a"), ("n1", "boot-b")],
                         ids=["other host", "rebooted"])
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


def test_another_users_reader_leaves_the_record_alone(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_data()))
    monkeypatch.setattr(os, "getuid", lambda: path.stat().st_uid + 1)
    assert not close_if_lost(path, _data())
    assert json.loads(path.read_text())["status"] == "running"


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (45.9, "45s"), (598, "9m58s"), (3720, "1h02m"),
                                               (-3, "0s")])
def test_duration_text(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


def test_wait_line() -> None:
    assert wait_line(1, [1], [0], 598.4) == ("node 1: waiting for node(s) 0 (joined: 1); 9m58s left "
                                             "(--rdzv-timeout)")
    assert wait_line(0, [0, 2], [1, 3], 5) == ("node 0: waiting for node(s) 1, 3 (joined: 0, 2); 5s left "
                                               "(--rdzv-timeout)")


class _Job:
    """A JobStore stand-in: its members, and a join that polls ``on_wait`` with the given times left."""

    def __init__(self, members: dict[int, int], lefts: list[float], interrupt: bool = False) -> None:
        self._members, self._lefts, self._interrupt = members, lefts, interrupt

    def members(self) -> dict[int, int]:
        return self._members

    def join(self, timeout_s: float, on_wait: Any = None) -> None:
        for left in self._lefts:
            on_wait(left)
        if self._interrupt:
            raise KeyboardInterrupt


def _wait(job: _Job, clock: list[float], said: list[str]) -> JoinWait:
    config = RunConfig(target="t.py", nproc=1, world_size=3, nnodes=3, node_rank=0,
                       rdzv=RendezvousConfig(timeout=600))
    return JoinWait(config, job, clock=lambda: clock[0], notify=said.append)  # type: ignore[arg-type]


def test_the_wait_is_said_after_a_second_then_every_30_s() -> None:
    said: list[str] = []
    clock = [100.0]
    job = _Job({0: 0, 2: 2}, [])
    wait = _wait(job, clock, said)
    for now, left in [(100.0, 599.9), (100.9, 599.1), (101.0, 599.0), (110.0, 590.0), (130.9, 569.1),
                      (131.0, 569.0), (150.0, 550.0)]:
        clock[0] = now
        wait(left)
    assert said == ["node 0: waiting for node(s) 1 (joined: 0, 2); 9m59s left (--rdzv-timeout)",
                    "node 0: waiting for node(s) 1 (joined: 0, 2); 9m29s left (--rdzv-timeout)"]


def test_the_time_out_names_the_missing_nodes() -> None:
    wait = _wait(_Job({0: 0}, [599.0, 0.0]), [0.0], [])
    with pytest.raises(RendezvousError, match=r"^node\(s\) 1, 2 never joined within 600s \(--rdzv-timeout\)"):
        wait.join()


def test_a_ctrl_c_while_waiting_is_one_line() -> None:
    wait = _wait(_Job({0: 0, 1: 1}, [599.0], interrupt=True), [0.0], [])
    with pytest.raises(Interrupted) as caught:
        wait.join()
    assert str(caught.value) == ("node 0: interrupted (SIGINT) while waiting for node(s) 2 to join "
                                 "(joined: 0, 1); no rank was started")


def test_the_elastic_round_wait_line() -> None:
    from multigpu.rendezvous.elastic import round_wait_line

    config = RunConfig(target="t.py", rdzv=RendezvousConfig(min_nodes=2, max_nodes=3))
    assert round_wait_line(["n1 pid 7"], config, 297.5) == (
        "waiting for 1 more node(s) for the round (2:3 nodes; joined: n1 pid 7); 4m57s left (join_timeout)")
    assert round_wait_line(["n1 pid 7", "n2 pid 9"], config, 100).startswith(
        "the round has its 2 node(s); waiting for more up to last_call_timeout (2:3 nodes; joined: n1 pid 7, "
        "n2 pid 9)")
