"""``multigpu.launch(fn, *args, ...)``: run a function on every rank and return their values in rank order.

Runs in the caller (a script, an HPO loop, a notebook kernel). It never forks itself: it writes the
payload (the function, its arguments, the caller's ``sys.path`` and working directory) and the launch
request into a private folder of its own (``mkdtemp``, 0700, removed when the launch ends), never into
the run folder, which the launcher creates, checks and locks (a second launch given a live run's
``output`` is refused without touching it). It hands the request to its launcher process
(``launcher_handle``: started by the first launch, kept warm for the next), which is ``multigpu run``'s
launcher in function mode, ranks forked from the node's template. The launcher's lines (each rank's
prefixed ``[rank N]``) appear in the caller's ``sys.stdout``/``sys.stderr`` as they come, so a notebook
shows them in the running cell; a Ctrl-C (a kernel interrupt) stops every rank and is raised here as
``KeyboardInterrupt``. The values come back through the private folder (``rank_call``); a failure comes
back as the root-cause rank's own exception, read from the record of this run id only
(``launch_errors``).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from multigpu.config.run import RunConfig
from multigpu.contract.errors import MultiGPUError
from multigpu.contract.files import write_private
from multigpu.function import launcher_handle, rank_call
from multigpu.function.launch_config import launch_config
from multigpu.function.launch_errors import failure_of
from multigpu.function.launch_folder import PrivateFolder
from multigpu.function.launcher_handle import launcher

RESULTS_DIR = "results"


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int | None = None,
    device: str = "auto",
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank; return the values in rank order.

    ``nprocs``: the rank count (None: every visible GPU). ``device``: "auto", "cuda" or "cpu".
    ``options``: ``multigpu run``'s settings by their Python names (``hang_timeout``, ``max_restarts``,
    ``grace_period``, ``output``, ...). A rank's exception is raised here with its own type.
    """
    return Launch(fn, args, dict(kwargs or {}), nprocs=nprocs, device=device, options=options).wait()


def shutdown() -> None:
    """End the warm launcher and its template now (else at this process's exit, however it ends)."""
    launcher_handle.shutdown()


class Launch:
    """One launch: its payload and request written; ``wait`` runs it and returns the values."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        nprocs: int | None,
        device: str,
        options: Mapping[str, Any],
    ) -> None:
        if not callable(fn):
            raise TypeError(f"multigpu.launch: fn must be callable, got {fn!r}")
        blob = _pickled((fn, args, kwargs))
        config = launch_config(nprocs, device, options, os.environ)
        self.output_dir = Path(str(config.output.dir))
        self.folder = PrivateFolder()  # 0700, this user's alone; a dead caller's is swept (launch_folder)
        self.private = self.folder.path
        try:
            self.results = self.private / RESULTS_DIR
            self.results.mkdir(mode=0o700)
            payload = self.private / "payload.pkl"
            self.config: RunConfig = dataclasses.replace(config, target=str(payload))
            preparation = {"sys_path": list(sys.path), "dir": os.getcwd()}
            call = (rank_call.call_in_rank, (blob, str(self.results)))
            write_private(payload, pickle.dumps(preparation) + pickle.dumps(call))
            self.request = self.private / "request.pkl"
            request = {"config": self.config, "env": dict(os.environ), "cwd": os.getcwd()}
            write_private(self.request, pickle.dumps(request))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """The private folder goes (payload, request, the ranks' values) once no rank can read it."""
        self.folder.remove()

    def wait(self) -> list[Any]:
        """Run it: the values in rank order once every rank is done; a rank's exception if one failed."""
        try:
            return self.run()
        finally:
            self.remove()

    def run(self) -> list[Any]:
        """``wait`` without removing the private folder (``spawn``'s context reads the ranks' pids in it
        while they run, and removes it once it has them)."""
        with launcher() as process:
            code = process.run(self.request)
        if code < 0 and -code == signal.SIGINT:
            raise KeyboardInterrupt
        if code != 0:
            raise failure_of(self.output_dir, str(self.config.output.run_id), self.results, code)
        return read_values(self.results, self.config.nproc)


def read_values(results: Path, nproc: int) -> list[Any]:
    """The ranks' values in rank order; a value that cannot be read here is one error naming its rank."""
    values = []
    for rank in range(nproc):
        path = rank_call.result_path(results, rank)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise MultiGPUError(
                f"multigpu.launch: rank {rank} succeeded but left no return value in {results}"
            ) from None
        try:
            values.append(pickle.loads(data))
        except Exception as exc:  # a class the caller cannot import, a __reduce__ that fails here
            raise MultiGPUError(
                f"multigpu.launch: rank {rank}'s return value cannot be read here: "
                f"{type(exc).__name__}: {exc}"
            ) from None
    return values


def _pickled(obj: Any) -> bytes:
    try:
        return rank_call.dumps_call(obj)
    except Exception as exc:
        raise MultiGPUError(
            f"multigpu.launch: the function or its arguments cannot be sent to the ranks: {exc}"
        ) from None
