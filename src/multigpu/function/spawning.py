"""``multigpu.spawn``: ``torch.multiprocessing.spawn``'s signature and meaning, on ``multigpu.launch``.

Runs in the caller. ``fn(i, *args)`` runs in ``nprocs`` ranks (``i`` is the local rank), forked from the
node's template rather than started as fresh interpreters that each import torch. As under torch, each
process sees every GPU (``CUDA_VISIBLE_DEVICES`` is left as the caller's, whatever ``nprocs`` is; the
run's record lists the ranks' device as "cpu", since multigpu assigns none) and sets up its own process
group (``MASTER_ADDR``/``MASTER_PORT`` are the job's unless ``fn`` sets its own, as PyTorch's DDP
tutorial does); the agent-store variable is removed, so
``init_process_group`` makes rank 0's store as it would under ``mp.spawn``. A failure raises torch's own
``ProcessRaisedException`` (the rank's exception as ``__cause__``) or ``ProcessExitedException``.
Both are importable from here, as from ``torch.multiprocessing`` (this module imports torch: a caller of
``mp.spawn`` has). ``daemon`` and ``start_method`` are accepted for compatibility: ranks always fork
from the template.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from multigpu.contract.errors import WorkerFailedError
from multigpu.function.launch_call import Launch
from multigpu.function.launch_errors import RemoteTraceback

__all__ = ["ProcessExitedException", "ProcessRaisedException", "SpawnContext", "spawn"]


def call_with_index(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """In the rank: ``fn(i, *args)`` as ``mp.spawn`` calls it, ``i`` being the local rank."""
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 serves init_process_group's store
    return fn(int(os.environ["LOCAL_RANK"]), *args)


class SpawnContext:
    """What ``spawn(..., join=False)`` returns, like torch's ``ProcessContext``: ``join`` until done.
    The launch runs on a thread of its own meanwhile."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="multigpu-spawn", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.launch.wait()
        except BaseException as exc:  # raised by join()
            self.error = exc

    def join(self, timeout: float | None = None) -> bool:
        """True once every rank is done; False if ``timeout`` passed first; raises as ``spawn`` does."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            return False
        exc = self.error
        if exc is not None:
            error = as_torch_error(exc)
            if error is exc:
                raise exc
            raise error from _cause_of(exc)
        return True


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> SpawnContext | None:
    """``torch.multiprocessing.spawn``, ranks forked from the warm template."""
    # As under torch: no GPU is assigned (device "cpu" to the launcher), so CUDA_VISIBLE_DEVICES stays
    # the caller's and every process sees every GPU; fn picks its own (torch.cuda.set_device(i)).
    launch = Launch(call_with_index, (fn, tuple(args)), {}, nprocs=nprocs, device="cpu", options={})
    if not join:
        return SpawnContext(launch)
    try:
        launch.wait()  # in this thread: a Ctrl-C stops every rank
    except BaseException as exc:
        error = as_torch_error(exc)
        if error is exc:
            raise
        raise error from _cause_of(exc)
    return None


def _cause_of(exc: BaseException) -> BaseException | None:
    """The rank's own exception is the cause; a ``WorkerFailedError`` only repeats what torch's says."""
    return None if isinstance(exc, WorkerFailedError) else exc


def as_torch_error(exc: BaseException) -> BaseException:
    """torch's exception for a failed rank: ``ProcessRaisedException`` for one that raised,
    ``ProcessExitedException`` for one that died without (a signal, an exit code); anything else as is."""
    remote = exc.__cause__
    if isinstance(remote, RemoteTraceback):
        message = f"\n\n-- Process {remote.rank} terminated with the following error:\n{remote.text}\n"
        return ProcessRaisedException(message, remote.rank, remote.pid or 0)
    if isinstance(exc, WorkerFailedError):
        root = exc.root_cause
        if root.traceback:
            message = f"\n\n-- Process {root.rank} terminated with the following error:\n{root.traceback}"
            return ProcessRaisedException(message, root.rank, root.pid or 0)
        if root.signal:
            return ProcessExitedException(
                f"process {root.rank} terminated with signal {root.signal}",
                root.rank,
                root.pid or 0,
                root.exit_code or 0,
                root.signal,
            )
        return ProcessExitedException(
            f"process {root.rank} terminated with exit code {root.exit_code}",
            root.rank,
            root.pid or 0,
            root.exit_code or 0,
        )
    return exc
