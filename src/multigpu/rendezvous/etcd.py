"""The etcd-v2 rendezvous (``--rdzv-backend etcd-v2``): torch's own etcd backend and a c10d store on the
same etcd cluster, through python-etcd. No consensus of ours: etcd's Raft keeps the job's state, so
losing any one process (an etcd member, leader or not; any node, node 0 included) costs at most a new
round. Runs in the launcher of an elastic job; python-etcd and torch are imported only when a job
opens the cluster (``open_etcd_store``), so the CLI checks the member list without either.

torch's parser takes one ``host:port`` ("must be a dot-separated list of labels" for a list): the
members are parsed here, and ``etcd_client.FailoverClient`` holds a python-etcd client for each.

What lives where: every job-wide record (torch's rendezvous state, the run id, the restart count, the
crash-loop stop's failed rounds, the launchers' beats) and each round's keys (fate sharing, hang
verdicts, fingerprints, preflight figures, under torch's per-round prefix) are in etcd: they survive
any one process, a node or a member. Only the workers' store (MASTER_ADDR/PORT) is on the round's
first node, made afresh each round (``elastic_fixes.handler_class``): it need not outlive its round.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from multigpu.config.endpoint import Endpoint, parse_endpoint
from multigpu.contract.errors import RendezvousError, UsageError
from multigpu.contract.values import seconds
from multigpu.rendezvous.etcd_client import FailoverClient, etcd_module, first_line
from multigpu.rendezvous.store import import_torch_quietly

ETCD_PORT = 2379
"""etcd's client port, torch's default for an etcd endpoint written without one."""
BACKENDS = ("etcd", "etcd-v2")
"""torchrun's names: both run torch's etcd-v2 backend here (the older ``etcd`` one is deprecated)."""
STORE_PREFIX = "/multigpu/store"
"""The etcd directory of every job's c10d keys (each key names its run id or torch's round)."""
RDZV_PREFIX = "/torch/elastic/rendezvous"
"""torch's own directory for the rendezvous state (``etcd_rendezvous_backend.create_backend``)."""
_CONF_ALIASES = {"ca_cert": "cacert", "ssl_cert": "cert", "ssl_cert_key": "key"}
"""The keys of torch's etcd-v2 backend, read as the older etcd backend's names (both are accepted)."""


def parse_members(text: str, *, option: str = "--rdzv-endpoint") -> tuple[Endpoint, ...]:
    """``H1:P1,H2:P2,...`` (or one member; a member without a port gets etcd's 2379), each a
    UsageError naming what to write instead; a member named twice is refused."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or not all(parts):
        raise UsageError(f"{option} {text!r}: write the etcd members as HOST:PORT,HOST:PORT,...")
    members = []
    for part in parts:
        if not part.endswith("]") and part.count(":") == 0:
            part = f"{part}:{ETCD_PORT}"
        member = parse_endpoint(part, option=option)
        if member.port == 0:
            raise UsageError(f"{option} {part!r}: an etcd member needs its client port, not 0")
        members.append(member)
    if len(set(members)) != len(members):
        raise UsageError(f"{option} {text!r} names a member twice")
    return tuple(members)


@dataclass(frozen=True)
class EtcdSettings:
    """``--rdzv-conf`` keys of torch's etcd backends: how to reach the cluster."""

    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    read_timeout: float = 60.0


def etcd_settings(conf: Mapping[str, str]) -> EtcdSettings:
    """The client's settings from ``--rdzv-conf`` (torch's names, either backend's), or a UsageError."""
    values = {_CONF_ALIASES.get(k, k): v for k, v in conf.items()}
    protocol = values.get("protocol", "http").strip().lower()
    if protocol not in ("http", "https"):
        raise UsageError(f"--rdzv-conf protocol must be http or https, got {values['protocol']!r}")
    if values.get("key") and not values.get("cert"):
        raise UsageError("--rdzv-conf key (the client certificate's key) needs cert too")
    timeout = values.get("read_timeout")
    return EtcdSettings(
        protocol=protocol,
        cacert=values.get("cacert") or None,
        cert=values.get("cert") or None,
        key=values.get("key") or None,
        read_timeout=seconds(timeout, "--rdzv-conf read_timeout", positive=True) if timeout else 60.0,
    )


def describe(members: Sequence[Endpoint]) -> str:
    return f"the etcd cluster at {','.join(map(str, members))}"


def open_etcd_store(members: Sequence[Endpoint], conf: Mapping[str, str]) -> Any:
    """The job's store on the etcd cluster (``FailoverClient``: every member); a cluster none of
    whose members answers is one line naming it."""
    etcd_module()
    import_torch_quietly()
    settings, where = etcd_settings(conf), describe(members)
    cert: Any = (settings.cert, settings.key) if settings.key else settings.cert
    try:
        client = FailoverClient(
            members, where, protocol=settings.protocol, cert=cert, ca_cert=settings.cacert
        )
        client.probe()  # one call now: an unreachable cluster is said here, not at the first round
    except Exception as exc:  # python-etcd's, urllib3's, a bad certificate: one line, which
        raise RendezvousError(f"{where} did not answer ({type(exc).__name__}: {first_line(exc)})") from None
    return job_store_class()(client, where, timedelta(seconds=settings.read_timeout))


def rendezvous_backend(store: Any, run_id: str) -> Any:
    """torch's etcd-v2 backend for ``run_id``, on the store's client (torch's own key prefix)."""
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend

    return EtcdRendezvousBackend(store.client, run_id, key_prefix=RDZV_PREFIX)


def _encode(value: str | bytes) -> str:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return base64.urlsafe_b64encode(raw).decode()


