"""Rendezvous on torch's own c10d TCPStore, with a port that is bound once and never probed.

The launcher binds the listening socket (port 0 on loopback picks a free port atomically) and keeps it
for the whole run; whoever serves the store (rank 0's bootstrap, or the caller in function mode)
serves it on that inherited descriptor. Workers use ``TORCHELASTIC_USE_AGENT_STORE``, so every rank is
a client and keys are namespaced per attempt, exactly as under torchrun.
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta
from typing import Any

from .endpoint import Endpoint
from .errors import RendezvousError

DEFAULT_TIMEOUT_S = 1800.0  # torch's default process-group timeout


def bind_store_socket(endpoint: Endpoint) -> socket.socket:
    """A listening socket for the store on the endpoint's own address (never on every interface)."""
    host = endpoint.bind_host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, endpoint.port, family, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RendezvousError(f"cannot resolve rendezvous host {endpoint.host!r}: {exc.strerror}") from None
    sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(infos[0][4])
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RendezvousError(
                f"rendezvous address {endpoint} is already in use; pick another port or use port 0"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise RendezvousError(
                f"rendezvous address {endpoint} is not an address of this machine"
            ) from None
        raise RendezvousError(f"cannot listen on {endpoint}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve_store(listen_fd: int, host: str, port: int, world_size: int | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Serve a c10d TCPStore on an already-listening descriptor. Imports torch: call it late."""
    from torch.distributed import TCPStore

    return TCPStore(
        host, port, world_size, True, timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=listen_fd,
    )
