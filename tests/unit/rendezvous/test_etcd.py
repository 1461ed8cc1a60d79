"""``--rdzv-backend etcd-v2``'s own parts: the member list, the client's settings, and the one line a
missing python-etcd or an unreachable cluster is (no etcd server here: the cluster tier runs one)."""

from __future__ import annotations

import socket
import sys

import pytest

from multigpu.config.endpoint import Endpoint
from multigpu.contract.errors import RendezvousError, UsageError
from multigpu.rendezvous import etcd, etcd_client


def test_members_one_or_a_list_with_etcd_default_port() -> None:
    assert etcd.parse_members("10.0.0.1") == (Endpoint("10.0.0.1", 2379),)
    assert etcd.parse_members(" a:1 , b , [fe80::1]:3") == (
        Endpoint("a", 1),
        Endpoint("b", 2379),
        Endpoint("fe80::1", 3),
    )
    assert etcd.describe(etcd.parse_members("a:1,b:2")) == "the etcd cluster at a:1,b:2"


@pytest.mark.parametrize("text", ["", ",", "a:1,", "a:1,a:1", "a:0", "a:x", "::1"])
def test_bad_member_lists_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError) as info:
        etcd.parse_members(text)
    assert "\n" not in str(info.value) and "--rdzv-endpoint" in str(info.value)


def test_settings_take_either_backends_key_names() -> None:
    old = etcd.etcd_settings({"protocol": "HTTPS", "cacert": "ca", "cert": "c", "key": "k"})
    new = etcd.etcd_settings({"protocol": "https", "ca_cert": "ca", "ssl_cert": "c", "ssl_cert_key": "k"})
    assert old == new == etcd.EtcdSettings("https", "ca", "c", "k", 60.0)
    assert etcd.etcd_settings({"read_timeout": "5"}).read_timeout == 5.0
    for bad in ({"protocol": "udp"}, {"key": "k"}, {"read_timeout": "0"}):
        with pytest.raises(UsageError):
            etcd.etcd_settings(bad)


def test_a_missing_python_etcd_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "etcd", None)  # import etcd raises ImportError
    with pytest.raises(RendezvousError) as info:
        etcd.open_etcd_store(etcd.parse_members("127.0.0.1:2379"), {})
    assert str(info.value) == (
        "--rdzv-backend etcd-v2 needs python-etcd: pip install 'multigpu[etcd]' (or python-etcd)"
    )


def test_an_unreachable_cluster_is_one_line_naming_it() -> None:
    pytest.importorskip("etcd")
    closed = []
    for _ in range(2):  # two ports nothing listens on: bound, then closed
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            closed.append(sock.getsockname()[1])
    members = etcd.parse_members(",".join(f"127.0.0.1:{port}" for port in closed))
    with pytest.raises(RendezvousError) as info:
        etcd.open_etcd_store(members, {})
    message = str(info.value)
    assert message.startswith(
        f"the etcd cluster at 127.0.0.1:{closed[0]},127.0.0.1:{closed[1]} did not answer"
    )
    assert "\n" not in message


class _Member:
    """A python-etcd client of one member: answers, or fails as a member without a leader does."""

    def __init__(self, failure: BaseException | None, base_uri: str) -> None:
        self.failure, self.base_uri, self.calls = failure, base_uri, 0

    def read(self, key: str) -> str:
        self.calls += 1
        if self.failure is not None:
            raise self.failure
        return f"{self.base_uri}{key}"


def test_a_failed_call_moves_to_the_next_member_then_ends_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    python_etcd = pytest.importorskip("etcd")
    client = etcd_client.FailoverClient(etcd.parse_members("a:1,b:2"), "the etcd cluster at a:1,b:2")
    timeout = python_etcd.EtcdException("Raft Internal Error : etcdserver: request timed out")
    client.clients = [_Member(timeout, "http://a:1"), _Member(None, "http://b:2")]
    assert client.read("/k") == "http://b:2/k" and client.current == 1  # the next member, kept
    assert client.read("/k") == "http://b:2/k" and client.clients[0].calls == 1
    client.clients[1].failure = timeout
    monkeypatch.setattr(etcd_client, "RIDE_OUT_S", 0.3)
    monkeypatch.setattr(etcd_client, "RETRY_S", 0.01)
    with pytest.raises(etcd_client.EtcdLostError) as info:
        client.read("/k")
    assert all(m.calls > 1 for m in client.clients)  # both tried again within the ride-out
    assert info.value.why.startswith("(the etcd cluster at a:1,b:2) lost its quorum or stopped answering (")
    assert "\n" not in str(info.value)
    missing = python_etcd.EtcdKeyNotFound("Key not found")
    client.clients = [_Member(missing, "http://a:1"), _Member(None, "http://b:2")]
    client.current = 0
    with pytest.raises(python_etcd.EtcdKeyNotFound):  # an answer, not a failure: never tried elsewhere
        client.read("/k")
