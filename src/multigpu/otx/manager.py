"""Function mode: OTX's ``MultiGPUManager``, same names and signatures, its bugs fixed.

The calling process becomes local rank 0 and keeps training in place; local ranks 1..n-1 are started
through the same rendezvous, spec builder, rank bootstrap and Supervisor as ``multigpu run``, watched
from a background thread (``watcher``). A child's failure reaches the caller's code as
``WorkerFailedError`` within moments, whatever it is doing (see ``interrupt_caller``). Setup is
all-or-nothing: every step registers its undo, so a setup that fails half-way leaves nothing behind.
The caller itself becomes a rank through ``rank_setup``, the one place that writes ``os.environ``.
Runs in the caller.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import datetime
from types import FrameType
from typing import Any

from multigpu.cluster.devices import dedupe, device_wish, keep_visible, parse_index_list, visible_gpus
from multigpu.config.endpoint import format_endpoint, parse_endpoint
from multigpu.config.run import SupervisionConfig
from multigpu.console.caller import caller_lines
from multigpu.console.log import keep_enabled
from multigpu.contract.environment import Device, inside_launched_worker
from multigpu.contract.errors import MultiGPUError, WorkerFailedError
from multigpu.contract.names import LAUNCHER_PID_ENV
from multigpu.otx import prepare as fm
from multigpu.otx.interrupt_caller import FailureDelivery, abort_collectives, hook_collective_errors
from multigpu.otx.rank_setup import (
    Member,
    become_rank_environ,
    child_entry,
    join_group,
    restore_environ,
    run_child,
)
from multigpu.otx.watcher import ChildWatcher
from multigpu.rank.guard import guard_parent
from multigpu.rendezvous.failure_sharing import finish_job, mark_done, serve_until_all_done
from multigpu.rendezvous.store import bind_store_socket, serve_store_on
from multigpu.runner.specs import AttemptContext, build_specs
from multigpu.runner.static_join import rendezvous

logger = logging.getLogger(__name__)

dist_timeout_s = fm.dist_timeout_s
TIMEOUT_ENV = fm.TIMEOUT_ENV


class MultiGPUManager:
    """Run ``train_func`` on several devices: this process is local rank 0, the others are spawned.

    ``device`` is ``"auto"`` (the GPUs; with none visible, multi-GPU training is not available and
    the caller trains in one process), ``"cuda"``, or ``"cpu"``, where ``gpu_ids`` name CPU worker
    slots and the backend is gloo.
    """

    def __init__(  # noqa: PLR0913, RUF100 - OTX's public signature (seed API), plus three keyword-only options
        self,
        train_func: Callable[..., Any],
        gpu_ids: str,
        rdzv_endpoint: str = "localhost:0",
        base_rank: int = 0,
        world_size: int = 0,
        start_time: datetime | None = None,
        *,
        device: str = "auto",
        timeout: float | None = None,
        grace_period: float = SupervisionConfig.grace_period,
    ) -> None:
        if not callable(train_func):
            raise ValueError(f"train_func must be callable, got {train_func!r}")
        wished = device_wish(device)
        requested = dedupe(parse_index_list(gpu_ids), what="gpu_ids")
        self._device: Device = "cpu" if wished == "cpu" else "cuda"
        # CPU: the ids name worker slots. GPUs: OTX's policy, one not visible is dropped with a warning.
        self._gpu_ids = requested if wished == "cpu" else keep_visible(requested, len(visible_gpus()))
        self._endpoint = parse_endpoint(rdzv_endpoint)
        self._world_size = fm.check_layout(  # the local count is the workers that will start
            self._endpoint, rdzv_endpoint, base_rank, world_size, len(self._gpu_ids)
        )
        self._train_func, self._base_rank = train_func, base_rank
        self._start_time, self._timeout, self._grace_period = start_time, timeout, grace_period
        self._state = "new"  # -> running -> finalized, or -> failed (setup raised; finalize is a no-op)
        self._undo = contextlib.ExitStack()
        self._children: ChildWatcher | None = None
        self._delivery = FailureDelivery()
        self._rdzv: Any = None
        self._store: Any = None
        self._previous_handlers: dict[int, Any] = {}
        self._previous_excepthook = sys.excepthook

    # ---- the seed's API ------------------------------------------------------------------------------

    def is_available(self) -> bool:
        """More than one usable device (GPUs; CPU slots only with ``device="cpu"``), not inside a worker."""
        return len(self._gpu_ids) > 1 and not inside_launched_worker()

    def setup_multi_gpu_train(self, output_path: str | None, optimized_hyper_parameters: Any = None) -> str:
        """Start local ranks 1..n-1, make this process rank ``base_rank``, and return the output path:
        ``output_path``, or (None) ``./multigpu_runs/<run id>``, where ``multigpu run`` would put it. The
        payload the children load is removed at ``finalize()``; the logs stay.

        ``optimized_hyper_parameters`` is a mapping of dotted names or OTX's ``ConfigurableParameters``;
        every rank sees them after ``params`` in its argv, and they are written to the output folder.
        """
        if self._state != "new":
            raise RuntimeError("setup_multi_gpu_train() was already called on this manager")
        self._state = "failed"  # until it has all worked: finalize() after a failed setup is a no-op
        keep_enabled()  # OTX's caller may have configured logging (dictConfig) after importing us
        node = f"rank{self._base_rank}" if self._world_size > len(self._gpu_ids) else None  # lock per node
        prepared = fm.prepare(output_path, optimized_hyper_parameters, self._train_func, node)
        try:
            with contextlib.ExitStack() as undo:
                undo.callback(prepared.remove_payload)  # last: once every child is gone
                self._start(prepared, undo)
                # A child that failed while setup ran could not be raised inside multigpu's own code;
                # raise it now, before setup counts as done: it is all or nothing, so the children
                # are stopped and everything is undone, and finalize() after it is a no-op.
                self._delivery.raise_pending()
                self._undo = undo.pop_all()
        except BaseException as exc:
            sys.argv[:] = prepared.argv_before
            error = self._delivery.error
            if error is not None and error is not exc:  # a child died first: that is the cause
                raise error from exc
            raise
        self._state = "running"
        return str(prepared.output_dir)

    def finalize(self, timeout: float | None = None) -> None:
        """Join the children (bounded); raise WorkerFailedError if any failed. Safe to call twice."""
        if self._state != "running":
            return
        self._state = "finalized"
        teardown: BaseException | None = None
        try:
            self._join_children(timeout)
        finally:
            try:
                self._undo.close()
            except Exception as exc:  # raised below, unless a failure explains it
                teardown = exc
        if self._delivery.error is not None:
            raise self._delivery.error
        crash = self._children.crash if self._children is not None else None
        if crash is not None:
            raise MultiGPUError(
                f"multigpu's supervisor thread crashed, so the children's outcome is unknown: {crash!r}"
            ) from crash
        if teardown is not None:
            raise teardown

    @staticmethod
    def check_parent_processes_alive() -> None:
        """The child's watchdog: end this process and its children within moments of the parent's death."""
        launcher = os.environ.get(LAUNCHER_PID_ENV)
        guard_parent(int(launcher) if launcher else os.getppid())

    @staticmethod
    def initialize_multigpu_train(
        rdzv_endpoint: str, rank: int, local_rank: int, gpu_ids: list[int], world_size: int
    ) -> bool:
        """Set this process's rank environment, pick its device, and init the default process group."""
        return join_group(rdzv_endpoint, Member(rank, local_rank, gpu_ids, world_size))

    @staticmethod
    def run_child_process(  # noqa: PLR0913, RUF100 - OTX's public signature (seed API)
        train_func: Callable[..., Any],
        output_path: str,
        rdzv_endpoint: str,
        rank: int,
        local_rank: int,
        gpu_ids: list[int],
        world_size: int,
    ) -> None:
        """What each spawned rank runs: fix its argv the OTX way, join the group, call ``train_func``."""
        MultiGPUManager.check_parent_processes_alive()
        run_child(train_func, output_path, rdzv_endpoint, Member(rank, local_rank, gpu_ids, world_size))

    # ---- setup: each step registers its undo ---------------------------------------------------------

    def _start(self, prepared: fm.Prepared, undo: contextlib.ExitStack) -> None:
        timeout = dist_timeout_s(self._start_time, self._timeout)
        layout = fm.Layout(self._device, self._gpu_ids, self._endpoint, self._base_rank, self._world_size)
        config = fm.function_config(prepared, layout, self._grace_period, timeout)
        sock = bind_store_socket(self._endpoint) if self._base_rank == 0 else None
        if sock is not None:
            undo.callback(sock.close)
        # This process is a rank too: torch imported as the user's environment says, before the store
        # (whose import_torch_quietly, for the CLI's launcher, then leaves c10's log level alone).
        import torch.distributed  # noqa: F401

        self._rdzv = rdzv = rendezvous(config, sock)  # no console writer here: its lines go to stderr
        undo.callback(setattr, self, "_rdzv", None)
        if rdzv.one_node:  # this process is rank 0 and serves the store
            assert sock is not None
            self._store = serve_store_on(sock, rdzv.master_addr, timeout_s=timeout)  # it owns the socket
            undo.callback(setattr, self, "_store", None)
        endpoint = format_endpoint(rdzv.master_addr, rdzv.master_port)
        out = prepared.output_dir
        self._write_payload(prepared, endpoint)
        specs = build_specs(
            config, AttemptContext(rdzv.run_id, out, 0, rdzv.master_addr, rdzv.master_port), os.environ
        )
        self._delivery = FailureDelivery(on_deliver=lambda: abort_collectives(fm.GROUP_SOCKETS))
        self._delivery.arm()
        undo.callback(self._delivery.disarm)
        undo.callback(hook_collective_errors(self._delivery))
        self._install_handlers(undo)
        undo.enter_context(caller_lines())
        undo.callback(restore_environ, become_rank_environ(rdzv.run_id, out, self._device, timeout))
        self._children = ChildWatcher(self._delivery, rdzv.job, self._grace_period)
        self._children.start(specs, undo)
        atexit.register(self._close_at_exit)
        undo.callback(atexit.unregister, self._close_at_exit)
        me = Member(self._base_rank, 0, self._gpu_ids, self._world_size)
        group = join_group(endpoint, me, failed=lambda: self._delivery.error)
        if group:
            undo.callback(_destroy_group)
            undo.callback(self._children.stop)  # runs first: no group teardown while children run

    def _write_payload(self, prepared: fm.Prepared, endpoint: str) -> None:
        """What every child loads: ``child_entry`` and its arguments (each child reads its own rank)."""
        entry_args = (
            MultiGPUManager.run_child_process,
            self._train_func,
            str(prepared.output_dir),
            endpoint,
            self._gpu_ids,
            self._world_size,
        )
        fm.write_inputs(prepared, child_entry, entry_args)

    def _install_handlers(self, undo: contextlib.ExitStack) -> None:
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        undo.callback(setattr, sys, "excepthook", self._previous_excepthook)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
                undo.callback(signal.signal, sig, self._previous_handlers[sig] or signal.SIG_DFL)

    # ---- running -------------------------------------------------------------------------------------

    def _join_children(self, timeout: float | None) -> None:
        bound = timeout if timeout is not None else dist_timeout_s(self._start_time, self._timeout)
        assert self._children is not None
        if not self._children.join(bound):
            self._children.stop()
            raise MultiGPUError(
                f"child processes were still running {bound:g}s after rank "
                f"{self._base_rank} finished; they were stopped"
            )
        job = self._rdzv.job if self._rdzv is not None else None
        if job is not None and self._delivery.error is None and self._children.crash is None:
            mark_done(job)
            if self._base_rank == 0:
                serve_until_all_done(job)  # the other nodes still need the store
            finish_job(job, hosts_store=self._base_rank == 0)  # the store's host goes last

    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        """An error in rank 0 is often a peer's death seen through a collective: show the root cause too."""
        self._delivery.disarm()  # this thread is ending: nothing more is raised into it
        self._previous_excepthook(exc_type, exc, tb)
        if self._children is not None:
            self._children.join(0.3)  # a child's failure already on its way is reported first
            self._children.stop()  # rank 0 itself failed: stop the children now
        error = self._delivery.error
        if error is not None and not isinstance(exc, WorkerFailedError):
            logger.error("root cause: %s", error)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Stop the children, then chain to whatever handler was there before."""
        if self._children is not None:
            self._children.request_signal(signum)
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            raise SystemExit(128 + signum)

    def _close_at_exit(self) -> None:
        if self._state == "running":
            self._state = "finalized"
            self._undo.close()


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
