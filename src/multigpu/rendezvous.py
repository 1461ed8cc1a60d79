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
import json
import os
import socket
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from .endpoint import Endpoint
from .errors import RendezvousError

DEFAULT_TIMEOUT_S = 1800.0  # torch's default process-group timeout
DONE = 1 << 50
"""Added to a node's beat counter when it finished well: one read tells beating, silent and done apart."""
WAKE_WAIT = timedelta(days=1)
"""A waiter blocks this long per call; it is woken by its key, never by a time-out (c10d logs those)."""


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


class JobStore:
    """The launchers' shared view of one multi-node job, kept in torch's c10d store.

    Keys live under ``multigpu/<run id>/``: a launcher with another run id reads only the published
    run id, is refused, and writes nothing the live job reads.
    """

    RUN_ID_KEY = "multigpu/run_id"

    def __init__(self, store: Any, *, node: int, base_rank: int, nproc: int, world_size: int) -> None:
        self.store = store
        self.node, self.base_rank, self.nproc, self.world_size = node, base_rank, nproc, world_size
        self.run_id = ""
        self.scope: tuple[str, ...] = ()
        self.watcher_base = 0
        """The base rank of the node that watches every node's beats (node 0 here)."""
        self.watcher_hosts_store = True
        """Whether the watcher serves the store: then its death is the store's, and nobody watches it."""
        self.waiter_store: Any = None
        """A second connection, for the one blocking wait (see ``with_own_client``)."""

    @property
    def is_watcher(self) -> bool:
        return self.base_rank == self.watcher_base

    def key(self, *parts: object) -> str:
        return "/".join(["multigpu", self.run_id, *self.scope, *map(str, parts)])

    def for_attempt(self, attempt: int) -> JobStore:
        """This node in a later attempt of the same job: fresh rank claims, beats and abort record."""
        job = JobStore(self.store, node=self.node, base_rank=self.base_rank, nproc=self.nproc,
                       world_size=self.world_size)
        job.run_id, job.scope = self.run_id, (f"attempt_{attempt}",)
        job.waiter_store = self.waiter_store
        return job

    def with_own_client(self) -> JobStore:
        """The same keys over a second connection: a blocking wait holds its connection (c10d
        serializes the calls of one client), so the beats go on over the first one. The connection
        is opened at join, on the caller's thread: c10d's connect holds the GIL (a slow reverse DNS
        lookup there would freeze every thread of the launcher, the beats included)."""
        if self.waiter_store is None:
            self.waiter_store = self.store.clone()
        job = JobStore(self.waiter_store, node=self.node, base_rank=self.base_rank, nproc=self.nproc,
                       world_size=self.world_size)
        job.run_id, job.scope = self.run_id, self.scope
        return job

    def settle_run_id(self, wanted: str | None) -> str:
        """The job's run id: node 0 publishes its own; the others adopt it, or are refused on a mismatch."""
        if self.base_rank == 0:
            assert wanted is not None
            current = self.store.compare_set(self.RUN_ID_KEY, "", wanted).decode()
            if current != wanted:
                raise RendezvousError(f"another job (run id {current!r}) already uses this rendezvous "
                                      "store; pick another --rdzv-endpoint")
            self.run_id = wanted
            return wanted
        self.store.wait([self.RUN_ID_KEY])
        current = str(self.store.get(self.RUN_ID_KEY).decode())
        if wanted is not None and wanted != current:
            raise RendezvousError(f"run id {wanted!r} does not match the live job's run id {current!r} "
                                  "at this endpoint; refusing to join it")
        self.run_id = current
        return current

    def join(self, timeout_s: float, poll_s: float = 0.1) -> None:
        """Claim this node's ranks, check the world size, and wait until every rank is claimed."""
        # The token makes every launcher distinct: the same command started twice is refused too.
        me = (f"node {self.node} (base rank {self.base_rank}, {self.nproc} worker(s), "
              f"{socket.gethostname()} pid {os.getpid()})")
        world = self.store.compare_set(self.key("world_size"), "", str(self.world_size)).decode()
        if world != str(self.world_size):
            self._refuse(f"{me} says world size {self.world_size}, the job says {world}")
        # A member before claiming ranks: once every rank is claimed, every node is a member (the
        # watcher reads the members once), and its beat counter exists (a read never waits for it).
        self.with_own_client()
        self.store.add(self.key("beat", self.base_rank), 0)
        self.store.append(self.key("members"), f"{self.base_rank}:{self.node},")
        for rank in range(self.base_rank, self.base_rank + self.nproc):
            owner = self.store.compare_set(self.key("rank", rank), "", me).decode()
            if owner != me:
                self._refuse(f"rank {rank} is claimed by both {owner} and {me}")
        self._wait_for_all(timeout_s, poll_s)

    def membership_change(self) -> str | None:
        """Why the current round must end for a new membership; a static job's never changes."""
        return None

    def members(self) -> dict[int, int]:
        """Every joined node, as base rank -> node index (none yet: empty, without waiting)."""
        if not self.store.check([self.key("members")]):
            return {}
        raw = self.store.get(self.key("members")).decode()
        pairs = (item.split(":") for item in raw.split(",") if item)
        return {int(base): int(node) for base, node in pairs}

    def beat(self) -> int:
        return int(self.store.add(self.key("beat", self.base_rank), 1))

    def beats_of(self, base_rank: int) -> int:
        return int(self.store.add(self.key("beat", base_rank), 0))

    def beat_counts(self, bases: list[int]) -> dict[int, int]:
        """Every listed node's beat counter in one call (``DONE`` or more: it finished)."""
        if not bases:
            return {}
        values = self.store.multi_get([self.key("beat", base) for base in bases])
        return {base: int(value) for base, value in zip(bases, values, strict=True)}

    def mark_done(self) -> None:
        self.store.add(self.key("beat", self.base_rank), DONE)

    def is_done(self, base_rank: int) -> bool:
        return self.beats_of(base_rank) >= DONE

    def all_done(self) -> bool:
        return all(count >= DONE for count in self.beat_counts(sorted(self.members())).values())

    def wake_all(self) -> None:
        """Wake every node's waiter (one call): the abort record is written, read it."""
        keys = [self.key("wake", base) for base in sorted(self.members())]
        self.store.multi_set(keys, ["1"] * len(keys))

    def wake_self(self) -> None:
        self.store.set(self.key("wake", self.base_rank), "1")

    def clear_wake(self) -> None:
        """Unset our wake key, so the next waiter (of the same attempt) blocks again."""
        self.store.delete_key(self.key("wake", self.base_rank))

    def wait_woken(self) -> None:
        """Block until our wake key is set (the store's server answers when it is)."""
        self.store.wait([self.key("wake", self.base_rank)], WAKE_WAIT)

    def _wait_for_all(self, timeout_s: float, poll_s: float) -> None:
        import time

        keys = [self.key("rank", r) for r in range(self.world_size)]
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_abort()
            if self.store.check(keys):  # one call per poll, however many ranks
                return
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise RendezvousError(f"ranks {_ranges(missing)} never joined within {timeout_s:g}s; "
                                      "check that every node started with the same --rdzv-endpoint and "
                                      "--world-size")
            time.sleep(poll_s)

    def _refuse(self, reason: str) -> None:
        """An inconsistent layout fails the whole job, so every node reports the same clear error."""
        self.store.compare_set(self.key("abort"), "", json.dumps({"reason": reason, "node": self.node}))
        self.wake_all()
        raise RendezvousError(f"inconsistent layout: {reason}")

    def check_abort(self) -> None:
        record = self.read_abort()
        if record is not None and "reason" in record:
            raise RendezvousError(f"inconsistent layout: {record['reason']}")

    def read_abort(self) -> dict[str, Any] | None:
        key = self.key("abort")
        if not self.store.check([key]):
            return None
        value = self.store.get(key).decode()
        return json.loads(value) if value else None

    def publish_abort(self, record: dict[str, Any]) -> dict[str, Any]:
        """Make the abort record the earliest failure in time (compare-and-set, so concurrent writers
        from several nodes agree), then wake every node's waiter; return the record that stands.
        Waking even when an earlier record stands covers a writer that died between its two calls."""
        standing = self._settle_abort(record)
        self.wake_all()
        return standing

    def _settle_abort(self, record: dict[str, Any]) -> dict[str, Any]:
        key, ours = self.key("abort"), json.dumps(record)
        current = self.store.compare_set(key, "", ours).decode()
        while current != ours:
            existing = dict(json.loads(current))
            never = float("inf")
            if "reason" in existing or (existing.get("time") or never) <= (record.get("time") or never):
                return existing
            current = self.store.compare_set(key, current, ours).decode()
        return record


def _ranges(ranks: list[int]) -> str:
    if len(ranks) <= 4:
        return ", ".join(map(str, ranks))
    return f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"
