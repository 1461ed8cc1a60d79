"""The launchers' shared view of one multi-node job, kept in torch's c10d store (``JobStore``).

Runs in every launcher of a job of several nodes (and in function mode's caller): membership, the run
id they agree on, heartbeat counters, the wake keys and the one abort record. The store itself is
``store.py``'s.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from multigpu.contract.errors import RendezvousError
from multigpu.contract.failure import FailureKind, WorkerFailure
from multigpu.rendezvous.store import guarded

DONE = 1 << 50
"""Added to a node's beat counter when it finished well: one read tells beating, silent and done apart."""


WAKE_WAIT = timedelta(days=1)
"""A waiter blocks this long per call; it is woken by its key, never by a time-out (c10d logs those)."""


class JobStore:
    """The launchers' shared view of one multi-node job, kept in torch's c10d store.

    Keys live under ``multigpu/<run id>/``: a launcher with another run id reads only the published
    run id, is refused, and writes nothing the live job reads.
    """

    RUN_ID_KEY = "multigpu/run_id"

    interrupt_stops_job = True
    """A node told to stop (SIGTERM, Ctrl-C) stops every node of a static job, as ``scancel`` does; an
    elastic job's other nodes take it as the node leaving (``ElasticJobStore``)."""

    def __init__(self, store: Any, *, node: int, base_rank: int, nproc: int, world_size: int) -> None:
        self.store = guarded(store)  # a lost store is one StoreLostError, never torch's C++ text
        self.node, self.base_rank, self.nproc, self.world_size = node, base_rank, nproc, world_size
        self.run_id = ""
        self.scope: tuple[str, ...] = ()
        self.watcher_base = 0
        """The base rank of the node that watches every node's beats (node 0 here)."""
        self.watcher_hosts_store = True
        """Whether the watcher serves the store: then its death is the store's, and nobody watches it."""
        self.store_host: int | None = 0
        """The node whose launcher serves the store (node 0 here); None: no node of the job does
        (``multigpu store``), and a lost store is named as the store's."""
        self.waiter_store: Any = None
        """A second connection, for the one blocking wait (see ``with_own_client``)."""
        self.member = False
        """This launcher joined the job's membership: the store's host waits for it to leave."""

    @property
    def is_watcher(self) -> bool:
        return self.base_rank == self.watcher_base

    def key(self, *parts: object) -> str:
        return "/".join(["multigpu", self.run_id, *self.scope, *map(str, parts)])

    def _copy(self, store: Any, scope: tuple[str, ...]) -> JobStore:
        """This node's view over ``store``, its keys under ``scope``."""
        layout = {"node": self.node, "base_rank": self.base_rank, "nproc": self.nproc}
        job = JobStore(store, **layout, world_size=self.world_size)
        job.run_id, job.scope = self.run_id, scope
        return job

    def for_attempt(self, attempt: int) -> JobStore:
        """This node in a later attempt of the same job: fresh rank claims, beats and abort record."""
        job = self._copy(self.store, (f"attempt_{attempt}",))
        job.waiter_store = self.waiter_store
        return job

    def with_own_client(self) -> JobStore:
        """The same keys over a second connection: a blocking wait holds its connection (c10d
        serializes the calls of one client), so the beats go on over the first one. The connection
        is opened at join, on the caller's thread: c10d's connect holds the GIL (a slow reverse DNS
        lookup there would freeze every thread of the launcher, the beats included)."""
        if self.waiter_store is None:
            self.waiter_store = self.store.clone()
        return self._copy(self.waiter_store, self.scope)

    def settle_run_id(self, wanted: str | None) -> str:
        """The job's run id: node 0 publishes its own; the others adopt it, or are refused on a mismatch."""
        if self.base_rank == 0:
            assert wanted is not None
            current = self.store.compare_set(self.RUN_ID_KEY, "", wanted).decode()
            if current != wanted:
                raise RendezvousError(
                    f"another job (run id {current!r}) already uses this rendezvous "
                    "store; pick another --rdzv-endpoint"
                )
            self.run_id = wanted
            return wanted
        self.store.wait([self.RUN_ID_KEY])
        current = str(self.store.get(self.RUN_ID_KEY).decode())
        if wanted is not None and wanted != current:
            raise RendezvousError(
                f"run id {wanted!r} does not match the live job's run id {current!r} "
                "at this endpoint; refusing to join it"
            )
        self.run_id = current
        return current

    def join(
        self, timeout_s: float, poll_s: float = 0.1, on_wait: Callable[[float], None] | None = None
    ) -> None:
        """Claim this node's ranks, check the world size, and wait until every rank is claimed;
        ``on_wait`` hears the seconds left at each poll that still waits (it may say so, or raise)."""
        me = _claim_token(self.node, self.base_rank, self.nproc)
        world = self.store.compare_set(self.key("world_size"), "", str(self.world_size)).decode()
        if world != str(self.world_size):
            self._refuse(f"{me} says world size {self.world_size}, the job says {world}")
        self._refuse_alone_if_formed(me)
        # A member before claiming ranks: once every rank is claimed, every node is a member (the
        # watcher reads the members once), and its beat counter exists (a read never waits for it).
        self.with_own_client()
        self.store.add(self.key("beat", self.base_rank), 0)
        self.store.append(self.key("members"), f"{self.base_rank}:{self.node},")
        self.member = True
        for rank in range(self.base_rank, self.base_rank + self.nproc):
            owner = self.store.compare_set(self.key("rank", rank), "", me).decode()
            if owner != me:
                self._refuse(f"rank {rank} is claimed by both {owner} and {me}")
        self._wait_for_all(timeout_s, poll_s, on_wait)

    def publish_fingerprint(self, fingerprint: Mapping[str, str]) -> None:
        """What this node would run (``fingerprint.py``), for every node to compare once all joined."""
        self.store.set(self.key("fingerprint", self.node), json.dumps(dict(fingerprint)))

    def fingerprints(self) -> dict[int, dict[str, str]]:
        """Every joined node's fingerprint (a node that published none is left out)."""
        nodes = sorted(set(self.members().values()))
        keys = [self.key("fingerprint", n) for n in nodes]
        present = [(n, k) for n, k in zip(nodes, keys, strict=True) if self.store.check([k])]
        if not present:
            return {}
        values = self.store.multi_get([k for _, k in present])
        return {n: json.loads(v) for (n, _), v in zip(present, values, strict=True)}

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

    def launcher_of(self, base_rank: int) -> str | None:
        """ "host H, pid N" of the launcher that claimed ``base_rank`` (its claim names both), or None."""
        if not self.store.check([self.key("rank", base_rank)]):
            return None
        return _launcher_in(self.store.get(self.key("rank", base_rank)).decode())

    def beat(self) -> int:
        return int(self.store.add(self.key("beat", self.base_rank), 1))

    def add_progress(self, count: int) -> int:
        """Add to the job's progress counter (``supervisor/hangs/verdict.JobProgress``); the new total."""
        return int(self.store.add(self.key("progress"), count))

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

    def left_key(self, base_rank: int) -> str:
        """Set by a node once it has made its last store call of the whole run (every attempt's)."""
        return "/".join(["multigpu", self.run_id, "left", str(base_rank)])

    def leave(self) -> None:
        """Say this node will ask the store nothing more: its host may go once every node has said so.
        A launcher refused before it became a member (a latecomer, another run id) writes nothing: its
        base rank may be a live member's."""
        if self.member:
            self.store.set(self.left_key(self.base_rank), "1")

    def still_reading(self) -> list[int]:
        """The other joined nodes (base ranks) that have not left yet: one ``check`` when all have."""
        others = [base for base in sorted(self.members()) if base != self.base_rank]
        keys = [self.left_key(base) for base in others]
        if not others or self.store.check(keys):
            return []
        return [base for base, key in zip(others, keys, strict=True) if not self.store.check([key])]

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

    def _wait_for_all(
        self, timeout_s: float, poll_s: float, on_wait: Callable[[float], None] | None = None
    ) -> None:
        keys = [self.key("rank", r) for r in range(self.world_size)]
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_abort()
            if self.store.check(keys):  # one call per poll, however many ranks
                return
            if on_wait is not None:
                on_wait(deadline - time.monotonic())
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise RendezvousError(
                    f"ranks {_ranges(missing)} never joined within {timeout_s:g}s; "
                    "check that every node started with the same --rdzv-endpoint and "
                    "--world-size"
                )
            time.sleep(poll_s)

    def _refuse_alone_if_formed(self, me: str) -> None:
        """A launcher that comes to a job already formed (the same node started twice, after the others
        met) is refused on its own: a healthy running job must not be aborted by a latecomer."""
        if not self.store.check([self.key("rank", r) for r in range(self.world_size)]):
            return
        owner = self.store.get(self.key("rank", self.base_rank)).decode()
        raise RendezvousError(
            f"inconsistent layout: rank {self.base_rank} is claimed by both {owner} and "
            f"{me}; the job already formed without this launcher and goes on"
        )

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
        standing = _settle_abort(self.store, self.key("abort"), record)
        self.wake_all()
        return standing


