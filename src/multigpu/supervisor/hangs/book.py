"""Per-rank progress and the hang decision: timeouts learned from step times, the culprit named.

The supervisor feeds every rank's reports (``contract/beats.Beat``) into a ``ProgressBook`` and asks it,
once per loop turn, whether the run hangs. Everything here is pure bookkeeping on an injected
clock, so the rules are unit-tested without processes.

The rules (``--hang-timeout`` is the ceiling C; F the safety factor, L the floor):

* A rank that reports steps (``multigpu.heartbeat(step=N)``) gets ``clamp(F x slowest step interval,
  L, C)`` once its step time is known: after ``warmup`` intervals in this attempt, or at once from
  numbers an earlier attempt of the same output folder learned (``learned.py``, so a restart or a
  requeue does not wait at the ceiling). Before its first step (start-up), inside a section
  never seen to end (``multigpu.section("checkpoint")``), and once any rank has finished (the loop is
  over), the timeout is C. Inside a known section it is ``clamp(F x slowest time of that section, L, C)``.
* Progress of such a rank is a step, a section boundary or ``multigpu.heartbeat()``; not its output.
* A rank that never reported a step is judged as before: the run hangs when no rank has shown any
  progress, output or a collective entered included, for C.
* Across nodes the silence is the job's: another node's progress (``remote_progress``, learned through
  the job's store once per fate beat, ``hangs.verdict.JobProgress``) counts as much as this node's own.

On a hang the rank(s) that stopped first (lowest step, then earliest last progress) are named
(``hang.py`` words it). The book also names stragglers (``stragglers.py``), ranks slower than the
others though not stuck.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multigpu.config.run import HangConfig
from multigpu.contract.beats import Beat
from multigpu.supervisor.hangs.hang import Hang, Timeout, hang_line, hang_notice
from multigpu.supervisor.hangs.lateness import StragglerWatch
from multigpu.supervisor.hangs.learned import LEARNED_FILE, Learned
from multigpu.supervisor.states import WINDOW, RankProgress, rounded

if TYPE_CHECKING:
    from multigpu.config.run import RunConfig
    from multigpu.supervisor.states import WorkerSpec

logger = logging.getLogger(__name__)

SAVE_EVERY_S = 2.0
"""Learned numbers go to the output folder at most this often (and at the attempt's end)."""


@dataclass(frozen=True)
class HangPolicy:
    ceiling: float | None = None
    """``--hang-timeout``; None: no hang detection (step times are still recorded)."""
    factor: float = HangConfig.factor
    floor: float = HangConfig.floor
    warmup: int = 2
    """Step intervals seen in this attempt before its own numbers are trusted."""
    straggler_ratio: float = 1.5
    straggler_window: int = 20
    straggler_threshold: float = HangConfig.straggler_threshold
    """``--straggler-threshold``: collective lateness named past this share of the step; 0: no
    straggler detection at all."""

    def clamp(self, seconds: float) -> float:
        value = max(self.floor, self.factor * seconds)
        return value if self.ceiling is None else min(self.ceiling, value)


class ProgressBook:
    """Every rank's progress for one attempt; see the module docstring for the rules."""

    def __init__(
        self,
        policy: HangPolicy,
        ranks: Iterable[int],
        *,
        store: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._wall_offset = wall() - clock()
        self._store = store
        self.learned = Learned.load(store)
        self._inherited = self.learned.slowest_step is not None
        now = clock()
        self.ranks = {r: RankProgress(r, now, now) for r in ranks}
        self.last_finish = -math.inf
        self.job_at = -math.inf
        """When another node of the job last showed progress (this clock); set from the fate thread."""
        self._dirty = False
        self._saved_at = -math.inf
        self.stragglers = StragglerWatch(
            policy.straggler_threshold, policy.straggler_window, policy.straggler_ratio
        )
        self.total_steps: int | None = None
        """``--steps``: the job's step count, for its ETA (``supervisor/eta.py``)."""

    # ---- feeding -----------------------------------------------------------------------------------

    def started(
        self, rank: int, now: float | None = None, pid: int | None = None, node: int = 0
    ) -> RankProgress:
        """The rank's process started: its progress starts afresh (its record, for ``Worker.progress``)."""
        now = self._clock() if now is None else now
        self.ranks[rank] = progress = RankProgress(rank, now, now, pid=pid, node=node)
        self.stragglers.lateness.entries.pop(rank, None)
        return progress

    def output(self, rank: int, now: float | None = None) -> None:
        """The rank's pipes had output: progress for ranks without our bootstrap (they never beat)."""
        p = self.ranks[rank]
        p.last_output = self._clock() if now is None else now
        if not p.beats:
            p.last_progress = p.last_output

    def remote_progress(self, now: float | None = None) -> None:
        """Another node's ranks made progress: the job is not silent (called from the fate thread)."""
        self.job_at = self._clock() if now is None else now

    def mark(self) -> float:
        """This node's latest progress (this clock): a larger mark than the last one shared is news."""
        return max(self.last_finish, *(p.last_progress for p in list(self.ranks.values())), -math.inf)

    def finished(self, rank: int, now: float | None = None) -> None:
        """The rank exited successfully: progress for the others (they may have waited on it)."""
        self.last_finish = self._clock() if now is None else now

    def feed(self, rank: int, beats: list[Beat], now: float | None = None) -> None:
        now = self._clock() if now is None else now
        p = self.ranks[rank]
        if beats:
            p.beats = True
        for beat in beats:
            if beat.kind in ("output", "collectives"):
                if not p.reports_steps:
                    p.last_progress = now
            elif beat.kind == "beat":
                p.last_progress = now
            elif beat.kind == "step":
                self._step(p, int(beat.value), now)
            elif beat.kind == "begin":
                p.section, p.last_progress = beat.name, now
            elif beat.kind == "end":
                self._section_end(p, beat.name, beat.value, now)
            elif beat.kind == "entered":
                self.stragglers.lateness.note(rank, beat.index, beat.value)
            elif beat.kind == "done":
                p.finished = True

    def _step(self, p: RankProgress, step: int, now: float) -> None:
        if p.step_at is not None and (p.step is None or step > p.step):
            p.intervals.append(now - p.step_at)
            if len(p.intervals) >= self.policy.warmup or self._inherited:
                self._dirty |= self.learned.note_step(max(p.intervals))
        p.step, p.step_at, p.last_progress = step, now, now
        if p.first_step_at is None:
            p.first_step_at = now

    def _section_end(self, p: RankProgress, name: str, seconds: float, now: float) -> None:
        p.section_times.setdefault(name, deque(maxlen=WINDOW)).append(seconds)
        self._dirty |= self.learned.note_section(name, seconds)
        if p.section == name:
            p.section = None
        p.last_progress = now

    # ---- deciding ----------------------------------------------------------------------------------

    def timeout(self, rank: int) -> Timeout | None:
        """This rank's hang timeout now, and why; None without a ceiling (no hang detection)."""
        limit = self._limit(rank)
        if limit is None:
            return None
        seconds, reason, learned = limit
        if learned is None:
            return Timeout(seconds, f"--hang-timeout {seconds:g}s: {reason}")
        return Timeout(seconds, self._explain(reason, learned))

    def timeout_seconds(self, rank: int) -> float | None:
        """``timeout(rank).seconds`` with no text made: the loop asks for every rank, every turn."""
        limit = self._limit(rank)
        return None if limit is None else limit[0]

    def _limit(self, rank: int) -> tuple[float, str, float | None] | None:
        """(seconds, reason, the learned time it comes from or None for the ceiling); None: no ceiling."""
        policy, p = self.policy, self.ranks[rank]
        ceiling = policy.ceiling
        if ceiling is None:
            return None
        if not p.reports_steps:
            return ceiling, "no step reported yet", None
        if self.last_finish > -math.inf:
            return ceiling, "a rank has finished", None
        if p.section is not None:
            known = self.learned.sections.get(p.section)
            if known is None:
                return ceiling, f"section {p.section!r} never seen to end", None
            return policy.clamp(known), f"section {p.section!r}", known
        slowest = self.learned.slowest_step
        trusted = self._inherited or len(p.intervals) >= policy.warmup
        if slowest is None or not trusted:
            return ceiling, "step time not learned yet", None
        return policy.clamp(slowest), "step", slowest

    def _explain(self, what: str, slowest: float) -> str:
        p = self.policy
        return (
            f"learned: {p.factor:g} x slowest {what} {slowest:.3g}s, floor {p.floor:g}s, "
            f"ceiling {p.ceiling:g}s"
        )

    def check(self, running: list[int], now: float | None = None) -> Hang | None:
        """A ``Hang`` when a rank that reports steps is past its timeout, or when no rank at all has
        shown progress for the ceiling; None otherwise (and always without a ceiling)."""
        now = self._clock() if now is None else now
        self.maybe_save(now)
        for line in self.stragglers.check(self.ranks, running, now, now + self._wall_offset):
            logger.info(line)
        ceiling = self.policy.ceiling
        if ceiling is None or not running:
            return None
        quiet = {r: now - self.ranks[r].last_progress for r in running}
        late = []
        for r in running:
            seconds = self.timeout_seconds(r) if self.ranks[r].reports_steps else None
            if seconds is not None and quiet[r] >= seconds and (limit := self.timeout(r)) is not None:
                late.append((r, limit))
        if late:
            # A rank that reports no steps and has been quiet at least as long is as suspect.
            since = min(quiet[r] for r, _ in late)
            suspects = {r for r, _ in late} | {
                r for r in running if not self.ranks[r].reports_steps and quiet[r] >= since
            }
            return self._hang(running, quiet, late[0][1], suspects)
        silent = now - max(self.last_finish, self.job_at, *(self.ranks[r].last_progress for r in running))
        if silent >= ceiling:
            why = f"no rank has shown progress for {silent:.1f}s, --hang-timeout {ceiling:g}s"
            return self._hang(running, quiet, Timeout(ceiling, why), set(running), silent)
        return None

    def _hang(
        self,
        running: list[int],
        quiet: dict[int, float],
        limit: Timeout,
        late: set[int],
        silent: float | None = None,
    ) -> Hang:
        ordered = self.order(running, late)
        culprits, line = hang_line(self.ranks, ordered, quiet, limit, late)
        silence = quiet[ordered[0]] if silent is None else silent
        return Hang(culprits, line, quiet, hang_notice(self.ranks, running, silence, limit))

    def shortest_timeout(self) -> float | None:
        """The shortest timeout any rank has now: how often the loop must look."""
        limits = [t for r in self.ranks if (t := self.timeout_seconds(r)) is not None]
        return min(limits, default=None)

    def order(self, ranks: Iterable[int], late: set[int] | None = None) -> list[int]:
        """Who stopped first: the ranks past their timeout (``late``), then the lowest step (no step
        at all lowest), then the earliest last progress."""

        def key(r: int) -> tuple[bool, float, float]:
            p = self.ranks[r]
            return (
                late is not None and r not in late,
                -math.inf if p.step is None else p.step,
                p.last_progress,
            )

        return sorted(ranks, key=key)

    # ---- stragglers, persistence, stats -------------------------------------------------------------

    def maybe_save(self, now: float, force: bool = False) -> None:
        if self._store is None or not self._dirty:
            return
        if force or now - self._saved_at >= SAVE_EVERY_S:
            self.learned.save(self._store)
            self._dirty, self._saved_at = False, now

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every rank's step times, for run.json and the live view."""
        out = {}
        for r, p in self.ranks.items():
            data = p.stats(self._wall_offset)
            limit = self.timeout(r) if p.reports_steps else None
            data["hang_timeout_s"] = rounded(limit.seconds) if limit is not None else None
            if p.late_s is not None:
                data["collective_late_s"] = rounded(p.late_s)
            data.update(self.stragglers.fields(r))
            out[str(r)] = data
        return out


def progress_book(
    config: RunConfig,
    output_dir: Path,
    specs: Iterable[WorkerSpec],
) -> ProgressBook:
    """The book for one attempt of a run: its policy from the command line, its learned numbers in
    the output folder (shared by every attempt and every requeue that writes there)."""
    policy = HangPolicy(
        ceiling=config.hang.timeout,
        factor=config.hang.factor,
        floor=config.hang.floor,
        straggler_threshold=config.hang.straggler_threshold,
    )
    book = ProgressBook(policy, (s.rank for s in specs), store=output_dir / LEARNED_FILE)
    book.total_steps = config.output.steps
    return book
