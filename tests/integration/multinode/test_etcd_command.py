"""``multigpu etcd`` and the tests' etcd cluster, on real etcd. The command's one line names the
``--rdzv-endpoint`` of three members that are healthy, list each other over the v2 API (the one torch's
etcd-v2 rendezvous speaks) and replicate a key written through one member to another; a member
``kill -9``ed is named in one line; Ctrl-C ends every member and removes their data, leaving nothing.
The test cluster (``tests/etcd_cluster.py``) finds the same leader over the v2 and v3 APIs and elects a
new one once that leader is ``kill -9``ed."""

from __future__ import annotations

import os
import re
import signal
import urllib.request
from pathlib import Path

import pytest

from etcd_cluster import client_ports, etcd_cluster, require
from helpers import assert_gone, start_cli
from multigpu.cli.etcd_cluster import get_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SERVING = re.compile(
    r"multigpu: etcd: 3 members serve \(pids (\d+), (\d+), (\d+)\); jobs: --rdzv-backend etcd-v2 "
    r"--rdzv-endpoint (\S+); data in (\S+); Ctrl-C ends them\n"
)


def put_key(url: str, key: str, value: str) -> None:
    request = urllib.request.Request(f"{url}/v2/keys/{key}", data=f"value={value}".encode(), method="PUT")
    with urllib.request.urlopen(request, timeout=5) as reply:
        assert reply.status in (200, 201)


def check_members(endpoint: str) -> None:
    """All three healthy, each listing the three, a key written through m1 read back (quorum) via m3."""
    urls = [f"http://{e}" for e in endpoint.split(",")]
    for url in urls:
        assert get_json(f"{url}/health") == {"health": "true"}, url
        listed = get_json(f"{url}/v2/members") or {}
        names = sorted(m["name"] for m in listed.get("members", []))  # type: ignore[attr-defined]
        assert names == ["m1", "m2", "m3"], listed
    put_key(urls[0], "multigpu-test", "written-via-m1")
    read = get_json(f"{urls[2]}/v2/keys/multigpu-test?quorum=true") or {}
    assert read.get("node", {}).get("value") == "written-via-m1", read  # type: ignore[union-attr]


def test_multigpu_etcd_serves_three_members_then_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    require()
    ports = client_ports()
    proc = start_cli(["etcd", "--ports", ",".join(map(str, ports))], cwd=tmp_path)
    assert proc.stderr is not None
    try:
        line = proc.stderr.readline()
        serving = SERVING.fullmatch(line)
        assert serving, line
        pids, endpoint, data = [int(p) for p in serving.groups()[:3]], serving[4], Path(serving[5])
        assert endpoint == ",".join(f"127.0.0.1:{p}" for p in ports) and data.is_dir(), line
        check_members(endpoint)
        os.kill(pids[1], signal.SIGKILL)
        assert proc.stderr.readline() == (
            f"multigpu: etcd: member m2 (pid {pids[1]}) ended (killed by SIGKILL); 2 left, the cluster "
            "keeps its quorum\n"
        )
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert err == "multigpu: etcd: SIGINT received; every member ended, their data removed\n" and out == ""
    assert_gone([*pids, proc.pid])
    assert not data.exists(), data


def test_the_test_cluster_finds_its_leader_and_elects_another_once_it_is_killed() -> None:
    with etcd_cluster() as cluster:
        check_members(cluster.endpoint)
        leader = cluster.leader()
        assert cluster.leader_v3() == leader
        assert cluster.kill_leader() == leader
        assert leader not in cluster.alive() and len(cluster.alive()) == 2
        assert cluster.leader() != leader  # two of three keep a quorum: a new leader is elected
        pids = list(cluster.pids().values())
    assert_gone(pids)
