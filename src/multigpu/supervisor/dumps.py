"""What a stuck rank can still tell: its Python stacks (faulthandler, on ``DUMP_SIGNAL``) and, where
the flight recorder is armed, torch's record of its last collectives (on ``FR_SIGNAL``).

The supervisor asks with ``DumpRequest``, keeps running its loop (the stacks arrive on the ranks'
stderr pipes, the "dumped" beat on their heartbeat pipes) until ``done()``, then ``finish()`` hands
each rank its captured lines. ``flight_record`` reads the dumps written since the request.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence

from multigpu.contract.names import FR_DUMP_ENV
from multigpu.contract.signals import DUMP_SIGNAL, FR_SIGNAL
from multigpu.supervisor.flight_record import Finding, missing_ranks, read_dumps
from multigpu.supervisor.states import Worker

FR_WAIT_S = 3.0
"""How long a request waits for the ranks' flight-recorder dumps (stacks: the supervisor's dump_wait)."""
QUIET_S = 0.03
"""A rank's stack dump is complete once its output has been quiet this long."""


class DumpRequest:
    """One round of dumps from the live ranks in ``targets``."""

    def __init__(self, targets: Sequence[Worker], clock: Callable[[], float], dump_wait: float) -> None:
        self.targets = list(targets)
        self._clock = clock
        self.wall_start = time.time()
        self._activity = {w.rank: w.last_output for w in self.targets}
        # Only a rank that has beaten has armed its recorder thread; to any other the signal is fatal.
        self.recording = [w for w in self.targets if FR_DUMP_ENV in w.spec.env and w.progress is not None
                          and w.progress.beats]
        for w in self.targets:
            w.capture, w.recorded, w.muted = [], False, True  # stacks go to the log; the report shows them
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, DUMP_SIGNAL)  # type: ignore[arg-type]
                if w in self.recording:
                    os.kill(w.pid, FR_SIGNAL)  # type: ignore[arg-type]
        self._start = clock()
        self._stacks_by = self._start + dump_wait
        self._deadline = self._start + max(dump_wait, FR_WAIT_S if self.recording else 0.0)

    def done(self) -> bool:
        now = self._clock()
        if now >= self._deadline:
            return True
        live = [w for w in self.targets if w.alive]
        pending = [w for w in live if w.last_output == self._activity[w.rank]]
        quiet = all(now - w.last_output >= QUIET_S for w in live)
        stacks = (not pending and quiet) or now >= self._stacks_by
        return stacks and all(w.recorded or not w.alive for w in self.recording)

    def finish(self) -> None:
        for w in self.targets:
            w.dump, w.capture = w.capture or [], None


def flight_record(workers: Sequence[Worker], all_ranks: set[int], newer_than: float = 0.0) -> list[Finding]:
    """What the flight-recorder dumps written since ``newer_than`` say: which rank is missing from
    which collective, most telling first; empty without dumps."""
    prefixes = {w.spec.env[FR_DUMP_ENV] for w in workers if FR_DUMP_ENV in w.spec.env}
    dumps = {r: d for prefix in prefixes for r, d in read_dumps(prefix, newer_than).items()}
    return missing_ranks(dumps, all_ranks) if dumps else []
