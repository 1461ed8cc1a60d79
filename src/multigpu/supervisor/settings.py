"""How a supervisor is set up: its timing (``SupervisorOptions``) and what it calls back (``Hooks``).

Runs in the launcher and in OTX's caller, wherever a ``Supervisor`` is built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from multigpu.config.run import SupervisionConfig
from multigpu.console.writer import Console
from multigpu.supervisor.control import ControlSocket
from multigpu.supervisor.file_timer import TimerKills
from multigpu.supervisor.states import SupervisorListener, Worker

if TYPE_CHECKING:
    from multigpu.supervisor.hangs.verdict import HangExchange


@dataclass(frozen=True)
class SupervisorOptions:
    """How the supervisor times its work; tests shorten these, the launcher takes the run's config."""

    grace_period: float = SupervisionConfig.grace_period
    hang_timeout: float | None = None
    """The ceiling of a default ``ProgressBook`` (a given book has its own policy)."""
    tick_period: float = 0.5
    dump_wait: float = 0.5
    """How long a stack-dump request waits for the ranks' answers."""
    clock: Callable[[], float] = time.monotonic
    reap_orphans: bool = False
    """The launcher is a child subreaper: end and reap descendants that left their group."""
    hold_peer_losses: bool = False
    """A job of several nodes: a rank's traceback that only says a peer's connection closed waits off
    the console until the attempt's root cause is known (``Supervisor.settle_peer_losses``)."""


@dataclass(frozen=True)
class Hooks:
    """What the supervisor calls back, all optional: called on the loop's thread, never in a handler.
    Its own lines it logs (``console/log.py`` shows them: on a run's console, else on stderr)."""

    listener: SupervisorListener | None = None
    tick: Callable[[], None] | None = None
    console: Console = field(default_factory=Console)
    """``multigpu run``: the console the ranks' lines go through; their pipes wait while its writer is
    congested (``output.WorkerOutput.hold``). Function mode has no writer."""
    on_failing: Callable[[Worker], None] | None = None
    """Function mode: a rank said it is failing (its record is written), before it exits."""
    control: ControlSocket | None = None
    """``multigpu run``: where ``multigpu stacks`` and ``multigpu status`` ask (``control.py``)."""
    guard: Callable[[int, int], bool] | None = None
    """``multigpu run``: hand each started rank (pid, pidfd) to the node's sentinel
    (``sentinel.NodeSentinel.watch``); its ranks then fork no sentinel of their own."""
    job_hang: HangExchange | None = None
    """A job of several nodes: a hang is declared for the job and judged from every node's stacks
    (``hangs/verdict.py``; the job's store behind it)."""
    timer: TimerKills | None = None
    """``multigpu run`` with ``TORCHELASTIC_ENABLE_FILE_TIMER=1``: the kills of the node's file timer,
    named as a rank's killer (``file_timer.py``)."""
