"""Function mode's pieces around ``MultiGPUManager``: checks before any child starts, the payload, the
run configuration handed to the one spec builder, and what makes a process a rank.

Everything that can fail is done before the first child starts (``prepare``): the output folder is
created and written to, ``train_func`` and its arguments are pickled, the hyper-parameters are
flattened. Only the rendezvous, which needs the other nodes, and the process group, which needs the
children, come later; the manager undoes every step if they fail.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from .argv import flatten_parameters, remove_option, set_arguments_to_argv
from .config import RunConfig
from .delivery import GroupSockets
from .endpoint import Endpoint, parse_endpoint
from .environment import CONTRACT_KEYS, JobContext, RankPlacement, rank_env
from .errors import MultiGPUError, WorkerFailure, signal_name
from .rendezvous import DEFAULT_TIMEOUT_S
from .supervisor import Worker

TIMEOUT_ENV = "MULTIGPU_DIST_TIMEOUT"
RDZV_TIMEOUT_S = 600.0  # how long nodes wait for each other, as `multigpu run --rdzv-timeout`
HPO_FILE = "optimized_hyper_parameters.json"
PAYLOAD_DIR = ".multigpu"
GROUP_SOCKETS = GroupSockets()
"""The connections of the process group this process created as rank 0 (cut to abort gloo)."""


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


def check_layout(endpoint: Endpoint, text: str, base_rank: Any, world_size: Any, local: int) -> int:
    """The constructor's checks of the job's shape; the world size (0: the local count)."""
    if endpoint.port == 0 and not endpoint.is_loopback:
        raise ValueError(f"rdzv_endpoint {text!r}: port 0 is only allowed on a loopback host; "
                         "give the port the other nodes will connect to")
    if not isinstance(base_rank, int) or base_rank < 0:
        raise ValueError(f"base_rank must be an integer >= 0, got {base_rank!r}")
    if not isinstance(world_size, int) or world_size < 0:
        raise ValueError(f"world_size must be an integer >= 0 (0: the local count), got {world_size!r}")
    world = world_size or local
    if base_rank + local > world:
        raise ValueError(f"base_rank {base_rank} + {local} local worker(s) exceeds world_size {world}; "
                         "raise world_size or lower base_rank")
    if world > local and endpoint.port == 0:
        raise ValueError("a multi-node job needs a fixed rdzv_endpoint port")
    return world


def become_rank_environ(run_id: str, out: Path, device: str, timeout: float) -> dict[str, str | None]:
    """The job's keys in this process's environment; returns what to restore."""
    saved = {key: os.environ.get(key) for key in (*CONTRACT_KEYS, TIMEOUT_ENV)}
    os.environ.setdefault(TIMEOUT_ENV, str(timeout))
    os.environ.update(MULTIGPU_RUN_ID=run_id, TORCHELASTIC_RUN_ID=run_id, MULTIGPU_OUTPUT_DIR=str(out),
                      MULTIGPU_DEVICE=device)
    return saved


def restore_environ(saved: dict[str, str | None]) -> None:
    """Undo what made this process a rank, so a later manager in it (HPO, say) starts afresh."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def announced_failure(worker: Worker) -> WorkerFailure:
    """A child that announced its failure is exiting with code 1; its record says why."""
    record = WorkerFailure.read(worker.spec.error_file) or WorkerFailure(rank=-1, local_rank=-1, pid=None)
    return WorkerFailure(
        rank=worker.rank, local_rank=worker.spec.local_rank, pid=worker.pid, exit_code=1,
        node=worker.spec.node, error_type=record.error_type, message=record.message,
        traceback=record.traceback, time=record.time,
        log_path=str(worker.spec.log_path) if worker.spec.log_path else None)


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
        if worker.failure is not None:
            return worker.failure
        try:
            info = os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        if info is None or (info.si_code == os.CLD_EXITED and info.si_status == 0):
            continue
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        record = WorkerFailure.read(worker.spec.error_file)
        return WorkerFailure(
            rank=worker.rank, local_rank=worker.spec.local_rank, pid=worker.pid, node=worker.spec.node,
            exit_code=None if killed else info.si_status,
            signal=signal_name(info.si_status) if killed else None,
            error_type=record.error_type if record else None, message=record.message if record else None,
            traceback=record.traceback if record else None, time=record.time if record else None,
            log_path=str(worker.spec.log_path) if worker.spec.log_path else None)
    return None


@dataclass
class Prepared:
    """What ``prepare`` checked and produced; nothing has started yet."""

    output_dir: Path
    preparation: bytes
    hyper_parameters: dict[str, Any]
    argv_before: list[str]


