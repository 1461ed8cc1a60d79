"""The launcher's watch over a preemption warning, for one run (all its attempts).

The signal handler only records and wakes a small thread (through a pipe: no lock a handler could
deadlock on); the supervisor passes the signal on to every rank, as it does for any SIGUSR1/2/HUP.
The thread does the rest:

* one line on the console, once;
* on a job of several nodes, it writes the warning into the job's store, and it checks the store once
  per ``poll_s`` (one store call per node per second, only while no warning has come), so a node whose
  launcher never got the signal passes it to its ranks too;
* with ``--preempt-grace S``, it stops the ranks S seconds after the warning if they are still running.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from typing import Any, Protocol

from multigpu.cluster import requeue
from multigpu.contract.exitcodes import EXIT_FAILED, EXIT_PREEMPTED
from multigpu.contract.signals import signal_name
from multigpu.record.run_json import RunRecord
from multigpu.rendezvous.elastic import is_elastic
from multigpu.rendezvous.failure_sharing import mark_done, serve_until_all_done
from multigpu.rendezvous.job import JobStore
from multigpu.rendezvous.store_threads import store_thread
from multigpu.runner.membership import Meeting
from multigpu.supervisor.states import RunResult, RunStatus

logger = logging.getLogger(__name__)

POLL_S = 1.0
JOIN_S = 2 * POLL_S
"""How long the end of an attempt waits for the watch thread: a poll and its store call, normally."""


class _Target(Protocol):
    def request_signal(self, signum: int) -> None: ...
    def request_stop(self) -> None: ...


class PreemptWatch:
    """Whether, when and how the warning came; see the module docstring."""

    def __init__(
        self,
        signals: Iterable[int],
        *,
        grace: float | None = None,
        job: JobStore | None = None,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.signals = frozenset(signals)
        self.grace, self.job, self.poll_s = grace, job, poll_s
        self._clock = clock
        self.signum: int | None = None
        self.time: float | None = None
        """Wall-clock time of the warning (for run.json)."""
        self.source = ""
        self._at: float | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._announced = self._published = False

    @property
    def warned(self) -> bool:
        return self.signum is not None

    def key(self) -> str:
        assert self.job is not None
        return self.job.key("preempt")

    def note(self, signum: int, source: str = "signal") -> None:
        """Record the warning (safe in a signal handler: attributes and one non-blocking write)."""
        if signum not in self.signals or self.signum is not None:
            return
        self.signum, self.time, self._at, self.source = signum, time.time(), self._clock(), source
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"w")

    def attach(self, stack: ExitStack, target: _Target) -> Callable[[int], None]:
        """Watch for one attempt: the thread runs until ``stack`` closes; returns the signal handler."""

        def handler(signum: int) -> None:
            self.note(signum)
            target.request_signal(signum)

        self._closing = False
        self._thread = store_thread(self._run, "multigpu-preempt", (target,))
        self._thread.start()
        stack.callback(self._stop_thread)
        if self.warned:  # warned between attempts: this attempt's ranks hear it too
            target.request_signal(self.signum or signal.SIGUSR1)
        return handler

    def _stop_thread(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            # bounded: the thread may be inside a store call over a cut link, which has no time-out;
            # it is a daemon, left behind as ``FateMonitor.stop`` leaves its own
            self._thread.join(JOIN_S)
            self._thread = None

    def close(self) -> None:
        """Release the wake-up pipe (after the last attempt)."""
        self._stop_thread()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _run(self, target: _Target) -> None:
        next_poll, stopped = self._clock(), False
        while True:
            select.select([self._wake_r], [], [], self._timeout(next_poll, stopped))
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(self._wake_r, 64)
            if self._closing:
                return
            if self.warned:
                self._on_warning()
                if not stopped and self._grace_over():
                    logger.warning(
                        f"the ranks are still running {self.grace:g}s after the warning "
                        "(--preempt-grace): stopping them"
                    )
                    target.request_stop()
                    stopped = True
            elif self.job is not None and self._clock() >= next_poll:
                next_poll = self._clock() + self.poll_s
                self._poll_store(target)

    def _timeout(self, next_poll: float, stopped: bool) -> float | None:
        now = self._clock()
        if self.warned:
            if self.grace is None or stopped or self._at is None:
                return None
            return max(0.0, self._at + self.grace - now)
        return max(0.0, next_poll - now) if self.job is not None else None

    def _grace_over(self) -> bool:
        return self.grace is not None and self._at is not None and self._clock() - self._at >= self.grace

    def _on_warning(self) -> None:
        if not self._announced:
            self._announced = True
            where = "" if self.source == "signal" else " (from another node, through the store)"
            logger.warning(
                f"{signal_name(self.signum or 0)}: preemption warning{where}; every rank has it "
                "(multigpu.preempted(), multigpu.should_stop(step)); waiting for the ranks to "
                "save and exit"
            )
        if self.job is not None and not self._published and self.source == "signal":
            self._published = True
            with contextlib.suppress(Exception):  # a lost store: the other nodes got SLURM's signal too
                self.job.store.compare_set(
                    self.key(),
                    "",
                    json.dumps({"signal": self.signum, "node": self.job.node, "time": self.time}),
                )

    def _poll_store(self, target: _Target) -> None:
        assert self.job is not None
        try:
            if not self.job.store.check([self.key()]):
                return
            record: dict[str, Any] = json.loads(self.job.store.get(self.key()).decode())
        except Exception:  # the fate monitor reports a store that is gone
            return
        signum = int(record.get("signal") or signal.SIGUSR1)
        self.note(signum if signum in self.signals else min(self.signals), source="store")
        if self.signum is not None:
            target.request_signal(self.signum)


def finish_preempted(
    meeting: Meeting,
    record: RunRecord,
    watch: PreemptWatch,
    result: RunResult,
    env: Mapping[str, str],
    *,
    leads: bool,
) -> int:
    """After a warning: wait for the other nodes (the leader), finish the record, then requeue the job.

    ``leads``: this node serves the job's store (node 0 of a static job, the store's host of an elastic
    one; a job of one node leads itself). Every node says it is done only once its record says
    "preempted": the leader requeues the moment all are done, and SLURM then ends every node's
    launcher, wherever it is."""
    config, job = meeting.config, meeting.job
    info: dict[str, Any] = {
        "signal": signal_name(watch.signum or 0),
        "time": watch.time,
        "source": watch.source,
        "ranks": result.status.value,
        "requeue": config.preemption.requeue,
    }
    record.data["preemption"] = info
    if result.status is RunStatus.SUCCEEDED and job is not None:
        if not leads:
            _record_preempted(record)
        mark_done(job)
        if leads:
            serve_until_all_done(job)
    ok = result.status is RunStatus.SUCCEEDED
    stopped = "the ranks stopped" if ok else f"the run {result.status.value}"
    if not config.preemption.requeue or not leads:
        leader = "the store's host" if is_elastic(config) else "node 0"
        reason = (
            f"{leader} requeues the job"
            if config.preemption.requeue
            else "not requeued (--no-requeue)"
            if requeue.under_slurm(env)
            else "not requeued (not a SLURM job)"
        )
        logger.info(f"preempted: {stopped} after {info['signal']}; {reason}: exit {EXIT_PREEMPTED}")
        _record_preempted(record)
        return EXIT_PREEMPTED
    logger.info(
        f"preempted: {stopped} after {info['signal']}; requeueing SLURM job {requeue.slurm_job_id(env)}"
    )
    _record_preempted(record)  # first: SLURM ends this allocation once it takes the request
    return _requeue(record, info, env)


def _requeue(record: RunRecord, info: dict[str, Any], env: Mapping[str, str]) -> int:
    """The leader's last act: ``scontrol requeue``, said and recorded; the launcher's exit code."""
    job_id, why = requeue.requeue_job(env)
    info["requeued"] = why is None
    if why is not None:
        logger.warning(f"requeue of job {job_id} failed: {why}; resubmit the job to resume it")
        record.finish("failed", EXIT_FAILED)
        return EXIT_FAILED
    logger.info(
        f"requeued job {job_id} (scontrol requeue); its next allocation resumes with "
        f"MULTIGPU_RESUMED={requeue.resume_count(env) + 1}: exit {EXIT_PREEMPTED}"
    )
    record.write()
    return EXIT_PREEMPTED


def _record_preempted(record: RunRecord) -> None:
    record.finish("preempted", EXIT_PREEMPTED)
    if record.data["status"] != "preempted":  # an attempt ended by SLURM's SIGTERM is still a preemption
        record.data["status"] = "preempted"
        record.write()
