"""Rendezvous on torch's own c10d TCPStore, with a port that is bound once and never probed.

The launcher binds the listening socket (port 0 on loopback picks a free port atomically) and keeps it
for the whole run; whoever serves the store (the node's template or store process, or the caller in
function mode) serves it on that inherited descriptor. Workers use ``TORCHELASTIC_USE_AGENT_STORE``,
so every rank is a client; torch then adds no per-attempt prefix to their keys (it expects a new store
per attempt), so each attempt gets a fresh store.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from multigpu.config.endpoint import Endpoint
from multigpu.contract.errors import RendezvousError

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
    return sock


def serve_store(listen_fd: int, host: str, port: int, world_size: int | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Serve a c10d TCPStore on an already-listening descriptor. Imports torch: call it late."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(
        host, port, world_size, True, timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=listen_fd,
    )


def serve_store_on(sock: socket.socket, host: str, world_size: int | None = None,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Serve the store on ``sock``, which the store then owns (and closes): the socket object lets go."""
    store = serve_store(sock.fileno(), host, sock.getsockname()[1], world_size, timeout_s)
    sock.detach()
    return store


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (C++ logging bypasses sys.stderr) for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def connect_store(host: str, port: int, timeout_s: float) -> Any:
    """A client of the job's store, retrying the connection until ``timeout_s``. Imports torch."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    try:
        with quiet_stderr():  # c10d logs every retry with a C++ stack; our one line says it all
            return TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
    except Exception:
        raise RendezvousError(
            f"no rendezvous store answered at {host}:{port} within {timeout_s:g}s; check that the "
            "base-rank-0 node runs multigpu with the same --rdzv-endpoint and that the port is reachable"
        ) from None
