"""One hang verdict for a job of several nodes: progress shared, the hang declared once, the culprit
read from every rank's stacks. Runs in each node's launcher (the supervisor's thread, and the fate
monitor's beat thread for ``JobProgress``).

The supervisor asks ``HangWatch`` each turn. On one node it sees every rank, so its ``ProgressBook``
decides alone, and this node's stacks and flight records judge the hang. Across nodes a
rank that prints nothing (most print from rank 0 only) would look silent to its own node while the
job trains, and the rank that holds a collective up may be on another node than the ranks that wait
for it. So:

* **Progress is the job's.** Each node adds 1 to one job-wide counter in the store per fate beat in
  which its ranks showed progress (output, beats, a collective entered), 0 otherwise; the ``add``'s
  answer tells it whether another node added meanwhile (``JobProgress.share``). One small call per
  node per beat, whatever the number of nodes.
* **A hang is declared once.** The first node to see the job silent publishes a notice (the job's
  one abort record, kind ``Hang``, no rank named); every node's fate monitor hears of it at once.
* **The culprit comes from every rank's stacks.** Each node dumps its ranks' stacks, publishes them
  (one key per node) and reads every node's (``HangExchange``, kept in the job's store by
  ``rendezvous/hang_store.py``); ``decide`` names the rank outside the collective the others wait in
  (``culprit.py``), and the first verdict written stands (compare-and-set), so every node prints the
  same one, with every rank's stacks once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from multigpu.contract.failure import FailureKind, WorkerFailure
from multigpu.supervisor.hangs.book import ProgressBook
from multigpu.supervisor.hangs.culprit import find_culprits
from multigpu.supervisor.hangs.hang import hang_failures
from multigpu.supervisor.hangs.stack_dumps import DumpRequest, flight_record
from multigpu.supervisor.outcome import Outcome
from multigpu.supervisor.states import Worker

logger = logging.getLogger(__name__)

GATHER_S = 10.0
"""How long a node waits for the other nodes' stacks: their waiters wake at once, but a flight record
dump may take 3 s and a loaded machine more. A node that never answers costs this once."""


class JobProgress:
    """This node's progress, shared with the job's other nodes once per fate beat (``share``), and
    theirs fed into the node's ``ProgressBook`` (``remote_progress``)."""

    def __init__(self, book: ProgressBook) -> None:
        self.book = book
        self._shared = -math.inf
        self._total: int | None = None

    def share(self, add: Callable[[int], int]) -> None:
        """``add(n)`` adds n to the job's progress counter and returns the new total: 1 when this node
        made progress since the last call; a total that grew by more than our own share is another
        node's progress."""
        mark = self.book.mark()
        mine = 1 if mark > self._shared else 0
        self._shared = max(self._shared, mark)
        total = add(mine)
        if self._total is not None and total - self._total > mine:
            self.book.remote_progress()
        self._total = total


@dataclass(frozen=True)
class RankState:
    """What a node tells the job about one of its ranks when the job hangs."""

    rank: int
    local_rank: int
    node: int
    pid: int | None
    running: bool
    step: int | None = None
    quiet: float = 0.0
    """Seconds since its last progress, on its node's clock."""
    dump: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankState:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rank_states(workers: Sequence[Worker], book: ProgressBook, now: float) -> list[RankState]:
    """This node's ranks at the hang, their stacks read (``Supervisor.dump_stacks``)."""
    states = []
    for w in workers:
        p = book.ranks.get(w.rank)
        states.append(
            RankState(
                w.rank,
                w.spec.local_rank,
                w.spec.node,
                w.pid,
                w.alive,
                p.step if p is not None else None,
                round(now - p.last_progress, 3) if p is not None else 0.0,
                list(w.dumps.stacks) if w.alive else [],
            )
        )
    return states


def decide(states: Sequence[RankState], notice: WorkerFailure) -> dict[str, Any]:
    """The job's verdict from every rank's state: the culprits in order and the line that names them.

    The ranks outside ``torch.distributed`` while others wait in it come first (with file:line), then
    the lowest step, then the longest silence. ``time`` is when the job last progressed (the notice's
    time less the silence): every failure of the verdict is dated from it, before the notice."""
    running = [s for s in states if s.running]
    stacks = find_culprits({s.rank: s.dump for s in running})
    by_progress = sorted(running, key=lambda s: (-math.inf if s.step is None else s.step, -s.quiet, s.rank))
    outside = stacks.ranks if stacks is not None else []
    culprits = [*outside, *(s.rank for s in by_progress if s.rank not in outside)]
    notice_line = notice.message or "no progress"
    if stacks is not None:
        line = f"{stacks.line}; {notice_line}"
    elif by_progress:
        first = by_progress[0]
        at = "before any step" if first.step is None else f"at step {first.step}"
        line = (
            f"rank {first.rank} stopped progressing first ({at}, last progress {first.quiet:.1f}s ago; "
            f"no stack shows a rank outside a collective the others wait in); {notice_line}"
        )
    else:
        line = notice_line
    since = max((s.quiet for s in running), default=0.0)
    return {"culprits": culprits, "line": line, "time": (notice.time or time.time()) - since}


