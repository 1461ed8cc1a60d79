"""The supervisor's vocabulary: worker and run states, the spec a rank starts from, a rank's live
record (``Worker``) and an attempt's result. ``supervisor`` re-exports every name here.

Worker states::

    PENDING -> RUNNING -> SUCCEEDED | FAILED      (the rank's own exit)
                       -> STOPPED                 (ended by the launcher's teardown)
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .errors import WorkerFailure
from .hang import RankProgress
from .output import LineCopy
from .progress import BeatDecoder
from .spawning import ProcessHandle

LOG_TAIL_LINES = 20


class WorkerState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class RunStatus(str, enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    HUNG = "hung"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one rank; built by the launcher, never changed by the supervisor."""

    rank: int
    local_rank: int
    argv: list[str]
    env: dict[str, str]
    device: str = "cpu"
    node: int = 0
    log_path: Path | None = None
    error_file: Path | None = None
    pass_fds: tuple[int, ...] = ()
    cwd: str | None = None
    stream_files: Mapping[str, Path] = field(default_factory=dict)
    """"stdout"/"stderr" -> a file that gets exactly that stream's bytes (torchrun's --log-dir files)."""
    console_streams: frozenset[str] = frozenset({"stdout", "stderr"})
    """The streams shown on the console (torchrun's --redirects without --tee hides one)."""
    line_copies: tuple[LineCopy, ...] = ()
    """Matching lines copied to a file the attempt's ranks share (torchrun's --duplicate-*-filters)."""


@dataclass
class Worker:
    spec: WorkerSpec
    state: WorkerState = WorkerState.PENDING
    popen: ProcessHandle | None = None
    pidfd: int | None = None
    start_time: float | None = None
    end_time: float | None = None
    returncode: int | None = None
    last_output: float = 0.0
    failure: WorkerFailure | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    open_streams: int = 0
    heartbeat_read_fd: int | None = None
    capture: list[str] | None = None
    group_open: bool = True
    dump: list[str] = field(default_factory=list)
    progress: RankProgress | None = None
    """Its steps and sections (``hang.ProgressBook``), for the live view."""
    decoder: BeatDecoder = field(default_factory=BeatDecoder)
    recorded: bool = False
    """It wrote its flight-recorder dump after the last request."""
    finished: bool = False
    """The bootstrap said its script returned and everything it left to do at exit is done."""
    late_death: str | None = None
    """How a finished rank's process ended badly anyway (torch's exit-time abort), for the report."""
    unkillable: bool = False

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def alive(self) -> bool:
        return self.state is WorkerState.RUNNING and self.returncode is None


@dataclass
class RunResult:
    status: RunStatus
    failures: list[WorkerFailure] = field(default_factory=list)
    signal: int | None = None

    @property
    def root_cause(self) -> WorkerFailure | None:
        return self.failures[0] if self.failures else None


class SupervisorListener(Protocol):
    def on_worker_change(self, worker: Worker) -> None: ...


def read_error_file(path: Path | None) -> dict[str, Any] | None:
    """The rank's record (``WorkerFailure.read``: ours or torch's ``@record``), as the keys read here."""
    record = WorkerFailure.read(path)
    if record is None:
        return None
    return {"type": record.error_type, "message": record.message, "traceback": record.traceback,
            "time": record.time, "pid": record.pid}