def named_lost(job: JobStore) -> list[int]:
    """The base ranks of the node ``job``'s abort record names as lost (its launcher fell silent), if
    any: a killed launcher makes no last read, a slow one beats again. Read by the store's host."""
    record = job.read_abort()
    if record is None or "reason" in record:
        return []
    failure = WorkerFailure.from_dict(record)
    if failure.kind is not FailureKind.NODE_LOST:
        return []
    return [base for base, node in sorted(job.members().items()) if node == failure.node]


def _settle_abort(store: Any, key: str, record: dict[str, Any]) -> dict[str, Any]:
    """``record`` at ``key`` unless an earlier failure (or a refused layout) stands there: the one that
    stands, after compare-and-set rounds against concurrent writers."""
    ours = json.dumps(record)
    current = store.compare_set(key, "", ours).decode()
    while current != ours:
        existing = dict(json.loads(current))
        never = float("inf")
        if "reason" in existing or (existing.get("time") or never) <= (record.get("time") or never):
            return existing
        current = store.compare_set(key, current, ours).decode()
    return record


def _claim_token(node: int, base_rank: int, nproc: int) -> str:
    """What this launcher writes on each rank it claims. The host and pid make every launcher distinct:
    the same command started twice is refused too."""
    return f"node {node} (base rank {base_rank}, {nproc} worker(s), {socket.gethostname()} pid {os.getpid()})"


def _launcher_in(claim: str) -> str | None:
    """ "host H, pid N" from a rank's claim (``_claim_token``), or None."""
    import re

    found = re.search(r", (\S+) pid (\d+)\)$", claim)
    return f"host {found.group(1)}, pid {found.group(2)}" if found else None


def _ranges(ranks: list[int]) -> str:
    if len(ranks) <= 4:
        return ", ".join(map(str, ranks))
    return f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"
