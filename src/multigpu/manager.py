"""Function mode: OTX's ``MultiGPUManager``, same names and signatures, its bugs fixed.

The calling process becomes local rank 0 and keeps training in place; local ranks 1..n-1 are started
with spawn semantics through the shared worker bootstrap and watched by the same Supervisor as
``multigpu run``, from a background thread. This is the one place that writes ``os.environ``: the
caller itself becomes a rank.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import pickle
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from .argv import remove_option, set_arguments_to_argv
from .config import new_run_id
from .console import PrefixedConsole
from .devices import dedupe, get_gpu_ids, parse_index_list, visible_gpus
from .endpoint import Endpoint, parse_endpoint
from .environment import (
    CONTRACT_KEYS,
    JobContext,
    RankPlacement,
    build_worker_env,
    inside_launched_worker,
    rank_env,
    usable_cpu_count,
)
from .errors import MultiGPUError, WorkerFailedError, WorkerFailure
from .fate import FateMonitor, mark_done, serve_until_all_done, share_failure
from .rendezvous import DEFAULT_TIMEOUT_S, JobStore, bind_store_socket, connect_store, serve_store
from .supervisor import RunResult, RunStatus, Supervisor, Worker, WorkerSpec, read_error_file
from .worker import ANNOUNCE_ENV, guard_parent

TIMEOUT_ENV = "MULTIGPU_DIST_TIMEOUT"
RDZV_TIMEOUT_S = 600.0  # how long nodes wait for each other, as `multigpu run --rdzv-timeout`
HPO_FILE = "optimized_hyper_parameters.json"


def dist_timeout_s(start_time: datetime | None, explicit: float | None = None,
                   env: Mapping[str, str] | None = None, now: datetime | None = None) -> float:
    """Peers are waited for longer the longer the run has already gone; a user's value always wins."""
    env = os.environ if env is None else env
    if explicit is not None:
        return explicit
    if env.get(TIMEOUT_ENV):
        return float(env[TIMEOUT_ENV])
    if start_time is None:
        return DEFAULT_TIMEOUT_S
    elapsed = ((now or datetime.now(start_time.tzinfo)) - start_time).total_seconds()
    return max(DEFAULT_TIMEOUT_S, 1.5 * elapsed)


def _resolve_device(device: str) -> str:
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if device == "auto":
        return "cuda" if visible_gpus() else "cpu"
    return device


def _raise_in_thread(thread_id: int, error: WorkerFailedError) -> None:
    """Raise ``error`` in another thread (the caller's main thread) at its next bytecode."""
    def init(self: WorkerFailedError) -> None:
        WorkerFailedError.__init__(self, error.root_cause, error.others)

    cls = type("WorkerFailedError", (WorkerFailedError,), {"__init__": init})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(cls))


