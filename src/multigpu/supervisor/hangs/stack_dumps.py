"""What a stuck rank can still tell: its Python stacks and, where the flight recorder is armed,
torch's record of its last collectives. Runs in the launcher; the rank's side is ``rank/dump_signal.py``.

The supervisor asks with ``DumpRequest``, keeps running its loop (the stacks arrive on the ranks'
stderr pipes, the "stacks" and "dumped" beats on their heartbeat pipes) until ``done()``, reads what
the pipes still hold, then ``finish()`` hands each rank its captured lines. ``flight_record`` reads
the dumps written since the request.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence

from multigpu.contract.names import FR_DUMP_ENV
from multigpu.contract.signals import DUMP_SIGNAL, FR_SIGNAL
from multigpu.supervisor.hangs.flight_record import Finding, missing_ranks, read_dumps
from multigpu.supervisor.states import Worker

FR_WAIT_S = 3.0
"""How long a request waits for the ranks' flight-recorder dumps (stacks: the supervisor's dump_wait)."""
ANSWER_S = 0.2
"""How long a rank's dump thread may take to say "stacks written" before faulthandler's C handler is
asked instead (a thread of the rank holds the GIL, so no Python code of ours can run there)."""
QUIET_S = 0.03
"""A stack dump from faulthandler's C handler is complete once the rank's output has been quiet this
long: that handler cannot say when it is done."""


class DumpRequest:
    """One round of dumps from the live ranks in ``targets``.

    A rank whose bootstrap armed the dump thread (``FR_DUMP_ENV`` in its environment, and it has
    beaten, so the bootstrap got that far) is asked with ``FR_SIGNAL`` and says when its stacks are
    written: a failed job's teardown then waits as long as the dump takes, not for a quiet pipe. Any
    other rank, and one whose thread does not answer within ``ANSWER_S``, gets ``DUMP_SIGNAL``.
    """

    def __init__(self, targets: Sequence[Worker], clock: Callable[[], float], dump_wait: float) -> None:
        self.targets = list(targets)
        self._clock = clock
        self.wall_start = time.time()
        self._activity = {w.rank: w.lines.last_at for w in self.targets}
        # Only a rank that has beaten has armed its dump thread; to any other FR_SIGNAL is fatal.
        self._answering = [
            w
            for w in self.targets
            if FR_DUMP_ENV in w.spec.env and w.progress is not None and w.progress.beats
        ]
        self.recording = [w for w in self._answering if w.spec.env[FR_DUMP_ENV]]
        self._quiet = [w for w in self.targets if w not in self._answering]
        self._was_muted = {w.rank: w.lines.muted for w in self.targets}
        for w in self.targets:
            w.dumps.capture, w.dumps.recorded, w.dumps.stacked = [], False, False
            w.lines.muted = True  # the stacks go to the log; the report shows them where they are the point
            _send(w, FR_SIGNAL if w in self._answering else DUMP_SIGNAL)
        self._start = clock()
        self._fallback_at = self._start + ANSWER_S
        self._stacks_by = self._start + dump_wait
        self._deadline = self._start + max(dump_wait, FR_WAIT_S if self.recording else 0.0)

    def done(self) -> bool:
        now = self._clock()
        if now >= self._deadline:
            return True
        if now >= self._fallback_at:
            self._fall_back()
        answered = all(w.dumps.stacked or not w.alive for w in self._answering)
        stacks = (answered and self._quiet_now(now)) or now >= self._stacks_by
        return stacks and all(w.dumps.recorded or not w.alive for w in self.recording)

    def next_check_in(self) -> float:
        """How long the loop may wait before ``done()`` can change without an event: the quiet
        period of a faulthandler dump ends, or a deadline passes."""
        now = self._clock()
        times = [self._deadline, self._stacks_by]
        times += [w.lines.last_at + QUIET_S for w in self._quiet if w.alive]
        if any(w.alive and not w.dumps.stacked for w in self._answering):
            times.append(self._fallback_at)
        return max(0.0, min(t for t in times if t > now) - now) if any(t > now for t in times) else 0.0

    def _quiet_now(self, now: float) -> bool:
        live = [w for w in self._quiet if w.alive]
        pending = [w for w in live if w.lines.last_at == self._activity[w.rank]]
        return not pending and all(now - w.lines.last_at >= QUIET_S for w in live)

    def _fall_back(self) -> None:
        for w in [w for w in self._answering if w.alive and not w.dumps.stacked]:
            self._answering.remove(w)
            if w in self.recording:
                self.recording.remove(w)
            self._quiet.append(w)
            self._activity[w.rank] = w.lines.last_at
            _send(w, DUMP_SIGNAL)

    def finish(self, *, unmute: bool) -> None:
        """Keep what each rank answered; ``unmute``: the job goes on (``multigpu stacks`` from another
        shell), so each rank's console shows again as it did before the request."""
        for w in self.targets:
            w.dumps.stacks, w.dumps.capture = w.dumps.capture or [], None
            if unmute:
                w.lines.muted = self._was_muted[w.rank]


def _send(worker: Worker, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(worker.pid, signum)  # type: ignore[arg-type]


def flight_record(workers: Sequence[Worker], all_ranks: set[int], newer_than: float = 0.0) -> list[Finding]:
    """What the flight-recorder dumps written since ``newer_than`` say: which rank is missing from
    which collective, most telling first; empty without dumps."""
    prefixes = {w.spec.env[FR_DUMP_ENV] for w in workers if w.spec.env.get(FR_DUMP_ENV)}
    dumps = {r: d for prefix in prefixes for r, d in read_dumps(prefix, newer_than).items()}
    return missing_ranks(dumps, all_ranks) if dumps else []