def prepare(output_path: str | None, params: Any, train_func: Callable[..., Any]) -> Prepared:
    """Check everything that can be checked before a child starts; change nothing but ``sys.argv``.

    ``sys.argv`` gains the hyper-parameters (after ``params``) before the spawn data captures it, so
    every rank sees them; ``argv_before`` lets the caller put it back.
    """
    out = Path(output_path) if output_path else Path(tempfile.mkdtemp(prefix="multigpu-"))
    try:
        (out / PAYLOAD_DIR).mkdir(parents=True, exist_ok=True)
        probe = out / PAYLOAD_DIR / f"probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise MultiGPUError(f"output folder {str(out)!r} is not usable: {exc.strerror or exc}") from None
    hyper = flatten_parameters(params) if params else {}
    argv_before = list(sys.argv)
    for name, value in hyper.items():
        set_arguments_to_argv(f"--{name}", str(value), after_params=True)
    try:
        preparation = _pickled(_spawn_preparation(), "the spawn data of __main__")
        _pickled(train_func, "train_func")
    except BaseException:
        sys.argv[:] = argv_before
        raise
    return Prepared(out.resolve(), preparation, hyper, argv_before)


def _spawn_preparation() -> dict[str, Any]:
    """Spawn semantics: what a child needs to re-import ``__main__`` as ``__mp_main__``."""
    from multiprocessing import spawn

    preparation: dict[str, Any] = spawn.get_preparation_data("multigpu-worker")
    preparation.pop("authkey", None)  # only for multiprocessing connections, which we do not use
    return preparation


def _pickled(obj: Any, what: str) -> bytes:
    try:
        return pickle.dumps(obj)
    except Exception as exc:
        raise MultiGPUError(f"{what} cannot be sent to the child processes: {exc} (use a module-level "
                            "function, picklable with everything it refers to)") from None


def write_inputs(prepared: Prepared, child: Callable[..., Any], args: tuple[Any, ...]) -> Path:
    """The payload every child loads, and the hyper-parameters as OTX writes them."""
    payload = prepared.output_dir / PAYLOAD_DIR / "payload.pkl"
    payload.write_bytes(prepared.preparation + _pickled((child, args), "train_func's arguments"))
    if prepared.hyper_parameters:
        (prepared.output_dir / HPO_FILE).write_text(json.dumps(prepared.hyper_parameters, indent=2,
                                                               default=str))
    return payload


def function_config(*, payload: Path, output_dir: Path, device: str, gpu_ids: list[int],
                    endpoint: Endpoint, base_rank: int, world_size: int, grace_period: float,
                    timeout: float) -> RunConfig:
    """The run as ``multigpu run`` would see it: the same rendezvous and spec builder take it from here."""
    return RunConfig(
        target=str(payload), function=True, first_local_rank=1, device=device, nproc=len(gpu_ids),
        gpus=tuple(gpu_ids) if device == "cuda" else (), output_dir=output_dir, rdzv_endpoint=endpoint,
        rdzv_timeout=RDZV_TIMEOUT_S, base_rank=base_rank, world_size=world_size, grace_period=grace_period,
        status="off", extra_env={TIMEOUT_ENV: os.environ.get(TIMEOUT_ENV, str(timeout))})


def become_rank(rdzv_endpoint: str, rank: int, local_rank: int, gpu_ids: list[int], world_size: int) -> bool:
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
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    try:
        with GROUP_SOCKETS.recording(store_port=endpoint.port):
            dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timeout)
    except BaseException:
        if not dist.is_initialized():
            # A failed init leaves torch's group counter advanced, so a later group in this process
            # would be named differently from its fresh peers' and never meet them. Destroying the
            # world resets it; with no world to destroy, reset it the same way.
            dist.distributed_c10d._world.group_count = 0
        raise
    return True


def run_child(train_func: Callable[..., Any], output_path: str, rdzv_endpoint: str, rank: int,
              local_rank: int, gpu_ids: list[int], world_size: int) -> None:
    """What each spawned rank runs: fix its argv the OTX way, join the group, call ``train_func``."""
    sys.argv = remove_option(sys.argv, "--gpus")
    sys.argv = remove_option(sys.argv, "--enable-hpo", takes_value=False)
    set_arguments_to_argv(["--output", "-o"], output_path)
    set_arguments_to_argv("--rdzv-endpoint", rdzv_endpoint)
    become_rank(rdzv_endpoint, rank, local_rank, gpu_ids, world_size)
    train_func()
    import torch.distributed as dist

    if dist.is_initialized():  # only after success: a failing rank's bootstrap announces first
        dist.destroy_process_group()


def child_entry(run_child_process: Callable[..., None], train_func: Callable[..., Any], output_path: str,
                rdzv_endpoint: str, gpu_ids: list[int], world_size: int) -> None:
    """The payload's call: one payload for every child, each reading its own rank from its environment."""
    run_child_process(train_func, output_path, rdzv_endpoint, int(os.environ["RANK"]),
                      int(os.environ["LOCAL_RANK"]), gpu_ids, world_size)
