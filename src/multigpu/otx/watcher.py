"""The caller's watch over its children: a ``Supervisor`` on a background thread, and what their
failures mean for the caller.

Runs in OTX's caller, on the thread named ``multigpu-supervisor``: it waits for the children,
hands a failure to the caller's thread through ``FailureDelivery``, and shares it with the job's other
nodes. A child that announces its failure (its error record is written) is raised at once, before it
exits; a peer that died of a signal first is the likelier root cause and is named instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

from multigpu.console.ranks import PrefixedConsole
from multigpu.contract.errors import WorkerFailedError
from multigpu.contract.failure import WorkerFailure
from multigpu.otx.interrupt_caller import FailureDelivery
from multigpu.rendezvous.failure_sharing import FateMonitor, share_failure
from multigpu.rendezvous.job import JobStore
from multigpu.supervisor.loop import Supervisor
from multigpu.supervisor.settings import Hooks, SupervisorOptions
from multigpu.supervisor.states import RunResult, RunStatus, Worker, WorkerSpec

logger = logging.getLogger(__name__)


class ChildWatcher:
    """The children of one ``MultiGPUManager``: started, watched from a thread, stopped once."""

    def __init__(self, delivery: FailureDelivery, job: JobStore | None, grace_period: float) -> None:
        self.delivery, self.job, self.grace_period = delivery, job, grace_period
        self.supervisor: Supervisor | None = None
        self.thread: threading.Thread | None = None
        self.crash: BaseException | None = None
        """What broke the watcher thread itself: the children's outcome is then unknown."""

    def start(self, specs: list[WorkerSpec], undo: contextlib.ExitStack) -> None:
        self.supervisor = Supervisor(
            specs,
            sink=PrefixedConsole(),
            options=SupervisorOptions(grace_period=self.grace_period),
            hooks=Hooks(on_failing=self._child_failing),
        )
        undo.callback(self.stop)
        self.supervisor.start()
        if self.job is not None:
            monitor = FateMonitor(self.job, self._on_remote_failure)
            monitor.start()
            undo.callback(monitor.stop)
        self.thread = threading.Thread(target=self._watch, name="multigpu-supervisor", daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> bool:
        """True when the watcher finished within ``timeout``."""
        if self.thread is None:
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def stop(self) -> None:
        if self.supervisor is None:
            return
        if self.thread is not None and self.thread.is_alive():
            self.supervisor.request_stop()
            self.thread.join(self.grace_period + 5)
        self.supervisor.close()

    def request_signal(self, signum: int) -> None:
        if self.supervisor is not None:
            self.supervisor.request_signal(signum)

    def _child_failing(self, worker: Worker) -> None:
        """A child announced its uncaught exception (it is exiting now): raise it in the caller at once.

        Across nodes it may only be a symptom (a peer elsewhere died first): the job's record decides.
        """
        failures = [announced_failure(worker)]
        workers = self.supervisor.workers if self.supervisor is not None else []
        peer = dead_peer(workers, worker, failures[0])
        result = RunResult(RunStatus.FAILED, failures if peer is None else [peer, *failures])
        if self.job is not None:
            result = share_failure(self.job, result)
        assert result.root_cause is not None
        self.delivery.deliver(WorkerFailedError(result.root_cause, result.failures[1:]))

    def _on_remote_failure(self, failure: WorkerFailure) -> None:
        """Another node failed (or vanished): stop the children and tell the caller."""
        self.delivery.deliver(WorkerFailedError(failure))
        if self.supervisor is not None:
            self.supervisor.abort(failure)

    def _watch(self) -> None:
        try:
            self._watch_children()
        except BaseException as exc:  # kept: finalize() must not read this as success
            self.crash = exc
            logger.error("the supervisor thread crashed: %r; finalize() will raise", exc)

    def _watch_children(self) -> None:
        supervisor = self.supervisor
        assert supervisor is not None
        result = supervisor.wait()
        assert result is not None
        if result.status in (RunStatus.SUCCEEDED, RunStatus.INTERRUPTED):
            supervisor.close(sig=result.signal or signal.SIGTERM)
            return
        if self.job is not None:
            result = share_failure(self.job, result)
        root = result.root_cause
        assert root is not None
        self.delivery.deliver(WorkerFailedError(root, result.failures[1:]))  # unless announced already
        logger.error("%s; stopping the other ranks", root.describe())
        supervisor.close(dump_stacks=True)


def announced_failure(worker: Worker) -> WorkerFailure:
    """A child that announced its failure is exiting with code 1; its record says why."""
    return worker.ended_with(1, WorkerFailure.read(worker.spec.error_file), with_tail=False)


SYMPTOM_WAIT_S = 0.5


_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def dead_peer(workers: list[Worker], announcer: Worker, announced: WorkerFailure) -> WorkerFailure | None:
    """A rank that died badly before ``announcer`` reported its error: the likelier root cause.

    A peer killed by a signal writes no record and announces nothing, and the others' collectives fail
    at once ("connection closed"), so their announcements can come before its exit is handled, even
    before it is a zombie (its sockets close first). An announced error that reads like that symptom
    waits up to ``SYMPTOM_WAIT_S`` for such a peer; any other error is delivered at once.
    """
    symptom = any(text in (announced.message or "") for text in _SYMPTOMS)
    deadline = time.monotonic() + (SYMPTOM_WAIT_S if symptom else 0.0)
    while True:
        peer = _exited_badly(workers, announcer)
        if peer is not None or time.monotonic() >= deadline:
            return peer
        time.sleep(0.01)


def _exited_badly(workers: list[Worker], announcer: Worker) -> WorkerFailure | None:
    """The exit status is read without reaping (``WNOWAIT``): the supervisor still reaps it."""
    for worker in workers:
        if worker is announcer or worker.pid is None:
            continue
        if worker.ending.failure is not None:
            return worker.ending.failure
        try:
            info = os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        if info is None or (info.si_code == os.CLD_EXITED and info.si_status == 0):
            continue
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        returncode = -info.si_status if killed else info.si_status
        return worker.ended_with(returncode, WorkerFailure.read(worker.spec.error_file), with_tail=False)
    return None
