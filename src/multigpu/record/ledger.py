"""The run's goodput ledger: every second of its wall time attributed to exactly one cause.

Runs in the launcher. The run record (``run_json.RunRecord``) feeds it on the launcher's main thread,
from what the attempts loop already tells the record: an attempt began, its ranks' first step (the
progress snapshots), its incident (``incidents.py``: when a rank failed or a hang began, when the
launcher learned of it, when every rank had stopped), the waits between attempts (the nodes' meeting,
the preflight check), a preemption warning, the run's end. ``seconds_by_cause``, ``wall_seconds`` and
``progress`` are snapshots that any other thread may take (a metrics server's); the record writes
``summary()`` into ``run.json`` (``ledger``) and ``multigpu report`` shows it (``ledger_line``).

The time is a line of marks, each "from this moment on, the time is this cause"; the causes therefore
sum to the wall time by construction. Some causes are known only afterwards, and then attributed back:
a hang is called ``--hang-timeout`` after its last progress, so the seconds from that progress to the
verdict, counted as training while nobody knew, become ``hang_undetected`` once it is called. So a
live figure of ``training`` (or ``starting``) can fall when a hang is called; the lost causes only grow.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from multigpu.supervisor.eta import estimate

if TYPE_CHECKING:
    from multigpu.supervisor.hangs.book import ProgressBook

CAUSES = (
    "starting",
    "training",
    "restarting",
    "hang_undetected",
    "hang_handling",
    "waiting_for_nodes",
    "preflight",
    "preemption",
    "stopping",
)
"""Every cause, in the order the record lists them:

* ``starting``: the launcher's start to the first step of the first attempt;
* ``training``: from an attempt's first step while its ranks run (a script that reports no step,
  no ``multigpu.heartbeat(step=N)``, trains from its attempt's start: nothing tells otherwise);
