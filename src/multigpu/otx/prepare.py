"""Function mode's checks before any child starts, the payload, and the run configuration handed to
the one spec builder. Runs in the caller's process (``MultiGPUManager``'s constructor and setup).

Everything that can fail is done before the first child starts (``prepare``): the output folder is
claimed and checked as ``multigpu run`` and ``launch(output=...)`` claim theirs (``record/folder.py``:
resolved through no other user's link, this user's own, locked against a second run) and written to,
``train_func`` and its arguments are pickled, the hyper-parameters are flattened. Only the
rendezvous, which needs the other nodes, and the process group, which needs the children, come
later; the manager undoes every step if they fail.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from multigpu.cluster.requeue import allocation_dir
from multigpu.config.endpoint import Endpoint
from multigpu.config.run import OutputConfig, RendezvousConfig, RunConfig, SupervisionConfig, new_run_id
from multigpu.contract.environment import Device
from multigpu.contract.errors import MultiGPUError
from multigpu.contract.files import create_file, open_folder, write_private
from multigpu.otx.argv import flatten_parameters, set_arguments_to_argv
from multigpu.otx.interrupt_caller import GroupSockets
from multigpu.record.folder import RunFolder, claim_output, resolve_output
from multigpu.rendezvous.store import DEFAULT_TIMEOUT_S

TIMEOUT_ENV = "MULTIGPU_DIST_TIMEOUT"
HPO_FILE = "optimized_hyper_parameters.json"
PAYLOAD_DIR = ".multigpu"
GROUP_SOCKETS = GroupSockets()
"""The connections of the process group this process created as rank 0 (cut to abort gloo)."""


def dist_timeout_s(
    start_time: datetime | None,
    explicit: float | None = None,
    env: Mapping[str, str] | None = None,
    now: datetime | None = None,
) -> float:
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
        raise ValueError(
            f"rdzv_endpoint {text!r}: port 0 is only allowed on a loopback host; "
            "give the port the other nodes will connect to"
        )
    if not isinstance(base_rank, int) or base_rank < 0:
        raise ValueError(f"base_rank must be an integer >= 0, got {base_rank!r}")
    if not isinstance(world_size, int) or world_size < 0:
        raise ValueError(f"world_size must be an integer >= 0 (0: the local count), got {world_size!r}")
    world = world_size or local
    if base_rank + local > world:
        raise ValueError(
            f"base_rank {base_rank} + {local} local worker(s) exceeds world_size {world}; "
            "raise world_size or lower base_rank"
        )
    if world > local and endpoint.port == 0:
        raise ValueError("a multi-node job needs a fixed rdzv_endpoint port")
    return world


@dataclass
class Prepared:
    """What ``prepare`` checked and produced; nothing has started yet."""

    output_dir: Path
    preparation: bytes
    hyper_parameters: dict[str, Any]
    argv_before: list[str]
    run_id: str | None = None
    """The run id the output folder is named after, when no ``output_path`` was given."""
    folder: RunFolder | None = field(default=None, repr=False)
    """The output folder's claim (its lock), held until the payload goes."""

    def remove_payload(self) -> None:
        """The payload folder goes once no child can still read it (``finalize``, a failed setup), and
        the folder's claim with it."""
        shutil.rmtree(self.output_dir / PAYLOAD_DIR, ignore_errors=True)
        if self.folder is not None:
            self.folder.release()


def output_folder(output_path: str | None, env: Mapping[str, str]) -> tuple[Path, str | None]:
    """``output_path``, or where ``multigpu run`` puts a run's record: ``./multigpu_runs/<run id>``
    (a requeued SLURM allocation's subfolder), never a temporary folder left behind at each call."""
    if output_path:
        return Path(output_path), None
    run_id = new_run_id()
    return allocation_dir(resolve_output(Path("multigpu_runs") / run_id), env), run_id


def prepare(
    output_path: str | None, params: Any, train_func: Callable[..., Any], node: str | None = None
) -> Prepared:
    """Check everything that can be checked before a child starts; change nothing but ``sys.argv``.

    ``sys.argv`` gains the hyper-parameters (after ``params``) before the spawn data captures it, so
    every rank sees them; ``argv_before`` lets the caller put it back. ``node``: this manager's lock
    in a folder the job's nodes share (``claim_output``).
    """
    given, run_id = output_folder(output_path, os.environ)
    out = resolve_output(given)
    folder = claim_output(out, run_id or "of MultiGPUManager", node)
    try:
        return _prepare_in(Prepared(out, b"", {}, list(sys.argv), run_id, folder), params, train_func)
    except BaseException:
        folder.release()
        raise


