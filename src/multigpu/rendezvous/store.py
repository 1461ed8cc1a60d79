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
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from multigpu.config.endpoint import Endpoint
from multigpu.contract.errors import RendezvousError, StoreLostError

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


def serve_store(
    listen_fd: int, host: str, port: int, world_size: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Any:
    """Serve a c10d TCPStore on an already-listening descriptor. Imports torch: call it late."""
    import_torch_quietly()
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(
        host,
        port,
        world_size,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def serve_store_on(
    sock: socket.socket, host: str, world_size: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Any:
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
    import_torch_quietly()
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    try:
        with quiet_stderr():  # c10d logs every retry with a C++ stack; our one line says it all
            return TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
    except Exception:
        raise RendezvousError(
            f"no rendezvous store answered at {host}:{port} within {timeout_s:g}s; check that the "
            "base-rank-0 node runs multigpu with the same --rdzv-endpoint and that the port is reachable"
        ) from None


CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
QUIET_CPP_LOG_LEVEL = "3"
"""FATAL: c10 reads ``TORCH_CPP_LOG_LEVEL`` once, when torch is imported, and then logs every failed
store call's warning with its C++ frames straight to file descriptor 2, the launcher's console. The
same text reaches Python as the exception, which ``GuardedStore`` writes to the node's log."""


def import_torch_quietly() -> None:
    """Import ``torch.distributed`` in the launcher with c10's C++ logging held to fatal errors, the
    environment variable set only across the import (c10 has read it by then), so the template and the
    ranks, started with the environment as it was, log as the user asked. A user who set
    ``TORCH_CPP_LOG_LEVEL`` keeps it; where torch is imported already (the template), nothing changes."""
    if "torch" in sys.modules:
        return
    before = os.environ.get(CPP_LOG_LEVEL_ENV)
    if before is None:
        os.environ[CPP_LOG_LEVEL_ENV] = QUIET_CPP_LOG_LEVEL
    try:
        import torch.distributed  # noqa: F401
    finally:
        if before is None:
            os.environ.pop(CPP_LOG_LEVEL_ENV, None)


class StoreNotes:
    """What torch said when a store call failed (its exception's text, C++ frames and all), kept for the
    node's log in the run folder: held in memory until the launcher knows its folder (``attach``), then
    appended to ``store_node<N>.log`` there. Any launcher thread writes; nothing here raises."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[str] = []
        self._path: Path | None = None

    def attach(self, path: Path | None) -> None:
        """Write to ``path`` from now on (what was held first); None: hold in memory again."""
        with self._lock:
            self._path, held, self._held = path, self._held, []
        self._write(held)

    def note(self, call: str, exc: BaseException) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        entry = f"{stamp} store.{call} failed: {type(exc).__name__}: {exc}\n"
        with self._lock:
            if self._path is None:
                self._held.append(entry)
                return
        self._write([entry])

    def _write(self, entries: list[str]) -> None:
        with self._lock:
            path = self._path
        if path is None or not entries:
            return
        with contextlib.suppress(OSError), open(path, "a") as f:
            f.writelines(entries)


STORE_NOTES = StoreNotes()
"""This launcher's one record of failed store calls (one process, one run folder)."""


def _is_network_error(exc: BaseException) -> bool:
    """torch's ``DistNetworkError`` (matched by name: no torch import here) or a socket's own error."""
    if isinstance(exc, TimeoutError):  # a wait that ran out: the store answered, the key never came
        return False
    return isinstance(exc, OSError) or any(c.__name__ == "DistNetworkError" for c in type(exc).__mro__)


class GuardedStore:
    """The job's c10d store as the launcher calls it: any call that fails because the store's host is
    gone raises ``StoreLostError`` (one line, naming the host), any other store failure a one-line
    ``RendezvousError``; torch's own text goes to ``STORE_NOTES``. Runs in the launcher, on any thread."""

    def __init__(self, store: Any, host: str = "node 0, the store's host") -> None:
        self.raw = store
        self.host = host

    def clone(self) -> GuardedStore:
        """A second connection to the same store, guarded the same way."""
        return GuardedStore(self._guarded("clone", self.raw.clone), self.host)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.raw, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._guarded(name, lambda: attr(*args, **kwargs))

        return call

    def _guarded(self, name: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except (RuntimeError, OSError) as exc:
            STORE_NOTES.note(name, exc)
            if _is_network_error(exc):
                raise StoreLostError(self.host) from None
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RendezvousError(
                f"the job's rendezvous store failed ({type(exc).__name__}: {first[:200]})"
            ) from None


def guarded(store: Any, host: str = "node 0, the store's host") -> Any:
    """``store`` behind a ``GuardedStore`` (once: a guarded store is returned as it is)."""
    return store if isinstance(store, GuardedStore) else GuardedStore(store, host)
