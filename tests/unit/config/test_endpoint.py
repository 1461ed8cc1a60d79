"""Rendezvous endpoints: ``host:port``, ``[v6]:port``, and what counts as loopback."""

from __future__ import annotations

import pytest

from multigpu.config.endpoint import Endpoint, format_endpoint, is_loopback_host, parse_endpoint
from multigpu.contract.errors import UsageError


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("localhost:0", "localhost", 0),
        ("127.0.0.1:29500", "127.0.0.1", 29500),
        ("node-3.cluster:65535", "node-3.cluster", 65535),
        ("[::1]:29500", "::1", 29500),
        ("[fe80::1%eth0]:1", "fe80::1%eth0", 1),
        ("  10.0.0.7:80  ", "10.0.0.7", 80),
    ],
)
def test_parse_endpoint(text: str, host: str, port: int) -> None:
    assert parse_endpoint(text) == Endpoint(host, port)


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("localhost", "no port"),
        ("10.0.0.1", "no port"),
        ("host:", "port must be a number"),
        ("host:abc", "port must be a number"),
        ("host:-1", "port must be a number"),
        ("host:65536", "port must be a number"),
        (":29500", "no host"),
        ("::1:29500", "brackets"),
        ("[::1]", "[ADDRESS]:PORT"),
        ("[::1]29500", "[ADDRESS]:PORT"),
        ("[::1:29500", "[ADDRESS]:PORT"),
    ],
)
def test_parse_endpoint_rejects_with_a_hint(text: str, hint: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_endpoint(text, option="--rdzv-endpoint")
    message = str(info.value)
    assert hint in message
    assert message.startswith("--rdzv-endpoint")
    assert isinstance(info.value, ValueError)  # the manager's contract: a ValueError


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("LocalHost", True),
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("ip6-localhost", True),
        ("10.0.0.1", False),
        ("0.0.0.0", False),
        ("::", False),
        ("example.com", False),
        ("192.168.1.5", False),
    ],
)
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback
    assert Endpoint(host, 1).is_loopback is loopback


@pytest.mark.parametrize(
    ("host", "bind"),
    [
        ("localhost", "127.0.0.1"),
        ("LOCALHOST", "127.0.0.1"),
        ("127.0.0.1", "127.0.0.1"),
        ("::1", "::1"),
        ("10.1.2.3", "10.1.2.3"),
    ],
)
def test_bind_host_never_all_interfaces(host: str, bind: str) -> None:
    assert Endpoint(host, 0).bind_host == bind


def test_format_round_trips() -> None:
    for text in ("[::1]:29500", "127.0.0.1:5", "host:0"):
        assert str(parse_endpoint(text)) == text
    assert format_endpoint("::1", 7) == "[::1]:7"