def _decode(value: str) -> bytes:
    return base64.urlsafe_b64decode(value.encode())


class _Missing(Exception):
    """A key absent from etcd (python-etcd's ``EtcdKeyNotFound``, named once), and etcd's index when
    it was read: a watch from the next index misses no write."""

    def __init__(self, index: int | None) -> None:
        super().__init__(index)
        self.index = index


@functools.cache
def job_store_class() -> Any:
    """``EtcdJobStore``: our keys on torch's ``Store`` (a C++ base, so made at the first use: torch)."""
    from torch.distributed import Store  # type: ignore[attr-defined]

    return type("EtcdJobStore", (EtcdKeys, Store), {})


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdKeys:
    """A c10d store on etcd (the job's keys: run id, restart count, each round's fate sharing), one
    etcd key per store key, so a read is one request (torch's ``EtcdStore`` reads a whole directory
    per key). Any failure to reach the cluster (a lost quorum: writes time out) is an
    ``EtcdLostError`` naming it, which fate sharing reports in one line. Every thread of the launcher
    calls it; python-etcd's pool opens a connection per call in flight (so ``clone`` shares it)."""

    def __init__(self, client: FailoverClient, where: str, timeout: timedelta, prefix: str = "") -> None:
        super().__init__()  # torch's Store, the second base (``job_store_class``)
        self.client, self.where, self.prefix = client, where, prefix
        self.etcd = client.etcd
        self.set_timeout(timeout)

    if TYPE_CHECKING:  # torch's Store's, the second base

        @property
        def timeout(self) -> timedelta: ...

        def set_timeout(self, timeout: timedelta) -> None: ...

    def prefixed(self, prefix: str) -> Any:
        """torch's ``PrefixStore``'s keys (``prefix/key``) as a store of ours: torch's C++ prefix store
        cannot call a Python store's ``delete_key``."""
        return type(self)(self.client, self.where, self.timeout, f"{self.prefix}{prefix}/")

    def clone(self) -> Any:
        return type(self)(self.client, self.where, self.timeout, self.prefix)

    def _path(self, key: str | bytes) -> str:
        return f"{STORE_PREFIX}/{_encode(self.prefix + _bytes(key).decode())}"

    def _call(self, method: str, key: str | bytes, *args: Any, **kwargs: Any) -> Any:
        """The client's ``method`` on ``key``'s etcd key (ridden out); a missing key is ``_Missing``."""
        try:
            return getattr(self.client, method)(self._path(key), *args, **kwargs)
        except self.etcd.EtcdKeyNotFound as exc:
            payload = exc.payload if isinstance(exc.payload, dict) else {}
            raise _Missing(payload.get("index")) from None

    def _read(self, key: str | bytes) -> bytes | None:
        try:
            return _decode(self._call("read", key).value)
        except _Missing:
            return None

    def set(self, key: str, value: str | bytes) -> None:
        self._call("write", key, _encode(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._read(key)
        if value is None:
            raise LookupError(f"key {key!r} not found in {self.where}")
        return value

    def check(self, keys: list[str]) -> bool:
        return all(self._read(key) is not None for key in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def delete_key(self, key: str) -> bool:
        try:
            self._call("delete", key)
        except _Missing:
            return False
        return True

    def num_keys(self) -> int:
        try:
            return len(list(self.client.read(STORE_PREFIX).leaves))
        except self.etcd.EtcdKeyNotFound:
            return 0

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """c10d's rule: set ``desired`` where the value is ``expected`` (absent for ""); the value now."""
        try:
            if expected in ("", b""):
                self._call("write", key, _encode(desired), prevExist=False)
            else:
                self._call("write", key, _encode(desired), prevValue=_encode(expected))
            return _bytes(desired)
        except (self.etcd.EtcdAlreadyExist, self.etcd.EtcdCompareFailed):
            current = self._read(key)
        except _Missing:  # c10d's answer for an absent key that was expected to be set
            return _bytes(expected)
        return self.compare_set(key, expected, desired) if current is None else current

    def add(self, key: str, amount: int) -> int:
        return int(self._update(key, lambda old: str(int(old or b"0") + amount).encode()))

    def append(self, key: str, value: str | bytes) -> None:
        self._update(key, lambda old: (old or b"") + _bytes(value))

    def _update(self, key: str, change: Callable[[bytes | None], bytes]) -> bytes:
        """A read-modify-write, retried until no other writer came between (etcd's index)."""
        while True:
            try:
                node = self._call("read", key)
            except _Missing:
                new = change(None)
                with contextlib.suppress(self.etcd.EtcdAlreadyExist):
                    self._call("write", key, _encode(new), prevExist=False)
                    return new
                continue
            new = change(_decode(node.value))
            with contextlib.suppress(self.etcd.EtcdCompareFailed):
                self._call("write", key, _encode(new), prevIndex=node.modifiedIndex)
                return new

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Each key in turn: read, else watched from the index it was found missing at (no write
        slips between), all under one deadline."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        for key in keys:
            while (index := self._missing_at(key)) is not False:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LookupError(f"{self.where}: key {key!r} not set within {limit:g}s")
                after = None if index is None else int(index) + 1
                with contextlib.suppress(self.etcd.EtcdWatchTimedOut, self.etcd.EtcdEventIndexCleared):
                    self._call("watch", key, index=after, timeout=left)

    def _missing_at(self, key: str) -> int | bool | None:
        """False where ``key`` is set, else etcd's index when it was found missing (or None)."""
        try:
            self._call("read", key)
        except _Missing as missing:
            return missing.index
        return False
