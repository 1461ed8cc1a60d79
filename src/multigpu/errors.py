"""Typed errors: a usage mistake, a rendezvous problem, or workers that failed."""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass, field
from typing import Any


class MultiGPUError(Exception):
    """Base of every error multigpu raises on purpose."""


class UsageError(MultiGPUError, ValueError):
    """Bad input from the user; the CLI prints it as one line and exits 2. Never retried."""


class RendezvousError(MultiGPUError):
    """The group could not be formed: a port is taken, peers never came, or layouts disagree."""


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class WorkerFailure:
    """Why one rank ended badly; enough to debug it without opening another file."""

    rank: int
    local_rank: int
    pid: int | None
    exit_code: int | None = None
    signal: str | None = None
    node: int = 0
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    time: float | None = None
    log_tail: list[str] = field(default_factory=list)
    log_path: str | None = None

    @property
    def launcher_exit_code(self) -> int:
        """The launcher's exit code for this root cause: the rank's own, or 128 + N for signal N."""
        if self.signal is not None:
            try:
                return 128 + int(signal.Signals[self.signal])
            except KeyError:
                return 1
        return self.exit_code if self.exit_code else 1

    def describe(self) -> str:
        how = f"was killed by {self.signal}" if self.signal else f"exited with code {self.exit_code}"
        what = f": {self.error_type}: {self.message}" if self.error_type else ""
        return f"rank {self.rank} (node {self.node}, pid {self.pid}) {how}{what}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class WorkerFailedError(MultiGPUError):
    """One or more ranks failed; ``root_cause`` is the first failure in time."""

    def __init__(self, root_cause: WorkerFailure, others: list[WorkerFailure] | None = None) -> None:
        self.root_cause = root_cause
        self.others = others or []
        text = root_cause.describe()
        if root_cause.traceback:
            text += "\n" + root_cause.traceback.rstrip()
        super().__init__(text)

    @property
    def rank(self) -> int:
        return self.root_cause.rank

    @property
    def exit_code(self) -> int | None:
        return self.root_cause.exit_code

    @property
    def signal(self) -> str | None:
        return self.root_cause.signal

    @property
    def traceback(self) -> str | None:
        return self.root_cause.traceback