class MultiGPUManager:
    """Run ``train_func`` on several devices: this process is local rank 0, the others are spawned.

    ``device`` is ``"auto"`` (CUDA when a GPU is visible), ``"cuda"`` or ``"cpu"``, where ``gpu_ids``
    name CPU worker slots and the backend is gloo.
    """

    def __init__(self, train_func: Callable[..., Any], gpu_ids: str, rdzv_endpoint: str = "localhost:0",
                 base_rank: int = 0, world_size: int = 0, start_time: datetime | None = None, *,
                 device: str = "auto", timeout: float | None = None, grace_period: float = 5.0) -> None:
        if not callable(train_func):
            raise ValueError(f"train_func must be callable, got {train_func!r}")
        self._device = _resolve_device(device)
        ids = dedupe(parse_index_list(gpu_ids), what="gpu_ids")
        self._gpu_ids = get_gpu_ids(gpu_ids) if self._device == "cuda" else ids
        self._endpoint: Endpoint = parse_endpoint(rdzv_endpoint)
        if self._endpoint.port == 0 and not self._endpoint.is_loopback:
            raise ValueError(f"rdzv_endpoint {rdzv_endpoint!r}: port 0 is only allowed on a loopback host; "
                             "give the port the other nodes will connect to")
        if not isinstance(base_rank, int) or base_rank < 0:
            raise ValueError(f"base_rank must be an integer >= 0, got {base_rank!r}")
        local = len(self._gpu_ids)
        if not isinstance(world_size, int) or world_size < 0:
            raise ValueError(f"world_size must be an integer >= 0 (0: the local count), got {world_size!r}")
        self._world_size = world_size or local
        if base_rank + local > self._world_size:
            raise ValueError(f"base_rank {base_rank} + {local} local worker(s) exceeds world_size "
                             f"{self._world_size}; raise world_size or lower base_rank")
        if self._world_size > local and self._endpoint.port == 0:
            raise ValueError("a multi-node job needs a fixed rdzv_endpoint port")
        self._train_func = train_func
        self._base_rank = base_rank
        self._start_time = start_time
        self._timeout = timeout
        self._grace_period = grace_period
        self._supervisor: Supervisor | None = None
        self._watcher: threading.Thread | None = None
        self._error: WorkerFailedError | None = None
        self._result: RunResult | None = None
        self._finalizing = False
        self._finalized = False
        self._main_thread = threading.main_thread().ident
        self._previous_handlers: dict[int, Any] = {}
        self._store: Any = None
        self._sock: Any = None
        self._rdzv_endpoint = rdzv_endpoint
        self._created_group = False
        self._previous_excepthook = sys.excepthook
        self._saved_environ: dict[str, str | None] = {}
        self._job: JobStore | None = None
        self._monitor: FateMonitor | None = None

    # ---- the seed's API ------------------------------------------------------------------------------

    def is_available(self) -> bool:
        """More than one usable device, and not already inside a launched worker."""
        return len(self._gpu_ids) > 1 and not inside_launched_worker()

    def setup_multi_gpu_train(self, output_path: str | None,
                              optimized_hyper_parameters: Mapping[str, Any] | None = None) -> str:
        """Start local ranks 1..n-1, make this process rank ``base_rank``, and return the output path."""
        if self._supervisor is not None:
            raise RuntimeError("setup_multi_gpu_train() was already called on this manager")
        out = Path(output_path) if output_path else Path(tempfile.mkdtemp(prefix="multigpu-"))
        out.mkdir(parents=True, exist_ok=True)
        if optimized_hyper_parameters:
            self._apply_hyper_parameters(out, optimized_hyper_parameters)
        timeout = dist_timeout_s(self._start_time, self._timeout)
        endpoint = self._serve_store(timeout) if self._base_rank == 0 else str(self._endpoint)
        self._rdzv_endpoint = endpoint
        run_id = self._join_job() if self._world_size > len(self._gpu_ids) else new_run_id()
        specs = self._child_specs(out, endpoint, run_id, timeout)
        self._supervisor = Supervisor(specs, sink=PrefixedConsole(), grace_period=self._grace_period,
                                      on_failing=self._child_failing)
        self._supervisor.start()
        if self._job is not None:
            self._monitor = FateMonitor(self._job, self._on_remote_failure)
            self._monitor.start()
        atexit.register(self._close_at_exit)
        self._watcher = threading.Thread(target=self._watch, name="multigpu-supervisor", daemon=True)
        self._watcher.start()
        self._install_signal_handlers()
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self._saved_environ = {key: os.environ.get(key) for key in (*CONTRACT_KEYS, TIMEOUT_ENV)}
        os.environ.setdefault(TIMEOUT_ENV, str(timeout))
        os.environ.update(MULTIGPU_RUN_ID=run_id, TORCHELASTIC_RUN_ID=run_id, MULTIGPU_OUTPUT_DIR=str(out),
                          MULTIGPU_DEVICE=self._device)
        self._created_group = self.initialize_multigpu_train(
            endpoint, self._base_rank, 0, self._gpu_ids, self._world_size)
        return str(out)

    def finalize(self, timeout: float | None = None) -> None:
        """Join the children (bounded); raise WorkerFailedError if any failed. Safe to call twice."""
        if self._finalized or self._supervisor is None:
            return
        self._finalizing = True
        try:
            bound = timeout if timeout is not None else dist_timeout_s(self._start_time, self._timeout)
            assert self._watcher is not None
            self._watcher.join(bound)
            if self._watcher.is_alive():
                self._supervisor.request_stop()
                self._watcher.join(self._grace_period + 5)
                raise MultiGPUError(f"child processes were still running {bound:g}s after rank "
                                    f"{self._base_rank} finished; they were stopped")
            if self._job is not None and self._error is None:
                mark_done(self._job)
                if self._base_rank == 0:
                    serve_until_all_done(self._job)  # the other nodes still need the store
        finally:
            self._finalized = True
            self._restore_signal_handlers()
            self._shutdown()
        if self._error is not None:
            raise self._error

    @staticmethod
    def check_parent_processes_alive() -> None:
        """The child's watchdog: end this process and its children within moments of the parent's death."""
        launcher = os.environ.get("MULTIGPU_LAUNCHER_PID")
        guard_parent(int(launcher) if launcher else os.getppid())

    @staticmethod
    def initialize_multigpu_train(rdzv_endpoint: str, rank: int, local_rank: int, gpu_ids: list[int],
                                  world_size: int) -> bool:
        """Set this process's rank environment, pick its device, and init the default process group.

        Returns True when it created the group (False when one already existed).
        """
        endpoint = parse_endpoint(rdzv_endpoint)
        import torch
        import torch.distributed as dist

        device = os.environ.get("MULTIGPU_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        placement = RankPlacement.on_node(rank, local_rank, world_size, len(gpu_ids))
        job = JobContext(master_addr=endpoint.bind_host, master_port=endpoint.port, device=device,
                         run_id=os.environ.get("TORCHELASTIC_RUN_ID", "multigpu"),
                         output_dir=os.environ.get("MULTIGPU_OUTPUT_DIR"))
        os.environ.update(rank_env(placement, job))  # the one place: this process becomes the rank
        if device == "cuda":
            torch.cuda.set_device(gpu_ids[local_rank])
        if dist.is_initialized():
            return False
        from datetime import timedelta

        timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timeout)
        return True

    @staticmethod
    def run_child_process(train_func: Callable[..., Any], output_path: str, rdzv_endpoint: str, rank: int,
                          local_rank: int, gpu_ids: list[int], world_size: int) -> None:
        """What each spawned rank runs: fix its argv the OTX way, join the group, call ``train_func``."""
        MultiGPUManager.check_parent_processes_alive()
        sys.argv = remove_option(sys.argv, "--gpus")
        sys.argv = remove_option(sys.argv, "--enable-hpo", takes_value=False)
        set_arguments_to_argv(["--output", "-o"], output_path)
        set_arguments_to_argv("--rdzv-endpoint", rdzv_endpoint)
        MultiGPUManager.initialize_multigpu_train(rdzv_endpoint, rank, local_rank, gpu_ids, world_size)
        train_func()
        # Only after success: on an error the group stays up until the bootstrap has announced the
        # failure, so the peers learn it from us rather than from a closed socket.
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    # ---- internals -----------------------------------------------------------------------------------

    def _apply_hyper_parameters(self, out: Path, params: Mapping[str, Any]) -> None:
        (out / HPO_FILE).write_text(json.dumps(dict(params), indent=2, default=str))
        for name, value in params.items():
            set_arguments_to_argv(f"--{name}", str(value), after_params=True)

    def _serve_store(self, timeout: float) -> str:
        self._sock = bind_store_socket(self._endpoint)
        host = self._endpoint.bind_host
        port = self._sock.getsockname()[1]
        self._store = serve_store(self._sock.fileno(), host, port, timeout_s=timeout)
        self._sock.detach()  # the store server owns the descriptor now and closes it
        self._sock = None
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _child_specs(self, out: Path, endpoint: str, run_id: str, timeout: float) -> list[WorkerSpec]:
        from multiprocessing import spawn

        ep = parse_endpoint(endpoint)
        job = JobContext(master_addr=ep.bind_host, master_port=ep.port, run_id=run_id, device=self._device,
                         output_dir=str(out), cpu_count=usable_cpu_count(), launcher_pid=os.getpid())
        payload_dir = out / ".multigpu"
        payload_dir.mkdir(exist_ok=True)
        preparation = spawn.get_preparation_data("multigpu-worker")
        preparation.pop("authkey", None)  # only for multiprocessing connections, which we do not use
        local = len(self._gpu_ids)
        base = dict(os.environ)
        base.setdefault(TIMEOUT_ENV, str(timeout))
        specs = []
        for local_rank in range(1, local):
            rank = self._base_rank + local_rank
            payload = payload_dir / f"rank_{rank}.pkl"
            args = (self._train_func, str(out), endpoint, rank, local_rank, self._gpu_ids, self._world_size)
            with open(payload, "wb") as f:
                pickle.dump(preparation, f)
                pickle.dump((MultiGPUManager.run_child_process, args), f)
            placement = RankPlacement.on_node(rank, local_rank, self._world_size, local)
            error_file = out / "logs" / f"error_rank_{rank}.json"
            env = build_worker_env(base, placement, job, error_file=str(error_file))
            env[ANNOUNCE_ENV] = "1"  # a failing child tells us before its sockets close
            device = f"cuda:{self._gpu_ids[local_rank]}" if self._device == "cuda" else "cpu"
            specs.append(WorkerSpec(
                rank=rank, local_rank=local_rank, device=device, env=env, error_file=error_file,
                node=placement.group_rank,
                argv=[sys.executable, "-m", "multigpu.worker", "function", str(payload)],
                log_path=out / "logs" / f"rank_{rank}.log"))
        return specs

    def _join_job(self) -> str:
        """Several nodes: the same membership, run id and layout checks as ``multigpu run``."""
        local = len(self._gpu_ids)
        store = self._store if self._base_rank == 0 else connect_store(
            self._endpoint.host, self._endpoint.port, RDZV_TIMEOUT_S)
        self._job = JobStore(store, node=self._base_rank // local, base_rank=self._base_rank, nproc=local,
                             world_size=self._world_size)
        run_id = self._job.settle_run_id(new_run_id() if self._base_rank == 0 else None)
        self._job.join(RDZV_TIMEOUT_S)
        return run_id

    def _child_failing(self, worker: Worker) -> None:
        """A child announced its uncaught exception (it exits in a moment): raise it here now."""
        record = read_error_file(worker.spec.error_file) or {}
        self._deliver(WorkerFailure(
            rank=worker.rank, local_rank=worker.spec.local_rank, pid=worker.pid, exit_code=1,
            node=worker.spec.node, error_type=record.get("type"), message=record.get("message"),
            traceback=record.get("traceback"), time=record.get("time"),
            log_path=str(worker.spec.log_path) if worker.spec.log_path else None))

    def _deliver(self, failure: WorkerFailure) -> None:
        if self._error is None:
            self._error = WorkerFailedError(failure)
            if not self._finalizing and self._main_thread is not None:
                _raise_in_thread(self._main_thread, self._error)

    def _on_remote_failure(self, failure: WorkerFailure) -> None:
        """Another node failed (or vanished): stop the children and tell this process's main thread."""
        self._deliver(failure)
        if self._supervisor is not None:
            self._supervisor.abort(failure)

    def _watch(self) -> None:
        supervisor = self._supervisor
        assert supervisor is not None
        result = supervisor.wait()
        assert result is not None
        self._result = result
        if result.status is RunStatus.SUCCEEDED:
            supervisor.close()
            return
        if result.status is RunStatus.INTERRUPTED:
            supervisor.close(sig=result.signal or signal.SIGTERM)
            return
        if self._job is not None:
            result = share_failure(self._job, result)
        root = result.root_cause
        assert root is not None
        if self._error is not None:  # already raised: announced by the child, or from another node
            supervisor.close(dump_stacks=True)
            return
        self._error = WorkerFailedError(root, result.failures[1:])
        if not self._finalizing and self._main_thread is not None:
            _raise_in_thread(self._main_thread, self._error)  # before teardown: as early as we know
        supervisor.close(dump_stacks=True)
        print(f"multigpu: {root.describe()}; stopped the other ranks", file=sys.stderr, flush=True)

    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        """An error in rank 0 is often a peer's death seen through a collective: show the root cause too."""
        self._finalizing = True  # no more errors raised into this thread: it is already ending
        self._previous_excepthook(exc_type, exc, tb)
        if self._watcher is not None:
            with contextlib.suppress(WorkerFailedError):  # one raised just before we said stop
                self._watcher.join(0.3)  # a child's failure already on its way is reported first
                if self._supervisor is not None and self._watcher.is_alive():
                    self._supervisor.request_stop()  # rank 0 itself failed: stop the children now
                self._watcher.join(self._grace_period + 2)
        if self._error is not None and not isinstance(exc, WorkerFailedError):
            print(f"multigpu: root cause: {self._error}", file=sys.stderr, flush=True)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Stop the children, then chain to whatever handler was there before."""
        if self._supervisor is not None:
            self._supervisor.request_signal(signum)
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            raise SystemExit(128 + signum)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers.clear()

    def _restore_environ(self) -> None:
        """Undo what made this process a rank, so a later manager in it (HPO, say) starts afresh."""
        for key, value in self._saved_environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_environ = {}

    def _shutdown(self) -> None:
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        if self._supervisor is not None:
            if self._watcher is not None and self._watcher.is_alive():
                self._supervisor.request_stop()
                self._watcher.join(self._grace_period + 5)
            self._supervisor.close()
        if self._created_group:
            import torch.distributed as dist

            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            self._created_group = False
        self._store = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._restore_environ()
        atexit.unregister(self._close_at_exit)

    def _close_at_exit(self) -> None:
        self._finalizing = True
        self._shutdown()
