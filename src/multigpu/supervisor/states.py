"""The supervisor's vocabulary: worker and run states, the spec a rank starts from, a rank's live
record (``Worker``, the launcher's record of one rank) and an attempt's result.

The bottom of ``supervisor/``: it imports none of the modules that use it, only ``contract``. Runs
in the launcher and in OTX's caller.

Worker states (``MOVES``; ``Worker.to`` is the one writer of a rank's state)::

    PENDING -> RUNNING                            (its process exists: ``spawning.bring_up``)
    RUNNING -> SUCCEEDED | FAILED | STOPPED       (its exit judged: ``exits.settle``)
    RUNNING -> STOPPED                            (it outlived SIGKILL: ``reaping.reap_killed``)

SUCCEEDED, FAILED and STOPPED are final. A rank that never started stays PENDING.
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from multigpu.contract.beats import BeatDecoder
from multigpu.contract.failure import RankIdentity, Subject, WorkerFailure, exit_status, exit_text
from multigpu.supervisor.oom import OomWatch

LOG_TAIL_LINES = 20


class WorkerState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


MOVES: Mapping[WorkerState, frozenset[WorkerState]] = {
    WorkerState.PENDING: frozenset({WorkerState.RUNNING}),
    WorkerState.RUNNING: frozenset({WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED}),
    WorkerState.SUCCEEDED: frozenset(),
    WorkerState.FAILED: frozenset(),
    WorkerState.STOPPED: frozenset(),
}
"""The state a rank may go to from each state (the module docstring draws them)."""


class IllegalMove(RuntimeError):
    """A rank asked to go where ``MOVES`` does not lead: a bug of the supervisor's, never a rank's."""


class RunStatus(str, enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    HUNG = "hung"
    INTERRUPTED = "interrupted"


class ProcessHandle(Protocol):
    """The part of ``subprocess.Popen`` the supervisor uses."""

    pid: int
    returncode: int | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass(frozen=True)
class LineCopy:
    """torchrun's ``--duplicate-std{out,err}-filters``: a rank's lines of ``stream`` that contain any of
    ``needles`` also go, after ``header``, to ``path``, one file shared by every rank of the attempt."""

    stream: str
    path: Path
    needles: tuple[bytes, ...]
    header: bytes

    def matching(self, lines: Iterable[bytes]) -> bytes:
        return b"".join(
            self.header + line + b"\n" for line in lines if any(needle in line for needle in self.needles)
        )


WINDOW = 100
"""Step intervals and section times kept per rank (medians, stragglers)."""


@dataclass
class RankProgress:
    """What one rank has reported in this attempt."""

    rank: int
    last_progress: float
    last_output: float
    beats: bool = False
    step: int | None = None
    step_at: float | None = None
    first_step_at: float | None = None
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    section: str | None = None
    section_times: dict[str, deque[float]] = field(default_factory=dict)
    finished: bool = False
    pid: int | None = None
    node: int = 0
    late_s: float | None = None
    """How late it enters collectives against the node's other ranks (``lateness.py``), when known."""
    straggling: bool = False

    @property
    def reports_steps(self) -> bool:
        return self.step is not None

    def median_interval(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None

    def stats(self, wall_offset: float) -> dict[str, Any]:
        """Per-rank step times for run.json; times are wall-clock (``wall_offset`` + clock)."""
        step_at = None if self.step_at is None else self.step_at + wall_offset
        first = None if self.first_step_at is None else self.first_step_at + wall_offset
        data: dict[str, Any] = {
            "step": self.step,
            "last_step_time": step_at,
            "first_step_time": first,
            "last_progress_time": self.last_progress + wall_offset,
            "median_step_s": rounded(self.median_interval()),
            "slowest_step_s": rounded(max(self.intervals, default=None)),
        }
        if self.section_times:
            data["sections"] = {
                name: {
                    "median_s": rounded(statistics.median(times)),
                    "slowest_s": rounded(max(times)),
                    "count": len(times),
                }
                for name, times in self.section_times.items()
                if times
            }
        return data


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


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
    cwd: str | None = None
    stream_files: Mapping[str, Path] = field(default_factory=dict)
    """"stdout"/"stderr" -> a file that gets exactly that stream's bytes (torchrun's --log-dir files)."""
    console_streams: frozenset[str] = frozenset({"stdout", "stderr"})
    """The streams shown on the console (torchrun's --redirects without --tee hides one)."""
    line_copies: tuple[LineCopy, ...] = ()
    """Matching lines copied to a file the attempt's ranks share (torchrun's --duplicate-*-filters)."""
    title: str = ""
    """What the launcher's lines call it where it is not a rank (the node's preflight check); empty:
    ``rank N``."""


@dataclass
class Lines:
    """What the supervisor keeps of a rank's output (``output.WorkerOutput`` reads its pipes)."""

    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    """Its last lines, for its failure's record and the report."""
    last_at: float = 0.0
    """When it last wrote anything (the loop's clock)."""
    muted: bool = False
    """Its lines go to its log only: the attempt already failed (what it says now is a consequence,
    named in the report) or it is dumping its stacks (shown by the report where they are the point)."""


@dataclass
class Dumps:
    """What it gave for the last dump request (``stack_dumps.DumpRequest``)."""

    stacks: list[str] = field(default_factory=list)
    """The lines it wrote while the last request ran: its stacks."""
    capture: list[str] | None = None
    """Where its lines are collected while a request runs (None: no request running)."""
    recorded: bool = False
    """It wrote its flight-recorder dump after the last request."""
    stacked: bool = False
    """Its dump thread wrote its stacks after the last request (all of them are in its stderr pipe)."""


@dataclass
class Ending:
    """How it ended, beyond its exit status: for the report, run.json and the error files."""

    failure: WorkerFailure | None = None
    late_death: str | None = None
    """How a finished rank's process ended badly anyway (torch's exit-time abort), for the report."""
    unkillable: bool = False
    """It outlived SIGKILL (uninterruptible sleep) and was left behind."""


@dataclass
class Worker:
    """The launcher's record of one rank: its process and descriptors, its progress, what it wrote
    (``lines``), what it gave for a dump (``dumps``) and how it ended (``ending``)."""

    spec: WorkerSpec
    state: WorkerState = WorkerState.PENDING
    """Written by ``to`` only, along ``MOVES``."""
    popen: ProcessHandle | None = None
    pidfd: int | None = None
    heartbeat_read_fd: int | None = None
    start_time: float | None = None
    end_time: float | None = None
    returncode: int | None = None
    oom: OomWatch | None = None
    """Its memory cgroup's OOM-kill count at its start (``oom.py``): read again if it dies of SIGKILL."""
    group_open: bool = True
    progress: RankProgress | None = None
    """Its steps and sections (``book.ProgressBook``), for the live view."""
    decoder: BeatDecoder = field(default_factory=BeatDecoder)
    finished: bool = False
    """The bootstrap said its script returned and everything it left to do at exit is done."""
    lines: Lines = field(default_factory=Lines)
    dumps: Dumps = field(default_factory=Dumps)
    ending: Ending = field(default_factory=Ending)

    def to(self, state: WorkerState) -> None:
        """Move to ``state``; ``IllegalMove`` where ``MOVES`` does not lead there."""
        if state not in MOVES[self.state]:
            raise IllegalMove(
                f"rank {self.rank}: {self.state.value} -> {state.value} is not a move a rank makes"
            )
        self.state = state

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def title(self) -> str:
        """How the launcher's lines name it: ``rank N``, or its spec's title."""
        return self.spec.title or f"rank {self.spec.rank}"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def alive(self) -> bool:
        return self.state is WorkerState.RUNNING and self.returncode is None

    def exit_status(self) -> tuple[int | None, str | None]:
        """(exit code, signal name), the one reading that run.json, the summary, the report and the
        error files give: its failure's when it has one (a rank that raised and was then cut short by
        the teardown counts as exit 1: the exception is what it did), else its exit status."""
        failure = self.ending.failure
        if failure is not None:
            return failure.exit_code, failure.signal
        return exit_status(self.returncode)

    @property
    def exit_text(self) -> str:
        return exit_text(*self.exit_status())

    def own_record(self) -> WorkerFailure | None:
        """The error record this very process wrote (never an earlier run's file at the same path)."""
        path = self.spec.error_file
        record = WorkerFailure.read(path)
        if record is None or path is None:
            return None
        if record.pid is not None:
            return record if record.pid == self.pid else None
        try:  # torch's @record format carries no pid: it must at least be newer than the process
            fresh = path.stat().st_mtime >= (self.start_time or 0) - 1.0
        except OSError:
            return None
        return record if fresh else None

    def ended_with(
        self, returncode: int | None, record: WorkerFailure | None = None, *, with_tail: bool = True
    ) -> WorkerFailure:
        """This rank's failure from its exit status and its record (``WorkerFailure.from_exit``), with
        the last lines it wrote unless another thread may be adding to them (``with_tail=False``)."""
        spec = self.spec
        return WorkerFailure.from_exit(
            RankIdentity(spec.rank, spec.local_rank, spec.node, self.pid),
            returncode,
            record,
            log_path=str(spec.log_path) if spec.log_path else None,
            log_tail=list(self.lines.tail) if with_tail else [],
        )


@dataclass
class RunResult:
    status: RunStatus
    failures: list[WorkerFailure] = field(default_factory=list)
    signal: int | None = None
    detected_time: float | None = None
    """When the launcher learned the attempt's outcome (a failure reaped, a hang declared, a stop
    signal handled): wall clock, for the incident timeline."""

    @property
    def root_cause(self) -> WorkerFailure | None:
        """The first failure seen, unless it only reports a peer's death and a later one is that peer's
        own (a rank SIGKILLed by the OOM killer is often reaped just after a peer that it cut off), or
        the loss of the peer's whole node."""
        first = next(iter(self.failures), None)
        if first is not None and first.saw_a_peer_die:
            own = next((f for f in self.failures if f.subject is Subject.RANK and not f.saw_a_peer_die), None)
            # else a lost node (or store), even when its silence was first seen after our rank failed
            return own or next((f for f in self.failures if f.subject is not Subject.RANK), first)
        return first


class SupervisorListener(Protocol):
    def on_workers_change(self, workers: Sequence[Worker]) -> None: ...