* ``restarting``: a rank's failure (or, after a hang, every rank stopped) to the next first step;
* ``hang_undetected``: a hang's last progress until the launcher called it;
* ``hang_handling``: the hang called (stacks collected, ranks stopped) until every rank had ended;
* ``waiting_for_nodes``: the nodes meeting again, or an elastic round ended by a node joining;
* ``preflight``: the nodes' preflight check (``--preflight``);
* ``preemption``: a preemption warning to the run's end;
* ``stopping``: a failure, or a stop signal, to the end of a run that does not restart."""

LOST_CAUSES = tuple(c for c in CAUSES if c != "training")


class Ledger:
    """The run's time by cause; see the module docstring. ``clock``: the wall clock (tests fake it)."""

    def __init__(
        self, start: float, *, total_steps: int | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._marks: list[tuple[float, str]] = [(start, "starting")]
        self._end: float | None = None
        self._before_step = "starting"
        """What an attempt's time before its first step counts as: starting, then restarting."""
        self._began: float | None = None
        """When the current attempt began; None between attempts."""
        self._stepping = False
        self._steps_seen = False
        """An attempt of this run reported a step: one that reports none never got to train."""
        self._unsettled: float | None = None
        """Since when a failure's time is ``restarting`` that becomes ``stopping`` if no attempt follows."""
        self.total_steps = total_steps
        """``--steps``: the job's step count, for ``progress``'s estimate."""
        self.book: ProgressBook | None = None
        """The current attempt's progress book (``watch``), read by ``progress``."""
        self._counted = dict.fromkeys(LOST_CAUSES, 0.0)
        """The most ``lost_seconds`` has said of each cause: what a counter was told stays told."""

    # ---- feeding (the launcher's main thread) ------------------------------------------------------

    def enter(self, cause: str, at: float | None = None) -> None:
        """From ``at`` (default: now) on, the time is ``cause``."""
        with self._lock:
            self._span(self._clock() if at is None else at, None, cause)

    @contextlib.contextmanager
    def phase(self, cause: str) -> Iterator[None]:
        """A wait between attempts (``waiting_for_nodes``, ``preflight``); then the time is again what
        it was before the attempt's first step."""
        self.enter(cause)
        try:
            yield
        finally:
            self.enter(self._before_step)

    def watch(self, book: ProgressBook) -> None:
        """The current attempt's progress book, for ``progress``."""
        self.book = book

    def attempt_began(self, at: float) -> None:
        with self._lock:
            self._began, self._stepping, self._unsettled = at, False, None
            self._span(at, None, self._before_step)

    def first_step(self, at: float) -> None:
        """The current attempt's first step (from a progress snapshot, a few seconds late): training
        from then on."""
        with self._lock:
            if self._stepping or self._began is None or self._end is not None:
                return
            self._stepping = self._steps_seen = True
            self._span(max(at, self._began), None, "training")

    def attempt_ended(self, incident: Mapping[str, Any] | None, at: float) -> None:
        """The current attempt's ranks have all ended (``at``); ``incident``: its incident
        (``incidents.incident``), None when it succeeded."""
        with self._lock:
            began = self._began if self._began is not None else self._marks[0][0]
            self._began = None
            if not self._stepping and not self._steps_seen:
                self._span(began, None, "training")  # ranks that report no step trained from the start
            if incident is None:
                return
            failed = min(max(float(incident["failed_time"]), began), at)
            detected = min(max(float(incident["detected_time"]), failed), at)
            self._before_step = "restarting"
            kind = incident["kind"]
            if kind == "hung":
                self._span(failed, detected, "hang_undetected")
                self._span(detected, None, "hang_handling")
                self._span(at, None, "restarting")
                self._unsettled = at
            elif kind == "interrupted":
                self._span(detected, None, "stopping")
            elif kind == "membership change":
                self._span(failed, None, "waiting_for_nodes")
            else:
                self._span(failed, None, "restarting")
                self._unsettled = failed

    def finish(self, at: float, preempted_at: float | None = None) -> None:
        """The run ended at ``at`` (safe twice: the later end wins). A failure no attempt followed is
        ``stopping``; a preemption warning (``preempted_at``) makes the rest ``preemption``."""
        with self._lock:
            self._end = max(at, self._marks[0][0])
            if self._unsettled is not None:
                since = self._unsettled
                self._marks = [
                    (t, "stopping" if t >= since and c == "restarting" else c) for t, c in self._marks
                ]
            if preempted_at is not None:
                self._span(preempted_at, None, "preemption")

    def _span(self, begin: float, end: float | None, cause: str) -> None:
        """From ``begin`` to ``end`` (None: from then on) the time was ``cause``, whatever was said of it
        before; the cause in force at ``end`` goes on from there. Called with the lock held."""
        marks = self._marks
        begin = max(begin, marks[0][0])
        if end is not None and end <= begin:
            return
        after = None if end is None else _cause_at(marks, end)
        kept = [m for m in marks if m[0] < begin or (end is not None and m[0] >= end)]
        kept.append((begin, cause))
        if end is not None and after is not None and all(t != end for t, _ in kept):
            kept.append((end, after))
        kept.sort(key=lambda m: m[0])
        merged = [m for i, m in enumerate(kept) if i == 0 or m[1] != kept[i - 1][1]]
        self._marks = merged  # one assignment: a reader copies either list whole

    # ---- reading (any thread) ----------------------------------------------------------------------

    def _totals(self, settled: bool = False) -> tuple[dict[str, float], float]:
        """(seconds by cause, wall seconds) now; ``settled``: only up to where no later event can
        take time back (an attempt that reported no step yet may turn out to have trained)."""
        with self._lock:
            marks, end = list(self._marks), self._end
            open_from = self._began if settled and not self._stepping else None
        now = end if end is not None else max(self._clock(), marks[-1][0])
        until = now if open_from is None else max(min(open_from, now), marks[0][0])
        seconds = dict.fromkeys(CAUSES, 0.0)
        for (t, cause), nxt in zip(marks, [*(t for t, _ in marks[1:]), now], strict=True):
            seconds[cause] += max(0.0, min(nxt, until) - t)
        return seconds, now - marks[0][0]

    def seconds_by_cause(self) -> dict[str, float]:
        """Seconds of the run so far by cause (every cause, 0.0 where none), summing to the wall time."""
        return self._totals()[0]

    def lost_seconds(self) -> dict[str, float]:
        """The causes other than training, for ``multigpu_lost_seconds_total{cause}``: counters, so only
        the settled time (an attempt's time before its first step counts once that step, or the
        attempt's end, says what it was), and never less than a previous call said: the run's end may
        still move time between lost causes (a failure no attempt followed, ``restarting``, becomes
        ``stopping``; a preemption warning takes what came after it), and a counter that fell would read
        as a reset. ``summary`` (run.json) keeps the exact story."""
        seconds = self._totals(settled=True)[0]
        with self._lock:
            for cause in LOST_CAUSES:
                self._counted[cause] = max(self._counted[cause], seconds[cause])
            return dict(self._counted)

    def wall_seconds(self) -> float:
        """Seconds from the run's start to its end, or to now while it runs."""
        return self._totals()[1]

    def progress(self) -> tuple[int | None, int | None, float | None]:
        """(the job's step: its slowest rank's last, or None before any; ``--steps`` or None; seconds
        left at the slowest rank's median step time, or None where unknown)."""
        book = self.book
        return estimate(list(book.ranks.values()) if book is not None else [], self.total_steps)

    def summary(self) -> dict[str, Any]:
        """What ``run.json`` keeps (``ledger``): seconds by cause, the wall time, training's share."""
        seconds, wall = self._totals()
        return {
            "seconds": {cause: round(value, 3) for cause, value in seconds.items()},
            "wall_seconds": round(wall, 3),
            "effective_training_percent": round(100 * seconds["training"] / wall, 1) if wall > 0 else None,
        }


def _cause_at(marks: list[tuple[float, str]], moment: float) -> str | None:
    """The cause in force at ``moment``: the last mark at or before it."""
    found = None
    for t, cause in marks:
        if t > moment:
            break
        found = cause
    return found


def ledger_line(ledger: Mapping[str, Any]) -> str | None:
    """``effective training 71.3% of 42.0s; lost: hang_undetected 8.1s, restarting 3.2s``: a record's
    ``ledger`` in one line (the run's last line, ``multigpu report``), the largest losses first; None
    for a record without one (an older multigpu wrote it)."""
    seconds, wall = ledger.get("seconds"), ledger.get("wall_seconds")
    percent = ledger.get("effective_training_percent")
    if not isinstance(seconds, dict) or not isinstance(wall, (int, float)) or percent is None:
        return None
    lost = sorted(((v, c) for c, v in seconds.items() if c != "training" and v >= 0.05), reverse=True)
    tail = "; lost: " + ", ".join(f"{c} {v:.1f}s" for v, c in lost) if lost else ""
    return f"effective training {percent:.1f}% of {wall:.1f}s{tail}"
