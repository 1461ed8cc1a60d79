"""``multigpu.spawn``: ``torch.multiprocessing.spawn``'s signature and meaning, on ``multigpu.launch``.

Runs in the caller. ``fn(i, *args)`` runs in ``nprocs`` ranks (``i`` is the local rank), forked from the
node's template rather than started as fresh interpreters that each import torch. As under torch, each
process sees every GPU (``CUDA_VISIBLE_DEVICES`` is left as the caller's, whatever ``nprocs`` is; the
run's record lists the ranks' device as "cpu", since multigpu assigns none) and sets up its own process
group (``MASTER_ADDR``/``MASTER_PORT`` are the job's unless ``fn`` sets its own, as PyTorch's DDP
tutorial does); the agent-store variable is removed, so
``init_process_group`` makes rank 0's store as it would under ``mp.spawn``.

What the caller sees is torch's (``tests/integration/function/test_spawn_parity.py`` compares the two):
a rank that raised is torch's own ``ProcessRaisedException`` (its message holds the rank's traceback;
the rank's exception, when it could be sent back, is its ``__cause__``); a rank that exited with a
code other than 0 or died of a signal is ``ProcessExitedException`` with torch's ``exit_code`` (minus
the signal's number), ``error_index``, ``signal_name`` and message; ``sys.exit(0)`` is success. Both
are importable from here, as from ``torch.multiprocessing`` (this module imports torch: a caller of
``mp.spawn`` has). ``join=False`` gives a context with torch's ``join(timeout)``, ``pids()`` and
``processes``. ``daemon`` is accepted for compatibility, and ``start_method`` warns as torch's does:
ranks always fork from the template.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from multigpu.contract.errors import WorkerFailedError
from multigpu.function import rank_call
from multigpu.function.launch_call import Launch
from multigpu.function.launch_errors import RemoteTraceback

__all__ = ["ProcessExitedException", "ProcessRaisedException", "SpawnContext", "spawn"]

PID_POLL_S = 0.01
"""While ``spawn(..., join=False)`` waits for its ranks to have started: how often it looks."""


def call_with_index(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """In the rank: ``fn(i, *args)`` as ``mp.spawn`` calls it, ``i`` being the local rank."""
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 serves init_process_group's store
    return fn(int(os.environ["LOCAL_RANK"]), *args)


class RankProcess:
    """One rank as torch's ``ProcessContext.processes`` lists it: what ``multiprocessing.Process`` offers
    that makes sense for a process the caller did not start (the template forked it): ``pid``,
    ``is_alive``, ``join``, ``terminate``, ``kill``, and ``exitcode`` once the launch has ended (None
    where the launch did not say: a rank stopped after another's failure)."""

    def __init__(self, index: int, pid: int, context: SpawnContext) -> None:
        self.index, self.pid, self.context = index, pid, context
        self.name = f"rank-{index}"
        self._process: psutil.Process | None = None
        with contextlib.suppress(psutil.Error, ValueError):
            self._process = psutil.Process(pid) if pid > 0 else None  # pid reuse safe from here on

    def is_alive(self) -> bool:
        try:
            return self._process is not None and self._process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def join(self, timeout: float | None = None) -> None:
        if self._process is not None:
            with contextlib.suppress(psutil.Error):
                self._process.wait(timeout)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self._process is not None:
            with contextlib.suppress(psutil.Error):
                self._process.send_signal(signum)

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else self.context.exit_codes.get(self.index)


class SpawnContext:
    """What ``spawn(..., join=False)`` returns, like torch's ``ProcessContext``: ``join`` until done.
    The launch runs on a thread of its own meanwhile; created once every rank has written its pid (or
    the launch ended first), as torch's once every process has started."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.error: BaseException | None = None
        self.exit_codes: dict[int, int] = {}
        """Each rank's exit code, once the launch has ended, where the launch says it."""
        self._ended, self._started = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="multigpu-spawn", daemon=True)
        self.thread.start()
        try:
            self._pids = self._wait_for_pids()
        finally:
            self._started.set()  # the thread may remove the private folder now
        self.processes = [RankProcess(i, pid, self) for i, pid in enumerate(self._pids)]

    def _run(self) -> None:
        nprocs = self.launch.config.nproc
        try:
            self.launch.run()
            self.exit_codes = dict.fromkeys(range(nprocs), 0)
        except BaseException as exc:  # raised by join()
            self.error = exc
            self.exit_codes = _exit_codes(exc)
        finally:
            self._ended.set()
            self._started.wait()
            self.launch.remove()

    def _wait_for_pids(self) -> list[int]:
        """Each rank's pid, as it wrote it on starting; 0 for one that never started."""
        paths = [rank_call.pid_path(self.launch.results, r) for r in range(self.launch.config.nproc)]
        while True:
            ended = self._ended.is_set()
            pids = [_read_pid(path) for path in paths]
            if all(pids) or ended:
                return pids
            self._ended.wait(PID_POLL_S)

    def pids(self) -> list[int]:
        return list(self._pids)

    def join(self, timeout: float | None = None) -> bool:
        """True once every rank is done; False if ``timeout`` passed first; raises as ``spawn`` does."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            return False
        if self.error is not None:
            raise_as_torch(self.error)
        return True


def _read_pid(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def _exit_codes(exc: BaseException) -> dict[int, int]:
    """The failed rank's exit code, as torch's process would have it (1 for one that raised)."""
    error = as_torch_error(exc)
    if isinstance(error, ProcessExitedException):
        return {error.error_index: error.exit_code}
    if isinstance(error, ProcessRaisedException):
        return {error.error_index: 1}
    return {}


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> SpawnContext | None:
    """``torch.multiprocessing.spawn``, ranks forked from the warm template."""
    if start_method != "spawn":  # torch's own warning, word for word
        warnings.warn(
            f"This method only supports start_method=spawn (got: {start_method}).\n"
            "To use a different start_method use:\n\t\t"
            " torch.multiprocessing.start_processes(...)",
            FutureWarning,
            stacklevel=2,
        )
    # As under torch: no GPU is assigned (device "cpu" to the launcher), so CUDA_VISIBLE_DEVICES stays
    # the caller's and every process sees every GPU; fn picks its own (torch.cuda.set_device(i)).
    launch = Launch(call_with_index, (fn, tuple(args)), {}, nprocs=nprocs, device="cpu", options={})
    if not join:
        return SpawnContext(launch)
    try:
        launch.wait()  # in this thread: a Ctrl-C stops every rank
    except BaseException as exc:
        raise_as_torch(exc)
    return None


def raise_as_torch(exc: BaseException) -> None:
    """Raise torch's exception for ``exc``: one traceback, as torch prints it. The rank's own exception
    (when it came back) stays reachable as ``__cause__``, without its remote traceback, which torch's
    message already holds."""
    error = as_torch_error(exc)
    if error is exc:
        raise exc
    cause = None if isinstance(exc, WorkerFailedError) else exc
    if cause is not None:
        cause.__cause__ = None
        cause.__suppress_context__ = True
    raise error from cause


def as_torch_error(exc: BaseException) -> BaseException:
    """torch's exception for a failed rank: ``ProcessRaisedException`` for one that raised,
    ``ProcessExitedException`` for one that died without (a signal, an exit code); anything else as is."""
    remote = exc.__cause__
    if isinstance(remote, RemoteTraceback):
        message = f"\n\n-- Process {remote.rank} terminated with the following error:\n{remote.text}\n"
        return ProcessRaisedException(message, remote.rank, remote.pid or 0)
    if not isinstance(exc, WorkerFailedError):
        return exc
    root = exc.root_cause
    if root.traceback:
        message = f"\n\n-- Process {root.rank} terminated with the following error:\n{root.traceback}"
        return ProcessRaisedException(message, root.rank, root.pid or 0)
    if root.signal:
        return ProcessExitedException(
            f"process {root.rank} terminated with signal {root.signal}",
            root.rank,
            root.pid or 0,
            -_signal_number(root.signal),
            root.signal,
        )
    return ProcessExitedException(
        f"process {root.rank} terminated with exit code {root.exit_code}",
        root.rank,
        root.pid or 0,
        root.exit_code or 0,
    )


def _signal_number(name: str) -> int:
    """15 for "SIGTERM"; 0 for a name Python does not know (torch's exit code is minus the number)."""
    try:
        return int(signal.Signals[name])
    except KeyError:
        return 0
