"""The one failure record, ``WorkerFailure``: a rank's bootstrap writes it (``write``), the supervisor
reads it back (``read``, which also understands torch elastic's ``@record`` files), and the nodes of a
job share it through the store (``to_dict``/``from_dict``). One type, one format. Every process of a run
imports it: a rank to write its record, the launchers to read, share and report it.

A failure the launchers name themselves has a ``FailureKind``; one of a node, the store or the job, not
of a rank, has its ``Subject``: both are types in memory, and plain values in the record (a kind's
string, a rank of ``NO_RANK``), so that launchers of every version read each other's records.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import time as _time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from multigpu.contract.signals import signal_name


class FailureKind(str, enum.Enum):
    """The failures the launchers name themselves (no rank raised them): a ``WorkerFailure``'s
    ``error_type`` holds one of these, where a rank that raised holds its exception's type name (a plain
    ``str``). ``str``-valued, so that every record (run.json, a rank's error file, the job's abort record
    in the store) holds the plain value ("NodeLost"), which reads back to the same kind."""

    HANG = "Hang"
    """A rank (or, without a rank, a node's notice to the job) that stopped progressing."""
    NODE_LOST = "NodeLost"
    """A node whose launcher stopped beating (killed, or its network is down)."""
    STORE_LOST = "StoreLost"
    """The job's c10d store is gone (its host's launcher killed, or the network down)."""
    MEMBERSHIP_CHANGE = "MembershipChange"
    """An elastic round ended for a node that joins or left: nothing failed."""
    REFUSED = "Refused"
    """A node's layout refused at the rendezvous (the job's abort record says why)."""
    INTERRUPTED = "Interrupted"
    """A node's launcher was told to stop (SIGTERM, Ctrl-C): the record's ``signal`` says which."""
    TIMER_EXPIRED = "TimerExpired"
    """A rank its node's file timer killed (torch's ``FileTimerServer``): it overstayed a
    ``timer.expires()`` scope; the message says which and for how long it was set."""

    def __str__(self) -> str:
        return self.value  # f-strings and str() read "NodeLost", as the string constants did


LEARNED_FROM_SILENCE = frozenset(
    {FailureKind.NODE_LOST, FailureKind.STORE_LOST, FailureKind.REFUSED, FailureKind.INTERRUPTED}
)
"""Known from a peer's or the store's silence (or the store's refusal, or a peer's word that it was
told to stop): nothing to publish, nothing to ask the store."""


class Subject(enum.Enum):
    """Whom a failure is about. Only the launcher holds it: a record says it by its ``rank`` (``NO_RANK``
    for anything but a rank) and its kind, and reads back to the same subject (``from_dict``)."""

    RANK = "rank"
    """One rank: ``rank``, ``local_rank``, ``node`` and ``pid`` name it."""
    NODE = "node"
    """A node's launcher (``node``): lost, stopped, refused at the rendezvous, or declaring a hang."""
    STORE = "store"
    """The job's store: ``node`` is its host, ``NO_NODE`` when it is served off the job's nodes."""
    JOB = "job"
    """The job as a whole, no one rank or node: a membership change, or a record that names no rank."""


NO_RANK = -1
"""The ``rank`` (and ``local_rank``) of a failure whose subject is not a rank, in memory and on the wire."""
NO_NODE = -1
"""The ``node`` of a failure that names none: a store served off the job's nodes, a membership change."""


def subject_without_rank(kind: FailureKind | None) -> Subject:
    """Whom a record that names no rank is about, from its kind: how ``from_dict`` reads the subject back."""
    if kind is FailureKind.STORE_LOST:
        return Subject.STORE
    if kind is None or kind is FailureKind.MEMBERSHIP_CHANGE:
        return Subject.JOB
    return Subject.NODE


_KINDS = {kind.value: kind for kind in FailureKind}


def _read_kind(data: dict[str, Any], rank: int) -> str | None:
    """A record's ``error_type`` read back. A record that names no rank (a node, the store, the job)
    holds a ``FailureKind`` there: every such record is the launcher's. A rank's record holds the type
    name of the exception it raised, which may be called ``Hang`` or ``Interrupted`` too; the launcher
    marks its own kinds on a rank (a hang, a file timer's kill) with a ``kind`` key, so a user's
    exception is never taken for one."""
    error_type = data.get("error_type")
    if error_type is None and isinstance(data.get("type"), str):
        error_type = data["type"]  # the bootstrap's older key
    if not isinstance(error_type, str):
        return None if error_type is None else str(error_type)
    named = error_type if rank == NO_RANK else data.get("kind")
    return _KINDS.get(named, error_type) if isinstance(named, str) else error_type


PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer")
"""What a collective's error says when the rank only saw a peer die (gloo's words): such a failure is
the consequence of another rank's, never preferred to it as the root cause."""


def exit_status(returncode: int | None) -> tuple[int | None, str | None]:
    """(exit code, signal name) from ``Popen``'s returncode (< 0: killed by signal -returncode)."""
    if returncode is not None and returncode < 0:
        return None, signal_name(-returncode)
    return returncode, None


def exit_text(exit_code: int | None, signal_text: str | None) -> str:
    """``exit 1`` or ``SIGTERM``: how the summary and the report say how a rank ended."""
    return signal_text if signal_text is not None else f"exit {exit_code}"


@dataclass(frozen=True)
class RankIdentity:
    """Which rank a process was: what ``WorkerFailure.from_exit`` names the failure by."""

    rank: int
    local_rank: int
    node: int
    pid: int | None


@dataclass
class WorkerFailure:
    """Why one rank ended badly (or a node, the store, the job: ``subject``); enough to debug it without
    opening another file."""

    rank: int
    """The global rank; ``NO_RANK`` when the subject is not a rank."""
    local_rank: int
    pid: int | None
    exit_code: int | None = None
    signal: str | None = None
    node: int = 0
    error_type: str | None = None
    """The type name of the exception a rank raised ("ValueError"), or the ``FailureKind`` the launcher
    named the failure with (``kind``): only a ``FailureKind`` is a kind, never a plain string."""
    message: str | None = None
    traceback: str | None = None
    time: float | None = None
    log_tail: list[str] = field(default_factory=list)
    log_path: str | None = None
    killed_by: str | None = None
    """Who sent the signal, where the launcher could tell: "the kernel's OOM killer (resident ...)"."""
    subject: Subject = Subject.RANK
    """Whom the failure is about; never written: a record says it by its rank and kind (``to_dict``)."""

    @property
    def kind(self) -> FailureKind | None:
        """The launcher's own name for the failure; None for a rank's exception or exit."""
        return self.error_type if isinstance(self.error_type, FailureKind) else None

    @classmethod
    def launcher_named(
        cls, subject: Subject, kind: FailureKind, message: str, *, node: int, at: float | None = None
    ) -> WorkerFailure:
        """A failure of a node, the store or the job, found by a launcher (``at``: when; default now)."""
        return cls(
            rank=NO_RANK,
            local_rank=NO_RANK,
            pid=None,
            node=node,
            error_type=kind,
            message=message,
            time=_time.time() if at is None else at,
            subject=subject,
        )

    @property
    def saw_a_peer_die(self) -> bool:
        """This rank failed only because a peer's connection closed under its collective."""
        return any(marker in (self.message or "") for marker in PEER_LOST_MARKERS)

    def explains(self, other: WorkerFailure) -> bool:
        """This lost node (or store) caused ``other``, a rank that only saw a peer's connection close:
        cause before effect, whatever the clocks say (a lost node is dated when its silence was seen)."""
        gone = self.kind in (FailureKind.NODE_LOST, FailureKind.STORE_LOST, FailureKind.INTERRUPTED)
        return self.subject is not Subject.RANK and gone and other.saw_a_peer_die

    @property
    def launcher_exit_code(self) -> int:
        """The launcher's exit code for this root cause: the rank's own, or 128 + N for signal N."""
        if self.signal is not None:
            try:
                return 128 + int(signal.Signals[self.signal])
            except KeyError:
                return 1
        return self.exit_code if self.exit_code else 1

    def describe(self) -> str:
        if self.subject is not Subject.RANK:  # a node, the store or the job, named by the launchers
            return self._describe_node()
        if self.kind is FailureKind.TIMER_EXPIRED:  # the message says it all: which timer, and the kill
            return f"rank {self.rank} (node {self.node}, pid {self.pid}) {self.message}"
        how = (
            f"was killed by {self.killed_by or self.signal}"
            if self.signal
            else f"exited with code {self.exit_code}"
        )
        what = f": {self.error_type}: {self.message}" if self.error_type else ""
        return f"rank {self.rank} (node {self.node}, pid {self.pid}) {how}{what}"

    def _describe_node(self) -> str:
        kind = self.kind
        if kind is FailureKind.NODE_LOST:
            return f"node {self.node} was lost: {self.message}"
        if kind is FailureKind.STORE_LOST and self.node == NO_NODE:  # served off the job's nodes
            return f"the rendezvous store {self.message}"
        if kind is FailureKind.STORE_LOST:
            return f"node {self.node}, the store's host, {self.message}"
        if kind is FailureKind.REFUSED:
            return f"the rendezvous refused a node: {self.message}"
        if kind is FailureKind.INTERRUPTED:
            return f"node {self.node} was stopped: its launcher received {self.signal}"
        return f"{self.error_type or 'the job'}: {self.message}"

    def to_dict(self, log_tail_lines: int | None = None) -> dict[str, Any]:
        """The record, as every copy of it is written (JSON's types; the subject said by rank and kind)."""
        data = asdict(self)
        del data["subject"]
        if self.subject is not Subject.RANK:
            data.update(rank=NO_RANK, local_rank=NO_RANK)
        if self.kind is not None:
            data["error_type"] = self.kind.value
            if self.subject is Subject.RANK:  # a rank's own exception could have the kind's name
                data["kind"] = self.kind.value
        if log_tail_lines is not None:
            data["log_tail"] = data["log_tail"][-log_tail_lines:] if log_tail_lines else []
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerFailure:
        """Tolerant of missing keys and of the bootstrap's older ``type`` key: records cross versions."""
        known = {f.name for f in fields(cls)} - {"subject"}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("rank", "local_rank"):
            values[key] = _int_or(values.get(key), NO_RANK)
        values["node"] = _int_or(values.get("node"), 0)
        values["pid"] = _int_or(values.get("pid"), None)
        values["log_tail"] = [str(line) for line in values.get("log_tail") or []]
        values["error_type"] = _read_kind(data, values["rank"])
        return cls(**values, subject=_subject_of(values["rank"], values["error_type"]))

    @classmethod
    def from_exit(
        cls,
        who: RankIdentity,
        returncode: int | None,
        record: WorkerFailure | None = None,
        *,
        log_path: str | None = None,
        log_tail: list[str] | None = None,
    ) -> WorkerFailure:
        """The one constructor for a rank that ended badly: its exit status (``returncode`` < 0: killed by
        signal -returncode, as ``Popen`` says) and what its own error record says, if it wrote one
        (``read``), as torch's ``ProcessFailure`` reads its error file."""
        code, signame = exit_status(returncode)
        return cls(
            rank=who.rank,
            local_rank=who.local_rank,
            node=who.node,
            pid=who.pid,
            exit_code=code,
            signal=signame,
            error_type=record.error_type if record else None,
            message=record.message if record else None,
            traceback=record.traceback if record else None,
            time=record.time if record else None,
            log_tail=list(log_tail or []),
            log_path=log_path,
        )

    @classmethod
    def from_exception(cls, exc: BaseException, env: dict[str, str] | None = None) -> WorkerFailure:
        """What a rank records about its own uncaught exception (exit code and signal come later)."""
        import traceback  # here, not at import: every rank's start-up imports this module

        env = dict(os.environ) if env is None else env
        rank = _int_or(env.get("RANK"), NO_RANK)
        return cls(
            rank=rank,
            local_rank=_int_or(env.get("LOCAL_RANK"), NO_RANK),
            pid=os.getpid(),
            node=_int_or(env.get("GROUP_RANK"), 0),
            error_type=type(exc).__name__,
            message=str(exc),
            time=_time.time(),
            subject=_subject_of(rank, None),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )

    def write(self, path: str | Path) -> None:
        """Atomic (a half-written record never shows); a rank that cannot write it still fails normally."""
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(_json().dumps(self.to_dict()))
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    @classmethod
    def read(cls, path: str | Path | None) -> WorkerFailure | None:
        """A rank's record, or torch elastic's ``@record`` file; None when there is none or it is garbled."""
        if path is None:
            return None
        try:
            data = _json().loads(Path(path).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        if isinstance(data.get("message"), dict):  # torch.distributed.elastic @record
            info = data["message"]
            extra = info.get("extraInfo") or {}
            return cls(
                rank=NO_RANK,
                local_rank=NO_RANK,
                pid=None,
                message=info.get("message"),
                traceback=extra.get("py_callstack"),
                time=float(extra.get("timestamp", 0) or 0) or None,
                subject=_subject_of(NO_RANK, None),
            )
        return cls.from_dict(data)


def _json() -> Any:
    import json  # only where a record is written or read, not in every rank's start-up

    return json


def _subject_of(rank: int, error_type: str | None) -> Subject:
    """Whom a record is about, read from what it writes: its rank, else its kind."""
    if rank != NO_RANK:
        return Subject.RANK
    return subject_without_rank(error_type if isinstance(error_type, FailureKind) else None)


def _int_or(value: Any, default: int | None) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


WorkerFailure.__module__ = "multigpu"  # a traceback names it as users import it: multigpu.WorkerFailure
