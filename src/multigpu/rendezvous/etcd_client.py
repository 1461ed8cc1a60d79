"""python-etcd's client for ``--rdzv-backend etcd-v2``, one per etcd member, with the failover ours:
a call that fails on one member (gone, no leader, a write lost with the old leader) moves to the next
and is tried again for ``RIDE_OUT_S`` from its start, each request bounded by ``REQUEST_S``. python-
etcd's own failover ("allow_reconnect") drops each member that failed from its list and re-reads the
cluster's member list after a failure: over a lost quorum one call took 8 s there, past fate sharing's
deadman, which then named a silent store instead of etcd. Runs in the launcher, on any thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from multigpu.config.endpoint import Endpoint
from multigpu.contract.errors import RendezvousError, StoreLostError

T = TypeVar("T")
RIDE_OUT_S = 5.0
"""How long a failing etcd call is tried again, from its start: a new leader's election (about a
second) and the move to another member fit; a lost quorum does not, and is said before fate sharing's
deadman would take the call in flight for a silent store (8 s: ``latency.OUTAGE_S``)."""
REQUEST_S = 1.5
"""One request's bound (a watch names its own): a write stuck at a member without a leader moves on."""
RETRY_S = 0.2


def etcd_module() -> Any:
    """python-etcd, or one line saying how to install it."""
    try:
        import etcd  # type: ignore[import-untyped]
    except ImportError:
        raise RendezvousError(
            "--rdzv-backend etcd-v2 needs python-etcd: pip install 'multigpu[etcd]' (or python-etcd)"
        ) from None
    return etcd


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


class EtcdLostError(StoreLostError):
    """The etcd cluster failed a call on every member for ``RIDE_OUT_S``: its quorum lost, or no
    member reached. ``why`` completes "the rendezvous store ..." in fate sharing's failure record."""

    def __init__(self, where: str, cause: str) -> None:
        self.why = f"({where}) lost its quorum or stopped answering ({cause})"
        super().__init__(where, f"lost its quorum or stopped answering ({cause})")


class FailoverClient:
    """python-etcd's ``read``, ``write``, ``delete`` and ``watch`` over every member (see the module).
    torch's etcd-v2 backend calls it as it calls python-etcd's client."""

    def __init__(self, members: Sequence[Endpoint], where: str, **options: Any) -> None:
        """``options``: python-etcd's (protocol, cert, ca_cert)."""
        self.etcd, self.where = etcd_module(), where
        self.clients = [
            self.etcd.Client(
                host=m.host, port=m.port, read_timeout=REQUEST_S, allow_reconnect=False, **options
            )
            for m in members
        ]
        self.current = 0
        self._passed = (
            self.etcd.EtcdKeyNotFound,
            self.etcd.EtcdAlreadyExist,
            self.etcd.EtcdCompareFailed,
            self.etcd.EtcdWatchTimedOut,
            self.etcd.EtcdEventIndexCleared,
        )

    def probe(self) -> None:
        """One read on each member until one answers; else the last member's error, raised."""
        for i, client in enumerate(self.clients):
            try:
                client.read("/")
            except Exception:
                if i == len(self.clients) - 1:
                    raise
            else:
                self.current = i
                return

    def read(self, key: str, **kwargs: Any) -> Any:
        return self.ride_out(lambda client: client.read(key, **kwargs))

    def write(self, key: str, value: str, ttl: int | None = None, **kwargs: Any) -> Any:
        return self.ride_out(lambda client: client.write(key, value, ttl, **kwargs))

    def delete(self, key: str, **kwargs: Any) -> Any:
        return self.ride_out(lambda client: client.delete(key, **kwargs))

    def watch(self, key: str, **kwargs: Any) -> Any:
        return self.ride_out(lambda client: client.watch(key, **kwargs))

    def _last_try(self, exc: BaseException, index: int) -> str:
        """``exc`` in a few words: urllib3's own cause where python-etcd wrapped one."""
        cause = getattr(exc, "cause", None) or exc
        cause = getattr(cause, "reason", None) or cause
        what = first_line(cause) if isinstance(exc, self.etcd.EtcdConnectionFailed) is False else ""
        name = type(cause).__name__
        return f"{RIDE_OUT_S:g}s of tries; the last, at {self.clients[index].base_uri}: {name}" + (
            f": {what}" if what else ""
        )

    def ride_out(self, call: Callable[[Any], T]) -> T:
        """``call`` on the current member; on a failure, on the next one, until ``RIDE_OUT_S``."""
        give_up = time.monotonic() + RIDE_OUT_S
        while True:
            index = self.current
            try:
                return call(self.clients[index])
            except self._passed:
                raise
            except (self.etcd.EtcdException, OSError) as exc:
                if time.monotonic() >= give_up:
                    raise EtcdLostError(self.where, self._last_try(exc, index)) from None
                self.current = (index + 1) % len(self.clients)
            time.sleep(RETRY_S)
