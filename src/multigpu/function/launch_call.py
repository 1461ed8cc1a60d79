"""``multigpu.launch(fn, *args, ...)``: run a function on every rank and return their values in rank order.

Runs in the caller (a script, an HPO loop, a notebook kernel). It never forks itself: it writes the
payload (the function, its arguments, the caller's ``sys.path`` and working directory) into the run's
folder and starts one launcher process (``function/launcher.py``), which is ``multigpu run``'s launcher
in function mode, ranks forked from the node's template. The launcher's lines (each rank's prefixed
``[rank N]``) are copied into the caller's ``sys.stdout``/``sys.stderr`` as they come, so a notebook
shows them in the running cell. A Ctrl-C (a kernel interrupt) is passed on to the launcher, which stops
every rank, and then raised here as ``KeyboardInterrupt``. The values come back through the run folder
(``rank_call``); a failure comes back as the root-cause rank's own exception (``launch_errors``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import cloudpickle

from multigpu.config.run import RunConfig
from multigpu.contract.errors import MultiGPUError
from multigpu.function import rank_call
from multigpu.function.launch_config import launch_config
from multigpu.function.launch_errors import failure_of

PAYLOAD_DIR = ".multigpu"
RESULTS_DIR = "results"
STOP_WAIT_S = 30.0
"""After a Ctrl-C: how long the launcher gets to stop every rank before it is killed (its ranks go too)."""


def launch(fn: Callable[..., Any], *args: Any, nprocs: int | None = None, device: str = "auto",
           kwargs: Mapping[str, Any] | None = None, **options: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank; return the values in rank order.

    ``nprocs``: the rank count (None: every visible GPU). ``device``: "auto", "cuda" or "cpu".
    ``options``: ``multigpu run``'s settings by their Python names (``hang_timeout``, ``max_restarts``,
    ``grace_period``, ``output``, ...). A rank's exception is raised here with its own type.
    """
    return Launch(fn, args, dict(kwargs or {}), nprocs=nprocs, device=device, options=options).wait()


class Launch:
    """One launch: its payload written and its launcher started; ``wait`` returns the values."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                 nprocs: int | None, device: str, options: Mapping[str, Any]) -> None:
        if not callable(fn):
            raise TypeError(f"multigpu.launch: fn must be callable, got {fn!r}")
        blob = _pickled((fn, args, kwargs))
        config = launch_config(nprocs, device, options, os.environ)
        self.output_dir = out = Path(str(config.output.dir))
        self.payload = out / PAYLOAD_DIR / "payload.pkl"
        self.config: RunConfig = dataclasses.replace(config, target=str(self.payload))
        self.results = out / RESULTS_DIR
        self.results.mkdir(parents=True, exist_ok=True)
        self.payload.parent.mkdir(exist_ok=True)
        preparation = {"sys_path": list(sys.path), "dir": os.getcwd()}
        self.payload.write_bytes(pickle.dumps(preparation) +
                                 pickle.dumps((rank_call.call_in_rank, (blob, str(self.results)))))
        config_path = out / PAYLOAD_DIR / "config.pkl"
        config_path.write_bytes(pickle.dumps(self.config))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "multigpu.function.launcher", str(config_path), str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, env=dict(os.environ), cwd=os.getcwd())
        self.copiers = [_copier(self.process.stdout, "stdout"), _copier(self.process.stderr, "stderr")]

    @property
    def nprocs(self) -> int:
        return self.config.nproc

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> list[Any]:
        """The values in rank order once every rank is done; a rank's exception if one failed.
        ``subprocess.TimeoutExpired`` if ``timeout`` passes first (the launch goes on)."""
        try:
            code = self.process.wait(timeout)
        except KeyboardInterrupt:
            self.stop(signal.SIGINT)
            raise
        return self._outcome(code)

    def stop(self, sig: int = signal.SIGINT) -> None:
        """Pass ``sig`` to the launcher, wait for it to stop every rank, and clean up."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(sig)
        try:
            self.process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()  # its guard ends the template and every rank with it
            self.process.wait()
        finally:
            self._cleanup()

    def _outcome(self, code: int) -> list[Any]:
        self._cleanup()
        if code < 0 and -code == signal.SIGINT:
            raise KeyboardInterrupt
        if code != 0:
            raise failure_of(self.output_dir, code)
        values = []
        for rank in range(self.config.nproc):
            path = rank_call.result_path(self.results, rank)
            try:
                values.append(pickle.loads(path.read_bytes()))
            except FileNotFoundError:
                raise MultiGPUError(f"multigpu.launch: rank {rank} succeeded but left no return value "
                                    f"in {self.results}") from None
            path.unlink()
        return values

    def _cleanup(self) -> None:
        for copier in self.copiers:
            copier.join()
        shutil.rmtree(self.output_dir / PAYLOAD_DIR, ignore_errors=True)


def _pickled(obj: Any) -> bytes:
    try:
        return bytes(cloudpickle.dumps(obj))
    except Exception as exc:
        raise MultiGPUError(f"multigpu.launch: the function or its arguments cannot be sent to the ranks: "
                            f"{exc}") from None


def _copier(pipe: IO[bytes] | None, name: str) -> threading.Thread:
    """A thread that copies the launcher's ``pipe`` into this process's ``sys.<name>`` line by line
    (looked up at each line: a notebook swaps it per cell)."""
    def copy() -> None:
        assert pipe is not None
        with pipe:
            for line in iter(pipe.readline, b""):
                stream = getattr(sys, name)
                with contextlib.suppress(Exception):
                    stream.write(line.decode(errors="replace"))
                    stream.flush()

    thread = threading.Thread(target=copy, name=f"multigpu-launch-{name}", daemon=True)
    thread.start()
    return thread
