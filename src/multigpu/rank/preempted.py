"""The rank's side of a preemption warning: ``multigpu.preempted()`` and ``multigpu.should_stop(step)``.

SLURM warns a job before its time limit or a preemption with a signal (``--signal=USR1@90``); the
launcher passes it to every rank, on every node (a node whose launcher missed it learns it from the
job's store and passes it on). The bootstrap installs a handler for the warning signals named in
``MULTIGPU_WARNING_SIGNALS`` that only records the arrival, so a script that knows nothing of it runs
on instead of dying of the signal.

Stopping is the training loop's choice, and every rank must stop at the same step: a rank that leaves
while its peers enter the next step's collective hangs them (Lightning's SLURM requeue deadlock).
``should_stop(step)``, called at every step boundary, agrees on that step through the job's c10d
store without ever blocking on a peer:

* before any warning it is a flag test: no store call, nothing else;
* once this rank has seen the warning, it writes the step it is at and counts itself in (two store
  calls, once); from then on one store call per step asks whether every rank has counted itself in;
* when all have, it reads every rank's step once; the stop step is ``max(steps) + 2`` and it returns
  True at every step from there on.

Why ``+ 2`` and not the maximum itself: a rank that wrote early keeps stepping while it waits for the
count, and may be inside step ``max`` when the last rank writes ``max``; stopping at ``max`` would leave
it in that step's collective. No rank can finish step ``max`` before the last writer has passed it, so
none can pass ``max + 1`` unseen; and every rank's check at ``max + 1`` comes after the count is
complete, so each learns the stop step before any rank leaves (on one machine rank 0 hosts the store:
it must not be gone while a peer still asks). This holds for loops whose every step has a collective
over all ranks (DDP, FSDP) and that call ``should_stop`` at every step with the same step numbers.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import Any, Protocol

from multigpu.contract.names import WARNING_SIGNALS_ENV
from multigpu.contract.values import signal_numbers

STOP_MARGIN = 2
STORE_TIMEOUT_S = 60.0


class Store(Protocol):
    """The part of torch's c10d store this module uses (a dict-backed fake in the tests)."""

    def set(self, key: str, value: str) -> None: ...
    def add(self, key: str, amount: int) -> int: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...


@dataclass
class _State:
    signum: int | None = None
    """The warning signal, once it arrived."""
    time: float | None = None
    written: int | None = None
    """The step this rank wrote to the store."""
    stop: int | None = None
    store: Any = None
    env: Mapping[str, str] = field(default_factory=lambda: os.environ)


_state = _State()


def _record(signum: int, frame: FrameType | None) -> None:
    """The handler: record, nothing else (the loop decides what to do, at a step boundary)."""
    if _state.signum is None:
        _state.signum, _state.time = signum, time.time()


def install(env: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """Called by the bootstrap before user code: record the warning signals instead of dying of them.

    A signal that is ignored at start (``nohup``) stays ignored; the user's own handler, installed
    later, replaces this one (and then ``preempted()`` knows only what that handler tells it).
    """
    env = os.environ if env is None else env
    try:
        signals = signal_numbers(env.get(WARNING_SIGNALS_ENV, ""), WARNING_SIGNALS_ENV)
    except ValueError:
        return ()
    installed = []
    for signum in signals:
        if signal.getsignal(signum) is signal.SIG_IGN:
            continue
        signal.signal(signum, _record)
        installed.append(signum)
    return tuple(installed)


def preempted() -> bool:
    """True once this rank has received the preemption warning. Cheap: a flag."""
    return _state.signum is not None


def should_stop(step: int) -> bool:
    """True when the training loop should save and leave *before* running ``step``.

    Call it at every step boundary, with the same step numbers on every rank; every rank gets True at
    the same step. Before a warning it costs a flag test; after one, one store call per step until
    every rank has seen the warning, then nothing (see the module docstring).
    """
    state = _state
    if state.stop is not None:
        return step >= state.stop
    if state.signum is None:
        return False
    try:
        return _agree(state, step)
    except Exception as exc:  # the store is gone: the job is ending anyway; save what this rank can
        print(
            f"multigpu: cannot agree on a stop step through the store ({exc}); stopping at step {step}",
            file=sys.stderr,
            flush=True,
        )
        state.stop = step
        return True


def _agree(state: _State, step: int) -> bool:
    store, prefix, world = _store(state), _prefix(state.env), int(state.env.get("WORLD_SIZE", "1"))
    if state.written is None:
        store.set(f"{prefix}/step/{state.env.get('RANK', '0')}", str(step))
        state.written = step
        counted = store.add(f"{prefix}/count", 1)
    else:
        counted = store.add(f"{prefix}/count", 0)
    if counted < world:
        return False
    steps = store.multi_get([f"{prefix}/step/{rank}" for rank in range(world)])
    state.stop = max(int(value) for value in steps) + STOP_MARGIN
    return step >= state.stop


def _prefix(env: Mapping[str, str]) -> str:
    """Per run and attempt: a restarted attempt (which gets a fresh store anyway) never reads old keys."""
    return f"multigpu/stop/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('MULTIGPU_ATTEMPT', '0')}"


def _store(state: _State) -> Any:
    if state.store is None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        state.store = TCPStore(
            state.env["MASTER_ADDR"],
            int(state.env["MASTER_PORT"]),
            None,
            False,
            timedelta(seconds=STORE_TIMEOUT_S),
        )
    return state.store
