"""The job's store, as the job-wide hang verdict needs it (``supervisor/hangs/verdict.py`` says why).

Runs in each node's launcher. The notice is the job's one abort record (kind ``Hang``, no rank: the
fate monitor of every node wakes on it); each node's rank states go under ``hang/node/<base rank>``
(one write per node) and the verdict under ``hang/verdict`` (compare-and-set: the first one written
stands). Every store call runs on a daemon thread, so a store that stops answering never blocks the
supervisor's loop; it then decides from what it has.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

from multigpu.contract.failure import FailureKind, Subject, WorkerFailure
from multigpu.rendezvous.failure_sharing import failure_record
from multigpu.rendezvous.job import DONE, JobStore
from multigpu.rendezvous.store_threads import store_thread
from multigpu.supervisor.hangs.verdict import GATHER_S, RankState, decide

POLL_S = 0.05


class StoreHangs:
    """``hangs.verdict.HangExchange`` on the job's c10d store."""

    def __init__(self, job: JobStore) -> None:
        self.job = job

    def declare(self, notice: str) -> None:
        failure = WorkerFailure.launcher_named(Subject.NODE, FailureKind.HANG, notice, node=self.job.node)
        record = failure_record(failure)
        store_thread(_quietly, "multigpu-hang-notice", (lambda: self.job.publish_abort(record),)).start()

    def exchange(self, mine: list[RankState], notice: WorkerFailure) -> Exchange:
        return Exchange(self.job, mine, notice)


def _quietly(call: Any) -> None:
    with contextlib.suppress(Exception):  # the store is gone: the fate monitor says so
        call()


class Exchange:
    """One node's part in the verdict, on a daemon thread: publish, gather (bounded), settle."""

    def __init__(
        self, job: JobStore, mine: list[RankState], notice: WorkerFailure, gather_s: float = GATHER_S
    ) -> None:
        self.job, self.mine, self.notice, self.gather_s = job, mine, notice, gather_s
        self._answer: tuple[list[RankState], dict[str, Any]] | None = None
        self._done = threading.Event()
        store_thread(self._run, "multigpu-hang-exchange").start()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def result(self) -> tuple[list[RankState], dict[str, Any]] | None:
        return self._answer

    def _run(self) -> None:
        try:
            self._answer = self._settle(self._gather())
        except Exception:  # the store is gone: the caller decides from this node's states alone
            self._answer = None
        finally:
            self._done.set()

    def _gather(self) -> list[RankState]:
        """Publish this node's states; read every running node's, waiting up to ``gather_s`` for them
        (a node that finished, its beat counter marked done, has none to give)."""
        job, store = self.job, self.job.store
        store.set(job.key("hang", "node", job.base_rank), json.dumps([s.to_dict() for s in self.mine]))
        members = sorted(job.members())
        running = [base for base, count in job.beat_counts(members).items() if count < DONE]
        keys = [job.key("hang", "node", base) for base in running if base != job.base_rank]
        deadline = time.monotonic() + self.gather_s
        while keys and not store.check(keys) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        present = [k for k in keys if store.check([k])]
        states = list(self.mine)
        for value in store.multi_get(present) if present else []:
            states += [RankState.from_dict(item) for item in json.loads(value)]
        return sorted(states, key=lambda s: s.rank)

    def _settle(self, states: list[RankState]) -> tuple[list[RankState], dict[str, Any]]:
        """The verdict that stands: ours if we are first to write one, else the first one written."""
        ours = json.dumps(decide(states, self.notice))
        standing = self.job.store.compare_set(self.job.key("hang", "verdict"), "", ours)
        return states, dict(json.loads(standing))
