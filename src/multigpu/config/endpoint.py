"""Parse and check rendezvous endpoints (``host:port``, IPv6 in brackets)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from multigpu.contract.errors import UsageError

TORCHRUN_MASTER_PORT = 29500
"""torchrun's ``--master-port`` default for a static rendezvous over several nodes (and SLURM's jobs)."""
C10D_PORT = 29400
"""torchrun's port for a c10d ``--rdzv-endpoint`` written without one."""

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)

    @property
    def bind_host(self) -> str:
        """The address a server binds: a loopback name becomes the loopback address, never all interfaces."""
        if self.host.lower() in LOOPBACK_NAMES:
            return "127.0.0.1"
        return self.host

    def __str__(self) -> str:
        return format_endpoint(self.host, self.port)


def is_loopback_host(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoint(text: str, *, option: str = "rdzv_endpoint") -> Endpoint:
    """Parse ``host:port``; every problem is a UsageError that says what to write instead."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise UsageError(f"{option} {text!r}: write an IPv6 endpoint as [ADDRESS]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise UsageError(f"{option} {text!r} has no port: write HOST:PORT (port 0 picks a free one)")
        if ":" in host:
            raise UsageError(f"{option} {text!r}: put an IPv6 address in brackets, [ADDRESS]:PORT")
    if not host:
        raise UsageError(f"{option} {text!r} has no host: write HOST:PORT")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise UsageError(f"{option} {text!r}: the port must be a number from 0 to 65535")
    return Endpoint(host, int(port_text))