def job_failures(
    verdict: dict[str, Any], states: Sequence[RankState], workers: Sequence[Worker]
) -> list[WorkerFailure]:
    """One ``Hang`` failure per running rank of the job, the verdict's first culprit first (the
    report's root cause, with the verdict as its message); each carries its rank's stacks. The same
    on every node, from the same verdict and states."""
    local = {w.rank: w for w in workers}
    order = {int(r): i for i, r in enumerate(verdict.get("culprits", []))}
    running = sorted((s for s in states if s.running), key=lambda s: (order.get(s.rank, len(order)), s.rank))
    base = float(verdict.get("time") or time.time())
    failures = []
    for i, s in enumerate(running):
        own = local.get(s.rank)
        failure = (
            own.ended_with(None)
            if own is not None
            else WorkerFailure(s.rank, s.local_rank, s.pid, node=s.node)
        )
        failure.error_type, failure.pid = FailureKind.HANG, s.pid
        failure.traceback = "\n".join(s.dump) or None
        failure.message = str(verdict.get("line")) if i == 0 else f"no progress for {s.quiet:.1f}s"
        failure.time = base + i * 1e-3  # keeps the culprits' order when sorted by time
        failures.append(failure)
    return failures


class Pending(Protocol):
    """An exchange in flight (a thread talks to the store; the supervisor's loop goes on)."""

    def done(self) -> bool: ...

    def result(self) -> tuple[list[RankState], dict[str, Any]] | None:
        """Every node's rank states and the verdict that stands; None when the store failed."""


class HangExchange(Protocol):
    """The job's store, as the hang verdict needs it (``rendezvous/hang_store.StoreHangs``)."""

    def declare(self, notice: str) -> None:
        """Publish that the job hangs (once; the first notice in time stands), without waiting."""

    def exchange(self, mine: list[RankState], notice: WorkerFailure) -> Pending:
        """Publish this node's rank states, gather every node's, settle the verdict."""


@dataclass(frozen=True)
class Turns:
    """How a node waits for the job's verdict: the supervisor's loop turns meanwhile (``turn``), on its
    clock, until a stop request (``stopped``) or the deadline."""

    turn: Callable[[float], None]
    clock: Callable[[], float]
    stopped: Callable[[], bool] = lambda: False


def gather_verdict(
    exchange: HangExchange,
    notice: WorkerFailure,
    workers: Sequence[Worker],
    book: ProgressBook,
    turns: Turns,
) -> list[WorkerFailure]:
    """After this node's stacks are read: share them, wait for the others' while the loop runs on
    (bounded; a stop request, Ctrl-C, ends the wait), and make the job's failures from the verdict
    that stands (this node's own states and verdict when the store cannot answer)."""
    clock = turns.clock
    mine = rank_states(workers, book, clock())
    pending = exchange.exchange(mine, notice)
    deadline = clock() + GATHER_S + 2.0
    while not pending.done() and clock() < deadline and not turns.stopped():
        turns.turn(0.05)
    answer = pending.result() if pending.done() else None
    states, verdict = answer if answer is not None else (mine, decide(mine, notice))
    return job_failures(verdict, states, workers)


class HangWatch:
    """The supervisor's hang duty, asked on its loop: each turn (``check``), whether the book calls a
    hang; on one node this node's stacks and flight records judge it here, in a job of several the hang
    is declared to every node, and each node judges with every node's stacks when the notice comes
    back (``job_hangs``). ``dump``: the supervisor's ``dump_stacks``; ``turns``: its loop."""

    def __init__(
        self,
        book: ProgressBook,
        exchange: HangExchange | None,
        dump: Callable[[list[Worker]], DumpRequest | None],
        turns: Turns,
    ) -> None:
        self.book, self.exchange, self._dump, self._turns = book, exchange, dump, turns
        self.declared = False
        """This node declared the job's hang (its notice then comes back through the store)."""

    def check(self, workers: Sequence[Worker], outcome: Outcome) -> None:
        """One look while the attempt runs, with no outcome or hang yet (the caller's condition)."""
        running = [w for w in workers if w.alive]
        hang = self.book.check([w.rank for w in running], self._turns.clock())
        if hang is not None and self.exchange is not None:  # every node hears of it, this one too
            self.declared = True
            self.exchange.declare(hang.notice)
        elif hang is not None:
            called = time.time()  # the verdict: the stacks' collection that follows is its handling
            since = self._collect_stacks(workers, outcome, hang.notice)
            flight = flight_record(running, {w.rank for w in workers}, since - 1.0)
            outcome.failures.extend(hang_failures(hang, running, flight, called))

    def job_hangs(self, notice: WorkerFailure, workers: Sequence[Worker], outcome: Outcome) -> bool:
        """The job hangs (a node said so through the store): dump this node's ranks, then judge with
        every node. False for any other failure from outside, and once this node has an outcome of its
        own (then the caller keeps ``notice`` as a failure)."""
        exchange = self.exchange
        if notice.kind is not FailureKind.HANG or exchange is None or outcome.hung or outcome.failures:
            return False  # a rank here failed already: that failure and the notice are ordered by time
        self._collect_stacks(workers, outcome, notice.message or "")
        outcome.failures.extend(gather_verdict(exchange, notice, workers, self.book, self._turns))
        return True

    def _collect_stacks(self, workers: Sequence[Worker], outcome: Outcome, notice: str) -> float:
        """Say what is known, then dump every live rank's stacks; when the request went out."""
        logger.warning(f"hang: {notice}; collecting every rank's stacks")
        outcome.hung = True  # before dumping: dumping runs the loop, which must not come back here
        outcome.learned(time.time())
        request = self._dump([w for w in workers if w.alive])
        return request.wall_start if request is not None else time.time()