def _prepare_in(prepared: Prepared, params: Any, train_func: Callable[..., Any]) -> Prepared:
    out = prepared.output_dir
    try:
        os.close(open_folder(out / PAYLOAD_DIR, create=True, mode=0o700))
        probe = out / PAYLOAD_DIR / f"probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise MultiGPUError(f"output folder {str(out)!r} is not usable: {exc.strerror or exc}") from None
    prepared.hyper_parameters = hyper = flatten_parameters(params) if params else {}
    for name, value in hyper.items():
        set_arguments_to_argv(f"--{name}", str(value), after_params=True)
    try:
        prepared.preparation = _pickled(_spawn_preparation(), "the spawn data of __main__")
        _pickled(train_func, "train_func")
    except BaseException:
        sys.argv[:] = prepared.argv_before
        prepared.remove_payload()
        raise
    return prepared


def _spawn_preparation() -> dict[str, Any]:
    """Spawn semantics: what a child needs to re-import ``__main__`` as ``__mp_main__``."""
    from multiprocessing import spawn

    preparation: dict[str, Any] = spawn.get_preparation_data("multigpu-worker")
    preparation.pop("authkey", None)  # only for multiprocessing connections, which we do not use
    return preparation


def interactive_main() -> bool:
    """``__main__`` is a notebook kernel's or a REPL's (no file): a child cannot re-import it, so what
    it defines must travel by value."""
    return getattr(sys.modules.get("__main__"), "__file__", None) is None


def _pickled(obj: Any, what: str) -> bytes:
    """By reference, as ``multiprocessing`` pickles; from a notebook or a REPL, by value (cloudpickle)
    what ``__main__`` defines, which a child could not find by name."""
    try:
        if interactive_main():
            import cloudpickle

            return bytes(cloudpickle.dumps(obj))
        return pickle.dumps(obj)
    except Exception as exc:
        raise MultiGPUError(
            f"{what} cannot be sent to the child processes: {exc} (use a module-level "
            "function, picklable with everything it refers to)"
        ) from None


def write_inputs(prepared: Prepared, child: Callable[..., Any], args: tuple[Any, ...]) -> Path:
    """The payload every child loads, and the hyper-parameters as OTX writes them. The payload is code
    the ranks run: it is created anew, 0600, and each rank checks that before loading it
    (``rank/bootstrap.py``)."""
    payload = prepared.output_dir / PAYLOAD_DIR / "payload.pkl"
    write_private(payload, prepared.preparation + _pickled((child, args), "train_func's arguments"))
    if prepared.hyper_parameters:
        text = json.dumps(prepared.hyper_parameters, indent=2, default=str)
        with os.fdopen(create_file(prepared.output_dir / HPO_FILE), "w") as f:  # a planted link replaced
            f.write(text)
    return payload


@dataclass(frozen=True)
class Layout:
    """Where the manager's ranks sit: its constructor's arguments, checked (``check_layout``)."""

    device: Device
    gpu_ids: list[int]
    endpoint: Endpoint
    base_rank: int
    world_size: int


def function_config(prepared: Prepared, layout: Layout, grace_period: float, timeout: float) -> RunConfig:
    """The run as ``multigpu run`` would see it: the same rendezvous and spec builder take it from here.
    A folder named after its run id gives node 0's rendezvous that id (the other nodes adopt node 0's)."""
    device, gpu_ids = layout.device, layout.gpu_ids
    run_id = prepared.run_id if layout.base_rank == 0 else None
    return RunConfig(
        target=str(prepared.output_dir / PAYLOAD_DIR / "payload.pkl"),
        function=True,
        first_local_rank=1,
        device=device,
        nproc=len(gpu_ids),
        gpus=tuple(gpu_ids) if device == "cuda" else (),
        base_rank=layout.base_rank,
        world_size=layout.world_size,
        rdzv=RendezvousConfig(endpoint=layout.endpoint),
        supervision=SupervisionConfig(grace_period=grace_period),
        output=OutputConfig(dir=prepared.output_dir, run_id=run_id, status="off"),
        extra_env={TIMEOUT_ENV: os.environ.get(TIMEOUT_ENV, str(timeout))},
    )
