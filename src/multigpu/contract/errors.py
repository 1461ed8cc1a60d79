"""Typed errors: a usage mistake, a rendezvous problem, or workers that failed.

Every process of a run imports them. ``WorkerFailedError`` carries the failure records
(``WorkerFailure``, in ``failure.py``) of the ranks that failed; the record is importable from here too,
as ``multigpu.WorkerFailure`` is.
"""

from __future__ import annotations

from multigpu.contract.exitcodes import EXIT_FAILED, EXIT_PREFLIGHT
from multigpu.contract.failure import WorkerFailure

__all__ = [
    "STORE_HOST_ENDED",
    "STORE_SERVER_ENDED",
    "Interrupted",
    "MultiGPUError",
    "PreflightRefused",
    "PreflightWithdrew",
    "RendezvousError",
    "StoreLostError",
    "UsageError",
    "WorkerFailedError",
    "WorkerFailure",
]


class MultiGPUError(Exception):
    """Base of every error multigpu raises on purpose."""

    launcher_exit = EXIT_FAILED
    """What ``multigpu run`` exits with when this error ends it (``exitcodes.py``)."""


class UsageError(MultiGPUError, ValueError):
    """Bad input from the user; the CLI prints it as one line and exits 2. Never retried."""


class RendezvousError(MultiGPUError):
    """The group could not be formed: a port is taken, peers never came, or layouts disagree."""


class PreflightRefused(RendezvousError):
    """``--preflight=strict`` found a node far slower than the others: every node refuses the job."""

    launcher_exit = EXIT_PREFLIGHT


class PreflightWithdrew(MultiGPUError):
    """This node was far slower than the others in an elastic round's preflight, and enough nodes are
    left without it: it leaves the job (not a failed rendezvous: the rendezvous stays open), which goes
    on with the others."""

    launcher_exit = EXIT_PREFLIGHT


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C caught where the launcher knows what it was doing: its one line says what stopped
    (``multigpu: node 0: interrupted (SIGINT) while waiting for node(s) 1 to join; no rank was
    started``). The command line prints it and ends the launcher with SIGINT, as Python does."""


STORE_HOST_ENDED = "ended (its launcher was killed?)"
"""How a lost store reads after "node 0, the store's host, ": its connection closed under a call."""
STORE_SERVER_ENDED = "went away (stopped or restarted? a restarted store has lost the job's state)"
"""How a lost store reads after "the rendezvous store " where no launcher of the job served it
(``multigpu store``, or a store elsewhere under ``is_host=false``): no launcher was killed."""


class StoreLostError(RendezvousError):
    """The job's c10d store is gone (its host's launcher was killed, or crashed): raised by the
    launcher's guarded store calls (``rendezvous/store.py``) in place of torch's ``DistNetworkError``,
    whose text (and C++ frames) goes to the node's log, never to the console. ``host`` names who served
    the store; the failure record it becomes is ``fate.store_lost``'s."""

    def __init__(self, host: str, detail: str = STORE_HOST_ENDED) -> None:
        super().__init__(f"{host}, {detail}; stopping")
        self.host, self.detail = host, detail


class WorkerFailedError(MultiGPUError):
    """One or more ranks failed; ``root_cause`` is the first failure in time.

    In function mode it is also raised asynchronously in the thread that called
    ``setup_multi_gpu_train``, like KeyboardInterrupt, but unlike KeyboardInterrupt it is an
    ``Exception``: it is the same type ``finalize()`` raises, and ``except MultiGPUError`` /
    ``except WorkerFailedError`` must catch both. A broad ``except Exception:`` therefore catches it
    too; swallowing it loses nothing, because the process group has already been aborted (the next
    collective fails at once) and ``finalize()`` raises the same error again.
    """

    def __init__(self, root_cause: WorkerFailure, others: list[WorkerFailure] | None = None) -> None:
        self.root_cause = root_cause
        self.others = others or []
        text = root_cause.describe()
        if root_cause.traceback:
            text += "\n" + root_cause.traceback.rstrip()
        super().__init__(text)

    @property
    def rank(self) -> int:
        return self.root_cause.rank

    @property
    def exit_code(self) -> int | None:
        return self.root_cause.exit_code

    @property
    def signal(self) -> str | None:
        return self.root_cause.signal

    @property
    def traceback(self) -> str | None:
        return self.root_cause.traceback


for _public in (MultiGPUError, UsageError, RendezvousError, WorkerFailedError):
    _public.__module__ = "multigpu"  # a traceback names them as users import them: multigpu.UsageError
